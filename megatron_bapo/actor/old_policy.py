"""The old policy of `actor.old_logprobs: recompute`: what the loss and the search read per token.

The actor's recompute pass (one forward-only pass over every mini-batch with the step's starting
weights, `Actor._recompute_old_policy`) gives, on the last pipeline stage, the trainer's own
log-probs of every loss token. This module turns them into the entries each micro-batch of the
step carries explicitly:

- `old_logprobs`: the ratio's reference, `r = exp(logp - old_logprobs)`;
- `is_weights`: the importance correction of `actor.correction` (`algorithms.importance`), which
  multiplies the token's loss term and its bound-search contribution;

and adds every token to the step's `mismatch/*` statistics. `seq_mis` needs each sequence's sum of
log-weights, whose tokens context parallelism splits over ranks (and packing over micro-batches):
those sums are all-reduced over the data x context parallel group once, before any weight is made.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_bapo.actor.mismatch import MismatchSums
from megatron_bapo.actor.scatter import MiniBatchWork
from megatron_bapo.algorithms.importance import CorrectionConfig, importance_weights, sequence_log_ratio_sums


def recomputed_entries(minibatches: Sequence[MiniBatchWork], passes: Sequence[Sequence[dict]],
                       correction: CorrectionConfig, measure: MismatchSums, device: torch.device,
                       group: Optional["dist.ProcessGroup"]) -> list[list[dict]]:
    """Per mini-batch, per micro-batch: `{"old_logprobs", "is_weights"}` (device tensors shaped like
    the micro-batch). `passes[i]` are the forward-only results (`{"lp": ...}`) of mini-batch i's
    micro-batches (empty for a skipped one). Sequences are numbered across mini-batches (`row` plus
    the rows of the mini-batches before it) for the mismatch metrics and `seq_mis`. Last stage only;
    `group` (DP x CP, or None when this rank holds all of it) carries seq_mis's one all-reduce."""
    tokens = []  # (mini-batch, old log-probs, behavior, loss mask, sequence index) per micro-batch
    offset = 0
    for i, (work, stored) in enumerate(zip(minibatches, passes)):
        for mb, res in zip(work.microbatches, stored):
            mask, beh = mb["loss_mask"].to(device), mb["behavior_logprobs"].to(device)
            seq = mb["row"].to(device) + offset
            lp = res["lp"].float()
            measure.add(lp, beh, mask, mb["lag"], seq)
            tokens.append((i, lp, beh, mask, seq))
        offset += work.num_rows
    seq_sums = None
    if correction.mode == "seq_mis":
        seq_sums = torch.zeros(measure.num_seqs, 3, dtype=torch.float64, device=device)
        for _, lp, beh, mask, seq in tokens:
            seq_sums += sequence_log_ratio_sums(lp, beh, mask, seq, measure.num_seqs)
        if group is not None:
            dist.all_reduce(seq_sums, group=group)
    out: list[list[dict]] = [[] for _ in minibatches]
    for i, lp, beh, mask, seq in tokens:
        weights = importance_weights(lp, beh, mask, correction, seq_index=seq, seq_sums=seq_sums)
        out[i].append({"old_logprobs": lp, "is_weights": weights})
    return out
