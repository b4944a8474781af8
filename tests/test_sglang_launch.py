"""The real SGLang's command line, built from a run's config (`rollout/sglang_launch.py`), checked on CPU.

Each flag the run relies on lands on the command line it builds (and the live contract tier,
`tests/test_server_contract.py`, starts its SGLang servers with exactly this command); what SGLang
cannot do on a CPU is refused before launch, naming the setting; GPUs are split between servers, as
ids of the devices this process sees, and each server is given those devices (its CUDA_VISIBLE_DEVICES
mapped through ours).
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.sglang_launch import required_server_flags
from megatron_bapo.rollout.sglang_launch import BOOT, SGLangLaunchConfig, server_gpus, sglang_command

FAKE_SERVER = Path(__file__).with_name("fake_server.py")
UUIDS = "GPU-5a1c0e2f-aaaa-0001,MIG-7d3e9b10-bbbb-0002,GPU-9f00aa41-cccc-0003"


def flag_value(cmd: list[str], flag: str):
    assert cmd.count(flag) == 1, f"{flag} appears {cmd.count(flag)} times in {cmd}"
    i = cmd.index(flag)
    return cmd[i + 1] if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else True


def test_a_cpu_server_runs_sglang_launch_server_on_the_torch_native_path(tmp_path):
    python = tmp_path / "python"
    python.touch()
    cfg = SGLangLaunchConfig(python=str(python), device="cpu")
    cmd, env = sglang_command(cfg, model_path="/m", port=31234, random_seed=7, api_key="k3y")
    assert cmd[:3] == [str(python), "-c", BOOT]
    assert "runpy.run_module('sglang.launch_server'" in BOOT and "start_parent_watch()" in BOOT
    assert env == {"SGLANG_USE_CPU_ENGINE": "1"}
    expect = {"--model-path": "/m", "--port": "31234", "--random-seed": "7", "--api-key": "k3y", "--device": "cpu",
              "--dtype": "float32", "--mem-fraction-static": "0.1", "--max-total-tokens": "16384",
              "--weight-version": "0", "--host": "127.0.0.1", "--tp-size": "1"}
    assert {f: flag_value(cmd, f) for f in expect} == expect
    assert "--disable-radix-cache" not in cmd and "--enable-deterministic-inference" not in cmd


@pytest.mark.parametrize("pause_mode", [None, "abort", "retract", "in_place"])
def test_the_in_place_pause_gets_a_server_without_radix_cache(pause_mode):
    flags = required_server_flags(deterministic_inference=False, pause_mode=pause_mode)
    cmd, _ = sglang_command(SGLangLaunchConfig(device="cpu"), model_path="/m", port=1, random_seed=0, flags=flags,
                            python="py")
    assert ("--disable-radix-cache" in cmd) == (pause_mode == "in_place")


def test_config_values_override_the_cpu_defaults_and_extra_args_pass_through():
    cfg = SGLangLaunchConfig(device="cpu", dtype="bfloat16", mem_fraction_static=0.3, max_total_tokens=4096,
                             extra_args=["--context-length", "1024", "--skip-server-warmup"])
    cmd, _ = sglang_command(cfg, model_path="/m", port=1, random_seed=0, python="py")
    assert flag_value(cmd, "--dtype") == "bfloat16"
    assert flag_value(cmd, "--mem-fraction-static") == "0.3"
    assert flag_value(cmd, "--max-total-tokens") == "4096"
    assert cmd[-3:] == ["--context-length", "1024", "--skip-server-warmup"]


@pytest.mark.parametrize("flags, field", [(["--enable-deterministic-inference"], "rollout.deterministic_inference=false"),
                                          (["--enable-return-routed-experts"], "rollout.return_routed_experts=false")])
def test_what_sglang_cannot_run_on_a_cpu_is_refused_naming_the_setting(flags, field):
    with pytest.raises(ConfigError, match=field) as info:
        sglang_command(SGLangLaunchConfig(device="cpu"), model_path="/m", port=1, random_seed=0, flags=flags,
                       python="py")
    assert flags[0] in str(info.value) and "\n" not in str(info.value)


def test_a_gpu_server_gets_its_own_gpus_and_the_deterministic_flag(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every GPU visible: ids are CUDA's own
    cfg = SGLangLaunchConfig(device="cuda", tp_size=2, dtype="bfloat16")
    flags = required_server_flags(deterministic_inference=True, pause_mode="in_place")
    cmd, env = sglang_command(cfg, model_path="/m", port=1, random_seed=3, flags=flags, gpus=[4, 5], python="py")
    assert env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert "--device" not in cmd and "--mem-fraction-static" not in cmd and "--max-total-tokens" not in cmd
    assert flag_value(cmd, "--tp-size") == "2" and flag_value(cmd, "--dtype") == "bfloat16"
    assert flag_value(cmd, "--enable-deterministic-inference") is True
    assert flag_value(cmd, "--disable-radix-cache") is True
    with pytest.raises(ValueError, match="2 GPU id"):
        sglang_command(cfg, model_path="/m", port=1, random_seed=3, gpus=[4], python="py")


def test_servers_get_consecutive_gpus_after_the_actor_or_the_configured_ones(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert server_gpus(SGLangLaunchConfig(tp_size=2), 2, num_visible=8) == [[4, 5], [6, 7]]
    assert server_gpus(SGLangLaunchConfig(), 3, num_visible=8, num_actor_gpus=2) == [[2], [3], [4]]
    assert server_gpus(SGLangLaunchConfig(gpu_ids=[7, 1, 3, 0], tp_size=2), 2, num_visible=8) == [[7, 1], [3, 0]]
    with pytest.raises(ConfigError, match=r"need 6 GPU\(s\), but the 4 GPU\(s\) after the actor's 4 give 4"):
        server_gpus(SGLangLaunchConfig(tp_size=3), 2, num_visible=8)
    with pytest.raises(ConfigError, match=r"names GPU\(s\) \[9\], but this process sees 8 GPU\(s\)"):
        server_gpus(SGLangLaunchConfig(gpu_ids=[1, 9]), 2, num_visible=8)


def _server_env(cfg: SGLangLaunchConfig, gpus: list[int]) -> str:
    return sglang_command(cfg, model_path="/m", port=1, random_seed=0, gpus=gpus, python="py")[1]["CUDA_VISIBLE_DEVICES"]


def test_gpu_ids_index_the_visible_devices_and_the_server_gets_those_devices(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES=4,5,6,7 id 1 is physical GPU 5 (as the actor's LOCAL_RANK counts): the
    server is given "5", not "1" (another job's GPU). The default (after the actor's ranks) maps the
    same way; UUID and MIG entries pass through as written; unset, ids are CUDA's own."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    configured = SGLangLaunchConfig(device="cuda", gpu_ids=[1])
    assert [_server_env(configured, g) for g in server_gpus(configured, 1, num_visible=4)] == ["5"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    default = SGLangLaunchConfig(device="cuda")
    assert [_server_env(default, g) for g in server_gpus(default, 2, num_visible=4)] == ["6", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", UUIDS)
    tp2 = SGLangLaunchConfig(device="cuda", tp_size=2, gpu_ids=[2, 1])
    (gpus,) = server_gpus(tp2, 1, num_visible=3)
    assert _server_env(tp2, gpus) == "GPU-9f00aa41-cccc-0003,MIG-7d3e9b10-bbbb-0002"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _server_env(configured, [1]) == "1"


def test_an_id_past_the_visible_devices_names_the_field_the_devices_and_the_fix(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(ConfigError) as info:
        server_gpus(SGLangLaunchConfig(device="cuda", gpu_ids=[4]), 1, num_visible=2)
    msg = str(info.value)
    assert "rollout.sglang.gpu_ids" in msg and "CUDA_VISIBLE_DEVICES=4,5" in msg and "0..1" in msg, msg
    with pytest.raises(ConfigError) as info:  # the command itself refuses too, whatever chose the ids
        _server_env(SGLangLaunchConfig(device="cuda"), [2])
    msg = str(info.value)
    assert "rollout.sglang.gpu_ids" in msg and "CUDA_VISIBLE_DEVICES=4,5" in msg and "0..1" in msg, msg
    assert "\n" not in msg


def test_the_pool_starts_and_restarts_each_server_process_on_the_visible_gpus(monkeypatch, tmp_path):
    """The real pool launches real child processes (a stand-in for SGLang's Python that records the
    CUDA_VISIBLE_DEVICES it was started with, then runs `tests/fake_server.py`): with 4,5,6,7 visible
    and two actor ranks, the servers run on physical GPUs 6 and 7, and a restarted one on its own again."""
    import torch

    from megatron_bapo.config import RolloutConfig
    from megatron_bapo.rollout.config import RolloutClientConfig
    from megatron_bapo.rollout.pool import ServerPool

    record = tmp_path / "server_env.txt"
    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import os, sys
        port = sys.argv[sys.argv.index("--port") + 1]
        with open({str(record)!r}, "a") as f:
            f.write(port + " " + os.environ.get("CUDA_VISIBLE_DEVICES", "unset") + "\\n")
        os.execv(sys.executable, [sys.executable, {str(FAKE_SERVER)!r}, "--port", port])
        """))
    python.chmod(0o755)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # what CUDA counts under that list
    rollout = RolloutConfig(engine="sglang", num_builtin_servers=2,
                            sglang=SGLangLaunchConfig(python=str(python), device="cuda"),
                            client=RolloutClientConfig(health_timeout_s=60))
    pool = ServerPool(rollout, model_path=str(tmp_path / "model"), seed=0, log_dir=tmp_path / "logs",
                      state_path=tmp_path / "servers.json")
    pool.start()
    try:
        ports = [s.port for s in pool.servers]
        os.kill(pool.servers[1].pid, signal.SIGKILL)
        pool.servers[1].proc.wait(timeout=30)
        assert pool.ensure_alive() == [pool.servers[1].url]
    finally:
        pool.close()
    assert record.read_text().splitlines() == [f"{ports[0]} 6", f"{ports[1]} 7", f"{ports[1]} 7"]


def test_bad_values_name_the_field(tmp_path):
    for kwargs, field in [({"device": "tpu"}, "rollout.sglang.device"), ({"tp_size": 0}, "rollout.sglang.tp_size"),
                          ({"mem_fraction_static": 1.5}, "rollout.sglang.mem_fraction_static"),
                          ({"gpu_ids": [1, 1]}, "rollout.sglang.gpu_ids")]:
        with pytest.raises(ConfigError, match=field):
            SGLangLaunchConfig(**kwargs)
    with pytest.raises(ConfigError, match="rollout.sglang.python=.*does not exist"):
        SGLangLaunchConfig(python=str(tmp_path / "nope")).resolved_python()
    with pytest.raises(ConfigError, match="rollout.sglang.tp_size=2 on a CPU"):
        sglang_command(SGLangLaunchConfig(device="cpu", tp_size=2), model_path="/m", port=1, random_seed=0,
                       python="py")


def test_the_run_config_refuses_an_sglang_engine_it_cannot_start(tmp_path):
    """`rollout.engine: sglang` is checked where the config is read (before any model is built): an
    unknown engine, a missing SGLang, what SGLang cannot do on a CPU; external servers are not started."""
    from megatron_bapo.config import RolloutConfig
    from megatron_bapo.rollout.config import RolloutClientConfig

    with pytest.raises(ConfigError, match="rollout.engine must be one of"):
        RolloutConfig(engine="vllm")
    missing = SGLangLaunchConfig(python=str(tmp_path / "nope"), device="cpu")
    with pytest.raises(ConfigError, match="rollout.sglang.python=.*does not exist"):
        RolloutConfig(engine="sglang", sglang=missing)
    python = tmp_path / "python"
    python.touch()
    here = SGLangLaunchConfig(python=str(python), device="cpu")
    with pytest.raises(ConfigError, match="rollout.deterministic_inference=false"):
        RolloutConfig(engine="sglang", sglang=here, deterministic_inference=True)
    with pytest.raises(ConfigError, match="rollout.return_routed_experts=false"):
        RolloutConfig(engine="sglang", sglang=here, return_routed_experts=True)
    RolloutConfig(engine="sglang", sglang=missing, deterministic_inference=True,
                  client=RolloutClientConfig(urls=["http://h:1"]))  # starts nothing: nothing to check
