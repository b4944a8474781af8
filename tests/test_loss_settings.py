"""Loss and preset settings are checked when the config loads, on every rank, not at step 1.

One case per rule (docs/bapo.md, "Settings checked at load"): the error names the field, its value
and the fix. Then the property the rules exist for: whatever the config accepts, the step's search
and loss accept (b74de61 accepted a CISPO floor at or above the searched cap's start and raised at
step 1, on the last pipeline stage only, while every other stage waited in the pipeline schedule).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_bapo.config import load_run_config
from megatron_bapo.config_io import ConfigError, from_dict

BASE = ["model.hf_path=/m", "data.path=/d.jsonl"]
CISPO = ["actor.policy_loss=cispo"]
DPPO = ["actor.policy_loss=dppo"]
RECOMPUTE = ["actor.old_logprobs=recompute", "actor.correction.mode=tis"]

RULES = {
    # BAPO's bounds are ratios: an on-policy token (r = 1) passes on both sides.
    "bapo-low-max-above-1": (["actor.bapo.low_max=1.05"], ["BapoConfig.low_max=1.05", "<= 1"]),
    "bapo-high-start-below-1": (["actor.bapo.high_start=0.95"], ["BapoConfig.high_start=0.95", ">= 1"]),
    # Algorithm 1 (paper order) moves nothing once c_low has no next grid point.
    "paper-order-fixed-low": (["actor.bapo.low_max=0.6"], ["actor.bapo.order=paper", "actor.bapo.low_start=0.6",
                                                          "actor.bapo.order: verl"]),
    "paper-order-fixed-low-dppo": (DPPO + ["actor.dppo.low_min=0.15"],
                                   ["actor.bapo.order=paper", "actor.dppo.delta_low=0.15", "(dppo)"]),
    "dppo-grids-single-points": (DPPO + ["actor.bapo.order=verl", "actor.dppo.low_min=0.15",
                                         "actor.dppo.high_max=0.15"], ["single points", "actor.dppo.high_max"]),
    # DPPO's TV divergence lies in [-1, 1]; its grid is bounded like BAPO's.
    "dppo-tv-delta-low-above-1": (["actor.dppo.delta_low=1.5", "actor.dppo.delta_high=0.2"],
                                  ["DppoConfig.delta_low=1.5", "(0, 1]"]),
    "dppo-tv-high-max-above-1": (["actor.dppo.high_max=1.5"], ["DppoConfig.high_max=1.5", "(0, 1]"]),
    "dppo-grid-too-fine": (["actor.dppo.high_step=1e-7"], ["too fine", "high_step"]),
    # CISPO's searched cap: above 1 and above the floor (as a fixed cap must be), and a grid to move on.
    "cispo-cap-start-at-1": (CISPO + ["actor.bapo.high_start=1.0"],
                             ["actor.bapo.high_start=1.0", "actor.cispo.c_low=0.0", "high_start > 1.0"]),
    "cispo-cap-start-at-floor": (CISPO + ["actor.bapo.high_start=1.0", "actor.cispo.c_low=0.9",
                                          "actor.bapo.low_max=0.9"], ["actor.cispo.c_low=0.9", "high_start"]),
    "cispo-cap-grid-one-point": (CISPO + ["actor.bapo.high_max=1.2"], ["upper grid is one point",
                                                                       "actor.bapo.high_max"]),
    # TIS: a cap below 1 shrinks the tokens the engines agree on.
    "tis-cap-below-1": (RECOMPUTE + ["actor.correction.tis_cap=0.5"], ["CorrectionConfig.tis_cap", ">= 1", "0.5"]),
    # Advantages: a group of one carries no signal; GRPO's std of equal rewards is 0.
    "group-of-one": (["rollout.group_size=1"], ["rollout.group_size=1", ">= 2"]),
    "grpo-eps-zero": (["advantage.eps=0"], ["advantage.eps=0", "advantage.estimator=grpo",
                                            "rollout.dynamic_sampling: filter"]),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_setting_that_cannot_work_is_refused_at_load_naming_field_value_and_fix(rule):
    overrides, needles = RULES[rule]
    with pytest.raises(ConfigError) as info:
        load_run_config(None, BASE + overrides)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (rule, message)


@pytest.mark.parametrize("overrides", [
    ["actor.bapo.high_start=1.0", "actor.bapo.low_max=0.95", "actor.bapo.low_start=0.9"],  # r = 1 inside, just
    ["actor.bapo.low_max=0.6", "actor.bapo.order=verl"],  # the verl order moves c_high alone
    CISPO + ["actor.bapo.low_max=0.6"],  # CISPO's search moves only the cap: a fixed c_low is fine
    CISPO + ["bapo_preset=grpo", "actor.cispo.c_low=0.9", "actor.cispo.c_high=1.05"],  # fixed: the configured cap
    DPPO + ["actor.dppo.low_min=0.15", "actor.bapo.order=verl"],  # verl moves delta_high alone
    DPPO + ["actor.dppo.divergence=kl", "actor.dppo.delta_low=1.5", "actor.dppo.high_max=6"],  # KL is unbounded
    RECOMPUTE + ["actor.correction.tis_cap=1.0"],
    ["advantage.eps=0", "rollout.dynamic_sampling=filter"],  # equal-reward groups never reach the advantages
    ["advantage.eps=0", "advantage.estimator=dr_grpo"],  # no std division
], ids=lambda o: " ".join(o))
def test_the_workable_neighbours_of_each_rule_load(overrides):
    load_run_config(None, BASE + overrides)


def test_cispo_floor_at_the_searched_caps_start_fails_at_load_not_at_step_1():
    """b74de61: these settings loaded, and `balance.search_cispo` raised ValueError at step 1 on the
    last pipeline stage only (with PP > 1 the other stages hung until the NCCL timeout)."""
    with pytest.raises(ConfigError, match=r"high_start=0\.6"):
        load_run_config(None, BASE + CISPO + ["actor.cispo.c_low=0.7", "actor.bapo.low_start=0.3",
                                              "actor.bapo.low_max=0.5", "actor.bapo.high_start=0.6"])


def test_cli_exits_2_naming_the_setting_before_anything_starts(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "megatron_bapo.train", *BASE, *CISPO, "actor.bapo.high_start=1.0",
                           f"trainer.output_dir={out}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("config error:") and "actor.bapo.high_start=1.0" in proc.stderr
    assert not out.exists()  # nothing started: no lock, no log


# ------------------------------------------------------- what the config accepts, the step accepts
def _batch(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    ref = torch.log(torch.rand(4, n // 4, generator=g, dtype=torch.float64) * 0.9 + 0.05)
    lp = (ref + 0.5 * torch.randn(ref.shape, generator=g, dtype=torch.float64)).clamp(max=-1e-4)
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64).expand_as(ref).contiguous()
    mask = (torch.rand(ref.shape, generator=g) < 0.8).double()
    return lp, ref, adv, mask


settings_ = st.fixed_dictionaries({
    "policy_loss": st.sampled_from(["ppo_clip", "dppo", "cispo", "sapo"]),
    "loss_agg": st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]),
    "bapo": st.fixed_dictionaries({
        "low_start": st.sampled_from([0.3, 0.6, 0.8]), "low_max": st.sampled_from([0.5, 0.6, 0.8, 0.9, 1.0]),
        "high_start": st.sampled_from([0.6, 0.95, 1.0, 1.2, 1.28]), "high_max": st.sampled_from([1.0, 1.2, 1.5, 3.0]),
        "order": st.sampled_from(["paper", "verl"]), "contribution": st.sampled_from(["gradient", "surrogate"]),
        "rho0": st.sampled_from([0.4, 0.9]), "dual_clip": st.sampled_from([3.0, None, 1.5])}),
    "cispo": st.fixed_dictionaries({"c_low": st.sampled_from([0.0, 0.5, 0.7, 0.99]),
                                    "c_high": st.sampled_from([1.05, 5.0])}),
    "dppo": st.fixed_dictionaries({"divergence": st.sampled_from(["tv", "kl"]),
                                   "delta_low": st.sampled_from([None, 0.05, 0.5]),
                                   "low_min": st.sampled_from([None, 0.05]),
                                   "high_max": st.sampled_from([None, 0.9])}),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=settings_)
def test_settings_the_config_accepts_run_the_step(cfg):
    from megatron_bapo.actor.config import ActorConfig
    from megatron_bapo.algorithms import aggregation_weights

    try:
        actor = from_dict(ActorConfig, cfg, "actor")
    except ConfigError:
        return  # refused at load: nothing reaches a step
    lp, ref, adv, mask = _batch()
    weights, denom = aggregation_weights(mask, actor.loss_agg)
    objective = actor.objective
    res = objective.search(lp, ref, adv, mask, rollout_logprobs=ref, token_weights=weights)
    x = lp.clone().requires_grad_(True)
    loss, _ = objective.loss(x, ref, adv, mask, (res.c_low, res.c_high), token_weights=weights, denominator=denom)
    loss.backward()
    assert torch.isfinite(x.grad).all()
    if actor.bapo.is_adaptive and actor.policy_loss != "sapo":  # an adaptive balance can move
        res_far = objective.search(lp, ref, torch.where(adv > 0, adv, adv * 1e6), mask, rollout_logprobs=ref,
                                   token_weights=weights)
        assert res_far.num_steps > 0, cfg
