"""The real SGLang's command line, built from a run's config (`rollout/sglang_launch.py`), checked on CPU.

Each flag the run relies on lands on the command line it builds (and the live contract tier,
`tests/test_server_contract.py`, starts its SGLang servers with exactly this command); what SGLang
cannot do on a CPU is refused before launch, naming the setting; GPUs are split between servers.
"""

from __future__ import annotations

import pytest

from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.pool import required_server_flags
from megatron_bapo.rollout.sglang_launch import BOOT, SGLangLaunchConfig, server_gpus, sglang_command


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


def test_a_gpu_server_gets_its_own_gpus_and_the_deterministic_flag():
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
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert server_gpus(SGLangLaunchConfig(tp_size=2), 2, num_visible=8) == [[4, 5], [6, 7]]
    assert server_gpus(SGLangLaunchConfig(), 3, num_visible=8, num_actor_gpus=2) == [[2], [3], [4]]
    assert server_gpus(SGLangLaunchConfig(gpu_ids=[7, 1, 3, 0], tp_size=2), 2, num_visible=8) == [[7, 1], [3, 0]]
    with pytest.raises(ConfigError, match=r"need 6 GPU\(s\), but the 4 GPU\(s\) after the actor's 4 give 4"):
        server_gpus(SGLangLaunchConfig(tp_size=3), 2, num_visible=8)
    with pytest.raises(ConfigError, match=r"names GPU\(s\) \[9\], but this node has 8"):
        server_gpus(SGLangLaunchConfig(gpu_ids=[1, 9]), 2, num_visible=8)


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
