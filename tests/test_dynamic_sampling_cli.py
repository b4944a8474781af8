"""`rollout.dynamic_sampling: refill` through `python -m megatron_bapo.train`, as a user runs it.

The reward is a coin flip per response and groups have 2 samples, so half the groups score alike
(no GRPO signal) and refill has work to do. Checked from the run's own records (`samples.jsonl`, `tb/metrics.jsonl`,
checkpoints): every updated step trains exactly `prompts_per_step` groups, none of zero variance;
with partial rollout and rollout ahead nothing drawn is lost or trained twice; a run resumed from a
checkpoint taken while refill draws were still generating draws the same prompts as the run that
never stopped.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_bapo.metrics import read_jsonl_metrics
from run_helpers import finish, run_config, start_train, write_assets

pytestmark = pytest.mark.slow
REFILL = {"dynamic_sampling": "refill", "max_refill_rounds": 8, "deterministic_inference": True, "group_size": 2}
REWARD = {"fn": "parity_reward_mod:char_sum_reward"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    return write_assets(tmp_path_factory.mktemp("refill_assets")), tiny_hf_dir


def _config(assets, out, rollout=None, **trainer):
    return run_config(assets, out, sections={"rollout": {**REFILL, **(rollout or {})}, "reward": REWARD}, **trainer)


def _ledger(out):
    return [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]


def _steps(out):
    return [r for r in read_jsonl_metrics(out / "tb") if "timing/step_s" in r]


def _run(config, assets, *extra: str) -> tuple[int, str]:
    proc = start_train(config, assets, *extra)
    log = finish(proc)
    return proc.returncode, log


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """The CLI runs the tests below check, started together and run two at a time (a run spends most
    of its time on one core: its imports, its server's start): {name: (output_dir, future of (exit
    status, console output))}. Each test checks its own run as before."""
    root = tmp_path_factory.mktemp("refill_runs")
    no_eval = "eval.every_n_steps=0"
    filter_config = run_config(assets, root / "filter", total_steps=3, save_every=0, sections={
        "rollout": {"dynamic_sampling": "filter", "group_size": 2, "segment_tokens": 6},
        "reward": {**REWARD, "overlong_buffer_tokens": 3, "overlong_penalty": 0.5},
        "actor": {"optim": {"lr": 1e-3}, "n_minibatches": 2, "max_tokens_per_microbatch": 256,
                  "vocab_divisible_by": 64, "overlong_filter": True}})
    # In the order the tests need them; the resume test's reference run first (its resumed run follows).
    args = {"uninterrupted": (_config(assets, root / "uninterrupted", total_steps=5, save_every=1, keep_checkpoints=0),
                              no_eval),
            "whole": (_config(assets, root / "whole", {"segment_tokens": 6}, total_steps=4, save_every=0), no_eval),
            # Rollout ahead also runs with a single refill round: max_refill_rounds reaches the sampler.
            "ahead": (_config(assets, root / "ahead", {"max_refill_rounds": 1}, total_steps=5, save_every=0,
                              async_steps=1), no_eval, "trainer.save_every=5"),
            "filter": (filter_config, no_eval)}
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="refill-run")
    futures = {name: pool.submit(_run, config, assets, *extra) for name, (config, *extra) in args.items()}
    yield {name: (root / name, futures[name]) for name in args}
    pool.shutdown(wait=True, cancel_futures=True)


def _finished(run) -> Path:
    """The output directory of a run of `runs`, once it ended well."""
    out, future = run
    code, log = future.result()
    assert code == 0, log[-4000:]
    return out


def test_refill_trains_exactly_prompts_per_step_groups_with_signal(runs):
    """Whole responses (one segment): every step is filled from its own draws."""
    out = _finished(runs["whole"])
    records = _steps(out)
    assert [r["train/updated"] for r in records] == [1.0] * 4
    for r in records:
        assert r["experience/num_groups"] == 3 and r["experience/num_zero_variance_groups"] == 0, r
        assert r["rollout/refill_cap_hit"] == 0
    assert sum(r["experience/num_groups_filtered"] for r in records) > 0  # some groups had no signal
    assert sum(r["rollout/refill_rounds"] for r in records) > 0  # and refill replaced them
    drawn, ended = [], []
    for line, r in zip(_ledger(out), records):
        assert len(line["trained"]) == 3 and len(line["dropped"]) == r["experience/num_groups_filtered"]
        assert len(line["drawn"]) >= r["rollout/refill_prompts"]
        drawn += line["drawn"]
        ended += [i for _, i in line["trained"] + line["dropped"]]
        assert set(ended) <= set(drawn)  # nothing trained or dropped before it was drawn
    assert len(ended) == len(set(ended))  # nor twice
    # Whole responses: every group drawn finished in its round; the ones not trained yet are carried.
    assert len(drawn) - len(ended) == records[-1]["rollout/num_surplus_groups"]


def _check_nothing_lost(out, async_steps):
    """Every drawn prompt is trained, dropped, still buffered or in a round produced ahead, once (the
    step-5 checkpoint); the updated steps train 3 groups with signal."""
    lines = _ledger(out)
    final = json.loads((out / "checkpoints" / "step_000005" / "trainer.json").read_text())
    ahead = final["rounds"]["ready"]
    assert len(ahead) == async_steps
    drawn = [i for ln in lines for i in ln["drawn"]] + [p["index"] for r in ahead for p in r["prompts"]]
    settled = ([i for ln in lines for _, i in ln["trained"] + ln["dropped"]]
               + [g["prompt"]["index"] for g in final["rollout"]["groups"]]
               + [g["prompt"]["index"] for r in ahead for g in r["groups"] + r["dropped"]])
    assert sorted(settled) == sorted(drawn) and len(set(drawn)) == len(drawn)
    records = _steps(out)
    updated = [r for r in records if r["train/updated"]]
    assert len(updated) >= 3
    for r in updated:
        assert r["experience/num_zero_variance_groups"] == 0, r
        if not r["rollout/refill_cap_hit"] and not r.get("rollout/num_regenerated"):
            assert r["experience/num_groups"] == 3, r
    return records


def test_refill_with_partial_rollout_and_rollout_ahead_loses_nothing(runs):
    """Responses take 2 segments (refill draws finish a round later) and rounds (and their refills)
    run a step ahead (the synchronous case: `test_resume_mid_refill_draws_the_same_prompts`). The run
    has a single refill round (max_refill_rounds reaches the sampler under rollout ahead too)."""
    out = _finished(runs["ahead"])
    records = _check_nothing_lost(out, async_steps=1)
    assert max(r["rollout/refill_rounds"] for r in records) == 1 and any(r["rollout/refill_cap_hit"] for r in records)


def test_filter_and_overlong_shaping_and_filtering_act(runs):
    """dynamic_sampling: filter drops equal-reward groups without refilling; the overlong penalty
    shapes the rewards of responses near the limit; overlong filtering masks the truncated ones."""
    out = _finished(runs["filter"])
    records = _steps(out)
    assert sum(r["experience/num_groups_filtered"] for r in records) > 0
    assert all("rollout/refill_rounds" not in r for r in records)
    for r in records:  # a random model runs to the 6-token limit: penalised by 0.5, masked out of the loss
        assert r["experience/num_groups"] + r["experience/num_groups_filtered"] == 3
        assert r["reward/num_overlong_penalized"] > 0 and -0.5 <= r["reward/overlong_penalty_mean"] < 0
        if r["train/updated"]:
            assert r["experience/num_zero_variance_groups"] == 0
            assert 0 < r["actor/overlong_filtered_frac"] <= 1


def test_resume_mid_refill_draws_the_same_prompts(assets, runs, tmp_path):
    """Resumed from a checkpoint taken while a step's refill draws were still generating (partial
    rollout: their groups finish in a later step), the run draws, trains and drops exactly what the
    run that never stopped did."""
    whole = _finished(runs["uninterrupted"])
    _check_nothing_lost(whole, async_steps=0)  # synchronous partial rollout: nothing lost
    ledger, records = _ledger(whole), _steps(whole)
    refill_drawn: set[int] = set()
    mid = None
    for line, r in zip(ledger, records):  # the first checkpoint holding a refill draw still generating
        refill_drawn |= set(line["drawn"][len(line["drawn"]) - int(r["rollout/refill_prompts"]):])
        state = json.loads((whole / "checkpoints" / f"step_{line['step']:06d}" / "trainer.json").read_text())
        if {g["prompt"]["index"] for g in state["rollout"]["groups"]} & refill_drawn and line["step"] < 5:
            mid = line["step"]
            break
    assert mid is not None, "no checkpoint was taken mid-refill: the test would be vacuous"
    # The same run, stopped after that checkpoint (a copy without the later ones), then resumed.
    split = tmp_path / "split"
    shutil.copytree(whole, split, ignore=shutil.ignore_patterns("hf_sync"))
    for ckpt in (split / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > mid:
            shutil.rmtree(ckpt)
    (split / "checkpoints" / "latest").write_text(f"step_{mid:06d}")
    config = _config(assets, split, total_steps=5, save_every=1, keep_checkpoints=0)
    proc = start_train(config, assets, "--resume", "eval.every_n_steps=0")
    log = finish(proc)
    assert proc.returncode == 0, log[-4000:]
    assert "resuming from" in log and f"step_{mid:06d}" in log
    resumed = _ledger(split)
    assert [ln["step"] for ln in resumed] == [1, 2, 3, 4, 5]
    for x, y in zip(ledger[mid:], resumed[mid:]):
        assert x["drawn"] == y["drawn"], (x["step"], x["drawn"], y["drawn"])
        assert [i for _, i in x["trained"]] == [i for _, i in y["trained"]], x["step"]
        assert [i for _, i in x["dropped"]] == [i for _, i in y["dropped"]], x["step"]
