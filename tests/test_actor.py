"""Actor train step invariances on real gloo ranks: DP split, micro-batch count, PP, TP, bounds."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from test_actor_helpers import TINY_QWEN2, full_params, make_batch  # noqa: E402


def _actor(tp=1, pp=1, budget=10_000, optim="sgd", lr=0.05, scope="minibatch", n_mini=1, epochs=1, **kw):
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    cfg = ActorConfig(
        optim=OptimConfig(name=optim, lr=lr, clip_grad=0.0), parallel=ParallelConfig(tp=tp, pp=pp),
        max_tokens_per_microbatch=budget, search_scope=scope, n_minibatches=n_mini, ppo_epochs=epochs,
        **{"use_distributed_optimizer": optim == "adam", **kw},  # megatron's distributed optimizer is Adam-only
    )
    return Actor(cfg, TINY_QWEN2)


def _near_batch(actor, seed=0, num_seqs=8):
    """A batch whose behavior log-probs are the current ones plus noise (so the search has work)."""
    b = make_batch(num_seqs=num_seqs, seed=seed)
    lp = actor.compute_logprobs(b)
    g = torch.Generator().manual_seed(seed + 1)
    b["behavior_logprobs"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    return b


def _train(rank, world_size, layout, init):
    """One step; `init` may say {"save": dir} (save the initial weights) or {"load": dir} (start from them)."""
    actor = _actor(**layout)
    if "save" in init:
        actor.save_checkpoint(init["save"])
    if "load" in init:
        actor.load_checkpoint(init["load"], load_optimizer=False)
    b = _near_batch(actor)
    metrics = actor.train_step(b)
    return {"params": full_params(actor), "metrics": metrics, "lp": actor.compute_logprobs(b)}


def _assert_same(ref, got, atol=1e-6):
    for k in ("actor/loss", "actor/grad_norm", "bapo/c_low", "bapo/c_high", "actor/entropy", "actor/clipfrac"):
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], abs=atol, rel=1e-5), k
    torch.testing.assert_close(got["lp"], ref["lp"], atol=atol * 10, rtol=0)


@pytest.fixture(scope="module")
def reference():
    from dist_harness import run_dist

    return run_dist(_train, 1, {}, {}, timeout=120)[0]


def test_dp2_step_equals_dp1(run_dist, reference):
    res = run_dist(_train, 2, {}, {}, timeout=120)
    for r in res:
        _assert_same(reference, r)
        for name, p in reference["params"].items():
            torch.testing.assert_close(r["params"][name], p, atol=1e-6, rtol=0, msg=name)
    assert res[0]["metrics"] == res[1]["metrics"]  # identical on every rank


def test_microbatch_count_does_not_change_the_step(run_dist, reference):
    res = run_dist(_train, 1, {"budget": 40}, {}, timeout=120)[0]  # ~1-2 sequences per micro-batch
    _assert_same(reference, res)
    for name, p in reference["params"].items():
        torch.testing.assert_close(res["params"][name], p, atol=1e-6, rtol=0, msg=name)


def test_step_actually_changes_parameters(run_dist, reference):
    from megatron_bapo.actor import ActorConfig  # noqa: F401 - import check only

    res = run_dist(_train, 1, {"lr": 1e-9}, {}, timeout=120)[0]
    moved = max((reference["params"][n] - p).abs().max().item() for n, p in res["params"].items())
    assert moved > 1e-5  # lr 0.05 vs 1e-9: the reference step moved the weights


def test_tp2_step_equals_tp1(run_dist, reference):
    res = run_dist(_train, 2, {"tp": 2}, {}, timeout=120)
    for r in res:
        _assert_same(reference, r, atol=1e-5)


def test_pp2_1f1b_equals_pp1(run_dist, tmp_path):
    """PP=2 with several micro-batches (1F1B) vs PP=1 from the same weights (loaded through a
    resharding checkpoint: stage-local init differs); tied embeddings cross the stage boundary."""
    init = str(tmp_path / "init")
    ref = run_dist(_train, 1, {"budget": 60}, {"save": init}, timeout=120)[0]
    res = run_dist(_train, 2, {"budget": 60, "pp": 2}, {"load": init}, timeout=120)
    for r in res:
        _assert_same(ref, r, atol=1e-5)


def _bounds(rank, world_size, scope):
    from megatron_bapo.actor.scatter import prepare_tensors
    from megatron_bapo.algorithms import search_clip_bounds

    actor = _actor(scope=scope, budget=10_000 if scope == "minibatch" else 10_000)
    b = _near_batch(actor, seed=3, num_seqs=12)
    prepared = prepare_tensors(b)
    lp = actor.compute_logprobs(b)
    mask = prepared["loss_mask"]
    ratio = torch.exp((lp - prepared["behavior_logprobs"]) * mask)
    ref = search_clip_bounds(ratio, prepared["advantages"], mask, actor.config.bapo,
                             rollout_logprobs=prepared["behavior_logprobs"])
    metrics = actor.train_step(b)
    return ref, metrics


@pytest.mark.parametrize("scope", ["minibatch", "microbatch"])
def test_bounds_equal_search_on_gathered_minibatch(run_dist, scope):
    """DP=2 (one micro-batch per rank for "microbatch"): the decision equals the one-process search."""
    for ref, metrics in run_dist(_bounds, 2, scope, timeout=120):
        assert ref.num_steps > 0  # the search moved: a real decision is compared
        assert metrics["bapo/c_low"] == pytest.approx(ref.c_low, abs=1e-9)
        assert metrics["bapo/c_high"] == pytest.approx(ref.c_high, abs=1e-9)
        assert metrics["bapo/rho_before"] == pytest.approx(ref.rho_initial, rel=1e-6)
        assert metrics["bapo/rho_after"] == pytest.approx(ref.rho, rel=1e-6)
        assert metrics["bapo/search_steps"] == ref.num_steps


def _multi(rank, world_size, layout):
    actor = _actor(optim="adam", lr=1e-3, n_mini=2, epochs=2, **layout)
    b = _near_batch(actor)
    b["versions"] = torch.full_like(b["input_ids"], 3)
    b["versions"][:2] = 1
    m = actor.train_step(b, current_version=3)
    return m, actor.num_updates, full_params(actor)


def test_minibatches_and_epochs_with_adam_dp2_equals_dp1(run_dist):
    (m1, n1, p1), = run_dist(_multi, 1, {}, timeout=120)
    res = run_dist(_multi, 2, {"budget": 50}, timeout=120)
    assert n1 == 4 and m1["actor/num_optimizer_steps"] == 4
    # Staleness in optimizer steps: 4 steps per call; rows 0-1 (version 1) sit in mini-batch 0,
    # trained at steps 0 and 2: (3 - 1) * 4 + 2 = 10 at most; version-3 rows of mini-batch 1 are 1 or 3.
    assert m1["staleness/max"] == 10 and m1["staleness/version_lag_max"] == 2
    assert 0 < m1["staleness/frac_0"] < 1 and 0 < m1["staleness/frac_1"] < 1
    for m, n, p in res:
        assert n == 4
        for name, ref in p1.items():
            torch.testing.assert_close(p[name], ref, atol=1e-5, rtol=0, msg=name)
        assert m["actor/loss"] == pytest.approx(m1["actor/loss"], abs=1e-5)


def _uneven(rank, world_size, scope):
    actor = _actor(budget=30, scope=scope)
    b = _near_batch(actor, seed=7, num_seqs=3)  # 3 sequences on 2 ranks: one rank runs a no-loss filler
    m = actor.train_step(b)
    return full_params(actor), m


@pytest.mark.parametrize("scope", ["minibatch", "microbatch"])
def test_uneven_shards_and_filler_microbatches(run_dist, scope):
    (p1, m1), = run_dist(_uneven, 1, "minibatch", timeout=120)
    for p, m in run_dist(_uneven, 2, scope, timeout=120):
        assert m["actor/num_loss_tokens"] == m1["actor/num_loss_tokens"]
        if scope == "minibatch":
            for name, ref in p1.items():
                torch.testing.assert_close(p[name], ref, atol=1e-6, rtol=0, msg=name)


def _nan_batch(rank, world_size):
    actor = _actor(n_mini=2)
    b = _near_batch(actor)
    before = full_params(actor)
    b["advantages"][0, :] = float("nan")  # first mini-batch is bad, second is fine
    m = actor.train_step(b)
    return before, full_params(actor), m, actor.num_updates, actor.num_skipped_steps


def test_non_finite_minibatch_is_skipped_and_counted(run_dist):
    for before, after, m, updates, skipped in run_dist(_nan_batch, 2, timeout=120):
        assert updates == 1 and skipped == 1
        assert m["actor/skipped_steps_total"] == 1 and math.isfinite(m["actor/loss"])
        assert any((after[n] - p).abs().max() > 0 for n, p in before.items())  # the good mini-batch trained


def _train_counting_layer_forwards(rank, world_size, layout, init):
    """One step like `_train`, also counting forward calls of the first decoder layer."""
    actor = _actor(**layout)
    calls = []
    layer = actor.model[0].module.decoder.layers[0]
    b = _near_batch(actor)
    handle = layer.register_forward_hook(lambda *a: calls.append(1))
    metrics = actor.train_step(b)
    handle.remove()
    return {"params": full_params(actor), "metrics": metrics, "lp": actor.compute_logprobs(b), "calls": len(calls)}


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_changes_memory_not_the_step(run_dist, reference, mode):
    plain = run_dist(_train_counting_layer_forwards, 1, {}, {}, timeout=120)[0]
    res = run_dist(_train_counting_layer_forwards, 1, {"recompute": mode}, {}, timeout=120)[0]
    _assert_same(reference, res)
    for name, p in reference["params"].items():
        torch.testing.assert_close(res["params"][name], p, atol=1e-6, rtol=0, msg=name)
    if mode == "full":  # each layer runs again in the backward (its activations were not kept)
        assert res["calls"] > plain["calls"]
    else:  # selective recompute re-runs core attention only, inside the layer
        assert res["calls"] == plain["calls"]


def _optimizer_steps(rank, world_size, reference):
    from megatron_bapo.actor.actor import Actor
    from strict_devices import StrictDevices

    class MegatronStep(Actor):
        """megatron's own `optimizer.step()` (prepare_grads, grad norm, clip, step) after the same backward."""

        def _grad_norm_or_skip(self, loss):
            ok, norm, _ = self.optimizer.step()
            assert ok
            return norm

        def _optimizer_step(self, grad_norm):
            pass

    with StrictDevices() as sd:
        actor = _actor(optim="adam", lr=1e-2, n_mini=2, budget=60)
        if reference:
            actor.__class__ = MegatronStep
        actor.optimizer.config.clip_grad = 0.05  # every step clips
        prepare = actor.optimizer.prepare_grads
        calls = []
        actor.optimizer.prepare_grads = lambda: calls.append(1) or prepare()
        metrics = [actor.train_step(make_batch(num_seqs=8, seed=s)) for s in range(2)]
    norm_group = [n for (op, group), n in sd.collectives.items() if op == "all_reduce" and "INSTANCE" in group]
    return {"params": full_params(actor), "norms": [m["actor/grad_norm"] for m in metrics],
            "prepare_grads": len(calls), "norm_all_reduces": sum(norm_group)}


def test_optimizer_step_runs_prepare_grads_and_the_norm_reduction_once(run_dist):
    """The actor needs the grad norm before stepping (to skip non-finite steps on every rank); it runs
    megatron's step in its two halves instead of computing the norm and then calling `step()`,
    which prepared the gradients and all-reduced the norm again (0fba64c). Same update as `step()`."""
    ours = run_dist(_optimizer_steps, 2, False, timeout=120)
    ref = run_dist(_optimizer_steps, 2, True, timeout=120)
    for got, want in zip(ours, ref):
        assert got["prepare_grads"] == want["prepare_grads"] == 4  # 2 train steps x 2 mini-batches
        assert got["norm_all_reduces"] == want["norm_all_reduces"] == 4
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-12) and min(got["norms"]) > 0.05  # clipped
        for name, p in want["params"].items():
            torch.testing.assert_close(got["params"][name], p, atol=0, rtol=0, msg=name)
