"""Start real SGLang servers for a run: the command line its config needs, and the process.

    cfg = SGLangLaunchConfig(device="cpu")                       # rollout.sglang in a run config
    cmd, env = sglang_command(cfg, model_path=..., port=30001, random_seed=1, flags=["--disable-radix-cache"])
    handle = start_sglang_server(cfg, model_path=..., log_path=..., random_seed=1, flags=[...])
    handle.url, handle.pid, handle.alive(), handle.stop()        # as the built-in server's ServerHandle

The command is `python -m sglang.launch_server` with the flags the run relies on (`flags`: the
`required_server_flags` (below): `--disable-radix-cache` under the in_place pause,
`--enable-deterministic-inference` when requests carry seeds), the dtype, the KV memory, the port, the
API key, the random seed, `--weight-version 0`, and the device: on CPU `--device cpu` with
`SGLANG_USE_CPU_ENGINE=1` (SGLang's torch-native path; the venv `tools/install.sh --with-sglang`
builds, see `sglang_cpu/README.md`), on GPUs the server's own GPUs through `CUDA_VISIBLE_DEVICES`.
GPU ids are indices into the devices this process sees, as `torch.cuda` and the actor's ranks count
them: under `CUDA_VISIBLE_DEVICES=4,5,6,7` id 1 is physical GPU 5, and the server is given `5`
(`physical_gpus`; UUID and MIG entries pass through as written).
It runs under a small bootstrap that starts the built-in server's parent watch first, so a server
exits when the trainer that started it dies, even by SIGKILL (SGLang's own children follow their
parent).

What SGLang 0.5.23 cannot do on a CPU is refused before anything starts (`check_cpu_support`):
`--enable-deterministic-inference` (its batch-invariant attention backends are GPU-only: launching
fails) and `--enable-return-routed-experts` (dies in a CUDA-only buffer).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_bapo.config_io import ConfigError

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO_ROOT / ".venv-sglang" / "bin" / "python"
"""The venv `tools/install.sh --with-sglang` builds (SGLang, CPU torch, the `sgl_kernel` stand-in)."""

DEVICES = ("auto", "cpu", "cuda")
CPU_DEFAULTS = {"dtype": "float32", "mem_fraction_static": 0.1, "max_total_tokens": 16384}
"""On a CPU: fp32 (the trainer's log-probs are fp32; SGLang's "auto" would serve an fp32 checkpoint in
fp16), and a small KV pool (SGLang sizes it from host memory otherwise)."""
CPU_UNSUPPORTED = {
    "--enable-deterministic-inference": "SGLang 0.5.23 supports it only with GPU attention backends (fa3, fa4, "
                                        "flashinfer, triton); on a CPU the launch fails. Set "
                                        "rollout.deterministic_inference=false (rollouts are then not reproducible)",
    "--enable-return-routed-experts": "SGLang 0.5.23 keeps the routed experts in a CUDA-only buffer and dies on a "
                                      "CPU. Set rollout.return_routed_experts=false, or use rollout.engine=builtin",
}
# The bootstrap: parent watch, then SGLang's own entry point as `python -m sglang.launch_server` runs it
# (alter_sys keeps `__main__` SGLang's module, so its spawned scheduler processes start as usual).
BOOT = ("from megatron_bapo.server.parent_watch import start_parent_watch; start_parent_watch(); import runpy; "
        "runpy.run_module('sglang.launch_server', run_name='__main__', alter_sys=True)")


@dataclass
class SGLangLaunchConfig:
    """How a run starts real SGLang servers (`rollout.engine: sglang`; `rollout.sglang` in a run config)."""

    python: Optional[str] = None
    """The Python of an environment with SGLang. None: this checkout's `.venv-sglang` (made by
    `bash tools/install.sh --with-sglang`), else this process's own if it has SGLang (the GPU image,
    where the actor and SGLang share one environment)."""
    device: str = "auto"
    """"cpu", "cuda", or "auto" (cuda when this process sees a GPU)."""
    gpu_ids: Optional[list[int]] = None
    """GPUs the servers get, `tp_size` consecutive entries per server (server i: entries
    [i * tp_size, (i + 1) * tp_size)). Ids index the devices this process sees (its
    CUDA_VISIBLE_DEVICES list when set, else every GPU), as the actor's LOCAL_RANK does; each server is
    given the matching entries as its CUDA_VISIBLE_DEVICES. None: the visible GPUs after the ones this
    node's actor ranks use (LOCAL_WORLD_SIZE of torchrun, else 1)."""
    tp_size: int = 1
    """SGLang's --tp-size: GPUs per server. The weight group gives each server that many ranks."""
    dtype: Optional[str] = None
    """SGLang's --dtype. None: "float32" on a CPU (the trainer's precision), SGLang's own "auto" on GPUs
    (the checkpoint's dtype)."""
    mem_fraction_static: Optional[float] = None
    """SGLang's --mem-fraction-static. None: 0.1 on a CPU, SGLang's default on GPUs."""
    max_total_tokens: Optional[int] = None
    """SGLang's --max-total-tokens (KV pool size). None: 16384 on a CPU, SGLang's default on GPUs."""
    extra_args: list[str] = field(default_factory=list)
    """More `sglang.launch_server` flags, passed as given (e.g. ["--context-length", "4096"])."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"rollout.sglang.device must be one of {DEVICES}, got {self.device!r}")
        if self.tp_size < 1:
            raise ConfigError(f"rollout.sglang.tp_size must be >= 1, got {self.tp_size}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"rollout.sglang.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ConfigError(f"rollout.sglang.max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.gpu_ids is not None and (len(set(self.gpu_ids)) != len(self.gpu_ids) or min(self.gpu_ids, default=0) < 0):
            raise ConfigError(f"rollout.sglang.gpu_ids must be distinct GPU indices, got {self.gpu_ids}")
        self.extra_args = [str(a) for a in self.extra_args]

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_python(self) -> str:
        """The interpreter to run: `python`, else this checkout's `.venv-sglang`, else this process's
        own when it has SGLang (the GPU image: one environment); ConfigError naming the fix otherwise."""
        import importlib.util
        import sys

        if self.python:
            if not Path(self.python).exists():
                raise ConfigError(f"rollout.sglang.python={self.python} does not exist: point it at the Python of "
                                  f"an environment with SGLang")
            return str(self.python)
        if DEFAULT_PYTHON.exists():
            return str(DEFAULT_PYTHON)
        if importlib.util.find_spec("sglang") is not None:
            return sys.executable
        raise ConfigError(f"rollout.engine=sglang needs SGLang: {DEFAULT_PYTHON} does not exist and this environment "
                          f"has no sglang; run `bash tools/install.sh --with-sglang` (it builds .venv-sglang) or set "
                          f"rollout.sglang.python")


def check_cpu_support(flags: Sequence[str]) -> None:
    """Refuse, naming the setting to change, what SGLang cannot run on a CPU (`CPU_UNSUPPORTED`)."""

    for flag in flags:
        if flag in CPU_UNSUPPORTED:
            raise ConfigError(f"rollout.engine=sglang on a CPU cannot launch with {flag}: {CPU_UNSUPPORTED[flag]}")


_FIX = "ids index the visible devices, so use ids in 0..{} or make the GPUs visible to the job"


def visible_devices() -> Optional[list[str]]:
    """This process's CUDA_VISIBLE_DEVICES entries in order (indices, `GPU-...` / `MIG-...` UUIDs, as
    written), or None when it is unset (every GPU is visible, in CUDA's order)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if raw is None else [e.strip() for e in raw.split(",") if e.strip()]


def physical_gpus(ids: Sequence[int]) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of a server whose GPUs are `ids` as this process counts them
    (index i: the i-th entry of this process's CUDA_VISIBLE_DEVICES; unset: i itself). A child given
    the bare ids would count from the machine's first GPU instead, and land on another job's GPUs.
    ConfigError naming rollout.sglang.gpu_ids when an id is past the visible list."""
    visible = visible_devices()
    if visible is None:
        return [str(int(i)) for i in ids]
    bad = [i for i in ids if not 0 <= i < len(visible)]
    if bad:
        raise ConfigError(f"rollout.sglang.gpu_ids: GPU id(s) {bad} are past the {len(visible)} device(s) this process "
                          f"sees (CUDA_VISIBLE_DEVICES={','.join(visible)}); {_FIX.format(len(visible) - 1)}")
    return [visible[i] for i in ids]


def server_gpus(cfg: SGLangLaunchConfig, num_servers: int, *, num_visible: int,
                num_actor_gpus: Optional[int] = None) -> list[list[int]]:
    """The GPUs of each of `num_servers` servers (see `SGLangLaunchConfig.gpu_ids`), as ids of the
    devices this process sees (`num_visible`: `torch.cuda.device_count()`, which counts only those);
    `sglang_command` maps them to the server's CUDA_VISIBLE_DEVICES. ConfigError when there are too few."""

    need = num_servers * cfg.tp_size
    visible = visible_devices()
    if visible is not None:
        num_visible = min(num_visible, len(visible))
    seen = f"this process sees {num_visible} GPU(s)" + (
        f" (CUDA_VISIBLE_DEVICES={','.join(visible)})" if visible is not None else "")
    if cfg.gpu_ids is not None:
        ids, where = list(cfg.gpu_ids), f"rollout.sglang.gpu_ids={cfg.gpu_ids}"
    else:
        first = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if num_actor_gpus is None else num_actor_gpus
        ids, where = list(range(first, num_visible)), f"the {max(num_visible - first, 0)} GPU(s) after the actor's {first}"
    if len(ids) < need:
        raise ConfigError(f"{num_servers} SGLang server(s) x rollout.sglang.tp_size={cfg.tp_size} need {need} GPU(s), "
                          f"but {where} give {len(ids)} ({seen}); set rollout.sglang.gpu_ids, "
                          f"rollout.num_builtin_servers or rollout.sglang.tp_size")
    bad = [i for i in ids[:need] if i >= num_visible]
    if bad:
        raise ConfigError(f"rollout.sglang.gpu_ids names GPU(s) {bad}, but {seen}; {_FIX.format(num_visible - 1)}")
    return [ids[i * cfg.tp_size:(i + 1) * cfg.tp_size] for i in range(num_servers)]


def sglang_command(cfg: SGLangLaunchConfig, *, model_path: str, port: int, random_seed: int,
                   flags: Sequence[str] = (), host: str = "127.0.0.1", api_key: Optional[str] = None,
                   gpus: Optional[Sequence[int]] = None, python: Optional[str] = None) -> tuple[list[str], dict]:
    """The command line and the environment variables (on top of the caller's) of one SGLang server.
    `gpus`: its GPUs on a GPU device (`server_gpus`: ids of the devices this process sees; the server's
    CUDA_VISIBLE_DEVICES names the same devices, `physical_gpus`). `python`: the interpreter (default:
    the config's, resolved)."""

    device = cfg.resolved_device()
    cmd = [python or cfg.resolved_python(), "-c", BOOT, "--model-path", str(model_path), "--host", host,
           "--port", str(int(port)), "--random-seed", str(int(random_seed)), "--weight-version", "0",
           "--tp-size", str(cfg.tp_size)]
    env: dict[str, str] = {}
    if device == "cpu":
        check_cpu_support(flags)
        if cfg.tp_size != 1:
            raise ConfigError(f"rollout.sglang.tp_size={cfg.tp_size} on a CPU: SGLang's CPU path here runs one rank "
                              f"per server; set it to 1")
        cmd += ["--device", "cpu"]
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    else:
        if gpus is None or len(gpus) != cfg.tp_size:
            raise ValueError(f"a GPU server needs its {cfg.tp_size} GPU id(s) (server_gpus), got {gpus}")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(physical_gpus(gpus))
    defaults = CPU_DEFAULTS if device == "cpu" else {}
    for name in ("dtype", "mem_fraction_static", "max_total_tokens"):
        value = getattr(cfg, name)
        value = defaults.get(name) if value is None else value
        if value is not None:
            cmd += ["--" + name.replace("_", "-"), str(value)]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += [*flags, *cfg.extra_args]
    return cmd, env


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (SGLang has no port file; a restart reuses its port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_sglang_server(cfg: SGLangLaunchConfig, *, model_path: str, log_path: Path, random_seed: int,
                        flags: Sequence[str] = (), port: Optional[int] = None, host: str = "127.0.0.1",
                        api_key: Optional[str] = None, gpus: Optional[Sequence[int]] = None,
                        startup_timeout_s: float = 600.0) -> Any:
    """Start one SGLang server and return its `ServerHandle` once `/health` answers (SGLang answers
    only when a generation went through); ServerStartError with the log tail otherwise."""
    from megatron_bapo.server.launch import launch_process

    port = free_port(host) if port is None else int(port)
    cmd, extra_env = sglang_command(cfg, model_path=model_path, port=port, random_seed=random_seed, flags=flags,
                                    host=host, api_key=api_key, gpus=gpus)
    if "CUDA_VISIBLE_DEVICES" in extra_env:
        logger.info("SGLang server on port %d: GPU(s) %s of this process, CUDA_VISIBLE_DEVICES=%s", port, list(gpus),
                    extra_env["CUDA_VISIBLE_DEVICES"])
    env = {**os.environ, **extra_env}
    return launch_process(cmd, host=host, port=port, log_path=Path(log_path), startup_timeout_s=startup_timeout_s,
                          env=env, name="SGLang server")


def required_server_flags(*, deterministic_inference: bool, pause_mode: Optional[str],
                          routed_experts: bool = False) -> list[str]:
    """SGLang launch flags the run relies on: `--enable-deterministic-inference` when requests carry a
    `sampling_seed` (SGLang ignores the seed without it), `--disable-radix-cache` under the "in_place"
    pause (the update cannot flush KV the old weights computed, so no cache may keep it),
    `--enable-return-routed-experts` when requests ask for the MoE routing (ignored without it; the
    client then stops the run naming the flag)."""
    flags = []
    if deterministic_inference:
        flags.append("--enable-deterministic-inference")
    if pause_mode == "in_place":
        flags.append("--disable-radix-cache")
    if routed_experts:
        flags.append("--enable-return-routed-experts")
    return flags
