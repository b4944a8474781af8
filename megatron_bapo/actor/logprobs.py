"""Log-probs and entropy of target tokens from vocab-parallel logits, chunked along the tokens.

With TP each rank holds logits `[..., V/TP]` for its slice of the vocabulary. A full log-softmax in
fp32 over 64k tokens x 152k vocab would need ~39 GB, so one autograd function walks the tokens in
chunks of `chunk_size`: per chunk it upcasts to fp32, computes the max and the sum of exponentials
(one all-reduce each over the TP group), picks the target logit on the rank that owns it (one
all-reduce), and, for the entropy, the expected logit (one all-reduce). Only per-token scalars are
kept; the backward recomputes each chunk's softmax from the saved log-sum-exp, so the peak extra
memory is `chunk_size x V/TP` floats on top of the logits and their gradient.

Temperature: the rollout servers sample from (and report log-probs of) softmax(logits / T), as
SGLang does, so the trainer's log-probs and entropy are those of the same distribution: every
formula below is applied to l = logits / T (the division happens per chunk, in fp32).

Gradients (per token, local vocab column j, p = softmax(l), l = logits / T, lse = log-sum-exp):
    d logp / d l_j = 1[j == target] - p_j
    d H    / d l_j = -p_j (l_j - lse + H)
and d l_j / d logits_j = 1 / T. They need only global scalars (lse, H) that the forward already
reduced: the backward has no communication. An output that no loss term uses (the entropy, when
it is only a metric) adds nothing to the backward: its gradient arrives as None, not as zeros.

Vocabulary padding: columns with global id >= `vocab_size` (the real HF vocabulary) are a suffix
of the vocabulary, so each rank simply ignores the padded tail of its slice (no copy, no -inf):
padded rows of the output layer never take probability mass and get zero gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_CHUNK_SIZE = 4096


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


def _real_width(vocab_start: int, v_local: int, vocab_size: Optional[int]) -> int:
    """Columns of this rank's slice that are real tokens (padding is a suffix of the global vocab)."""
    if vocab_size is None:
        return v_local
    return max(0, min(v_local, vocab_size - vocab_start))


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 `x / T` (a view of fp32 logits when T == 1, else one chunk-sized temporary)."""
    x = x.float()
    return x if temperature == 1.0 else x / temperature


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_size, chunk_size, with_entropy, temperature):
        n, v_local = logits.shape
        rank = dist.get_rank(group) if group is not None and dist.get_world_size(group) > 1 else 0
        vocab_start = rank * v_local
        width = _real_width(vocab_start, v_local, vocab_size)
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n, dtype=torch.float32, device=logits.device) if with_entropy else None
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            x = _scaled(logits[s:e, :width], temperature)
            if width:
                m = x.max(dim=-1).values
            else:
                m = torch.full((e - s,), float("-inf"), device=logits.device)
            _all_reduce(m, dist.ReduceOp.MAX, group)
            ex = x - m.unsqueeze(-1)
            ex.exp_()
            sum_exp = ex.sum(-1)
            local_t = targets[s:e] - vocab_start
            owned = (local_t >= 0) & (local_t < width)
            if width:
                tgt = torch.gather(x, 1, local_t.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
                tgt = torch.where(owned, tgt, torch.zeros_like(tgt))
            else:
                tgt = torch.zeros_like(sum_exp)
            if with_entropy:
                wsum = torch.linalg.vecdot(ex, x) if width else torch.zeros_like(sum_exp)  # sum_j e^(l_j-m) l_j
                packed = torch.stack([sum_exp, tgt, wsum])
            else:
                packed = torch.stack([sum_exp, tgt])
            _all_reduce(packed, dist.ReduceOp.SUM, group)
            lse = m + torch.log(packed[0])
            lse_all[s:e] = lse
            logp[s:e] = packed[1] - lse
            if with_entropy:
                ent[s:e] = lse - packed[2] / packed[0]
            del x, ex
        ctx.save_for_backward(logits, targets, lse_all, ent if with_entropy else lse_all)
        ctx.meta = (vocab_start, width, chunk_size, with_entropy, temperature)
        # An output the loss does not use gets None, not a materialised zero gradient: the actor
        # reads the entropy as a metric only, and a zero `grad_ent` would still run its backward.
        ctx.set_materialize_grads(False)
        if with_entropy:
            return logp, ent
        return logp, torch.zeros(0, dtype=torch.float32, device=logits.device)

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, targets, lse_all, ent = ctx.saved_tensors
        vocab_start, width, chunk_size, with_entropy, temperature = ctx.meta
        n, v_local = logits.shape
        grad = torch.empty_like(logits)
        if width < v_local:
            grad[:, width:] = 0
        use_ent = with_entropy and grad_ent is not None and grad_ent.numel() == n
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            if not width:
                continue
            x = _scaled(logits[s:e, :width], temperature)
            g = x - lse_all[s:e].unsqueeze(-1)
            g.exp_()  # softmax p
            if use_ent:
                # dH/dl_j = -p_j (l_j - lse + H)
                t = x + (ent[s:e] - lse_all[s:e]).unsqueeze(-1)
                t.mul_(g).mul_(-grad_ent[s:e].unsqueeze(-1))
            if grad_logp is not None:
                g.mul_(-grad_logp[s:e].unsqueeze(-1))  # -p * dL/dlogp
                local_t = targets[s:e] - vocab_start
                rows = torch.nonzero((local_t >= 0) & (local_t < width)).squeeze(1)
                g[rows, local_t[rows]] += grad_logp[s:e][rows]
            else:
                g.zero_()
            if use_ent:
                g.add_(t)
                del t
            if temperature != 1.0:
                g.div_(temperature)  # d(logits / T) / d logits
            grad[s:e, :width] = g.to(grad.dtype)
            del x, g
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Optional["dist.ProcessGroup"] = None,
    vocab_size: Optional[int] = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of `targets` and the full-distribution entropy, from this rank's vocab slice.

    Args:
        logits: `[..., V/TP]` this TP rank's contiguous vocabulary slice (rank r holds global ids
            `r*V/TP .. (r+1)*V/TP - 1`), any float dtype; differentiable.
        targets: `[...]` global token ids (long), same leading shape.
        tp_group: tensor-parallel group (None or size 1: the logits hold the whole vocabulary).
        vocab_size: real vocabulary size; columns at or beyond it are masked (padding).
        chunk_size: tokens per chunk; peak extra memory is `chunk_size x V/TP` fp32 values.
        with_entropy: also return the entropy (costs one more reduction per chunk).
        temperature: T > 0 of the sampling distribution softmax(logits / T) (the rollout's).

    Returns `(logprobs, entropy)`, fp32, shape `[...]`; entropy is None without `with_entropy`.
    Identical on every rank of `tp_group`.
    """
    if chunk_size < 1:
        raise ValueError(f"vocab_parallel_logprobs: chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"vocab_parallel_logprobs: temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"vocab_parallel_logprobs: logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree"
        )
    lead = targets.shape
    flat = logits.reshape(-1, logits.shape[-1])
    lp, ent = _VocabParallelLogProbEntropy.apply(
        flat, targets.reshape(-1).long(), tp_group, vocab_size, chunk_size, with_entropy, float(temperature)
    )
    return lp.reshape(lead), (ent.reshape(lead) if with_entropy else None)


def token_aligned_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    **kwargs,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs aligned to the token: out[b, t] = log p(input_ids[b, t] | input_ids[b, :t]).

    `logits` `[B, T, V/TP]` are the model outputs at every position (position t predicts t+1).
    Position 0 has no prediction and is 0 in both outputs; the entropy at [b, t] is that of the
    distribution that produced token t. Keyword arguments go to `vocab_parallel_logprobs`.
    """
    targets = torch.roll(input_ids, shifts=-1, dims=-1)  # last column: a dummy target, dropped below
    lp, ent = vocab_parallel_logprobs(logits, targets, **kwargs)
    pad = torch.zeros_like(lp[..., :1])
    lp = torch.cat([pad, lp[..., :-1]], dim=-1)
    if ent is not None:
        ent = torch.cat([pad, ent[..., :-1]], dim=-1)
    return lp, ent
