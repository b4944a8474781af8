"""Server pools per role: the models served beside the policy (a teacher, a judge).

    teacher:                         # a run config section; `judge` has the same shape
      model_path: runs/tiny_assets/teacher_model
      engine: builtin                # or sglang (its launch options under `sglang`, as rollout's)
      num_servers: 1                 # or client.urls: servers someone else runs

    pools = start_role_pools({"teacher": cfg.teacher, "judge": cfg.judge}, seed=..., output_dir=..., vocab_size=...)
    pools["teacher"].client          # prefill log-probs (`rollout.teacher`), generations (a judge)
    close_role_pools(pools)

A role is a configuration of the one `ServerPool`, not a copy of it: the same start (engine, flags,
seed, API key, health wait), the same restart of a dead server on its port (`max_server_restarts`),
the same client with its retries, failover and reply checks. What differs is that the pool is never
weight-synced (`ServerPool.weight_synced` is False): its `update` is refused before anything reaches
a server, it never joins a weight group, and its servers serve `model_path` as version 0 for the
whole run. The URLs go to `<output_dir>/<role>_servers.json` next to the policy's `servers.json`
(with the PIDs of the servers the run started), its servers' logs to `logs/<role>_server_<i>.log`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Optional

from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.config import ENGINES, RolloutClientConfig
from megatron_bapo.rollout.sglang_launch import SGLangLaunchConfig, check_cpu_support

if TYPE_CHECKING:
    from megatron_bapo.rollout.pool import ServerPool

logger = logging.getLogger(__name__)

ROLES = ("teacher", "judge")
"""The run config sections that configure a pool beside the policy's."""


@dataclass
class ServerRoleConfig:
    """One role's pool (`teacher`, `judge`): which model, which servers, how they are started.

    The launch fields are the `rollout` section's, under the same names where they apply (the pool
    reads them as it reads `rollout`'s); `num_servers` is `rollout.num_builtin_servers`. Empty
    `model_path`: no pool (the default; nothing about the run changes).
    """

    model_path: str = ""
    """HF directory the servers serve (also read at start: the teacher's tokenizer must be the
    student's). Needed with `client.urls` too. Empty: this role has no pool."""
    engine: str = "builtin"
    """The servers the run starts when `client.urls` and `client.router_url` are empty: "builtin" (the
    built-in CPU server) or "sglang" (`sglang.launch_server`, as `sglang` says), as `rollout.engine`."""
    num_servers: int = 1
    """How many servers the run starts (of `engine`) when `client.urls` and `client.router_url` are empty."""
    builtin_server_dtype: str = "float32"
    """The built-in servers' `--dtype` ("float32" or "bfloat16"), as `rollout.builtin_server_dtype`."""
    builtin_server_decode_delay_ms: float = 0.0
    """The built-in servers' `--decode-delay-ms`, as `rollout.builtin_server_decode_delay_ms`."""
    sglang: SGLangLaunchConfig = field(default_factory=SGLangLaunchConfig)
    """How `engine: sglang` launches the servers, as `rollout.sglang`; on GPUs `sglang.gpu_ids` must
    name this pool's own GPUs (the default would be the policy servers')."""
    client: RolloutClientConfig = field(default_factory=RolloutClientConfig)
    """Servers someone else runs (`urls`, `router_url`), concurrency, timeouts, retries, API key, as
    `rollout.client`. A failed request is retried (`max_retries`) on another server; one whose server
    died is retried after the pool restarted it."""
    max_server_restarts: int = 3
    """Times the run restarts a server of this pool that died (each restart counted and logged)."""

    deterministic_inference: ClassVar[bool] = False
    """No request of a role carries a sampling seed, so its servers need no deterministic kernels."""
    return_routed_experts: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if not self.model_path:
            changed = [f.name for f in fields(self) if getattr(self, f.name) != _default(f)]
            if changed:
                raise ValueError(f"model_path must be set when the section sets {', '.join(changed)} (it names the "
                                 f"model the pool serves); remove the section to run without this pool")
            return
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {self.num_servers}")
        if self.builtin_server_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"builtin_server_dtype must be 'float32' or 'bfloat16', got {self.builtin_server_dtype!r}")
        if not self.builtin_server_decode_delay_ms >= 0:
            raise ValueError(f"builtin_server_decode_delay_ms must be >= 0, got {self.builtin_server_decode_delay_ms}")
        if self.max_server_restarts < 0:
            raise ValueError(f"max_server_restarts must be >= 0, got {self.max_server_restarts}")
        if self.engine == "sglang" and not self.starts_servers:
            return
        if self.engine == "sglang":
            self.sglang.resolved_python()  # SGLang is installed (before any model is built)
            if self.sglang.resolved_device() == "cpu":
                check_cpu_support([])
            elif self.sglang.gpu_ids is None:
                raise ValueError("sglang.gpu_ids must name this pool's GPUs (sglang.tp_size per server): the default "
                                 "is the GPUs after the actor's, which the policy's servers take")

    @property
    def enabled(self) -> bool:
        """Whether the run has this pool (`model_path` set)."""
        return bool(self.model_path)

    @property
    def starts_servers(self) -> bool:
        """Whether the run starts the servers itself (no `client.urls`, no `client.router_url`)."""
        return not (self.client.urls or self.client.router_url)

    @property
    def num_builtin_servers(self) -> int:
        """`num_servers` under the name the pool reads on `rollout`."""
        return self.num_servers


def _default(f: Field) -> object:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def check_role_gpus(rollout_gpus: Optional[list[int]], roles: dict[str, ServerRoleConfig]) -> None:
    """No two pools started on GPUs may share one (ConfigError naming both sections)."""
    taken: dict[int, str] = {i: "rollout.sglang.gpu_ids" for i in rollout_gpus or ()}
    for role, cfg in roles.items():
        if not (cfg.enabled and cfg.engine == "sglang" and cfg.starts_servers and cfg.sglang.gpu_ids):
            continue
        for gpu in cfg.sglang.gpu_ids:
            if gpu in taken:
                raise ConfigError(f"{role}.sglang.gpu_ids and {taken[gpu]} both name GPU {gpu}: give each pool its own")
            taken[gpu] = f"{role}.sglang.gpu_ids"


def start_role_pools(roles: dict[str, ServerRoleConfig], *, seed: int, output_dir: Path,
                     vocab_size: Optional[int]) -> dict[str, "ServerPool"]:
    """Start (or reach, with `client.urls`) the pool of every enabled role and wait for its health;
    `{role: pool}`. `vocab_size`: the student's vocabulary, which bounds the token ids a reply may carry.
    A pool that fails to start stops the ones started before it."""
    from megatron_bapo.rollout.pool import ServerPool

    pools: dict[str, ServerPool] = {}
    try:
        for role, cfg in roles.items():
            if not cfg.enabled:
                continue
            pools[role] = ServerPool(cfg, None, model_path=cfg.model_path, seed=seed, log_dir=Path(output_dir) / "logs",
                                     state_path=Path(output_dir) / f"{role}_servers.json", vocab_size=vocab_size,
                                     weight_version=0, role=role)
            pools[role].start()
            logger.info("%s pool: %s at %s (never weight-synced)", role, cfg.model_path,
                        ", ".join(pools[role].client.config.urls or [str(pools[role].client.config.router_url)]))
    except BaseException:
        close_role_pools(pools)
        raise
    return pools


def close_role_pools(pools: dict[str, "ServerPool"]) -> None:
    """Close every pool (abort in flight, stop the servers it started); one failing does not stop the others."""
    for pool in pools.values():
        with contextlib.suppress(Exception):
            pool.close()
