"""Mixture of experts on megatron-core's MoE layer: the router that replays recorded routing.

megatron-core's `TopKRouter` calls `router_replay.get_replay_topk(scores, topk, ...)` (when it has a
`router_replay` object) instead of its own top-k. `ReplayRouter` is a `TopKRouter` whose
`router_replay` is a `RoutingTape`: the layer spec puts it in every MoE layer, so every MoE model this
project builds can replay the routing the rollout server recorded (rollout routing replay, "R3").

What a tape does per router call:
- take this call's target: the expert ids the rollout server chose, `[tokens, top_k]`, -1 where
  nothing was recorded (the trainer's own choice stands there);
- with `replay` on, use the target's experts (the probabilities are the router's scores at those
  experts, so the router still gets its gradient); off, keep the router's own top-k;
- count, under no_grad and over the tokens the actor marks as counted (real tokens that predict
  one: no padding, whose amount depends on the layout), the tokens whose own top-k SET differs from
  the recorded one, the tokens that had a target, the tokens it forced, and the load-balance
  statistic of the layer (per-expert token counts and probability sums), for the `moe/*` metrics.

Targets come from the actor (`actor.moe.push_targets`): per forward step, the micro-batch's
`[b, s, num_layers, top_k]` routing (or None) and its `[b, s]` counted-token mask, in the
micro-batch's own layout (padded or packed, this CP rank's chunks). The router takes its layer
(`layer_number`, global), transposes to megatron's `[s, b]` order and, under sequence parallelism,
keeps this TP rank's slice of the sequence, exactly as the hidden states it routes were split. Calls happen in the order of the forward steps; with full
activation recompute every layer runs twice (once without grad inside the checkpoint, once with grad
in the backward, in the same order per model chunk), so the first call files its target for the
recompute, which takes it back: the backward recomputes with the experts the forward used.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

STAT_FIELDS = ("mismatch", "recorded", "replayed", "tokens")
"""Per-router counters (float64): tokens whose own top-k set differs from the recorded one, tokens
with a recorded routing, tokens whose routing was forced, tokens routed."""


class RoutingTape:
    """The replay state of one router (see the module docstring). Not a module: no parameters."""

    def __init__(self, router) -> None:
        self.router = router
        self.replay = False
        """Force the targets (actor.routing_replay); False: only compare and count."""
        self.pending: collections.deque = collections.deque()
        """Per forward call to come: (routing `[b, s, L, k]` or None, counted-token mask `[b, s]` or None)."""
        self.for_recompute: collections.deque = collections.deque()
        """Targets already used by a checkpointed forward, for its recompute in the backward."""
        self.log_used = False
        """Keep the experts every forward call used, as `[tokens, k]` (tests and debugging)."""
        self.used: list[torch.Tensor] = []
        self.stats: Optional[torch.Tensor] = None
        """`STAT_FIELDS` counters, then per expert the tokens routed to it and the summed router
        probability: `[4 + 2 * num_experts]` float64 on the router's device (no host sync per call)."""

    def clear(self) -> None:
        """Drop queued targets (the start of every pass: nothing stale can reach a later one)."""
        self.pending.clear()
        self.for_recompute.clear()
        self.used = []

    def reset_stats(self) -> None:
        if self.stats is not None:
            self.stats.zero_()

    # ------------------------------------------------------------------ the hook megatron calls
    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: Optional[int], group_topk: Optional[int],
                        default_compute_topk: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """`(values, indices)` of the experts to use for `scores` `[tokens, num_experts]` (megatron's
        pre-top-k scores: logits, or softmax probabilities with `moe_router_pre_softmax`)."""
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recomputing, (target, counted) = self._take_target()
        layer = int(self.router.layer_number) - 1
        if target is not None:
            if target.dim() != 4 or target.shape[-1] != topk or not 0 <= layer < target.shape[2]:
                raise ValueError(f"routing replay: target of shape {tuple(target.shape)} does not fit layer {layer} "
                                 f"with top_k={topk} (expected [batch, seq, num_layers, top_k])")
            target = self._local_rows(target[:, :, layer, :], scores.shape[0]).long().to(indices.device)
        if counted is not None:
            counted = self._local_rows(counted, scores.shape[0]).to(indices.device)
        own = indices
        if target is not None and self.replay:
            indices = torch.where(target[:, :1] >= 0, target, indices)
            values = scores.gather(1, indices)
        if not recomputing:
            self._count(scores, own, indices, target, counted)
        if self.log_used and not recomputing:
            self.used.append(indices.detach().cpu())
        return values, indices

    def _take_target(self) -> tuple[bool, tuple]:
        router = self.router
        checkpointed = router.training and router.config.recompute_granularity == "full"
        if checkpointed and torch.is_grad_enabled():  # the backward's recompute of a checkpointed layer
            return True, (self.for_recompute.popleft() if self.for_recompute else (None, None))
        item = self.pending.popleft() if self.pending else (None, None)
        if checkpointed:
            self.for_recompute.append(item)
        return False, item

    def _local_rows(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """This router's tokens of a micro-batch tensor `[b, s, ...]`: `[tokens, ...]` in megatron's
        `[s, b]` order, this TP rank's slice of the sequence under sequence parallelism."""
        router = self.router
        rows = x.transpose(0, 1)
        group = router.tp_group
        if router.config.sequence_parallel and group is not None and group.size() > 1:
            rows = rows.chunk(group.size(), dim=0)[group.rank()]
        rows = rows.reshape(-1, *x.shape[2:])
        if rows.shape[0] != num_tokens:
            raise ValueError(f"routing replay: layer {int(router.layer_number) - 1} routes {num_tokens} tokens but the "
                             f"micro-batch gives {rows.shape[0]} (the micro-batch and the routing tensor disagree)")
        return rows

    @torch.no_grad()
    def _count(self, scores: torch.Tensor, own: torch.Tensor, used: torch.Tensor, target: Optional[torch.Tensor],
               counted: Optional[torch.Tensor]) -> None:
        num_experts = scores.shape[1]
        if self.stats is None:
            self.stats = torch.zeros(len(STAT_FIELDS) + 2 * num_experts, dtype=torch.float64, device=scores.device)
        keep = counted if counted is not None else torch.ones(scores.shape[0], dtype=torch.bool, device=scores.device)
        probs = scores.double() if self.router.config.moe_router_pre_softmax else torch.softmax(scores.double(), dim=-1)
        counts = torch.zeros(4, dtype=torch.float64, device=scores.device)
        counts[3] = keep.sum()
        if target is not None:
            has = (target[:, 0] >= 0) & keep
            differs = (own.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1) & has
            counts[0], counts[1] = differs.sum(), has.sum()
            if self.replay:
                counts[2] = counts[1]
        self.stats[:4] += counts
        self.stats[4:4 + num_experts] += torch.bincount(used[keep].reshape(-1), minlength=num_experts).double()
        self.stats[4 + num_experts:] += probs[keep].sum(0)


_ROUTER = None


def replay_router_class():
    """megatron-core's `TopKRouter` with a `RoutingTape` as its `router_replay` (built lazily so that
    importing this module needs no megatron)."""
    global _ROUTER
    if _ROUTER is None:
        from megatron.core.transformer.moe.router import TopKRouter

        class ReplayRouter(TopKRouter):
            """`TopKRouter` that can replay recorded routing and counts routing statistics."""

            def __init__(self, config, pg_collection=None) -> None:
                super().__init__(config=config, pg_collection=pg_collection)
                if config.moe_router_fusion:
                    raise ValueError("ReplayRouter: moe_router_fusion=True bypasses the routing replay hook")
                self.router_replay = RoutingTape(self)

        _ROUTER = ReplayRouter
    return _ROUTER


def routing_tapes(model) -> list[RoutingTape]:
    """The tapes of every MoE router in `model` (any wrapper), in layer order."""
    tapes = [m.router_replay for m in model.modules() if isinstance(getattr(m, "router_replay", None), RoutingTape)]
    return sorted(tapes, key=lambda t: int(t.router.layer_number))


def is_moe_config(config) -> bool:
    """True for a megatron `TransformerConfig` (or anything with `num_moe_experts`) of an MoE model."""
    return bool(getattr(config, "num_moe_experts", None))
