"""Training-inference mismatch with a real one: rollouts from the built-in server in bfloat16 against
the fp32 trainer, at temperature 0.6.

The servers start as the trainer starts them (`rollout.builtin_server_dtype`, `ServerPool`).
1. The first update's `mismatch/*` metrics (old_logprobs: rollout) are non-zero with the bf16 server
   and equal an independent recomputation: the same tokens scored by `transformers` in fp32 at the
   same temperature, the metrics written out in plain Python; with an fp32 server they are below
   1e-6. Tokens one version old land in the lag-1 bucket. A wrong temperature in the trainer (a real
   cause of mismatch) warns once, naming the likely causes.
2. With old_logprobs: recompute (+ TIS) the first update is on-policy even with the bf16 server --
   ratio mean 1 within 1e-6 and KL below 1e-8 -- for one process and under TP 2 and CP 2 (under
   `StrictDevices`), and the TIS weights the loss used equal min(w, 2) of the independent
   recomputation. With `rollout` the same batch shows the bf16 mismatch as KL (the old behaviour).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from server_helpers import http  # noqa: E402
from strict_devices import StrictDevices  # noqa: E402
from test_importance import _reference_mismatch  # noqa: E402

TEMPERATURE = 0.6
PROMPTS = [[5, 6, 7, 8], [40, 41, 42], [9, 10], [70, 71, 72, 73, 74]]
NEW_TOKENS = 12
STALE_ROWS = (6, 7)  # sampled one version before the trainer's: version lag 1


def _rollout(hf_dir, dtype: str, tmp: Path) -> dict:
    """8 responses (4 prompts x 2) sampled at TEMPERATURE by the run's built-in server, started as the
    trainer starts it (`rollout.builtin_server_dtype`), as a batch."""
    from megatron_bapo.config import RolloutConfig
    from megatron_bapo.rollout.pool import ServerPool

    pool = ServerPool(RolloutConfig(builtin_server_dtype=dtype, deterministic_inference=True), model_path=str(hf_dir),
                      seed=0, log_dir=tmp, state_path=tmp / "servers.json")
    try:
        pool.start()
        url = pool.servers[0].url
        status, out = http(url + "/generate", {
            "input_ids": PROMPTS, "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": TEMPERATURE, "ignore_eos": True, "n": 2,
                                "sampling_seed": 7}})
        _, info = http(url + "/get_server_info", method="GET")
    finally:
        pool.close()
    assert status == 200 and info["dtype"] == dtype, (status, out)
    rows = [(PROMPTS[i // 2], o["meta_info"]["output_token_logprobs"]) for i, o in enumerate(out)]
    width = max(len(p) + len(r) for p, r in rows)
    batch = {k: torch.zeros(len(rows), width) for k in ("loss_mask", "behavior_logprobs", "advantages")}
    batch["input_ids"] = torch.zeros(len(rows), width, dtype=torch.long)
    batch["attention_mask"] = torch.zeros(len(rows), width, dtype=torch.long)
    batch["versions"] = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, (prompt, resp) in enumerate(rows):
        p, n = len(prompt), len(resp)
        batch["input_ids"][b, :p + n] = torch.tensor(prompt + [t for _, t, _ in resp])
        batch["attention_mask"][b, :p + n] = 1
        batch["loss_mask"][b, p:p + n] = 1.0
        batch["behavior_logprobs"][b, p:p + n] = torch.tensor([lp for lp, _, _ in resp])
        batch["advantages"][b, p:p + n] = 1.0 if b % 3 else -1.0
        batch["versions"][b, p:p + n] = 0 if b in STALE_ROWS else 1
    batch["temperature"] = TEMPERATURE
    return batch


@pytest.fixture(scope="module")
def rollouts(tiny_hf_dir, tmp_path_factory):
    """The bf16 and fp32 servers' batches and the independent fp32 log-probs of their tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_hf_dir, dtype=torch.float32).eval()
    out = {}
    for dtype in ("bfloat16", "float32"):
        batch = _rollout(tiny_hf_dir, dtype, tmp_path_factory.mktemp(dtype))
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        lp = torch.log_softmax(logits[:, :-1] / TEMPERATURE, dim=-1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        ref = torch.cat([torch.zeros(lp.shape[0], 1), lp], dim=1)  # aligned to the token
        out[dtype] = (batch, ref)
    return out


def _flat(batch, ref):
    """Per loss token: (reference log-prob, behavior log-prob, mask 1, version lag, sequence)."""
    keep = batch["loss_mask"] > 0
    rows = torch.arange(keep.shape[0])[:, None].expand_as(keep)[keep]
    lag = (1 - batch["versions"])[keep]
    return (ref[keep].tolist(), batch["behavior_logprobs"][keep].tolist(), [1] * int(keep.sum()), lag.tolist(),
            rows.tolist())


def _steps(rank, world_size, hf_dir, jobs):
    """For each job (batch, actor config overrides, number of steps): a fresh actor holding the HF
    weights, its train_step metrics, and the warnings the actor logged. Under StrictDevices."""
    from transformers import AutoConfig

    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.convert import load_hf_into_model
    from megatron_bapo.models.parallel import ParallelConfig

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    logging.getLogger("megatron_bapo.actor.actor").addHandler(Keep())
    results = []
    with StrictDevices():
        for batch, overrides, num_steps in jobs:
            overrides = dict(overrides)
            cfg = ActorConfig(optim=OptimConfig(name="sgd", lr=0.05, clip_grad=0.0), use_distributed_optimizer=False,
                              vocab_divisible_by=64, parallel=ParallelConfig(**overrides.pop("parallel", {})),
                              **overrides)
            hf_config = AutoConfig.from_pretrained(hf_dir)
            actor = Actor(cfg, hf_config)
            load_hf_into_model(actor.model, hf_dir, hf_config=hf_config)
            records.clear()
            metrics = [actor.train_step(batch, current_version=1) for _ in range(num_steps)]
            results.append({"metrics": metrics, "warnings": list(records)})
    return results


@pytest.mark.slow
def test_first_update_mismatch_is_real_with_bf16_and_equals_an_independent_recomputation(run_dist, rollouts,
                                                                                          tiny_hf_dir):
    bf16, fp32 = rollouts["bfloat16"], rollouts["float32"]
    wrong_temperature = dict(fp32[0], temperature=1.0)  # sampled at 0.6, scored at 1: a real cause
    # The random tiny model's near-uniform logits keep even this KL small: warn at 1e-3 (default 1e-2).
    jobs = [(bf16[0], {}, 1), (fp32[0], {}, 1), (wrong_temperature, {"mismatch": {"warn_kl": 1e-3}}, 2)]
    got_bf16, got_fp32, got_wrong = run_dist(_steps, 1, str(tiny_hf_dir), jobs, timeout=240)[0]

    ref = _reference_mismatch(*_flat(*bf16), band=(0.5, 2.0))
    metrics = got_bf16["metrics"][0]
    for key, value in ref.items():
        if key.endswith("num_tokens"):
            assert metrics[key] == value, key
        else:  # megatron-core and transformers in fp32 agree to ~1e-6 per log-prob
            assert metrics[key] == pytest.approx(value, rel=2e-3, abs=2e-6), (key, metrics[key], value)
    assert metrics["mismatch/num_tokens"] == 6 * NEW_TOKENS and metrics["mismatch/lag1/num_tokens"] == 2 * NEW_TOKENS
    assert metrics["mismatch/kl_k3"] > 1e-8 and metrics["mismatch/abs_diff_mean"] > 1e-4  # bf16: really there
    assert metrics["actor/kl"] > 1e-8  # old_logprobs rollout: the ratio carries the mismatch
    assert got_bf16["warnings"] == []  # far below the default warn_kl

    fp32_metrics = got_fp32["metrics"][0]
    for key in ("abs_diff_mean", "abs_diff_max", "kl_k3", "lag1/abs_diff_mean", "lag1/kl_k3"):
        assert fp32_metrics[f"mismatch/{key}"] < 1e-6, (key, fp32_metrics[f"mismatch/{key}"])
    for key in ("seq_ratio_min", "seq_ratio_max"):
        assert abs(fp32_metrics[f"mismatch/{key}"] - 1.0) < 1e-6, key
    assert fp32_metrics["mismatch/frac_outside_band"] == 0.0

    assert got_wrong["metrics"][0]["mismatch/kl_k3"] > 1e-3
    assert len(got_wrong["warnings"]) == 1, got_wrong["warnings"]  # once, on the first update only
    assert "temperature" in got_wrong["warnings"][0] and "SGLANG_RETURN_ORIGINAL_LOGPROB" in got_wrong["warnings"][0]


@pytest.mark.slow  # the module's fixture starts a bf16 and an fp32 server and samples on both: ~20 s
@pytest.mark.parametrize("layout, world_size", [({}, 1), ({"parallel": {"tp": 2}}, 2),
                                                ({"parallel": {"cp": 2}, "packing": True}, 2)],
                         ids=["one-process", "tp2", "cp2-packed"])
def test_recompute_first_update_is_on_policy_even_with_the_bf16_server(run_dist, rollouts, tiny_hf_dir, layout,
                                                                        world_size):
    batch, ref = rollouts["bfloat16"]
    recompute = {**layout, "old_logprobs": "recompute", "correction": {"mode": "tis", "tis_cap": 2.0}}
    results = run_dist(_steps, world_size, str(tiny_hf_dir), [(batch, recompute, 1)], timeout=240)
    keep = batch["loss_mask"] > 0
    tis = torch.exp(ref[keep].double() - batch["behavior_logprobs"][keep].double()).clamp(max=2.0)
    for (res,) in results:
        m = res["metrics"][0]
        assert abs(m["actor/ratio_mean"] - 1.0) < 1e-6, m["actor/ratio_mean"]
        assert abs(m["actor/kl"]) < 1e-8 and abs(m["actor/kl_k1"]) < 1e-8, (m["actor/kl"], m["actor/kl_k1"])
        assert m["actor/grad_norm"] > 0 and m["actor/loss"] != 0  # a real update
        assert m["correction/weight_mean"] == pytest.approx(float(tis.mean()), rel=1e-5)
        assert m["mismatch/kl_k3"] > 1e-8 and m["mismatch/num_tokens"] == 6 * NEW_TOKENS  # measured, whole batch
        assert math.isfinite(m["bapo/c_high"])
    assert all(r[0]["metrics"] == results[0][0]["metrics"] for r in results)  # identical on every rank


@pytest.mark.slow
def test_recompute_with_seq_mis_under_pp2_cp2_equals_one_process(run_dist, rollouts, tiny_hf_dir):
    """Sequence masks need each sequence's log-weights summed over its CP chunks and packed
    micro-batches; two mini-batches x two epochs exercise the reused first search pass and the later
    ones. Every metric of the step, the mismatch and the correction included, equals one process."""
    batch, _ = rollouts["bfloat16"]
    cfg = {"old_logprobs": "recompute", "correction": {"mode": "seq_mis", "band": (0.9995, 1.0005)},
           "n_minibatches": 2, "ppo_epochs": 2, "packing": True, "max_tokens_per_microbatch": 40}
    (one,), = run_dist(_steps, 1, str(tiny_hf_dir), [(batch, cfg, 1)], timeout=240)
    four = run_dist(_steps, 4, str(tiny_hf_dir), [(batch, {**cfg, "parallel": {"pp": 2, "cp": 2}}, 1)], timeout=240)
    ref = one["metrics"][0]
    assert 0 < ref["correction/masked_frac"] < 1  # the band masks some sequences, not all
    for (res,) in four:
        got = res["metrics"][0]
        assert got.keys() == ref.keys()
        for key, value in ref.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
