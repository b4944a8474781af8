"""Non-finite safety (design section 8) on real pipeline-parallel ranks.

An extreme but finite behavior log-prob trains (nothing raises, no stage hangs, every parameter
stays finite); a non-finite gradient norm on ONE pipeline stage skips the optimizer step on every
rank, is counted, and past `max_skipped_steps` stops every rank with the same error (no hang).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from test_actor_helpers import TINY_QWEN2, full_params, make_batch  # noqa: E402

from megatron_bapo.actor.errors import SkippedStepsError  # noqa: E402


def _actor(**kw):
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    cfg = ActorConfig(optim=OptimConfig(name="adam", lr=1e-3), parallel=ParallelConfig(pp=2), **kw)
    return Actor(cfg, TINY_QWEN2)


def _extreme(rank, world_size):
    actor = _actor()
    b = make_batch(num_seqs=6, seed=1)
    lp = actor.compute_logprobs(b)
    b["behavior_logprobs"] = lp.clone()
    rows, cols = torch.nonzero(b["loss_mask"][:, 1:] > 0, as_tuple=True)
    b["behavior_logprobs"][rows[0], cols[0] + 1] -= 1e4  # ratio e^10000 for the current policy
    b["behavior_logprobs"][rows[-1], cols[-1] + 1] += 1e4  # ratio e^-10000
    b["advantages"][rows[0]] = 1.0
    b["advantages"][rows[-1]] = -1.0
    metrics = actor.train_step(b)
    params = full_params(actor)
    return metrics, actor.num_updates, all(bool(torch.isfinite(p).all()) for p in params.values())


def test_extreme_behavior_logprob_trains_and_keeps_parameters_finite(run_dist):
    for metrics, updates, finite in run_dist(_extreme, 2, timeout=120):
        assert updates == 1 and finite
        assert math.isfinite(metrics["actor/loss"]) and math.isfinite(metrics["actor/grad_norm"])
        assert metrics["actor/skipped_steps_total"] == 0


def _nan_gradient_on_stage0(rank, world_size, max_skipped):
    actor = _actor(max_skipped_steps=max_skipped)
    if actor.parallel.pp_rank == 0:  # poison one gradient on the first stage only
        next(actor.model[0].module.parameters()).register_hook(lambda g: g * float("nan"))
    b = make_batch(num_seqs=6, seed=2)
    b["behavior_logprobs"] = actor.compute_logprobs(b)
    before = full_params(actor)
    try:
        metrics = actor.train_step(b)
    except SkippedStepsError as exc:  # the CLI's one-line "training error:" (megatron_bapo.train)
        return {"error": str(exc)}
    after = full_params(actor)
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"metrics": metrics, "updates": actor.num_updates, "skipped": actor.num_skipped_steps, "unchanged": unchanged}


def test_nan_grad_norm_on_one_stage_skips_the_step_on_every_rank(run_dist):
    for res in run_dist(_nan_gradient_on_stage0, 2, 1, timeout=120):
        assert res["updates"] == 0 and res["skipped"] == 1 and res["unchanged"]
        assert res["metrics"]["actor/skipped_steps_total"] == 1
        assert math.isnan(res["metrics"]["actor/grad_norm"])


def test_too_many_skipped_steps_stop_every_rank(run_dist):
    for res in run_dist(_nan_gradient_on_stage0, 2, 0, timeout=120):
        assert "actor.max_skipped_steps=0" in res["error"]


def _nan_logprobs_on_the_last_stage(rank, world_size):
    """A NaN weight on the last stage: its current log-probs (not the batch's) are NaN, which only the
    last stage's bound search sees."""
    actor = _actor()
    b = make_batch(num_seqs=6, seed=3)
    b["behavior_logprobs"] = actor.compute_logprobs(b)
    if actor.parallel.is_last_stage:
        with torch.no_grad():
            next(actor.model[0].module.decoder.final_layernorm.parameters()).fill_(float("nan"))
    before = full_params(actor)
    metrics = actor.train_step(b)
    after = full_params(actor)
    same = all(torch.equal(before[k], after[k]) or bool(torch.isnan(before[k]).any()) for k in before)
    return {"metrics": metrics, "updates": actor.num_updates, "skipped": actor.num_skipped_steps, "unchanged": same}


def test_a_non_finite_search_skips_the_step_on_every_stage(run_dist):
    """PP 2: the bound search on the last stage meets NaN log-probs. Every rank skips the step
    together, counted (at 1b21a04 the last stage raised and the first waited in the next
    collective until the timeout)."""
    for res in run_dist(_nan_logprobs_on_the_last_stage, 2, timeout=120):
        assert res["updates"] == 0 and res["skipped"] == 1 and res["unchanged"], res
        assert res["metrics"]["actor/skipped_steps_total"] == 1
