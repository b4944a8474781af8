"""The progress watchdog (`megatron_bapo.progress`) and its config field `trainer.max_steps_without_update`:
the derived default, the values refused, the field reaching the trainer's watchdog, and the one
line that names why the last steps made no update."""

from __future__ import annotations

import pytest

from megatron_bapo.config import load_run_config
from megatron_bapo.config_io import ConfigError
from megatron_bapo.progress import NoProgressError, ProgressWatchdog, why_no_update

BASE = ["model.hf_path=m", "data.path=d.jsonl"]


def _config(*overrides: str):
    return load_run_config(None, BASE + list(overrides))


def test_default_is_derived_from_segments_and_steps_ahead():
    # 2 x (segments per response + rounds ahead) + 2: twice the longest healthy stretch (see the docstring).
    assert _config("rollout.max_response_tokens=6", "rollout.segment_tokens=3").steps_without_update_limit() == 6
    cfg = _config("rollout.max_response_tokens=65536", "rollout.segment_tokens=16384", "trainer.async_steps=1",
                  "rollout.max_staleness=4")
    assert cfg.steps_without_update_limit() == 12
    assert _config("trainer.max_steps_without_update=0").steps_without_update_limit() == 0  # never stop


def test_the_field_reaches_the_trainers_watchdog():
    from megatron_bapo.trainer import Trainer

    assert Trainer(_config("trainer.max_steps_without_update=7")).watchdog.limit == 7
    assert Trainer(_config("rollout.max_response_tokens=6", "rollout.segment_tokens=3")).watchdog.limit == 6


@pytest.mark.parametrize("value, needle", [("-1", "must be >= 0"), ("1", "use >= 2")])
def test_limits_that_would_stop_a_healthy_run_are_refused(value, needle):
    with pytest.raises(ConfigError, match=f"trainer.max_steps_without_update.*{needle}"):
        _config(f"trainer.max_steps_without_update={value}", "rollout.max_response_tokens=6",
                "rollout.segment_tokens=3")


def test_stops_after_the_limit_naming_the_last_reasons():
    dog = ProgressWatchdog(3)
    dog.observe(1, {"train/updated": 0.0, "experience/num_groups": 0.0, "rollout/buffer_groups": 3.0})
    dog.observe(2, {"train/updated": 1.0})  # an update resets the count
    # rollout.dynamic_sampling dropped both finished groups: none is left to train
    dog.observe(3, {"train/updated": 0.0, "experience/num_groups": 0.0, "experience/num_groups_filtered": 2.0,
                    "experience/num_samples": 0.0})
    dog.observe(4, {"train/updated": 0.0, "rollout/num_regenerated": 12.0, "experience/num_groups": 0.0})
    with pytest.raises(NoProgressError) as err:
        dog.observe(5, {"train/updated": 0.0, "rollout/num_groups_failed": 1.0, "rollout/num_bad_replies": 2.0,
                        "experience/num_groups": 1.0, "experience/num_samples": 4.0,
                        "actor/num_optimizer_steps": 2.0})
    msg = str(err.value)
    assert msg.startswith("no optimizer update in 3 consecutive steps (3-5; trainer.max_steps_without_update=3)")
    assert ("step 5: 2 reply(ies) refused, 1 group(s) failed (4xx), every optimizer step skipped (non-finite loss, "
            "log-probs or advantages); step 4: 12 stale sample(s) regenerated, no group finished (0 still generating); "
            "step 3: all 2 finished group(s) filtered") in msg
    assert "rollout.max_staleness" in msg and "uniform rewards" in msg and "(0: never stop)" in msg
    assert (dog.num_updated, dog.num_steps) == (1, 5)


def test_zero_never_stops_and_rank_without_metrics_still_counts():
    dog = ProgressWatchdog(0)
    for step in range(1, 50):
        dog.observe(step, {"train/updated": 0.0})
    assert len(dog.stalled) == 49 and why_no_update({}) == ""
