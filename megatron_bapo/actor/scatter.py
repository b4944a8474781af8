"""The batch as each actor rank needs it: its own DP/CP slice, tokens only to the stages that use them.

The trainer's rank 0 holds the global batch (`[B, T]` right-padded CPU tensors, aligned to the
token). What needs the whole batch is done once, by `PreparedBatch`: typed copies and the loss mask,
and per mini-batch the aggregation weights and denominator (global token / sequence counts), the
non-finite check (every rank must agree to skip a step), the micro-batch plan (token-budget packing
balanced over the DP ranks, the same count on every rank) and the staleness metrics.
`PreparedBatch.for_rank` then cuts one rank's `RankBatch`: the micro-batches of its DP rank, its
context-parallel chunks of every sequence (labels taken from the full sequence first), and of
those only what its pipeline stage reads:

| stage              | per micro-batch                                                  |
|--------------------|------------------------------------------------------------------|
| every stage        | shape, `cu_seqlens` / `max_seqlen` (packed)                      |
| first (embedding)  | `input_ids`                                                      |
| last (loss)        | `labels`, `row` (the token's sequence in its mini-batch) and the |
|                    | `POSITION_KEYS` (loss mask, behavior log-probs, advantages,      |
|                    | aggregation weights, version lag)                                |
| every stage (MoE)  | `routed_experts` (the recorded routing its routers replay) and   |
|                    | `row` (which tokens count in the routing statistics)             |

Position ids are rebuilt on the rank from the layout. `scatter_batch` sends each rank its slice
over a gloo group (sizes broadcast, then one point-to-point message per rank; ranks that differ
only in their TP rank get the same bytes, serialised once). On the wire ids and rows are int32, the
loss mask is bool, the version lag uint8 (clamped to 255) and expert ids int16. `docs/parallelism.md` states the bytes per step; `benchmarks/bench_scatter.py`
measures them. With every rank holding the global batch (tests, one process), `Actor.train_step`
cuts its own slice the same way, without communication.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_bapo.actor import batching
from megatron_bapo.actor.moe import ROUTED_EXPERTS, attach_targets
from megatron_bapo.actor.layout import (
    POSITION_KEYS,
    MicroBatchLayout,
    build_microbatch,
    empty_like_microbatch,
    pad_packed_microbatch,
)
from megatron_bapo.actor.metrics import staleness_metrics
from megatron_bapo.algorithms import aggregation_weights

REQUIRED_KEYS = ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "advantages")
FIRST_STAGE_KEYS = ("input_ids",)
LAST_STAGE_KEYS = ("labels", "row") + POSITION_KEYS
MOE_KEYS = (ROUTED_EXPERTS, "row")
SHAPE_KEYS = ("cu_seqlens", "max_seqlen", "shape")
_WIRE_DTYPES = {"input_ids": torch.int32, "labels": torch.int32, "row": torch.int32, "loss_mask": torch.bool,
                "lag": torch.uint8, ROUTED_EXPERTS: torch.int16}
"""Narrower dtypes on the wire (restored on receipt): token ids and rows < 2^31, a 0/1 mask, lags <= 255."""
_RESTORE_DTYPES = {"input_ids": torch.long, "labels": torch.long, "row": torch.long, "loss_mask": torch.float32,
                   "lag": torch.float32}
MAX_LAG = 255
"""Version lags are clamped to this (the metrics bucket them as 0, 1, 2, 3+)."""


@dataclass(frozen=True)
class BatchSpec:
    """What cutting the batch needs to know about the actor (identical on every rank)."""

    packed: bool
    cp_size: int
    sp_size: int
    dp_size: int
    max_tokens_per_microbatch: int
    n_minibatches: int
    ppo_epochs: int
    loss_agg: str
    microbatch_multiple: int = 1
    """Micro-batch count multiple (interleaved pipelines need a multiple of the pipeline size)."""
    common_shape: bool = False
    """Pad every micro-batch of a pass to one shape (interleaved pipelines exchange a fixed shape)."""
    moe: bool = False
    """A mixture-of-experts model: every stage's routers read `MOE_KEYS`."""
    overlong_filter: bool = False
    """Mask the rows the batch marks `truncated` out of the loss (`ActorConfig.overlong_filter`)."""

    def layout(self, cp_rank: int) -> MicroBatchLayout:
        return MicroBatchLayout(packed=self.packed, cp_size=self.cp_size, cp_rank=cp_rank, sp_size=self.sp_size)


@dataclass(frozen=True)
class RankCoords:
    """Where a rank sits, as far as its data is concerned (TP ranks of one position get the same)."""

    dp_rank: int
    cp_rank: int
    first_stage: bool
    last_stage: bool


@dataclass
class MiniBatchWork:
    """One optimizer step's share of this rank."""

    skip: bool
    """Non-finite behavior log-probs or advantages on a loss token somewhere in the mini-batch."""
    denominator: float
    """Aggregation denominator over the loss-token count (megatron divides by the count itself)."""
    microbatches: list[dict] = field(default_factory=list)
    num_rows: int = 0
    """Sequences in the mini-batch (micro-batch `row` values lie in [0, num_rows))."""


@dataclass
class RankBatch:
    """Everything one rank trains on in one `Actor.train_step`."""

    temperature: float
    num_tokens: int
    """Real (non-padding) tokens of the global batch."""
    minibatches: list[MiniBatchWork]
    schedule: list[int]
    """Mini-batch index of each optimizer step (`ppo_epochs` passes over `n_minibatches`)."""
    metrics: dict[str, float]
    """Batch-level metrics computed on the global batch (staleness)."""


def check_batch(batch: dict[str, Any], keys: Sequence[str] = REQUIRED_KEYS) -> float:
    """Validate keys, shapes and the temperature of a global batch; returns the temperature."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise ValueError(f"Actor batch is missing {missing}; required: {list(keys)}")
    shape = batch["input_ids"].shape
    for k, v in batch.items():
        if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape != shape:
            raise ValueError(f"Actor batch[{k!r}] has shape {tuple(v.shape)}, expected {tuple(shape)}")
    temperature = float(batch.get("temperature", 1.0))
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"Actor batch['temperature'] must be a finite number > 0, got {temperature}")
    return temperature


def prepare_tensors(batch: dict[str, torch.Tensor], current_version: Optional[int] = None) -> dict[str, torch.Tensor]:
    """Typed copies; loss only on real tokens after position 0 (it has no prediction); each token's
    version lag `current_version - versions` in [0, MAX_LAG] (`current_version` None: the newest
    version on a loss token; no `versions`: every token is on-policy, lag 0)."""
    out = {
        "input_ids": batch["input_ids"].long(),
        "attention_mask": batch["attention_mask"].long(),
        "behavior_logprobs": batch["behavior_logprobs"].float(),
        "advantages": batch["advantages"].float(),
    }
    mask = (batch["loss_mask"] > 0) & (out["attention_mask"] > 0)
    mask[:, 0] = False
    out["loss_mask"] = mask.float()
    if ROUTED_EXPERTS in batch:  # the rollout's MoE routing `[B, T, layers, top_k]`
        out[ROUTED_EXPERTS] = batch[ROUTED_EXPERTS]
    versions = batch.get("versions")
    if versions is None or not bool(mask.any()):
        out["lag"] = torch.zeros(mask.shape, dtype=torch.float32)
    else:
        current = float(versions[mask].max()) if current_version is None else float(current_version)
        out["lag"] = (current - versions.to(torch.float64)).clamp(0, MAX_LAG).float()
    return out


def overlong_filter(batch: dict[str, Any], data: dict[str, torch.Tensor]) -> dict[str, float]:
    """DAPO's overlong filtering: zero the loss mask of the rows `batch["truncated"]` (`[B]` bool, from
    the rollout: the response hit its token limit) marks, in `data`, before any aggregation weight
    or denominator is computed; returns `actor/overlong_filtered_frac` (rows masked / rows)."""
    if "truncated" not in batch:
        raise ValueError("actor.overlong_filter=true needs the batch's `truncated` rows (rollout.batch.build_batch "
                         "writes them); this batch has none")
    truncated = torch.as_tensor(batch["truncated"]).reshape(-1).bool()
    if truncated.numel() != data["loss_mask"].shape[0]:
        raise ValueError(f"batch['truncated'] has {truncated.numel()} rows, the batch {data['loss_mask'].shape[0]}")
    data["loss_mask"][truncated] = 0.0
    return {"actor/overlong_filtered_frac": float(truncated.double().mean()) if truncated.numel() else 0.0}


def plan(lengths: list[int], spec: BatchSpec) -> list[list[list[int]]]:
    """`plan[dp_rank][k]`: the rows of micro-batch k of that DP rank (see `batching.plan_microbatches`)."""
    return batching.plan_microbatches(lengths, spec.dp_size, spec.max_tokens_per_microbatch,
                                      cost=spec.layout(0).cost, count_multiple=spec.microbatch_multiple)


def local_microbatches(data: dict[str, torch.Tensor], rows_plan: list[list[list[int]]], spec: BatchSpec,
                       dp_rank: int, cp_rank: int) -> list[dict]:
    """The full micro-batch dicts (`actor.layout.build_microbatch`) of one DP x CP rank."""
    layout = spec.layout(cp_rank)
    out = []
    for group in rows_plan[dp_rank]:
        if group:
            out.append(build_microbatch(data, group, layout))
        else:  # a rank with fewer rows than micro-batches runs a no-loss filler to keep counts equal
            out.append(empty_like_microbatch(build_microbatch(data, [0], layout)))
    if spec.common_shape:  # one shape for the whole pass, the same on every rank of the pipeline
        lengths = [int(n) for n in data["attention_mask"].sum(-1)]
        longest = max(layout.cost([lengths[i] for i in g]) // spec.cp_size for shard in rows_plan for g in shard)
        out = [pad_packed_microbatch(mb, longest, layout) for mb in out]
    for mb in out:
        mb["shape"] = tuple(mb["input_ids"].shape)
        attach_targets(mb, data)  # the recorded MoE routing of each position, when the batch has it
    return out


def stage_view(mb: dict, coords: RankCoords, moe: bool = False) -> dict:
    """The keys of a micro-batch that a rank at `coords` reads (see the module table)."""
    keys = [k for k in SHAPE_KEYS if k in mb]
    if coords.first_stage:
        keys += FIRST_STAGE_KEYS
    if coords.last_stage:
        keys += [k for k in LAST_STAGE_KEYS if k in mb]
    if moe:
        keys += [k for k in MOE_KEYS if k in mb and k not in keys]
    return {k: mb[k] for k in keys}


class PreparedBatch:
    """The global batch with everything computed that needs all of it (any rank can hold one)."""

    def __init__(self, batch: dict[str, Any], spec: BatchSpec, current_version: Optional[int] = None) -> None:
        self.spec = spec
        self.temperature = check_batch(batch)
        data = prepare_tensors(batch, current_version)
        filtered = overlong_filter(batch, data) if spec.overlong_filter else {}
        self.num_tokens = int(data["attention_mask"].sum())
        slices = batching.minibatch_slices(data["input_ids"].shape[0], spec.n_minibatches)
        self.schedule = [i for _ in range(spec.ppo_epochs) for i in range(len(slices))]
        self.minibatches: list[tuple[dict, Optional[list], bool, float]] = []
        self.rows_per_minibatch = slices[0].stop - slices[0].start if slices else 0
        for rows in slices:
            mini = {k: v[rows] for k, v in data.items()}
            keep = mini["loss_mask"] > 0
            finite = bool(torch.isfinite(mini["behavior_logprobs"][keep]).all()
                          and torch.isfinite(mini["advantages"][keep]).all())
            weights, denominator = aggregation_weights(mini["loss_mask"], spec.loss_agg)
            mini["weights"] = weights.float()
            # megatron divides the summed gradient by the summed returned counts (the loss tokens, S).
            denominator = denominator / max(float(keep.sum()), 1.0)
            rows_plan = plan([int(n) for n in mini["attention_mask"].sum(-1)], spec) if finite else None
            self.minibatches.append((mini, rows_plan, not finite, denominator))
        self.metrics = staleness_metrics(batch.get("versions"), data["loss_mask"], current_version,
                                         [slices[i] for i in self.schedule])
        self.metrics.update(filtered)
        self._built: dict[tuple[int, int, int], list[dict]] = {}  # (mini-batch, DP rank, CP rank): its micro-batches

    def for_rank(self, coords: RankCoords) -> RankBatch:
        work = []
        for i, (mini, rows_plan, skip, denominator) in enumerate(self.minibatches):
            key = (i, coords.dp_rank, coords.cp_rank)
            if not skip and key not in self._built:  # pipeline stages of one DP x CP rank share them
                self._built[key] = local_microbatches(mini, rows_plan, self.spec, coords.dp_rank, coords.cp_rank)
            mbs = [] if skip else [stage_view(mb, coords, self.spec.moe) for mb in self._built[key]]
            work.append(MiniBatchWork(skip=skip, denominator=denominator, microbatches=mbs,
                                      num_rows=self.rows_per_minibatch))
        return RankBatch(temperature=self.temperature, num_tokens=self.num_tokens, minibatches=work,
                         schedule=list(self.schedule), metrics=dict(self.metrics))


# ---------------------------------------------------------------------- the wire
def to_bytes(work: RankBatch) -> torch.Tensor:
    """A `RankBatch` as one uint8 tensor (`torch.save` of plain containers; narrow dtypes)."""
    state = {
        "temperature": work.temperature, "num_tokens": work.num_tokens, "schedule": work.schedule,
        "metrics": work.metrics,
        "minibatches": [{"skip": m.skip, "denominator": m.denominator, "num_rows": m.num_rows,
                         "microbatches": [{k: (v.to(_WIRE_DTYPES[k]) if k in _WIRE_DTYPES else v)
                                           for k, v in mb.items()} for mb in m.microbatches]}
                        for m in work.minibatches],
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)


def from_bytes(payload: torch.Tensor) -> RankBatch:
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    minibatches = [
        MiniBatchWork(skip=m["skip"], denominator=m["denominator"], num_rows=m["num_rows"],
                      microbatches=[{k: (v.to(_RESTORE_DTYPES[k]) if k in _RESTORE_DTYPES else v) for k, v in mb.items()}
                                    for mb in m["microbatches"]])
        for m in state["minibatches"]
    ]
    return RankBatch(temperature=state["temperature"], num_tokens=state["num_tokens"], minibatches=minibatches,
                     schedule=state["schedule"], metrics=state["metrics"])


@dataclass
class Shipment:
    """A batch prepared for every rank where it was built (`ship`): rank 0's own slice and the bytes
    of every other rank's, in group order. The driver process (`trainer.driver_process`) builds it,
    so rank 0's training process only sends bytes."""

    coords: list[RankCoords]
    """Every rank's coordinates, in group order, as the payloads were cut for."""
    own: torch.Tensor
    """Rank 0's `RankBatch` as bytes (`to_bytes`): one tensor crosses the process boundary, not one per micro-batch."""
    payloads: list[torch.Tensor]
    """Group rank r's bytes at index r (index 0 is empty: rank 0 keeps `own`)."""


def ship(batch: dict[str, Any], spec: BatchSpec, everyone: Sequence[RankCoords], *,
         current_version: Optional[int] = None) -> Shipment:
    """Prepare `batch` once and serialise each rank's slice (ranks with equal coordinates share bytes)."""
    prepared = PreparedBatch(batch, spec, current_version)
    return Shipment(coords=list(everyone), own=to_bytes(prepared.for_rank(everyone[0])),
                    payloads=_payloads(prepared, everyone))


def _payloads(prepared: PreparedBatch, everyone: Sequence[RankCoords]) -> list[torch.Tensor]:
    """Bytes for group ranks 1.. (index 0 empty); ranks with equal coordinates share one serialisation."""
    cache: dict[RankCoords, torch.Tensor] = {}
    for c in everyone[1:]:
        if c not in cache:
            cache[c] = to_bytes(prepared.for_rank(c))
    return [torch.zeros(0, dtype=torch.uint8)] + [cache[c] for c in everyone[1:]]


def scatter_batch(batch: Optional[dict[str, Any] | Shipment], spec: BatchSpec, coords: RankCoords,
                  group: "dist.ProcessGroup", *, current_version: Optional[int] = None) -> Optional[RankBatch]:
    """Collective over `group` (gloo, every actor rank): each rank's `RankBatch` from rank 0's `batch`.

    `batch` is read on group rank 0 only (None there: no batch this step, None everywhere). Rank 0
    learns every rank's coordinates (one small all-gather), prepares the batch once, serialises one
    payload per distinct (DP rank, CP rank, stage) and sends each rank its own; the others receive
    exactly their bytes. Given a `Shipment` (prepared in the driver process), rank 0 only checks it
    was cut for these ranks and sends it. Returns this rank's slice.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, coords, group=group)
    sizes = torch.zeros(world, dtype=torch.int64)
    own: Optional[RankBatch] = None
    payloads: list[torch.Tensor] = []
    if rank == 0 and isinstance(batch, Shipment):
        if batch.coords != everyone:
            raise RuntimeError(f"the driver process cut the batch for ranks {batch.coords}, but the group's ranks are "
                               f"{everyone}: it was told other coordinates (Trainer._setup sends them once)")
        own, payloads = from_bytes(batch.own), batch.payloads
    elif rank == 0 and batch is not None:
        prepared = PreparedBatch(batch, spec, current_version)
        own, payloads = prepared.for_rank(coords), _payloads(prepared, everyone)
    if payloads:
        sizes = torch.tensor([max(p.numel(), 1) for p in payloads], dtype=torch.int64)
    dist.broadcast(sizes, src=dist.get_global_rank(group, 0), group=group)
    if int(sizes[0]) == 0:
        return None
    if rank == 0:
        works = [dist.isend(payloads[r], dst=dist.get_global_rank(group, r), group=group) for r in range(1, world)]
        for w in works:
            w.wait()
        return own
    buf = torch.empty(int(sizes[rank]), dtype=torch.uint8)
    dist.recv(buf, src=dist.get_global_rank(group, 0), group=group)
    return from_bytes(buf)
