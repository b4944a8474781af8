"""Next-token choice and its log-prob for a batch of rows with per-row sampling parameters.

Order (as SGLang): penalties / logit bias / min-new-tokens mask on the raw logits, then
temperature, then top-k, top-p, min-p filtering of the probabilities, then a draw.

The returned log-prob (what RL uses as the behavior log-prob) is the log-softmax of the
temperature-scaled logits *before* top-k/top-p/min-p filtering (SGLang's default), or of the raw
logits when `original=True` (SGLang's `SGLANG_RETURN_ORIGINAL_LOGPROB`). At temperature 1 (and for
greedy, which SGLang runs at temperature 1) both equal `log_softmax(model logits)`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def adjust_logits(logits: torch.Tensor, params, output_ids: Sequence[int], stop_ids: Sequence[int]) -> torch.Tensor:
    """Penalties, logit bias and the min-new-tokens stop mask for one row ([vocab] fp32, copied)."""
    row = logits
    changed = False

    def own() -> torch.Tensor:
        nonlocal row, changed
        if not changed:
            row, changed = row.clone(), True
        return row

    if output_ids and (params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0):
        ids = torch.tensor(list(output_ids), dtype=torch.long)
        counts = torch.bincount(ids, minlength=row.numel())[: row.numel()].to(row.dtype)
        seen = counts > 0
        r = own()
        if params.repetition_penalty != 1.0:
            vals = r[seen]
            r[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
        if params.frequency_penalty:
            r -= params.frequency_penalty * counts
        if params.presence_penalty:
            r -= params.presence_penalty * seen.to(r.dtype)
    if params.logit_bias:
        r = own()
        for tok, bias in params.logit_bias.items():
            if 0 <= tok < r.numel():
                r[tok] += bias
    if len(output_ids) < params.min_new_tokens and stop_ids:
        r = own()
        r[[t for t in stop_ids if 0 <= t < r.numel()]] = float("-inf")
    return row


def filter_probs(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Zero out what top-k / top-p / min-p exclude from one row of probabilities (renormalised)."""
    if top_k > 0 and top_k < probs.numel():
        kth = torch.topk(probs, top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=0)
        drop = (cum - sorted_p) > top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    if min_p > 0.0:
        probs = torch.where(probs >= min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()


def choose_token(
    logits: torch.Tensor,
    params,
    generator: Optional[torch.Generator],
    *,
    original: bool = False,
) -> tuple[int, float, torch.Tensor]:
    """Pick the next token from one adjusted logits row ([vocab] fp32).

    Returns (token id, its log-prob, the full log-prob row used for top-logprobs).
    """
    raw_lp = torch.log_softmax(logits, dim=-1)
    if params.greedy:
        tok = int(torch.argmax(logits))
        return tok, float(raw_lp[tok]), raw_lp
    scaled = logits / params.temperature if params.temperature != 1.0 else logits
    lp = raw_lp if scaled is logits else torch.log_softmax(scaled, dim=-1)
    probs = torch.exp(lp)
    if params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0:
        probs = filter_probs(probs, params.top_k, params.top_p, params.min_p)
    tok = int(torch.multinomial(probs, 1, generator=generator))
    out_lp = raw_lp if original else lp
    return tok, float(out_lp[tok]), out_lp


def top_logprobs(lp_row: torch.Tensor, k: int) -> list:
    """[[logprob, token_id, None], ...] of the k most likely tokens."""
    if k <= 0:
        return []
    vals, ids = torch.topk(lp_row, min(k, lp_row.numel()))
    return [[float(v), int(i), None] for v, i in zip(vals.tolist(), ids.tolist())]


def is_plain(params, num_output: int, stop_ids, has_own_generator: bool, top_n: int) -> bool:
    """True when a row needs nothing but temperature (or greedy): it can join `choose_plain_batch`."""
    return (not has_own_generator and top_n == 0 and params.top_k <= 0 and params.top_p >= 1.0
            and params.min_p <= 0.0 and not params.logit_bias and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0 and params.repetition_penalty == 1.0
            and (num_output >= params.min_new_tokens or not stop_ids))


def choose_plain_batch(
    logits: torch.Tensor, temperatures: Sequence[float], generator: Optional[torch.Generator], *, original: bool = False,
) -> tuple[list, list]:
    """`choose_token` for many plain rows at once ([b, vocab] fp32): (token ids, log-probs).

    Same distribution and log-prob definition as `choose_token`; one multinomial call for the batch.
    """
    temps = torch.tensor(list(temperatures), dtype=logits.dtype)
    greedy = temps < 1e-6
    raw_lp = torch.log_softmax(logits, dim=-1)
    safe = torch.where(greedy, torch.ones_like(temps), temps)
    lp = raw_lp if bool((safe == 1.0).all()) else torch.log_softmax(logits / safe[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        sampled = torch.multinomial(torch.exp(lp), 1, generator=generator).squeeze(1)
        tokens = torch.where(greedy, tokens, sampled)
    out_lp = (raw_lp if original else lp).gather(1, tokens[:, None]).squeeze(1)
    return tokens.tolist(), out_lp.tolist()
