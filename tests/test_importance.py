"""Importance corrections (TIS / MIS / seq-MIS) and the mismatch statistics against hand-made references.

Every case is written out by hand, including extreme (|log w| far beyond the exp() range) and
non-finite (NaN, +-inf) log-probs, which must come out masked (weight 0), never propagated. The
weighted loss passes each token's gradient scaled by exactly its weight.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_bapo.actor.mismatch import MismatchConfig, MismatchSums, mismatch_metrics, warn_if_large
from megatron_bapo.algorithms import policy_loss
from megatron_bapo.algorithms.importance import (
    CorrectionConfig,
    importance_weights,
    mis_weights,
    seq_mis_weights,
    sequence_log_ratio_sums,
    tis_weights,
)

NAN, INF = math.nan, math.inf
# One row of hand-made tokens: (old log-prob, behavior log-prob, loss mask).
OLD = [-1.0, -1.0, -2.0, -0.1, 0.0, -1.0, -5.0, NAN, -1.0, -1.0, -3.0]
BEH = [-1.0, -1.0 - math.log(3), -2.0 + math.log(4), -0.1 - 0.5, -200.0, 50.0, -INF, -1.0, INF, NAN, -3.0]
MASK = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]
#        w=1  w=3  w=1/4  w=e^0.5  huge  tiny  inf   nan  0/inf nan  off-mask


def _t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_tis_truncates_at_the_cap_and_masks_non_finite():
    got = tis_weights(_t(OLD), _t(BEH), _t(MASK), cap=2.0)
    expected = [1.0, 2.0, 0.25, math.exp(0.5), 2.0, math.exp(-20.0), 0.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(got, _t(expected), rtol=1e-6, atol=0)
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())


def test_mis_keeps_w_inside_the_band_and_masks_the_rest():
    got = mis_weights(_t(OLD), _t(BEH), _t(MASK), band=(0.5, 2.0))
    expected = [1.0, 0.0, 0.0, math.exp(0.5), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(got, _t(expected), rtol=1e-6, atol=0)
    # Just inside the band's edges is kept, just outside is masked.
    edge = mis_weights(_t([math.log(0.5) + 1e-4, math.log(2.0) - 1e-4, math.log(0.5) - 1e-4, math.log(2.0) + 1e-4]),
                       torch.zeros(4), torch.ones(4), band=(0.5, 2.0))
    assert (edge > 0).tolist() == [True, True, False, False]


def test_seq_mis_masks_whole_sequences_by_their_geometric_mean():
    # Three sequences: mean log w = (log 1.2 + log 1.2 - 0) / 3 -> inside [0.9, 1.1]? exp(0.1216) = 1.129: out.
    # seq 1: log w = +0.05, -0.05 -> geometric mean 1: in.  seq 2: one NaN token -> out, whole sequence.
    old = _t([math.log(1.2), math.log(1.2), 0.0, 0.05, -0.05, 0.0, NAN])
    beh = torch.zeros(7)
    mask = _t([1, 1, 1, 1, 1, 1, 1])
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    sums = sequence_log_ratio_sums(old, beh, mask, seq, 3)
    torch.testing.assert_close(sums[:, 1], torch.tensor([3.0, 2.0, 2.0], dtype=torch.float64))
    assert sums[:, 2].tolist() == [0.0, 0.0, 1.0]
    got = seq_mis_weights(mask, seq, sums, band=(0.9, 1.1))
    assert got.tolist() == [0, 0, 0, 1, 1, 0, 0]
    wide = seq_mis_weights(mask, seq, sums, band=(0.5, 2.0))
    assert wide.tolist() == [1, 1, 1, 1, 1, 0, 0]
    # Sums over two halves of a sequence (context parallel ranks) add up to the same decision.
    half = sequence_log_ratio_sums(old[:4], beh[:4], mask[:4], seq[:4], 3) + sequence_log_ratio_sums(
        old[4:], beh[4:], mask[4:], seq[4:], 3)
    torch.testing.assert_close(half, sums)


def test_dispatch_and_none_is_the_loss_mask():
    cfg = CorrectionConfig(mode="none")
    assert importance_weights(_t(OLD), _t(BEH), _t(MASK), cfg).tolist() == [float(m) for m in MASK]
    tis = importance_weights(_t(OLD), _t(BEH), _t(MASK), CorrectionConfig(mode="tis", tis_cap=3.0))
    assert tis[1].item() == pytest.approx(3.0)
    with pytest.raises(ValueError, match="seq_index"):
        importance_weights(_t(OLD), _t(BEH), _t(MASK), CorrectionConfig(mode="seq_mis"))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(mode="ppo"), "mode"), (dict(tis_cap=0.0), "tis_cap"), (dict(tis_cap=math.inf), "tis_cap"),
    (dict(band=(1.1, 2.0)), "band"), (dict(band=(0.5,)), "band"), (dict(band=(0.5, 1.0)), "band"),
])
def test_bad_correction_config_names_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        CorrectionConfig(**kwargs)


def test_weighted_loss_gradient_is_the_weight_times_the_unweighted_one():
    g = torch.Generator().manual_seed(0)
    beh = -torch.rand(5, 7, generator=g, dtype=torch.float64) * 3
    old = beh + 0.3 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    lp = old + 0.1 * torch.randn(5, 7, generator=g, dtype=torch.float64)
    adv = torch.randn(5, 1, generator=g, dtype=torch.float64).expand(5, 7).contiguous()
    mask = torch.ones(5, 7, dtype=torch.float64)
    w = tis_weights(old, beh, mask, cap=1.2).double()
    grads = []
    for tw in (torch.ones_like(mask), w):
        x = lp.clone().requires_grad_(True)
        loss, _ = policy_loss(x, old, adv, mask, 0.8, 1.2, token_weights=tw, denominator=35.0)
        loss.backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0] * w, rtol=1e-12, atol=1e-15)
    assert bool((w > 1.2 - 1e-6).any()) and bool((w < 1.0).any())  # both truncated and plain weights were used


def _reference_mismatch(lp, beh, mask, lag, seq, band):
    """Plain-Python transcription of the mismatch metrics of one bucket set."""
    out = {}
    for b, prefix in enumerate(("", "lag1/", "lag2/", "lag3plus/")):
        toks = [(x - y, s) for x, y, m, g, s in zip(lp, beh, mask, lag, seq)
                if m and min(g, 3) == b and math.isfinite(x - y)]
        out[f"mismatch/{prefix}num_tokens"] = float(len(toks))
        if not toks:
            continue
        d = [t for t, _ in toks]
        out[f"mismatch/{prefix}abs_diff_mean"] = sum(abs(x) for x in d) / len(d)
        out[f"mismatch/{prefix}abs_diff_max"] = max(abs(x) for x in d)
        out[f"mismatch/{prefix}kl_k3"] = sum(math.exp(x) - 1 - x for x in d) / len(d)
        out[f"mismatch/{prefix}frac_outside_band"] = sum(not band[0] <= math.exp(x) <= band[1] for x in d) / len(d)
        per_seq = {}
        for x, s in toks:
            per_seq.setdefault(s, []).append(x)
        geo = [math.exp(sum(v) / len(v)) for v in per_seq.values()]
        out[f"mismatch/{prefix}seq_ratio_min"] = min(geo)
        out[f"mismatch/{prefix}seq_ratio_max"] = max(geo)
    return out


def test_mismatch_sums_equal_a_plain_transcription_and_split_like_ranks():
    g = torch.Generator().manual_seed(1)
    n = 60
    beh = (-torch.rand(n, generator=g) * 4).tolist()
    lp = [b + float(x) for b, x in zip(beh, torch.randn(n, generator=g) * 0.5)]
    lp[3] = NAN  # non-finite: counted apart, never in a sum
    mask = (torch.rand(n, generator=g) < 0.8).long().tolist()
    lag = torch.randint(0, 6, (n,), generator=g).tolist()
    seq = torch.randint(0, 9, (n,), generator=g).tolist()
    cfg = MismatchConfig(band=(0.7, 1.5))
    whole = MismatchSums(9, cfg, torch.device("cpu"))
    whole.add(_t(lp), _t(beh), _t(mask), _t(lag), torch.tensor(seq))
    got = mismatch_metrics(whole.finalize())
    ref = _reference_mismatch(lp, beh, mask, lag, seq, cfg.band)
    for key, value in ref.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert got["mismatch/num_nonfinite"] + got["mismatch/lag1/num_nonfinite"] + got["mismatch/lag2/num_nonfinite"] \
        + got["mismatch/lag3plus/num_nonfinite"] == float(mask[3])
    # Two "ranks" holding halves of the same sequences, summed (what reduce() does), give the same.
    parts = [MismatchSums(9, cfg, torch.device("cpu")) for _ in range(2)]
    for p, sl in zip(parts, (slice(0, 25), slice(25, n))):
        p.add(_t(lp[sl]), _t(beh[sl]), _t(mask[sl]), _t(lag[sl]), torch.tensor(seq[sl]))
    parts[0].sums += parts[1].sums
    parts[0].seq += parts[1].seq
    parts[0].maxes = torch.maximum(parts[0].maxes, parts[1].maxes)
    assert mismatch_metrics(parts[0].finalize()) == pytest.approx(got)


def test_empty_bucket_logs_only_counts_and_the_warning_names_causes(caplog):
    sums = MismatchSums(2, MismatchConfig(warn_kl=1e-3), torch.device("cpu"))
    sums.add(_t([-1.0, -2.0]), _t([-1.5, -1.0]), _t([1, 1]), _t([0, 0]), torch.tensor([0, 1]))
    metrics = mismatch_metrics(sums.finalize())
    assert "mismatch/lag1/kl_k3" not in metrics and metrics["mismatch/lag1/num_tokens"] == 0.0
    import logging

    with caplog.at_level(logging.WARNING):
        assert warn_if_large(metrics, MismatchConfig(warn_kl=1e-3), logging.getLogger("test"))
        assert not warn_if_large({"mismatch/num_tokens": 0.0}, MismatchConfig(), logging.getLogger("test"))
    assert "temperature" in caplog.text and "dtype" in caplog.text and "penalties" in caplog.text
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in caplog.text
