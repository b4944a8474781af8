"""Micro-batch layout (pure torch, no ranks): CP chunking, prediction alignment, packing, planning.

The invariant behind CP/packing equivalence: whatever the layout, the union over CP ranks of the
positions a micro-batch holds carries exactly the same (row, col) -> (label, loss mask, behavior
log-prob, advantage, weight) entries as the plain padded cp=1 layout, and every label is the token
that follows its input token in the FULL sequence.
"""

from __future__ import annotations

import pytest
import torch

from megatron_bapo.actor.batching import padded_cost, plan_microbatches
from megatron_bapo.actor.layout import POSITION_KEYS, MicroBatchLayout, build_microbatch
from megatron_bapo.models.context_parallel import chunk_index, packed_index


def _data(lengths, seed=0, vocab=50):
    g = torch.Generator().manual_seed(seed)
    t = max(lengths) + 3
    ids = torch.randint(1, vocab, (len(lengths), t), generator=g)
    cols = torch.arange(t).unsqueeze(0)
    attn = (cols < torch.tensor(lengths).unsqueeze(1)).long()
    ids = ids * attn
    data = {"input_ids": ids, "attention_mask": attn}
    for k in POSITION_KEYS:
        data[k] = torch.randn(len(lengths), t, generator=g) * attn
    data["loss_mask"] = (data["loss_mask"] > 0).float() * attn
    return data


def _entries(mbs):
    """(row, col) -> (input token at col-1, label, position values) over a list of micro-batches."""
    out = {}
    for mb in mbs:
        keep = mb["row"] >= 0
        for i in torch.nonzero(keep).tolist():
            i = tuple(i)
            key = (int(mb["row"][i]), int(mb["col"][i]))
            assert key not in out, f"{key} held twice"
            out[key] = (int(mb["input_ids"][i]), int(mb["labels"][i])) + tuple(float(mb[k][i]) for k in POSITION_KEYS)
    return out


def test_chunk_index_pairs_early_and_late_chunks():
    assert chunk_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([chunk_index(24, 3, r) for r in range(3)]).tolist()) == list(range(24))
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        chunk_index(6, 2, 0)
    flat, seg, pos = packed_index([4, 8], 2, 1)
    assert flat.tolist() == [1, 2, 6, 7, 8, 9] and seg.tolist() == [0, 0, 1, 1, 1, 1] and pos.tolist() == [1, 2, 2, 3, 4, 5]


def test_labels_come_from_the_full_sequence():
    data = _data([7, 12, 3])
    mb = build_microbatch(data, [0, 1, 2], MicroBatchLayout())
    for (row, col), (tok, label, *values) in _entries([mb]).items():
        assert label == int(data["input_ids"][row, col]) and tok == int(data["input_ids"][row, col - 1])
        assert values == [float(data[k][row, col]) for k in POSITION_KEYS]
    # every real token after position 0 is predicted exactly once
    assert len(_entries([mb])) == 6 + 11 + 2


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cp, sp", [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (2, 4)])
def test_every_layout_holds_the_same_entries(packed, cp, sp):
    lengths = [7, 12, 3, 9]
    data = _data(lengths, seed=cp * 10 + sp)
    reference = _entries([build_microbatch(data, [0, 1, 2, 3], MicroBatchLayout())])
    mbs = [build_microbatch(data, [0, 1, 2, 3], MicroBatchLayout(packed=packed, cp_size=cp, cp_rank=r, sp_size=sp))
           for r in range(cp)]
    assert _entries(mbs) == reference
    for mb in mbs:
        local = mb["input_ids"].shape[1]
        assert local % sp == 0  # sequence parallel splits every rank's tokens over TP
        if packed:
            slots = (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()
            assert all(n % (2 * cp if cp > 1 else 1) == 0 for n in slots)
            assert sum(slots) == local * cp and mb["input_ids"].shape[0] == 1
        else:
            assert mb["input_ids"].shape[0] == 4 and (local * cp) % (2 * cp if cp > 1 else 1) == 0


def test_packed_positions_restart_per_sequence():
    data = _data([5, 3])
    mb = build_microbatch(data, [0, 1], MicroBatchLayout(packed=True))
    assert mb["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert mb["cu_seqlens"].tolist() == [0, 5, 8] and mb["max_seqlen"] == 5
    assert mb["input_ids"][0].tolist() == data["input_ids"][0, :5].tolist() + data["input_ids"][1, :3].tolist()


def test_costs_and_packed_plans():
    padded, packed = MicroBatchLayout(), MicroBatchLayout(packed=True, cp_size=2)
    assert padded.cost([5, 100]) == 200 and packed.cost([5, 100]) == 8 + 100
    assert padded_cost([3, 9, 4]) == 27
    # A realistic mix: few long, many short. Packing needs far fewer micro-batches for one budget.
    torch.manual_seed(0)
    lengths = [int(x) for x in torch.distributions.LogNormal(5.0, 1.2).sample((256,)).clamp(20, 8000)]
    for layout in (padded, packed):
        plan = plan_microbatches(lengths, 4, 16384, cost=layout.cost)
        rows = sorted(i for shard in plan for mb in shard for i in mb)
        assert rows == list(range(256))  # every row exactly once
        assert len({len(shard) for shard in plan}) == 1  # the same micro-batch count on every DP rank
        for shard in plan:
            for mb in shard:
                assert len(mb) == 1 or layout.cost([lengths[i] for i in mb]) <= 16384
    n_padded = len(plan_microbatches(lengths, 4, 16384, cost=padded.cost)[0])
    n_packed = len(plan_microbatches(lengths, 4, 16384, cost=packed.cost)[0])
    assert n_packed < n_padded


@pytest.mark.parametrize("cp", [1, 2])
def test_padding_a_pack_to_a_common_shape_trains_nothing_more(cp):
    """Interleaved pipelines need one shape per pass: the filler slot holds no entry."""
    from megatron_bapo.actor.layout import pad_packed_microbatch

    data = _data([7, 12, 3])
    layout = [MicroBatchLayout(packed=True, cp_size=cp, cp_rank=r) for r in range(cp)]
    mbs = [build_microbatch(data, [0, 1, 2], lay) for lay in layout]
    target = mbs[0]["input_ids"].shape[1] + 6
    padded = [pad_packed_microbatch(mb, target, lay) for mb, lay in zip(mbs, layout)]
    assert _entries(padded) == _entries(mbs)
    for mb in padded:
        assert mb["input_ids"].shape == (1, target)
        slots = (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()
        assert slots[-1] == 6 * cp and sum(slots) == target * cp


@pytest.mark.parametrize("packed, cp, sp", [(False, 1, 1), (False, 2, 2), (True, 1, 1), (True, 2, 1), (True, 2, 3)])
def test_position_ids_are_rebuilt_from_the_shape_alone(packed, cp, sp):
    """The batch scatter does not send position ids: each rank rebuilds them (vpp-padded packs too)."""
    from megatron_bapo.actor.layout import local_position_ids, pad_packed_microbatch

    data = _data([7, 12, 3, 9])
    for rank in range(cp):
        layout = MicroBatchLayout(packed=packed, cp_size=cp, cp_rank=rank, sp_size=sp)
        mbs = [build_microbatch(data, [0, 1, 2, 3], layout)]
        if packed:
            mbs.append(pad_packed_microbatch(mbs[0], mbs[0]["input_ids"].shape[1] + 6, layout))
        for mb in mbs:
            mb["shape"] = tuple(mb["input_ids"].shape)
            assert torch.equal(local_position_ids(mb, layout), mb["position_ids"])
