"""Run config: YAML + overrides, presets under explicit keys, errors that name the field."""

import pytest

from megatron_bapo.config import dump_run_config, load_run_config
from megatron_bapo.config_io import ConfigError

BASE = ["model.hf_path=/m", "data.path=/d.jsonl"]


def test_yaml_overrides_and_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("bapo_preset: bapo-verl\nactor:\n  optim:\n    lr: 2e-6\n  bapo:\n    rho0: 0.6\n"
                    "rollout:\n  group_size: 4\n  prompts_per_step: 2\n")
    cfg = load_run_config(path, BASE + ["rollout.segment_tokens=16", "rollout.max_response_tokens=48"])
    assert cfg.actor.optim.lr == 2e-6
    assert cfg.actor.bapo.order == "verl" and cfg.actor.bapo.low_max == 0.95  # from the preset
    assert cfg.actor.bapo.rho0 == 0.6  # explicit key wins over the preset
    assert cfg.rollout.segment_tokens == 16 and cfg.rollout.group_size == 4
    # The dumped YAML reproduces the same config (no preset needed any more).
    again = tmp_path / "again.yaml"
    again.write_text(dump_run_config(cfg))
    assert load_run_config(again) == cfg


@pytest.mark.parametrize(
    "override, needle",
    [
        ("rollout.grup_size=3", "rollout.grup_size"),
        ("actor.bapo.low_start=0.95", "low_start"),
        ("rollout.sampling.temperature=0", "rollout.sampling.temperature"),
        ("rollout.sampling.top_p=0.95", "rollout.sampling.top_p"),
        ("rollout.sampling.top_k=50", "rollout.sampling.top_k"),
        ("rollout.max_group_staleness=-1", "max_group_staleness must be >= 0"),
        ("sync.pause_mode=now", "sync.pause_mode"),
        ("rollout.temperature=0.6", "rollout.temperature"),  # moved: rollout.sampling.temperature
        ("bapo_preset=ppo", "bapo_preset"),
        ("actor.n_minibatches=3", "actor.n_minibatches"),
        ("sync.method=nccl", "sync.method"),
        ("advantage.estimator=ppo", "advantage.estimator"),
        ("actor.policy_loss=reinforce", "policy_loss"),
        ("actor.dppo.divergence=js", "actor.dppo"),
        ("actor.cispo.c_high=0.9", "actor.cispo"),
        ("actor.sapo.tau_pos=-1", "actor.sapo"),
        ("rollout.dynamic_sampling=drop", "rollout.dynamic_sampling"),
        ("rollout.max_refill_rounds=0", "rollout.max_refill_rounds"),
        ("reward.overlong_buffer_tokens=-1", "reward.overlong_buffer_tokens"),
        ("advantage.filter_uniform_groups=true", "rollout.dynamic_sampling: filter"),  # moved, same behaviour
    ],
)
def test_bad_values_name_the_field(override, needle):
    with pytest.raises((ConfigError, ValueError), match=needle.replace(".", r"\.")):
        load_run_config(None, BASE + [override])


def test_required_paths():
    with pytest.raises(ConfigError, match="model.hf_path"):
        load_run_config(None, ["data.path=/d"])
    with pytest.raises(ConfigError, match="data.path"):
        load_run_config(None, ["model.hf_path=/m"])


@pytest.mark.parametrize("overrides, needles", [
    # Distributed sync + rollout ahead + no pause: each bucket would wait for the generation in flight.
    (["sync.method=distributed", "trainer.async_steps=1", "rollout.max_staleness=3"],
     ["sync.method=distributed", "trainer.async_steps=1", "sync.pause_mode"]),
    # Penalties change the logits before the returned log-prob: the trainer cannot reproduce them.
    (["rollout.sampling.extra={frequency_penalty: 0.5}"], ["rollout.sampling.extra", "frequency_penalty"]),
    (["rollout.sampling.extra={min_new_tokens: 4}"], ["min_new_tokens"]),
    (["rollout.sampling.extra={sampling_seed: 4}"], ["rollout.deterministic_inference"]),
    (["sync.group_timeout_s=0"], ["sync.group_timeout_s"]),
    # A hard cap below the versions a response spans would regenerate every long response forever
    # (1024 tokens: 11 segments, 10 versions; 3 steps ahead). The per-token cap may be lower.
    (["rollout.segment_tokens=100", "rollout.max_group_staleness=5"],
     ["rollout.max_group_staleness=5 < 10", "rollout.segment_tokens"]),
    (["trainer.async_steps=3", "rollout.max_group_staleness=2"], ["rollout.max_group_staleness=2 < 3",
                                                                   "trainer.async_steps=3"]),
    # Routing replay replays what the servers return only when asked to.
    (["actor.routing_replay=true"], ["actor.routing_replay=true", "rollout.return_routed_experts=true"]),
    # SAPO's gates are soft: an adaptive preset has no bound to move; the surrogate sums are PPO's.
    (["actor.policy_loss=sapo"], ["policy_loss=sapo", "bapo_preset: grpo"]),
    (["actor.policy_loss=dppo", "bapo_preset=bapo-paper"], ["policy_loss=dppo", "contribution='surrogate'"]),
    # The overlong penalty's ramp must end at the response limit.
    (["reward.overlong_buffer_tokens=2000"], ["reward.overlong_buffer_tokens=2000", "rollout.max_response_tokens=1024"]),
])
def test_combinations_that_cannot_work_are_refused_naming_the_fields(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_run_config(None, BASE + overrides)
    for needle in needles:
        assert needle in str(info.value)


def test_the_new_losses_and_dynamic_sampling_load_with_workable_settings():
    cfg = load_run_config(None, BASE + ["actor.policy_loss=dppo", "rollout.dynamic_sampling=refill",
                                        "reward.overlong_buffer_tokens=256", "actor.overlong_filter=true"])
    assert cfg.actor.objective.name == "dppo" and cfg.actor.bapo.is_adaptive  # balanced DPPO
    assert cfg.rollout.dynamic_sampling == "refill" and cfg.rollout.max_refill_rounds == 8
    for loss in ("sapo", "cispo", "dppo"):
        assert load_run_config(None, BASE + [f"actor.policy_loss={loss}", "bapo_preset=grpo"]).actor.policy_loss == loss
    assert load_run_config(None, BASE).rollout.dynamic_sampling == "off"  # today's behaviour by default
    # An unquoted `off` is YAML's false: it means "off", in a file and on the command line.
    assert load_run_config(None, BASE + ["rollout.dynamic_sampling=off"]).rollout.dynamic_sampling == "off"
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling"):
        load_run_config(None, BASE + ["rollout.dynamic_sampling=on"])


def test_a_per_token_staleness_cap_below_a_responses_span_loads():
    """The per-token cap may be below the versions a response spans (its oldest tokens then leave the
    loss); the derived hard cap, max_staleness + 2 x segments, still lets every response finish."""
    cfg = load_run_config(None, BASE + ["rollout.segment_tokens=100", "trainer.async_steps=1"])
    assert cfg.rollout.max_staleness == 2 and cfg.rollout.group_staleness_cap == 2 + 2 * 11


def test_workable_sync_combinations_and_neutral_penalties_load():
    load_run_config(None, BASE + ["sync.method=distributed", "trainer.async_steps=1", "rollout.max_staleness=3",
                                  "sync.pause_mode=abort", "sync.group_timeout_s=30"])
    load_run_config(None, BASE + ["rollout.sampling.extra={repetition_penalty: 1.0}"])
