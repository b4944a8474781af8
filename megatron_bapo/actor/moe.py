"""The actor's mixture-of-experts side: config checks and overrides, routing replay, `moe/*` metrics.

Rollout routing replay (`ActorConfig.routing_replay`): the batch carries `ROUTED_EXPERTS`, the experts
every MoE layer chose for each token when the rollout server computed it (`[B, T, num_layers, top_k]`,
aligned to the token like every batch tensor, -1 where nothing was recorded). Each micro-batch gets its
slice in its own layout (`attach_targets`, from the label coordinates the layout already carries: the
input token at a position is the one before its label), every forward step hands it to the routers of
its model chunk (`push_targets`), and each router (`models.moe.RoutingTape`) forces those experts for
the tokens that have them, in every forward of the step (the bound search's pass, the loss, the
recompute, `compute_logprobs`). Prompt tokens use the recorded prompt routing where the server returned
it, else the trainer's own; a sequence's last token predicts nothing, so its routing does not matter.

Without replay the recorded routing is still compared: `moe/routing_mismatch` is the share of
(token, layer) pairs whose top-k SET in training differs from the rollout's.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist

from megatron_bapo.models.moe import STAT_FIELDS, RoutingTape, routing_tapes

logger = logging.getLogger(__name__)

ROUTED_EXPERTS = "routed_experts"
"""Batch key of the recorded routing: int `[B, T, num_layers, top_k]`, token-aligned, -1 = none."""


def is_moe(hf_config: Any) -> bool:
    from megatron_bapo.models.registry import model_args_from_hf

    return bool(model_args_from_hf(hf_config).config_kwargs.get("num_moe_experts"))


def config_overrides(config: Any, hf_config: Any) -> dict[str, Any]:
    """TransformerConfig fields the actor config sets for an MoE model (none for a dense one), after
    checking the layout: megatron trains MoE under TP only with sequence parallelism."""
    moe = is_moe(hf_config)
    pc = config.parallel
    if not moe:
        if config.routing_replay:
            raise ValueError("ActorConfig.routing_replay=True needs a mixture-of-experts model (Qwen3MoeForCausalLM)")
        return {}
    if pc.tp > 1 and not pc.sequence_parallel:
        raise ValueError(f"ActorConfig.parallel.tp={pc.tp} with a mixture-of-experts model needs "
                         "parallel.sequence_parallel=True (megatron-core trains MoE layers under TP only with it)")
    if config.moe_aux_loss_coeff > 0:
        return {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": float(config.moe_aux_loss_coeff)}
    return {}


def setup_tapes(model_chunks: Iterable[Any], *, replay: bool) -> list[RoutingTape]:
    """Every router tape of the actor's chunks, replaying (or only comparing) as configured."""
    tapes = [t for chunk in model_chunks for t in routing_tapes(chunk)]
    for tape in tapes:
        tape.replay = replay
    return tapes


def attach_targets(mb: dict, data: dict) -> None:
    """Add `ROUTED_EXPERTS` `[b, s, L, k]` to a micro-batch built from `data` (in its layout): the
    recorded routing of the INPUT token at each position, i.e. the token before the position's label
    `(row, col)`; -1 where the position has no label (a sequence's last token, padding, fillers)."""
    routed = data.get(ROUTED_EXPERTS)
    if routed is None:
        return
    row, col = mb["row"], mb["col"]
    has = row >= 0
    target = routed[row.clamp(min=0), (col - 1).clamp(min=0)]
    target[~has] = -1
    mb[ROUTED_EXPERTS] = target


def push_targets(chunk_tapes: list[RoutingTape], mb: dict) -> None:
    """Queue a micro-batch's routing for the forward about to run on the chunk whose router tapes are
    `chunk_tapes` (None: own routing), with the tokens its statistics count: those with a label (no
    padding, no filler)."""
    item = (mb.get(ROUTED_EXPERTS), mb["row"] >= 0)
    for tape in chunk_tapes:
        tape.pending.append(item)


def begin_pass(tapes: list[RoutingTape]) -> None:
    """Start of a forward(-backward) pass: nothing queued from an earlier one can leak into it."""
    for tape in tapes:
        tape.clear()


def reset_stats(tapes: list[RoutingTape]) -> None:
    for tape in tapes:
        tape.reset_stats()


def collect_metrics(tapes: list[RoutingTape], *, num_layers: int, num_experts: int, group: Any,
                    device: torch.device) -> dict[str, float]:
    """`moe/*` metrics of the pass since `reset_stats`, identical on every rank of `group` (all actor
    ranks: each (token, layer) is routed on exactly one (DP, CP, PP, TP-under-SP) position; without
    sequence parallelism TP ranks route the same tokens, which scales every sum alike).

    moe/routing_mismatch: share of (token, layer) pairs with a recorded routing whose own top-k set
        differs from it (replay on: what replay overrides; off: what it would);
    moe/routing_recorded: share of routed (token, layer) pairs that had a recorded routing;
    moe/routing_replayed: share of routed (token, layer) pairs whose experts were forced;
    moe/load_balance: the load-balancing statistic of the routing used, E * sum_e f_e * P_e averaged
        over layers (f_e: share of the top-k slots that went to expert e, P_e: mean router
        probability of e); 1.0 is perfectly even, E / top_k the worst.
    """
    width = len(STAT_FIELDS) + 2 * num_experts
    table = torch.zeros(num_layers, width, dtype=torch.float64, device=device)
    for tape in tapes:
        if tape.stats is not None:
            table[int(tape.router.layer_number) - 1] += tape.stats.to(device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(table, group=group)
    totals = table[:, :len(STAT_FIELDS)].sum(0)
    mismatch, recorded, replayed, tokens = (float(x) for x in totals)
    out: dict[str, float] = {}
    if tokens > 0:
        out["moe/routing_recorded"] = recorded / tokens
        out["moe/routing_replayed"] = replayed / tokens
        if recorded > 0:
            out["moe/routing_mismatch"] = mismatch / recorded
        counts = table[:, len(STAT_FIELDS):len(STAT_FIELDS) + num_experts]
        probs = table[:, len(STAT_FIELDS) + num_experts:]
        per_layer_tokens = table[:, 3:4]
        routed = per_layer_tokens[:, 0] > 0
        if routed.any():
            f = counts[routed] / counts[routed].sum(-1, keepdim=True)
            p = probs[routed] / per_layer_tokens[routed]
            out["moe/load_balance"] = float((num_experts * (f * p).sum(-1)).mean())
    return out


def moe_shape(model_chunks: Iterable[Any]) -> Optional[tuple[int, int]]:
    """(num_layers, num_experts) of an MoE model's chunks, None for a dense model."""
    for chunk in model_chunks:
        config = getattr(chunk, "config", None)
        if config is not None and getattr(config, "num_moe_experts", None):
            return int(config.num_layers), int(config.num_moe_experts)
    return None
