"""The Megatron actor: builds the model/optimizer and runs BAPO optimizer steps.

One `train_step(batch)` = `ppo_epochs` x `n_minibatches` optimizer steps. First, with
`old_logprobs: recompute`, one forward-only pass over the whole batch with the step's starting
weights: the old policy's log-probs, the importance corrections (`algorithms.importance`) and the
`mismatch/*` metrics (`actor.mismatch`). Then per mini-batch:
  1. (search_scope "minibatch") forward-only pass over the mini-batch for the current log-probs
     (the first step reuses the recompute pass: the same weights, the same forward);
  2. the bound search (`search_clip_bounds`, or the balance of `actor.policy_loss`'s trust region:
     `algorithms.objective`) on the last pipeline stage over the DP x CP group (one collective);
  3. megatron's `get_forward_backward_func()` over token-budget micro-batches with the policy loss;
  4. grad norm; a non-finite one skips the step on every rank; else optimizer + LR schedule step.
The ratio's reference is the behavior log-probs (`old_logprobs: rollout`; the first step's loss
forward then also measures the mismatch) or the recomputed ones. The per-step inputs of the loss
(temperature, bounds, denominator: `StepInputs`; old log-probs and importance weights: per-token
entries of the step's micro-batches) are passed down explicitly.

A step trains on this rank's slice of the batch (`actor.scatter`: its DP rank's micro-batches, its
context-parallel chunks, its pipeline stage's keys), cut here from the global batch or received from
the trainer's rank 0. Micro-batches are packed (THD) or padded by `actor.layout`; log-probs and
entropy are those of the sampling distribution softmax(logits / T), T being the rollout temperature
the batch carries, passed explicitly down to the loss. Every tensor a collective over a device
(NCCL) group carries lives on `Actor.device` (docs/parallelism.md).

Global aggregation: every token carries an aggregation weight computed on the whole mini-batch
(`aggregation_weights`: token-mean, or a sequence mean that would otherwise need a sequence's
tokens together). megatron (`calculate_per_token_loss`) sums the micro-batch losses and the
returned token counts over micro-batches and DP x CP ranks and divides the gradient once by the
total count S (`finalize_model_grads`); so each micro-batch returns `(S / D) * sum(w_t loss_t)`,
and the gradient is that of `sum(w_t loss_t) / D` over the mini-batch, exactly the single-process
loss for any DP / CP / micro-batch / packing split.
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
from megatron_bapo.actor.config import ActorConfig
from megatron_bapo.actor.errors import SkippedStepsError
from megatron_bapo.actor.layout import POSITION_KEYS, MicroBatchLayout, local_position_ids
from megatron_bapo.actor.logprobs import vocab_parallel_logprobs
from megatron_bapo.actor.metrics import MetricSums, acc_keys, average_steps
from megatron_bapo.actor.mismatch import BUCKETS, FINAL_KEYS, MismatchSums, mismatch_metrics, warn_if_large
from megatron_bapo.actor.old_policy import recomputed_entries
from megatron_bapo.actor.scatter import (
    BatchSpec,
    MiniBatchWork,
    PreparedBatch,
    RankBatch,
    RankCoords,
    check_batch,
    local_microbatches,
    plan,
)
from megatron_bapo.models.builder import build_gpt_model
from megatron_bapo.models.layer_spec import describe_attention, resolve_layer_spec
from megatron_bapo.models.moe import routing_tapes
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


class Actor:
    """Megatron-core policy model under TP/PP/CP/DP with BAPO updates.

    Attributes used by other components: `model` (list of DDP-wrapped model chunks), `parallel`
    (`ParallelGroups`), `optimizer`, `scheduler`, `num_updates` (optimizer steps taken).
    """

    def __init__(self, config: ActorConfig, hf_config: Any, *, groups: Optional[ParallelGroups] = None) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.config = config
        self.hf_config = hf_config
        self.parallel = groups or initialize_model_parallel(config.parallel, seed=config.seed)
        pc = config.parallel
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        self.distributed_optimizer = config.use_distributed_optimizer
        torch.manual_seed(config.seed)  # identical initial weights on every DP rank
        # Micro-batches have different shapes (token budget); PP must then exchange shapes.
        # (megatron rejects variable lengths with the default MoE dispatcher even for dense models.)
        overrides = dict(calculate_per_token_loss=True, sequence_parallel=pc.sequence_parallel,
                         **config.recompute_overrides(), **moe.config_overrides(config, hf_config))
        if pc.pp > 1 and not pc.vpp:
            # Interleaved schedules exchange one fixed shape instead (`BatchSpec.common_shape` pads to it).
            overrides.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
        spec = resolve_layer_spec(config.layer_spec)
        chunks = [
            build_gpt_model(hf_config, dtype=dtype, vp_stage=stage if pc.vpp else None, use_te=spec.use_te,
                            vocab_divisible_by=config.vocab_divisible_by, config_overrides=overrides)
            for stage in range(pc.vpp or 1)
        ]
        fused = sorted(k.replace("_fusion", "") for k, v in vars(chunks[0].config).items()
                       if k.endswith("_fusion") and v is True)
        logger.info("model: %s layer spec (%s); %s; fusions: %s", "transformer_engine" if spec.use_te else "local",
                    spec.reason, describe_attention(chunks[0].config, spec.use_te), ", ".join(fused) or "none")
        self.hf_vocab_size = chunks[0].hf_vocab_size
        self.routing_tapes = moe.setup_tapes(chunks, replay=config.routing_replay)
        self.moe_shape = moe.moe_shape(chunks)
        self.layout = MicroBatchLayout(
            packed=config.packing, cp_size=self.parallel.cp_size, cp_rank=self.parallel.cp_rank,
            sp_size=pc.tp if pc.sequence_parallel else 1,
        )
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.distributed_optimizer,
            check_for_nan_in_grad=False,  # a non-finite grad norm skips the step instead (below)
        )
        self.model = [
            DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
            for i, c in enumerate(chunks)
        ]
        # Each wrapped chunk's router tapes, found once (the forward step feeds them every micro-batch).
        self.chunk_tapes = {id(m): routing_tapes(m) for m in self.model}
        mcfg = self.model[0].config
        mcfg.finalize_model_grads_func = finalize_model_grads
        mcfg.no_sync_func = [m.no_sync for m in self.model] if len(self.model) > 1 else self.model[0].no_sync
        oc = config.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=oc.name, lr=oc.lr, min_lr=oc.min_lr, weight_decay=oc.weight_decay,
                adam_beta1=oc.adam_beta1, adam_beta2=oc.adam_beta2, adam_eps=oc.adam_eps,
                sgd_momentum=oc.sgd_momentum, clip_grad=oc.clip_grad, bf16=dtype == torch.bfloat16,
                params_dtype=dtype, use_distributed_optimizer=self.distributed_optimizer,
            ),
            self.model,
        )
        decay_steps = oc.decay_steps if oc.decay_style != "constant" else max(oc.warmup_steps + 1, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if oc.warmup_steps else oc.lr, max_lr=oc.lr, min_lr=oc.min_lr,
            lr_warmup_steps=oc.warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=oc.decay_style,
            start_wd=oc.weight_decay, end_wd=oc.weight_decay, wd_incr_steps=decay_steps, wd_incr_style="constant",
            # On resume the config's schedule wins over the checkpoint's (a changed actor.optim.lr is
            # applied at the saved step count, megatron_bapo.resume_policy); megatron's default keeps the saved one.
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
        )
        self.num_updates = 0
        self.num_skipped_steps = 0
        self.phase_times = {"recompute": 0.0, "search": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
        """This rank's wall seconds per phase of the last `train_step`, summed over its optimizer steps:
        the recompute pass (old_logprobs recompute), the forward-only pass + bound search,
        forward/backward, grad norm + optimizer (diagnostics, e.g. benchmarks/gpu_bench.py; they
        differ across ranks, unlike the returned metrics)."""
        self.mismatch_checked = False
        """The first update's mismatch was checked against `mismatch.warn_kl` (warned at most once)."""
        logger.info("actor built: %s parameters on this rank, %s, %s micro-batches, %s optimizer",
                    f"{sum(p.numel() for m in self.model for p in m.parameters()):,}", config.dtype,
                    "packed" if config.packing else "padded",
                    "distributed" if self.distributed_optimizer else "plain")

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

    # ------------------------------------------------------------------ model passes
    def _forward_step(self, loss_fn, data_iterator, model):
        mb = next(data_iterator)
        dev = self.device
        packed = None
        if "cu_seqlens" in mb:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = mb["cu_seqlens"].to(dev)
            n = int(mb["max_seqlen"])
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                     cu_seqlens_kv_padded=cu, max_seqlen_q=n, max_seqlen_kv=n)
        ids = positions = None
        if "input_ids" in mb:  # the first pipeline stage; later stages take the previous stage's output
            ids = mb["input_ids"].to(dev).long()
            positions = local_position_ids(mb, self.layout).to(dev)
        if self.moe_shape is not None:
            moe.push_targets(self.chunk_tapes[id(model)], mb)  # every stage: its own layers' routers
        logits = model(ids, positions, None, packed_seq_params=packed)
        return logits, partial(loss_fn, mb)

    def _logprobs(self, mb: dict, logits: torch.Tensor, temperature: float):
        return vocab_parallel_logprobs(
            logits, mb["labels"].to(logits.device), tp_group=self.parallel.tp_group, vocab_size=self.hf_vocab_size,
            chunk_size=self.config.logprob_chunk_size, with_entropy=True, temperature=temperature,
        )

    def _run(self, mbs: list[dict], loss_fn, *, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        iters = [iter(mbs) for _ in self.model] if len(self.model) > 1 else iter(mbs)
        moe.begin_pass(self.routing_tapes)
        return get_forward_backward_func()(
            forward_step_func=partial(self._forward_step, loss_fn),
            data_iterator=iters,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(mbs),
            # megatron's schedules take the GLOBAL sequence length and divide it by CP (and SP) themselves.
            seq_length=max(mb["shape"][1] for mb in mbs) * self.parallel.cp_size,
            micro_batch_size=max(mb["shape"][0] for mb in mbs),
            forward_only=forward_only,
        )

    def _eval_loss(self, temperature: float, mb: dict, logits: torch.Tensor):
        lp, ent = self._logprobs(mb, logits, temperature)
        one = torch.ones((), dtype=torch.int, device=logits.device)
        return torch.zeros((), device=logits.device), one, {"lp": lp.detach(), "ent": ent.detach()}

    def _forward_only(self, mbs: list[dict], temperature: float) -> list:
        for m in self.model:
            m.eval()
        with torch.no_grad():
            return self._run(mbs, partial(self._eval_loss, temperature), forward_only=True)

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        """Current log-probs `[B, T]` aligned to the token (0 at position 0 and on padding), at the
        batch's `temperature` (default 1). Every rank holds `batch`; collective over all ranks;
        identical on every rank."""
        temperature = check_batch(batch, ("input_ids", "attention_mask"))
        data = {"input_ids": batch["input_ids"].long(), "attention_mask": batch["attention_mask"].long()}
        if moe.ROUTED_EXPERTS in batch:
            data[moe.ROUTED_EXPERTS] = batch[moe.ROUTED_EXPERTS]
        for key in POSITION_KEYS:
            data[key] = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        spec, me = self.batch_spec, self.coords
        rows_plan = plan([int(n) for n in data["attention_mask"].sum(-1)], spec)
        mbs = local_microbatches(data, rows_plan, spec, me.dp_rank, me.cp_rank)
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
        for mb, res in zip(mbs, self._forward_only(mbs, temperature)):
            keep = mb["row"] >= 0
            out[mb["row"][keep], mb["col"][keep]] = res["lp"].double().cpu()[keep]
        return self._share_from_last_stage(out.to(self.device)).float()

    def _share_from_last_stage(self, t: torch.Tensor, reduce_dp: bool = True) -> torch.Tensor:
        """Sum a device tensor over DP x CP on the last stage, broadcast it to the other stages; to host."""
        if self.parallel.is_last_stage and reduce_dp and dist.get_world_size(self.parallel.dp_cp_group) > 1:
            dist.all_reduce(t, group=self.parallel.dp_cp_group)
        if self.parallel.config.pp > 1:
            src = dist.get_global_rank(self.parallel.pp_group, self.parallel.config.pp - 1)
            dist.broadcast(t, src=src, group=self.parallel.pp_group)
        return t.cpu()

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

    def _search(self, lp, ref, beh, adv, mask, weights, acc: MetricSums):
        """The step's trust-region parameters of `actor.policy_loss` (BAPO's bounds for ppo_clip) for the
        ratio exp(lp - ref) (ref: behavior or recomputed old log-probs), each token's contribution
        weighted by its importance correction as in the loss."""
        res = self.config.objective.search(lp.detach().float(), ref, adv, mask, rollout_logprobs=beh,
                                           token_weights=weights, group=self._search_group())
        acc.add_search(res.c_low, res.c_high, res.rho_initial, res.rho, res.num_steps)
        return res

    def _train_loss(self, step: StepInputs, acc: MetricSums, measure: Optional[MismatchSums], mb: dict,
                    logits: torch.Tensor):
        lp, ent = self._logprobs(mb, logits, step.temperature)
        dev = lp.device
        mask, beh, adv, weights = (mb[k].to(dev) for k in ("loss_mask", "behavior_logprobs", "advantages", "weights"))
        ref = mb["old_logprobs"] if "old_logprobs" in mb else beh  # the ratio's reference (old_logprobs)
        is_weights = mb.get("is_weights")
        if measure is not None:  # rollout: before the first update, the trainer's log-probs vs the rollout's
            measure.add(lp, beh, mask, mb["lag"], mb["row"])
        bounds = step.bounds
        if bounds is None:  # search_scope "microbatch": one collective per micro-batch, same count on all ranks
            res = self._search(lp, ref, beh, adv, mask, is_weights, acc)
            bounds = (res.c_low, res.c_high)
        loss, stats = self.config.objective.loss(
            lp, ref, adv, mask, bounds, token_weights=weights if is_weights is None else weights * is_weights,
            denominator=step.denominator,
        )
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
                weights = cat("is_weights") if old else None
                res = self._search(lp, ref, beh, cat("advantages"), torch.ones_like(lp), weights, acc)
                bounds = (res.c_low, res.c_high)
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
        """The global grad norm, or None (step skipped and counted) when it or the loss is not finite.

        These are the first two stages of megatron's `optimizer.step()` (`prepare_grads`, then
        `get_grad_norm`: one all-reduce over the grad-stats group); `_optimizer_step` runs the rest,
        so neither runs twice. Every rank decides the same: the norm is reduced over the
        model-parallel group (and DP for the distributed optimizer), DP replicas hold all-reduced
        gradients, and the flag is all-reduced over all actor ranks anyway, so no rank steps while
        another skips.
        """
        found_inf = bool(self.optimizer.prepare_grads())
        norm = float(self.optimizer.get_grad_norm() or 0.0)
        flag = torch.tensor([0.0 if (not found_inf and math.isfinite(norm) and math.isfinite(loss)) else 1.0],
                            device=self.device)
        if dist.get_world_size(self.parallel.world_group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.parallel.world_group)
        if float(flag) == 0.0:
            return norm
        self.optimizer.zero_grad()
        self._skip(f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} (grad norm {norm})")
        return None

    def _optimizer_step(self, grad_norm: float) -> None:
        """The rest of megatron's `ChainedOptimizer.step()` (megatron/core/optimizer/optimizer.py):
        clip every optimizer's gradients by the norm already computed, then `step_with_ready_grads`."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            params = opt.get_parameters()
            if opt.config.clip_grad > 0.0 and params and not getattr(opt, "is_stub_optimizer", False):
                clip_grad_by_total_norm_fp32(
                    params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                    use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        self.optimizer.step_with_ready_grads()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory) -> "Path":
        """Atomic dist_checkpointing save of model, optimizer, scheduler and RNG (see actor.checkpoint)."""
        from megatron_bapo.actor.checkpoint import save_checkpoint

        return save_checkpoint(self, directory)

    def load_checkpoint(self, directory, *, load_optimizer: bool = True) -> dict:
        """Load (and reshard) a checkpoint from `save_checkpoint`; returns its metadata."""
        from megatron_bapo.actor.checkpoint import load_checkpoint

        return load_checkpoint(self, directory, load_optimizer=load_optimizer)
