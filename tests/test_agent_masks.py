"""Tool tokens are context, never trained: the loss, the BAPO bound search, the importance corrections
and the mismatch/staleness metrics see only the tokens the policy sampled.

1. The batch of multi-turn samples and the "same model tokens laid out single-turn" (the tool tokens
   cut out) give the same bound search (every preset, both search scopes, as the actor flattens a
   mini-batch or masks a micro-batch) and the same loss with the same gradient on every sampled token;
   a tool token's gradient is exactly zero.
2. The real actor (megatron-core on CPU) trains the same update, with the same metrics, whatever the
   batch holds on tool tokens (log-probs, advantages, versions changed to garbage), with the rollout
   log-probs and with the recomputed old policy + TIS, for either search scope.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_bapo.actor.scatter import prepare_tensors
from megatron_bapo.algorithms import BapoConfig
from megatron_bapo.algorithms.bound_search import search_clip_bounds
from megatron_bapo.algorithms.policy_loss import clamped_log_ratio, policy_loss
from megatron_bapo.rollout import Sample, build_batch

VOCAB = 300


def _samples(seed: int) -> tuple[list[Sample], list[Sample], list[list[float]]]:
    """Multi-turn samples (2-3 model turns, tool results between), the same sampled tokens laid out
    single-turn, and the current log-prob of each sampled token (in order)."""
    rng = random.Random(seed)
    multi, single, current = [], [], []
    for _ in range(6):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 6))]
        s, ids, lps, vers, cur = Sample(prompt_ids=list(prompt)), [], [], [], []
        for turn in range(rng.randint(2, 3)):
            if turn:
                s.append_tool_tokens([rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 5))])
            n = rng.randint(2, 8)
            t_ids = [rng.randrange(2, VOCAB) for _ in range(n)]
            t_lps = [-rng.uniform(0.05, 4.0) for _ in range(n)]
            t_ver = [rng.choice([3, 4, 5]) for _ in range(n)]
            s.response_ids += t_ids
            s.response_logprobs += t_lps
            s.response_versions += t_ver
            ids, lps, vers = ids + t_ids, lps + t_lps, vers + t_ver
            cur += [lp + rng.gauss(0.0, 0.4) for lp in t_lps]
        multi.append(s)
        single.append(Sample(prompt_ids=list(prompt), response_ids=ids, response_logprobs=lps, response_versions=vers))
        current.append(cur)
    return multi, single, current


def _current(batch: dict, samples: list[Sample], current: list[list[float]], garbage: float) -> torch.Tensor:
    """[B, T] current log-probs: each sampled token's value at its position, `garbage` elsewhere."""
    lp = torch.full(batch["input_ids"].shape, garbage, dtype=torch.float64)
    for b, (s, cur) in enumerate(zip(samples, current)):
        positions = [len(s.prompt_ids) + i for i, m in enumerate(s.model_mask) if m]
        lp[b, positions] = torch.tensor(cur, dtype=torch.float64)
    return lp


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("preset", ["bapo", "bapo-paper", "bapo-verl"])
def test_search_and_loss_over_a_multi_turn_batch_equal_the_single_turn_layout(seed, preset):
    multi, single, current = _samples(seed)
    rng = random.Random(seed + 99)
    adv = [rng.uniform(-2, 2) for _ in multi]
    config = BapoConfig.preset(preset)
    results = []
    for samples, garbage in ((multi, 9.0), (single, -1.0)):
        data = prepare_tensors(build_batch(samples, advantages=adv))  # the actor's view of the batch
        lp = _current(data, samples, current, garbage).requires_grad_(True)
        mask, beh, a = data["loss_mask"].double(), data["behavior_logprobs"].double(), data["advantages"].double()
        keep = mask > 0
        # search_scope "minibatch": the actor concatenates the loss tokens of its micro-batches.
        flat_ratio = torch.exp(clamped_log_ratio(lp.detach()[keep], beh[keep]))
        flat = search_clip_bounds(flat_ratio, a[keep], torch.ones_like(flat_ratio), config, rollout_logprobs=beh[keep])
        # search_scope "microbatch": the [B, T] tensors with the loss mask.
        ratio = torch.exp(clamped_log_ratio(lp.detach(), beh) * mask)
        masked = search_clip_bounds(ratio, a, mask, config, rollout_logprobs=beh)
        assert masked == flat
        loss, stats = policy_loss(lp, beh, a, mask, flat.c_low, flat.c_high)
        loss.backward()
        results.append((flat, loss.item(), {k: float(v) for k, v in stats.items()}, lp.grad[keep].tolist(),
                        lp.grad[~keep]))
    (multi_res, single_res) = results
    assert multi_res[0] == single_res[0]  # the search: bit for bit
    assert multi_res[1] == pytest.approx(single_res[1], rel=1e-12)  # the loss (summed in another order)
    assert multi_res[2] == pytest.approx(single_res[2], rel=1e-12)
    assert multi_res[3] == single_res[3]  # every sampled token's gradient: bit for bit
    assert multi_res[0].num_tokens == sum(len(c) for c in current)  # every sampled token, no tool token
    assert torch.count_nonzero(multi_res[4]) == 0  # tool tokens (and prompt, padding): exactly zero gradient


def _actor_steps(rank, world_size, hf_dir, jobs):
    """For each (batch, actor config overrides): a fresh actor with the HF weights, one train_step;
    its metrics and the parameters after the step."""
    from transformers import AutoConfig

    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.convert import load_hf_into_model
    from test_actor_helpers import full_params

    out = []
    for batch, overrides in jobs:
        cfg = ActorConfig(optim=OptimConfig(name="sgd", lr=0.05, clip_grad=0.0), use_distributed_optimizer=False,
                          vocab_divisible_by=64, **overrides)
        hf_config = AutoConfig.from_pretrained(hf_dir)
        actor = Actor(cfg, hf_config)
        load_hf_into_model(actor.model, hf_dir, hf_config=hf_config)
        metrics = actor.train_step(batch, current_version=5)
        out.append((metrics, full_params(actor)))
    return out


def test_the_actor_trains_the_same_update_whatever_the_tool_tokens_hold(run_dist, tiny_hf_dir):
    pytest.importorskip("megatron.core")
    multi, _, _ = _samples(7)
    batch = build_batch(multi, advantages=[1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    batch["temperature"] = 1.0
    tool = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    for b, s in enumerate(multi):
        for start, end in s.agent.tool_spans:
            tool[b, len(s.prompt_ids) + start:len(s.prompt_ids) + end] = True
    assert tool.any() and not (batch["loss_mask"][tool]).any()
    garbage = {k: v.clone() for k, v in batch.items() if torch.is_tensor(v)}
    garbage["temperature"] = 1.0
    garbage["behavior_logprobs"][tool] = -0.001  # a tool token "sampled" with probability ~1 ...
    garbage["advantages"][tool] = 5.0  # ... with a large advantage ...
    garbage["versions"][tool] = 0  # ... five versions old
    configs = [{}, {"search_scope": "microbatch"}, {"old_logprobs": "recompute", "correction": {"mode": "tis"}}]
    jobs = [(b, c) for c in configs for b in (batch, garbage)]
    results = run_dist(_actor_steps, 1, str(tiny_hf_dir), jobs, timeout=300)[0]
    for i in range(0, len(results), 2):
        (m_a, p_a), (m_b, p_b) = results[i], results[i + 1]
        same = {k for k in m_a if m_a[k] == m_b[k] or (math.isnan(m_a[k]) and math.isnan(m_b[k]))}
        assert same == set(m_a) == set(m_b), (configs[i // 2], {k: (m_a[k], m_b[k]) for k in set(m_a) - same})
        assert all(torch.equal(p_a[k], p_b[k]) for k in p_a), configs[i // 2]
        assert m_a["staleness/version_lag_max"] == 2.0  # versions 3..5 of the sampled tokens; the tools' 0 unseen
