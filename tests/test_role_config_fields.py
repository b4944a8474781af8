"""Every field of a role's pool (`teacher`, `judge`: `rollout.roles.ServerRoleConfig`) and of `distill`
reaches the code that acts on it: each check sets a non-default value, runs the real pool (built-in
servers, or SGLang's command line run by a stand-in Python that records it and serves
`tests/fake_server.py`) or the real advantage, and looks at what it did with the value;
`test_every_field_has_a_check` fails when a field is added without one. (The client's and SGLang's
sub-fields act as `rollout.client.*` / `rollout.sglang.*` do, which their own tests check: here they
reach the pool's client and launch unchanged.)"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import textwrap

import pytest

from megatron_bapo.algorithms.distill import DistillConfig
from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.config import RolloutClientConfig
from megatron_bapo.rollout.errors import RolloutError
from megatron_bapo.rollout.roles import ServerRoleConfig, close_role_pools, start_role_pools
from megatron_bapo.rollout.sglang_launch import SGLangLaunchConfig

FAKE_SERVER = os.path.join(os.path.dirname(__file__), "fake_server.py")
CLIENT = RolloutClientConfig(health_timeout_s=60, max_retries=1, backoff_s=0.05, request_timeout_s=77.0,
                             connect_timeout_s=3.0, control_timeout_s=55.0, backoff_max_s=2.0,
                             unhealthy_cooldown_s=4.0, flush_cache_timeout_s=9.0, max_concurrency=3,
                             api_key="role-key")


def _pool(tmp_path, role="teacher", **fields):
    cfg = ServerRoleConfig(**{"client": CLIENT, **fields})
    return start_role_pools({role: cfg}, seed=5, output_dir=tmp_path, vocab_size=None)


@pytest.fixture(scope="module")
def fake_sglang(tmp_path_factory, tiny_hf_dir):
    """A `judge` pool of two "SGLang" servers whose Python records its command line and serves the fake
    server: (the recorded command lines, the pool's client config)."""
    tmp = tmp_path_factory.mktemp("fake_sglang")
    record, python = tmp / "argv.txt", tmp / "python"
    python.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import json, os, sys
        with open({str(record)!r}, "a") as f:
            f.write(json.dumps(sys.argv[1:]) + "\\n")
        port = sys.argv[sys.argv.index("--port") + 1]
        os.execv(sys.executable, [sys.executable, {FAKE_SERVER!r}, "--port", port])
        """))
    python.chmod(0o755)
    sglang = SGLangLaunchConfig(python=str(python), device="cpu", dtype="bfloat16", mem_fraction_static=0.2,
                                max_total_tokens=4096, extra_args=["--context-length", "256"])
    pools = _pool(tmp, "judge", model_path=str(tiny_hf_dir), engine="sglang", num_servers=2, sglang=sglang)
    try:
        import json

        return [json.loads(line) for line in record.read_text().splitlines()], pools["judge"].client.config
    finally:
        close_role_pools(pools)


@pytest.fixture(scope="module")
def builtin(tmp_path_factory, tiny_hf_dir):
    """A `teacher` pool of one built-in server with non-default launch fields: (the pool, its /server_info)."""
    pools = _pool(tmp_path_factory.mktemp("builtin"), model_path=str(tiny_hf_dir), builtin_server_dtype="bfloat16",
                  builtin_server_decode_delay_ms=2.5)
    try:
        pool = pools["teacher"]
        [info] = pool.client.run(pool.client.aget_server_info()).values()
        yield pool, info
    finally:
        close_role_pools(pools)


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def check_model_path(tiny_hf_dir, tmp_path, fake, builtin):
    return builtin[1]["model_path"] == str(tiny_hf_dir) and \
        all(flag(cmd, "--model-path") == str(tiny_hf_dir) for cmd in fake[0])


def check_engine(tiny_hf_dir, tmp_path, fake, builtin):
    return all("runpy.run_module('sglang.launch_server'" in cmd[1] for cmd in fake[0]) and \
        "megatron_bapo.server" in builtin[1]["backend"]


def check_num_servers(tiny_hf_dir, tmp_path, fake, builtin):
    return len(fake[0]) == 2 and len(fake[1].urls) == 2


def check_builtin_server_dtype(tiny_hf_dir, tmp_path, fake, builtin):
    return builtin[1]["dtype"] == "bfloat16"


def check_builtin_server_decode_delay_ms(tiny_hf_dir, tmp_path, fake, builtin):
    return builtin[1]["decode_delay_ms"] == 2.5


def check_max_server_restarts(tiny_hf_dir, tmp_path, fake, builtin):
    pools = _pool(tmp_path, model_path=str(tiny_hf_dir), max_server_restarts=0)
    try:
        pool = pools["teacher"]
        os.kill(pool.servers[0].pid, signal.SIGKILL)
        pool.servers[0].proc.wait(timeout=30)
        with pytest.raises(RolloutError, match=r"after 0 restart\(s\) \(teacher.max_server_restarts\)"):
            pool.ensure_alive()
        return True
    finally:
        close_role_pools(pools)


def check_sglang(field):
    expect = {"python": lambda cmd: True, "device": lambda cmd: flag(cmd, "--device") == "cpu",
              "dtype": lambda cmd: flag(cmd, "--dtype") == "bfloat16",
              "mem_fraction_static": lambda cmd: flag(cmd, "--mem-fraction-static") == "0.2",
              "max_total_tokens": lambda cmd: flag(cmd, "--max-total-tokens") == "4096",
              "extra_args": lambda cmd: flag(cmd, "--context-length") == "256"}

    def check(tiny_hf_dir, tmp_path, fake, builtin):
        if field == "tp_size":  # on a CPU SGLang runs one rank: a larger value is refused at the launch
            with pytest.raises(ConfigError, match="tp_size=2 on a CPU"):
                _pool(tmp_path, model_path=str(tiny_hf_dir), engine="sglang",
                      sglang=dataclasses.replace(SGLangLaunchConfig(python=sys.executable, device="cpu"), tp_size=2))
            return True
        if field == "gpu_ids":  # this process sees no GPU: the ids are refused naming them
            pools = {}
            with pytest.raises(ConfigError, match=r"names GPU\(s\) \[5\]"):
                pools = _pool(tmp_path, model_path=str(tiny_hf_dir), engine="sglang",
                              sglang=SGLangLaunchConfig(python=sys.executable, device="cuda", gpu_ids=[5]))
            close_role_pools(pools)
            return True
        return all(expect[field](cmd) for cmd in fake[0])
    return check


def check_client(field):
    def check(tiny_hf_dir, tmp_path, fake, builtin):
        if field == "api_key":
            return all(flag(cmd, "--api-key") == "role-key" for cmd in fake[0]) and fake[1].api_key == "role-key"
        if field in ("urls", "router_url"):  # servers someone else runs: none started, the client goes there
            url = builtin[0].client.config.urls[0]
            key = {"urls": [url]} if field == "urls" else {"router_url": url}
            external = _pool(tmp_path, "judge", model_path=str(tiny_hf_dir), client=dataclasses.replace(CLIENT, **key))
            try:
                judge = external["judge"]
                reached = not judge.servers and getattr(judge.client.config, field) == key[field]
                return reached and (field == "router_url" or judge.client.get_weight_version() == 0)
            finally:
                close_role_pools(external)
        return getattr(fake[1], field) == getattr(CLIENT, field)  # the pool's client runs with the section's
    return check


def check_distill(field):
    def check(tiny_hf_dir, tmp_path, fake, builtin):
        from megatron_bapo.config import AdvantageConfig, load_run_config
        from megatron_bapo.experience import build_experience
        from megatron_bapo.tiny.tokenizer import build_tiny_tokenizer
        from test_distill import _group

        cfg = load_run_config("examples/configs/tiny_bapo.yaml", ["teacher.model_path=/m", f"distill.{field}=2"])
        batch, _ = build_experience([_group()], build_tiny_tokenizer(), AdvantageConfig(estimator="dr_grpo"),
                                    distill=cfg.distill)
        first = batch["advantages"][0, 2].item()  # -(-0.5 + 0.25) x coef + 0.5 x reward_coef
        return first == (0.5 if field == "coef" else 0.25 + 1.0)
    return check


CHECKS = {
    "model_path": check_model_path, "engine": check_engine, "num_servers": check_num_servers,
    "builtin_server_dtype": check_builtin_server_dtype,
    "builtin_server_decode_delay_ms": check_builtin_server_decode_delay_ms,
    "max_server_restarts": check_max_server_restarts,
    **{f"sglang.{f.name}": check_sglang(f.name) for f in dataclasses.fields(SGLangLaunchConfig)},
    **{f"client.{f.name}": check_client(f.name) for f in dataclasses.fields(RolloutClientConfig)},
    **{f"distill.{f.name}": check_distill(f.name) for f in dataclasses.fields(DistillConfig)},
}


def _field_paths() -> set[str]:
    nested = {"sglang": SGLangLaunchConfig, "client": RolloutClientConfig}
    out = {f"distill.{f.name}" for f in dataclasses.fields(DistillConfig)}
    for f in dataclasses.fields(ServerRoleConfig):
        out |= {f"{f.name}.{g.name}" for g in dataclasses.fields(nested[f.name])} if f.name in nested else {f.name}
    return out


def test_every_field_has_a_check():
    assert set(CHECKS) == _field_paths(), f"fields without a check: {sorted(_field_paths() - set(CHECKS))}"


@pytest.mark.parametrize("field", sorted(CHECKS))
def test_every_field_reaches_where_it_acts(field, fake_sglang, builtin, tiny_hf_dir, tmp_path):
    assert CHECKS[field](tiny_hf_dir, tmp_path, fake_sglang, builtin), field
