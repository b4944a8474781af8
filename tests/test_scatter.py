"""The batch reaches each rank as its own slice (`megatron_bapo.actor.scatter`), over real gloo ranks.

Rank 0 alone holds the global batch; every rank must receive exactly what it would have cut from
the whole batch itself (its DP rank's micro-batches, its CP chunks, its pipeline stage's keys), a
training step on scattered slices must equal one on the full batch everywhere, and the bytes each
rank receives must be a fraction of the batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")

from test_actor_helpers import TINY_QWEN2, full_params, make_batch  # noqa: E402

SPEC = dict(packed=True, cp_size=2, sp_size=1, dp_size=2, max_tokens_per_microbatch=48, n_minibatches=2,
            ppo_epochs=2, loss_agg="seq-mean-token-mean")


def _batch():
    b = make_batch(num_seqs=8, max_len=30, seed=11)
    b["versions"] = torch.full_like(b["input_ids"], 2)
    b["temperature"] = 0.7
    return b


def _coords(rank: int):
    from megatron_bapo.actor.scatter import RankCoords

    # 8 ranks: 2 pipeline stages x DP 2 x CP 2 (TP ranks would repeat a position).
    return RankCoords(dp_rank=(rank // 2) % 2, cp_rank=rank % 2, first_stage=rank < 4, last_stage=rank >= 4)


def _scatter(rank, world_size, with_batch, shipped=False):
    from megatron_bapo.actor.scatter import BatchSpec, PreparedBatch, scatter_batch, ship

    spec = BatchSpec(**SPEC)
    batch = _batch() if (rank == 0 and with_batch) else None
    if shipped and batch is not None:  # cut where the driver process runs (`trainer.driver_process`)
        batch = ship(batch, spec, [_coords(r) for r in range(world_size)], current_version=3)
    got = scatter_batch(batch, spec, _coords(rank), dist.group.WORLD, current_version=3)
    want = PreparedBatch(_batch(), spec, current_version=3).for_rank(_coords(rank))
    return got, want


@pytest.mark.parametrize("shipped", [False, True], ids=["cut_on_rank0", "cut_in_the_driver_process"])
def test_each_rank_receives_exactly_its_slice(run_dist, shipped):
    results = run_dist(_scatter, 8, True, shipped, timeout=120)
    for rank, (got, want) in enumerate(results):
        assert (got.temperature, got.num_tokens, got.schedule, got.metrics) == \
               (want.temperature, want.num_tokens, want.schedule, want.metrics)
        assert got.metrics["staleness/version_lag_max"] == 1.0
        assert got.schedule == [0, 1, 0, 1]
        for g, w in zip(got.minibatches, want.minibatches):
            assert (g.skip, g.denominator, len(g.microbatches)) == (w.skip, w.denominator, len(w.microbatches))
            for gm, wm in zip(g.microbatches, w.microbatches):
                assert gm.keys() == wm.keys()
                for k in gm:
                    if isinstance(wm[k], torch.Tensor):
                        assert gm[k].dtype == wm[k].dtype, k
                        torch.testing.assert_close(gm[k], wm[k], atol=0, rtol=0, msg=k)
                    else:
                        assert gm[k] == wm[k], k
        keys = set().union(*(mb.keys() for m in got.minibatches for mb in m.microbatches))
        # tokens only where they are read: ids on the first stage, labels and loss inputs on the last
        assert ("input_ids" in keys) == (rank < 4) and ("labels" in keys) == (rank >= 4)
        assert "advantages" in keys or rank < 4
        assert not keys & {"position_ids", "col", "attention_mask"}
        # the sequence index and the version lag (3 - 2) reach the loss for the mismatch statistics
        assert ("row" in keys) == ("lag" in keys) == (rank >= 4)
        for mb in (mb for m in got.minibatches for mb in m.microbatches if rank >= 4):
            on = mb["loss_mask"] > 0
            assert bool((mb["lag"][on] == 1).all()) and bool((mb["row"][on] >= 0).all())
    # Each token reaches exactly one DP x CP rank per stage (sequences rounded up to 2 * cp slots).
    lengths = _batch()["attention_mask"].sum(-1).tolist()
    slots = sum(-(-n // 4) * 4 for n in lengths)
    for key, ranks in (("input_ids", range(4)), ("labels", range(4, 8))):
        received = sum(mb[key].numel() for r in ranks for m in results[r][0].minibatches for mb in m.microbatches)
        assert received == slots, key


def test_no_batch_on_rank_zero_means_none_everywhere(run_dist):
    assert all(got is None for got, _ in run_dist(_scatter, 2, False, timeout=60))


def _train(rank, world_size, layout, scattered):
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.actor.scatter import scatter_batch
    from megatron_bapo.models.parallel import ParallelConfig

    hf = dict(TINY_QWEN2, num_hidden_layers=4)
    cfg = ActorConfig(optim=OptimConfig(lr=1e-3), parallel=ParallelConfig(**layout), max_tokens_per_microbatch=48,
                      n_minibatches=2, loss_agg="seq-mean-token-mean")
    actor = Actor(cfg, hf)
    b = _batch()
    if scattered:
        b = scatter_batch(b if rank == 0 else None, actor.batch_spec, actor.coords, dist.group.WORLD,
                          current_version=3)
    metrics = actor.train_step(b, current_version=3)
    return metrics, full_params(actor)


@pytest.mark.parametrize("layout", [{"pp": 2, "cp": 2}], ids=["pp2-cp2"])
def test_training_on_scattered_slices_equals_training_on_the_whole_batch(run_dist, layout):
    whole = run_dist(_train, 4, layout, False, timeout=180)
    sliced = run_dist(_train, 4, layout, True, timeout=180)
    for (mw, pw), (ms, ps) in zip(whole, sliced):
        assert ms == mw
        for name, p in pw.items():
            torch.testing.assert_close(ps[name], p, atol=0, rtol=0, msg=name)
