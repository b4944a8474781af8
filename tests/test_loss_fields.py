"""`actor.policy_loss` and its configs (`dppo`, `cispo`, `sapo`) and `actor.overlong_filter` reach where they act.

One actor per loss on 2 real gloo ranks (data parallel: the balance's collective runs over a real
group), each with a non-default value in every field of its loss, runs a train step; each field is
checked where it acts, recorded by wrappers around `algorithms.objective`'s calls (which delegate to
the real functions), and in the metrics. `tests/test_actor_config_fields.py` checks every other
`ActorConfig` field; together they cover every field (`test_every_field_has_a_check` there).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from test_actor_helpers import TINY_QWEN2, make_batch  # noqa: E402

DPPO = dict(divergence="kl", delta_low=0.06, delta_high=0.04, ratio_cap=3.0, high_max=0.3, high_step=0.02,
            low_min=0.01, low_step=0.005)
CISPO = dict(c_low=0.3, c_high=1.7)
SAPO = dict(tau_pos=0.7, tau_neg=1.6)
RUNS = {
    # An adaptive balance (the default bapo preset) moving DPPO's thresholds on the configured grid,
    # with overlong filtering on: the batch marks rows 1 and 2 truncated.
    "dppo": dict(policy_loss="dppo", dppo=DPPO, overlong_filter=True),
    # Fixed presets: the configured CISPO bounds and SAPO temperatures are what the loss uses.
    "cispo": dict(policy_loss="cispo", cispo=CISPO, bapo=dict(low_start=0.8, low_max=0.8, high_start=1.2,
                                                             high_max=1.2)),
    "sapo": dict(policy_loss="sapo", sapo=SAPO, bapo=dict(low_start=0.8, low_max=0.8, high_start=1.2, high_max=1.2),
                 search_scope="microbatch"),  # measured inside the loss, per micro-batch
}
OWNED = {"policy_loss", "overlong_filter", *(f"dppo.{k}" for k in DPPO), *(f"cispo.{k}" for k in CISPO),
         *(f"sapo.{k}" for k in SAPO)}
"""The `ActorConfig` field paths this file checks."""


class Recorder:
    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        result = self.fn(*args, **kwargs)
        self.calls.append((args, kwargs, result))
        return result


def _steps(rank, world_size):
    import megatron_bapo.algorithms.objective as objective_mod
    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.config_io import from_dict

    names = ("policy_loss", "dppo_loss", "cispo_loss", "sapo_loss", "search_clip_bounds", "search_dppo",
             "search_cispo", "measure_sapo")
    out = {}
    for key, fields in RUNS.items():
        spies = {n: Recorder(getattr(objective_mod, n)) for n in names}
        for n, spy in spies.items():
            setattr(objective_mod, n, spy)
        try:
            cfg = from_dict(ActorConfig, dict(fields, max_tokens_per_microbatch=64, use_distributed_optimizer=False,
                                              vocab_divisible_by=64), "actor")
            actor = Actor(cfg, TINY_QWEN2)
            b = make_batch(num_seqs=8, max_len=20, seed=4)
            b["behavior_logprobs"] = actor.compute_logprobs(b) + 0.4 * torch.randn(b["input_ids"].shape,
                                                                                 generator=torch.Generator().manual_seed(1))
            b["truncated"] = torch.tensor([False, True, True, False, False, False, False, False])
            unfiltered = int(((b["loss_mask"] > 0) & (b["attention_mask"] > 0))[:, 1:].sum())
            metrics = actor.train_step(b)
        finally:
            for n, spy in spies.items():
                setattr(objective_mod, n, spy.fn)
        out[key] = {"metrics": metrics, "unfiltered_tokens": unfiltered,
                    "called": {n for n, s in spies.items() if s.calls},
                    "loss_configs": [c[0][4] for n in ("dppo_loss", "cispo_loss", "sapo_loss") for c in spies[n].calls],
                    "search_configs": [c[0][4] for n in ("search_dppo", "search_cispo", "measure_sapo")
                                       for c in spies[n].calls],
                    "searched": [(c[2].c_low, c[2].c_high) for n in ("search_dppo", "search_cispo")
                                 for c in spies[n].calls]}
    return out


def _on_grid(value, start, step, lo, hi):
    k = (value - start) / step
    return lo - 1e-9 <= value <= hi + 1e-9 and abs(k - round(k)) < 1e-6


def _dppo_field(name):
    return lambda r: all(getattr(c, name) == DPPO[name] for c in r["dppo"]["loss_configs"] + r["dppo"]["search_configs"])


CHECKS = {
    # each run calls its own loss and search, never PPO's
    "policy_loss": lambda r: r["dppo"]["called"] == {"dppo_loss", "search_dppo"}
    and r["cispo"]["called"] == {"cispo_loss", "search_cispo"} and r["sapo"]["called"] == {"sapo_loss", "measure_sapo"},
    # the divergence, cap and grid reach the loss and the search, and the searched thresholds lie on
    # the configured grid: delta_high up from 0.04 by 0.02 to 0.3, delta_low down from 0.06 by 0.005 to 0.01
    **{f"dppo.{k}": _dppo_field(k) for k in DPPO},
    "dppo.high_step": lambda r: _dppo_field("high_step")(r) and r["dppo"]["searched"] and all(
        _on_grid(hi, DPPO["delta_high"], DPPO["high_step"], DPPO["delta_high"], DPPO["high_max"])
        for _, hi in r["dppo"]["searched"]),
    "dppo.low_step": lambda r: _dppo_field("low_step")(r) and all(
        _on_grid(lo, DPPO["delta_low"], DPPO["low_step"], DPPO["low_min"], DPPO["delta_low"])
        for lo, _ in r["dppo"]["searched"]),
    # a fixed preset: the configured bounds are the step's (bapo/c_low, bapo/c_high report them)
    "cispo.c_low": lambda r: r["cispo"]["metrics"]["bapo/c_low"] == CISPO["c_low"]
    and all(c.c_low == CISPO["c_low"] for c in r["cispo"]["loss_configs"]),
    "cispo.c_high": lambda r: r["cispo"]["metrics"]["bapo/c_high"] == pytest.approx(CISPO["c_high"]),
    "sapo.tau_pos": lambda r: all(c.tau_pos == SAPO["tau_pos"] for c in r["sapo"]["loss_configs"] + r["sapo"]["search_configs"]),
    "sapo.tau_neg": lambda r: all(c.tau_neg == SAPO["tau_neg"] for c in r["sapo"]["loss_configs"] + r["sapo"]["search_configs"]),
    # the two truncated rows leave the loss: fewer loss tokens than the batch has, and the share logged
    "overlong_filter": lambda r: r["dppo"]["metrics"]["actor/overlong_filtered_frac"] == 0.25
    and r["dppo"]["metrics"]["actor/num_loss_tokens"] < r["dppo"]["unfiltered_tokens"]
    and "actor/overlong_filtered_frac" not in r["cispo"]["metrics"],
}


def test_every_owned_field_has_a_check():
    assert set(CHECKS) == OWNED


def test_every_loss_field_reaches_where_it_acts(run_dist):
    for res in run_dist(_steps, 2, timeout=300):
        failed = sorted(k for k, check in CHECKS.items() if not check(res))
        assert not failed, f"fields that did not arrive: {failed}"
        for key in RUNS:
            assert math.isfinite(res[key]["metrics"]["actor/loss"]), key
        assert "bapo/c_low" not in res["sapo"]["metrics"] and 0 <= res["sapo"]["metrics"]["bapo/rho_after"] <= 1
