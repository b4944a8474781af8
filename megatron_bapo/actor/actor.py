"""The Megatron actor: BAPO optimizer steps on a model built by `actor.build`.

One `train_step(batch)` = `ppo_epochs` x `n_minibatches` optimizer steps. First, with
`old_logprobs: recompute`, one forward-only pass over the whole batch with the step's starting
weights: the old policy's log-probs, the importance corrections (`algorithms.importance`) and the
`mismatch/*` metrics (`actor.mismatch`). Then per mini-batch:
  1. (search_scope "minibatch") forward-only pass over the mini-batch for the current log-probs
     (the first step reuses the recompute pass: the same weights, the same forward);
  2. the bound search (`search_clip_bounds`, or the balance of `actor.policy_loss`'s trust region:
     `algorithms.objective`) on the last pipeline stage over the DP x CP group (one collective); a
     non-finite result is a flag reduced over the pipeline group, and every stage skips together;
  3. megatron's `get_forward_backward_func()` over token-budget micro-batches with the policy loss;
  4. grad norm; a non-finite one skips the step on every rank; else optimizer + LR schedule step.
The ratio's reference is the behavior log-probs (`old_logprobs: rollout`; the first step's loss
forward then also measures the mismatch) or the recomputed ones. The per-step inputs of the loss
(temperature, bounds, denominator: `StepInputs`; old log-probs and importance weights: per-token
entries of the step's micro-batches) are passed down explicitly.

A step trains on this rank's slice of the batch (`actor.scatter`: its DP rank's micro-batches, its
context-parallel chunks, its pipeline stage's keys), cut here from the global batch or received from
the trainer's rank 0. The model passes are `actor.passes`, the optimizer step `actor.optimizer_step`.
Micro-batches are packed (THD) or padded by `actor.layout`; log-probs and
entropy are those of the sampling distribution softmax(logits / T), T being the rollout temperature
the batch carries, passed explicitly down to the loss. Every tensor a collective over a device
(NCCL) group carries lives on `Actor.device` (docs/parallelism.md).

Global aggregation: every token carries an aggregation weight computed on the whole mini-batch
(`aggregation_weights`: token-mean, or a sequence mean that would otherwise need a sequence's
tokens together). megatron (`calculate_per_token_loss`) sums the micro-batch losses and the
returned token counts over micro-batches and DP x CP ranks and divides the gradient once by the
total count S (`finalize_model_grads`); so each micro-batch returns `(S / D) * sum(w_t loss_t)`,
and the gradient is that of `sum(w_t loss_t) / D` over the mini-batch, exactly the single-process
loss for any DP / CP / micro-batch / packing split. `w_t` (aggregation weight x importance
correction, `_token_weights`) also weights each token's contribution in the bound search, so the
balance it steers is the applied gradient's under every `loss_agg`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from megatron_bapo.actor import moe
from megatron_bapo.actor.build import build_actor
from megatron_bapo.actor.config import ActorConfig
from megatron_bapo.actor.errors import SkippedStepsError
from megatron_bapo.actor.metrics import MetricSums, acc_keys, average_steps
from megatron_bapo.actor.mismatch import BUCKETS, FINAL_KEYS, MismatchSums, mismatch_metrics, warn_if_large
from megatron_bapo.actor.old_policy import recomputed_entries
from megatron_bapo.actor.optimizer_step import grad_norm_or_skip, step_with_norm
from megatron_bapo.actor.passes import ModelPasses
from megatron_bapo.actor.scatter import BatchSpec, MiniBatchWork, PreparedBatch, RankBatch, RankCoords
from megatron_bapo.algorithms import loss_token_weights
from megatron_bapo.models.parallel import ParallelGroups, initialize_model_parallel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInputs:
    """What an optimizer step's loss needs besides its micro-batch, decided per step and passed down
    explicitly (never parked on the actor)."""

    temperature: float
    """Sampling temperature of the batch: log-probs are those of softmax(logits / temperature)."""
    denominator: float
    """Aggregation denominator over the loss-token count (`MiniBatchWork.denominator`)."""
    bounds: Optional[tuple[float, float]] = None
    """(c_low, c_high) of the step (the policy loss's (lower, upper) trust-region parameters); None:
    searched per micro-batch inside the loss (search_scope microbatch)."""


class Actor(ModelPasses):
    """Megatron-core policy model under TP/PP/CP/DP with BAPO updates.

    Attributes used by other components: `model` (list of DDP-wrapped model chunks), `parallel`
    (`ParallelGroups`), `optimizer`, `scheduler`, `num_updates` (optimizer steps taken).
    """

    def __init__(self, config: ActorConfig, hf_config: Any, *, groups: Optional[ParallelGroups] = None) -> None:
        self.config = config
        self.hf_config = hf_config
        self.parallel = groups or initialize_model_parallel(config.parallel, seed=config.seed)
        self.distributed_optimizer = config.use_distributed_optimizer
        built = build_actor(config, hf_config, self.parallel)  # model chunks, DDP, optimizer, schedule
        self.model, self.optimizer, self.scheduler = built.model, built.optimizer, built.scheduler
        self.layout, self.hf_vocab_size, self.moe_shape = built.layout, built.hf_vocab_size, built.moe_shape
        self.routing_tapes, self.chunk_tapes = built.routing_tapes, built.chunk_tapes
        self.num_updates = 0
        self.num_skipped_steps = 0
        self.phase_times = {"recompute": 0.0, "search": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
        """This rank's wall seconds per phase of the last `train_step`, summed over its optimizer steps:
        the recompute pass (old_logprobs recompute), the forward-only pass + bound search,
        forward/backward, grad norm + optimizer (diagnostics, e.g. benchmarks/gpu_bench.py; they
        differ across ranks, unlike the returned metrics)."""
        self.mismatch_checked = False
        """The first update's mismatch was checked against `mismatch.warn_kl` (warned at most once)."""

    # ------------------------------------------------------------------ batches
    @property
    def batch_spec(self) -> BatchSpec:
        """How a global batch is cut for this actor's layout (the same on every rank)."""
        pc, cfg = self.config.parallel, self.config
        return BatchSpec(
            packed=cfg.packing, cp_size=self.parallel.cp_size, sp_size=self.layout.sp_size,
            dp_size=self.parallel.dp_size, max_tokens_per_microbatch=cfg.max_tokens_per_microbatch,
            n_minibatches=cfg.n_minibatches, ppo_epochs=cfg.ppo_epochs, loss_agg=cfg.loss_agg,
            microbatch_multiple=pc.pp if pc.vpp else 1, common_shape=bool(pc.vpp), moe=self.moe_shape is not None,
            overlong_filter=cfg.overlong_filter,
        )

    @property
    def coords(self) -> RankCoords:
        """This rank's place for the data it needs (its DP and CP rank, first/last pipeline stage)."""
        p = self.parallel
        return RankCoords(dp_rank=p.dp_rank, cp_rank=p.cp_rank, first_stage=p.is_first_stage,
                          last_stage=p.is_last_stage)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live: every tensor a device-group collective carries goes here."""
        return next(self.model[0].parameters()).device

    # ------------------------------------------------------------------ training
    def train_step(self, batch: Union[dict[str, Any], RankBatch], *,
                   current_version: Optional[int] = None) -> dict[str, float]:
        """`ppo_epochs` x `n_minibatches` BAPO optimizer steps on the global batch.

        batch: either the global batch, the same on every rank -- CPU tensors `[B, T]`, right-padded
        and aligned to the token (value at [b, t] concerns input_ids[b, t]): input_ids,
        attention_mask, loss_mask, behavior_logprobs, advantages and optionally versions (policy
        version per token); plus `temperature` (float, default 1), the sampling temperature the
        behavior log-probs were computed at -- or this rank's `RankBatch` from `scatter_batch`
        (the trainer's path: rank 0 prepared it, with its `current_version`).
        Staleness (`staleness/*`) counts optimizer steps: a token of version v trained in the k-th
        optimizer step of this call is `(current_version - v) * steps_per_call + k` steps stale
        (`current_version` defaults to the newest version in the batch); the `mismatch/*` metrics
        bucket tokens by their version lag `current_version - v` (actor.mismatch).
        Returns metrics averaged over the optimizer steps, identical on every rank.
        """
        if not isinstance(batch, RankBatch):
            batch = PreparedBatch(batch, self.batch_spec, current_version).for_rank(self.coords)
        self.phase_times = dict.fromkeys(self.phase_times, 0.0)
        old: Optional[list[list[dict]]] = None
        mismatch: dict[str, float] = {}
        if self.config.old_logprobs == "recompute":
            old, mismatch = self._recompute_old_policy(batch)
        steps = []
        for k, i in enumerate(batch.schedule):
            work = batch.minibatches[i]
            measure = None
            if old is None and k == 0:  # rollout: the first step's loss forward measures the mismatch
                measure = MismatchSums(work.num_rows, self.config.mismatch, self.device)
            steps.append(self._minibatch_step(work, batch.temperature, old=None if old is None else old[i],
                                              reuse_search=old is not None and k == 0, measure=measure))
            if measure is not None:
                mismatch = self._mismatch_metrics(measure)
        out = average_steps(steps)
        out["actor/num_optimizer_steps"] = float(len(steps))
        out["actor/skipped_steps_total"] = float(self.num_skipped_steps)
        out.update(batch.metrics)
        out.update(mismatch)
        if not self.mismatch_checked:
            self.mismatch_checked = warn_if_large(out, self.config.mismatch, logger, emit=self.parallel.rank == 0)
        return out

    def _recompute_old_policy(self, batch: RankBatch) -> tuple[list[list[dict]], dict[str, float]]:
        """The old policy of `old_logprobs: recompute`: one forward-only pass over every mini-batch with
        the step's starting weights. Returns, per mini-batch, the per-micro-batch entries the loss reads
        (`old_logprobs`, `is_weights`; last pipeline stage only, empty elsewhere) and the `mismatch/*`
        metrics of the whole batch. Collectives: the passes' own, then over DP x CP one SUM and one MAX
        all-reduce (plus one SUM for seq_mis's sequence sums), and a broadcast over PP."""
        t0 = time.perf_counter()
        passes = [[] if work.skip else self._forward_only(work.microbatches, batch.temperature)
                  for work in batch.minibatches]
        measure = MismatchSums(sum(w.num_rows for w in batch.minibatches), self.config.mismatch, self.device)
        old: list[list[dict]] = [[] for _ in batch.minibatches]
        if self.parallel.is_last_stage:
            old = recomputed_entries(batch.minibatches, passes, self.config.correction, measure, self.device,
                                     self._search_group())
        self.phase_times["recompute"] += time.perf_counter() - t0
        return old, self._mismatch_metrics(measure)

    def _mismatch_metrics(self, measure: MismatchSums) -> dict[str, float]:
        """`mismatch/*` from the last stage's sums (reduced over DP x CP there), identical on every rank."""
        if self.parallel.is_last_stage:
            measure.reduce(self._search_group())
            vec = measure.finalize()
        else:
            vec = torch.zeros(len(BUCKETS) * len(FINAL_KEYS), dtype=torch.float64, device=self.device)
        return mismatch_metrics(self._share_from_last_stage(vec, reduce_dp=False))

    def _search_group(self):
        g = self.parallel.dp_cp_group
        return g if dist.get_world_size(g) > 1 else None

    def _token_weights(self, mb: dict) -> torch.Tensor:
        """The loss's weight of every token of micro-batch `mb` (last stage), on the device: aggregation
        weight x importance correction (`loss_token_weights`). The one source of both the loss's
        `token_weights` and the bound search's, so the searched balance is the applied gradient's."""
        dev = self.device
        correction = mb.get("is_weights")
        return loss_token_weights(mb["weights"].to(dev), None if correction is None else correction.to(dev))

    def _search(self, lp, ref, beh, adv, mask, weights, acc: MetricSums):
        """The step's trust-region parameters of `actor.policy_loss` (BAPO's bounds for ppo_clip) for the
        ratio exp(lp - ref) (ref: behavior or recomputed old log-probs), each token's contribution
        weighted by `weights`, the loss's own (`_token_weights`)."""
        # Not raised here: only this (last) stage knows; `_minibatch_step` agrees with the other stages.
        res = self.config.objective.search(lp.detach().float(), ref, adv, mask, rollout_logprobs=beh,
                                           token_weights=weights, group=self._search_group(), raise_nonfinite=False)
        acc.add_search(res.c_low, res.c_high, res.rho_initial, res.rho, res.num_steps)
        return res

    def _any_stage(self, flag: bool) -> bool:
        """`flag` of any pipeline stage (a MAX over the pipeline group, on the device its backend
        carries): a decision only the last stage can make, taken by every stage together."""
        if dist.get_world_size(self.parallel.pp_group) == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.parallel.pp_group)
        return bool(t.item() > 0)

    def _train_loss(self, step: StepInputs, acc: MetricSums, measure: Optional[MismatchSums], mb: dict,
                    logits: torch.Tensor):
        lp, ent = self._logprobs(mb, logits, step.temperature)
        dev = lp.device
        mask, beh, adv = (mb[k].to(dev) for k in ("loss_mask", "behavior_logprobs", "advantages"))
        ref = mb["old_logprobs"] if "old_logprobs" in mb else beh  # the ratio's reference (old_logprobs)
        is_weights = mb.get("is_weights")
        weights = self._token_weights(mb)  # the search's (microbatch scope) and the loss's: one tensor
        if measure is not None:  # rollout: before the first update, the trainer's log-probs vs the rollout's
            measure.add(lp, beh, mask, mb["lag"], mb["row"])
        bounds = step.bounds
        if bounds is None:  # search_scope "microbatch": one collective per micro-batch, same count on all ranks
            res = self._search(lp, ref, beh, adv, mask, weights, acc)
            bounds = (res.c_low, res.c_high)
        loss, stats = self.config.objective.loss(lp, ref, adv, mask, bounds, token_weights=weights,
                                                 denominator=step.denominator)
        maskd = mask.double()
        stats["sum_entropy"] = (ent.detach().double() * maskd).sum()
        stats["sum_is_weight"] = maskd.sum() if is_weights is None else (is_weights.double() * maskd).sum()
        stats["num_is_masked"] = torch.zeros((), dtype=torch.float64, device=dev) if is_weights is None else (
            (is_weights == 0).double() * maskd).sum()
        stats["sum_objective"] = loss.detach().double()
        stats["count"] = stats["num_tokens"]
        return loss, stats["num_tokens"].round().to(torch.int).reshape(()), stats

    def _skip(self, reason: str) -> None:
        self.num_skipped_steps += 1
        logger.warning("%s: optimizer step skipped (%d so far)", reason, self.num_skipped_steps)
        if self.num_skipped_steps > self.config.max_skipped_steps:
            raise SkippedStepsError(
                f"{self.num_skipped_steps} optimizer steps were skipped for a non-finite gradient norm, more than "
                f"actor.max_skipped_steps={self.config.max_skipped_steps}; check rewards, advantages and behavior "
                f"log-probs (the warnings above say which steps), or lower actor.optim.lr"
            )

    def _skipped_metrics(self) -> dict[str, float]:
        out = MetricSums.finalize(torch.full((len(acc_keys()),), float("nan"), dtype=torch.float64))
        out.update({"actor/grad_norm": float("nan"), "actor/lr": float(self.optimizer.param_groups[0]["lr"])})
        return out

    def _minibatch_step(self, work: MiniBatchWork, temperature: float, *, old: Optional[list[dict]] = None,
                        reuse_search: bool = False, measure: Optional[MismatchSums] = None) -> dict[str, float]:
        """One optimizer step. `old`: the recompute pass's per-micro-batch entries (old log-probs,
        importance weights; last stage), None for `old_logprobs: rollout`; `reuse_search`: the
        weights have not changed since that pass, so it is the search pass too; `measure`: collect
        the mismatch metrics from this step's loss forward (rollout, first step)."""
        # The check ran on the whole mini-batch where the batch was prepared: every rank agrees.
        if work.skip:
            self._skip("non-finite behavior log-probs or advantages on loss tokens")
            return self._skipped_metrics()
        mbs = work.microbatches
        if old:  # the last stage's micro-batches carry the step's per-token inputs explicitly
            mbs = [dict(mb, **extra) for mb, extra in zip(mbs, old)]
        acc = MetricSums(self.device)
        bounds = None
        nonfinite = 0
        t0 = time.perf_counter()
        if self.config.search_scope == "minibatch":
            if reuse_search:
                stored = [{"lp": mb["old_logprobs"]} for mb in mbs] if old else []
            else:
                stored = self._forward_only(mbs, temperature)
            if self.parallel.is_last_stage:
                # Everything stays on the device: the search's one collective runs over the DP x CP
                # group, a device (NCCL) group on GPUs (docs/parallelism.md).
                dev = self.device
                masks = [mb["loss_mask"].to(dev) > 0 for mb in mbs]

                def cat(key: str) -> torch.Tensor:
                    return torch.cat([mb[key].to(dev)[k] for mb, k in zip(mbs, masks)])

                lp = torch.cat([r["lp"].float()[k] for r, k in zip(stored, masks)])
                beh = cat("behavior_logprobs")
                ref = cat("old_logprobs") if old else beh
                weights = torch.cat([self._token_weights(mb)[k] for mb, k in zip(mbs, masks)])
                res = self._search(lp, ref, beh, cat("advantages"), torch.ones_like(lp), weights, acc)
                bounds, nonfinite = (res.c_low, res.c_high), res.num_nonfinite
            # Non-finite current log-probs (the model's forward, not the batch: that was checked where
            # it was prepared): every stage skips together, or the others would wait for the last one
            # in the forward-backward below until the collective timeout.
            if self._any_stage(nonfinite > 0):
                self.phase_times["search"] += time.perf_counter() - t0
                self._skip("non-finite current log-probs in the bound search's pass"
                           + (f" ({nonfinite} loss tokens)" if nonfinite else ""))
                return self._skipped_metrics()
        t1 = time.perf_counter()  # the search's result is on the host: the pass has finished
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        step = StepInputs(temperature=temperature, denominator=work.denominator, bounds=bounds)
        moe.reset_stats(self.routing_tapes)
        stored = self._run(mbs, partial(self._train_loss, step, acc, measure), forward_only=False)
        for stats in stored:
            acc.add_stats(stats)
        sums = self._share_from_last_stage(acc.sums)
        search = self._share_from_last_stage(acc.search, reduce_dp=False)
        t2 = time.perf_counter()  # the loss sums are on the host: forward/backward has finished
        metrics = MetricSums.finalize(torch.cat([sums, search]))
        if self.moe_shape is not None:  # the loss pass's routing (moe/*), from every rank
            metrics.update(moe.collect_metrics(self.routing_tapes, num_layers=self.moe_shape[0],
                                               num_experts=self.moe_shape[1], group=self.parallel.world_group,
                                               device=self.device))
        metrics["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        grad_norm = self._grad_norm_or_skip(metrics["actor/loss"])
        if grad_norm is not None:
            self._optimizer_step(grad_norm)
            self.scheduler.step(increment=1)
            self.num_updates += 1
        metrics["actor/grad_norm"] = float("nan") if grad_norm is None else grad_norm
        for phase, seconds in (("search", t1 - t0), ("forward_backward", t2 - t1), ("optimizer", time.perf_counter() - t2)):
            self.phase_times[phase] += seconds
        return metrics

    def _grad_norm_or_skip(self, loss: float) -> Optional[float]:
        """The global grad norm, or None (step skipped on every rank, counted) when it or the loss is
        not finite (`actor.optimizer_step`: megatron's step in two halves)."""
        norm, seen = grad_norm_or_skip(self.optimizer, loss, self.parallel.world_group, self.device)
        if norm is None:
            self._skip(f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} (grad norm {seen})")
        return norm

    def _optimizer_step(self, grad_norm: float) -> None:
        step_with_norm(self.optimizer, grad_norm)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory) -> "Path":
        """Atomic dist_checkpointing save of model, optimizer, scheduler and RNG (see actor.checkpoint)."""
        from megatron_bapo.actor.checkpoint import save_checkpoint

        return save_checkpoint(self, directory)

    def load_checkpoint(self, directory, *, load_optimizer: bool = True) -> dict:
        """Load (and reshard) a checkpoint from `save_checkpoint`; returns its metadata."""
        from megatron_bapo.actor.checkpoint import load_checkpoint

        return load_checkpoint(self, directory, load_optimizer=load_optimizer)
