"""Pools per role (`rollout.roles`): a teacher's or a judge's servers run beside the policy's under the
one `ServerPool`, and are never weight-synced: policy updates move the policy's servers and leave
theirs at version 0 with the same log-probs; an update of such a pool is refused before it reaches a
server. Real built-in servers on loopback; config sections checked through `load_run_config`."""

from __future__ import annotations

import json

import pytest

from megatron_bapo.config import RolloutConfig, dump_run_config, load_run_config
from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.config import RolloutClientConfig
from megatron_bapo.rollout.errors import RolloutError
from megatron_bapo.rollout.pool import ServerPool
from megatron_bapo.rollout.roles import ServerRoleConfig, close_role_pools, start_role_pools
from megatron_bapo.sync.config import SyncConfig

PROBE = [1, 5, 9, 3, 7, 2, 8, 4, 6]
TINY = "examples/configs/tiny_bapo.yaml"


@pytest.mark.slow
def test_policy_updates_never_move_a_role_pool(tiny_hf_dir, tmp_path):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    other = make_tiny_hf_checkpoint(tmp_path / "other", seed=1)
    client_cfg = RolloutClientConfig(health_timeout_s=120, max_retries=1, backoff_s=0.1)
    policy = ServerPool(RolloutConfig(client=client_cfg), SyncConfig(method="disk", verify="off"),
                        model_path=str(tiny_hf_dir), seed=0, log_dir=tmp_path / "logs",
                        state_path=tmp_path / "servers.json")
    roles = {}
    try:
        policy.start()
        roles = start_role_pools({"teacher": ServerRoleConfig(model_path=str(tiny_hf_dir), client=client_cfg)},
                                 seed=0, output_dir=tmp_path, vocab_size=None)
        teacher = roles["teacher"]
        [url] = teacher.client.config.urls
        before = teacher.client.run(teacher.client.ascore(url, PROBE))
        assert policy.client.run(policy.client.ascore(policy.client.config.urls[0], PROBE)) == before
        for version, path in ((1, other), (2, tiny_hf_dir), (3, other)):
            with policy.update(version) as session:
                session.load_from_disk(path, version)
        assert policy.version == 3 and policy.client.get_weight_version() == 3
        assert policy.client.run(policy.client.ascore(policy.client.config.urls[0], PROBE)) != before
        assert teacher.version == 0 and teacher.client.get_weight_version() == 0
        assert teacher.client.run(teacher.client.aget_weight_versions()) == {url: "0"}
        assert teacher.client.run(teacher.client.ascore(url, PROBE)) == before  # bit for bit: untouched
        with pytest.raises(RolloutError, match="the teacher pool is not weight-synced"):
            with teacher.update(1) as session:
                session.load_from_disk(other, 1)
        assert teacher.client.get_weight_version() == 0 and teacher._sender is None
        recorded = json.loads((tmp_path / "teacher_servers.json").read_text())
        assert recorded == [{"url": url, "pid": teacher.servers[0].pid}]
        assert json.loads((tmp_path / "servers.json").read_text())[0]["url"] != url
        assert (tmp_path / "logs" / "teacher_server_0.log").exists()
        assert teacher.kind == "teacher built-in server" and policy.kind == "built-in server"
    finally:
        close_role_pools(roles)
        policy.close()
    assert not teacher.servers[0].alive()


def test_role_sections_parse_refuse_and_mask(tmp_path):
    cfg = load_run_config(TINY)
    assert not cfg.teacher.enabled and not cfg.judge.enabled  # the default: no pool, nothing changes
    cfg = load_run_config(TINY, ["teacher.model_path=/m/teacher", "teacher.num_servers=2",
                                 "judge.model_path=/m/judge", "judge.client.urls=[http://127.0.0.1:9]",
                                 "judge.client.api_key=secret", "teacher.client.api_key=hidden"])
    assert cfg.teacher.num_builtin_servers == 2 and cfg.teacher.starts_servers and not cfg.judge.starts_servers
    dumped = dump_run_config(cfg)
    assert "secret" not in dumped and "hidden" not in dumped and dumped.count("api_key: '***'") == 2
    for overrides, needle in [
        (["teacher.engine=sglang"], "teacher: model_path must be set when the section sets engine"),
        (["teacher.model_path=/m", "teacher.engine=vllm"], "teacher: engine must be one of"),
        (["judge.model_path=/m", "judge.num_servers=0"], "judge: num_servers must be >= 1"),
        (["teacher.model_path=/m", "teacher.bogus=1"], "unknown config key(s) teacher.bogus"),
        (["rollout.engine=sglang", "rollout.client.urls=[http://127.0.0.1:9]", "rollout.sglang.gpu_ids=[0, 1]",
          "teacher.model_path=/m", "teacher.engine=sglang", "teacher.sglang.device=cpu",
          "teacher.client.urls=[http://127.0.0.1:8]"], None),  # external teacher servers: no GPUs taken
    ]:
        if needle is None:
            load_run_config(TINY, overrides)
            continue
        with pytest.raises(ConfigError) as err:
            load_run_config(TINY, overrides)
        assert needle in str(err.value), str(err.value)


def test_two_pools_on_one_gpu_are_refused():
    from megatron_bapo.rollout.roles import check_role_gpus

    teacher = ServerRoleConfig(model_path="/m", client=RolloutClientConfig(urls=["http://127.0.0.1:9"]))
    teacher.engine = "sglang"  # set after validation: the GPU check alone, without SGLang installed
    teacher.client = RolloutClientConfig()
    teacher.sglang.gpu_ids = [1, 2]
    check_role_gpus([0], {"teacher": teacher})
    with pytest.raises(ConfigError, match="teacher.sglang.gpu_ids and rollout.sglang.gpu_ids both name GPU 1"):
        check_role_gpus([0, 1], {"teacher": teacher})
