"""Bound search across real gloo ranks: one collective, identical decisions, equal to one process."""

from __future__ import annotations

import pytest
import torch

from megatron_bapo.algorithms import BapoConfig, search_clip_bounds

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
    "all_to_all",
)


def _shard(rank: int, n: int, seed: int):
    """Different data per rank (different sizes too), reproducible from (seed, rank)."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    size = n + 37 * rank
    ratio = torch.exp(torch.randn(size, generator=g) * (0.2 + 0.2 * rank))
    adv = torch.randn(size, generator=g) + (0.1 if rank == 0 else -0.5)
    mask = (torch.rand(size, generator=g) < 0.9).float()
    lpb = -torch.rand(size, generator=g) * 3
    return ratio, adv, mask, lpb


def _worker(rank, world_size, presets, n, seed):
    calls = []
    originals = {name: getattr(torch.distributed, name) for name in COLLECTIVES}

    def counting(name):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return wrapped

    for name in COLLECTIVES:
        setattr(torch.distributed, name, counting(name))
    group = torch.distributed.new_group(list(range(world_size)))
    calls.clear()  # new_group may synchronise; count only the searches
    out = []
    try:
        ratio, adv, mask, lpb = _shard(rank, n, seed)
        for preset in presets:
            before = len(calls)
            res = search_clip_bounds(ratio, adv, mask, BapoConfig.preset(preset), rollout_logprobs=lpb, group=group)
            out.append((preset, res, calls[before:]))
    finally:
        for name, fn in originals.items():
            setattr(torch.distributed, name, fn)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_agree_and_match_single_process(run_dist, world_size):
    presets = ["bapo", "bapo-paper", "bapo-verl", "grpo", "clip-higher"]
    results = run_dist(_worker, world_size, presets, 4000, 7, timeout=180)
    shards = [_shard(r, 4000, 7) for r in range(world_size)]
    full = [torch.cat([s[i] for s in shards]) for i in range(4)]
    for i, preset in enumerate(presets):
        per_rank = [results[r][i] for r in range(world_size)]
        for _, res, calls in per_rank:
            assert calls == ["all_reduce"], f"{preset}: expected exactly one all_reduce, saw {calls}"
        # Bit-identical decisions and sums on every rank.
        assert len({(res.c_low, res.c_high, res.rho, res.num_steps, res.pos_contribution) for _, res, _ in per_rank}) == 1
        single = search_clip_bounds(*full[:3], BapoConfig.preset(preset), rollout_logprobs=full[3])
        got = per_rank[0][1]
        assert (got.c_low, got.c_high, got.num_steps) == (single.c_low, single.c_high, single.num_steps), preset
        assert got.rho == pytest.approx(single.rho, rel=1e-12)
        assert got.num_tokens == single.num_tokens
    # The adaptive preset actually moved on this data, so the comparison is not vacuous.
    assert results[0][0][1].num_steps > 0


def _nan_worker(rank, world_size):
    ratio = torch.ones(8)
    if rank == 1:
        ratio[3] = float("nan")
    try:
        search_clip_bounds(ratio, torch.ones(8), torch.ones(8), BapoConfig(), group=torch.distributed.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return None


def test_nan_on_one_rank_raises_on_every_rank(run_dist):
    messages = run_dist(_nan_worker, 2, timeout=120)
    assert all(m is not None and "1 loss tokens" in m for m in messages)
