"""The Megatron actor: builds the model/optimizer and runs BAPO optimizer steps.

One `train_step(batch)` = `ppo_epochs` x `n_minibatches` optimizer steps. Per mini-batch:
  1. (search_scope "minibatch") forward-only pass over the mini-batch for the current log-probs;
  2. `search_clip_bounds` on the last pipeline stage over the DP x CP group (one collective);
  3. megatron's `get_forward_backward_func()` over token-budget micro-batches with `policy_loss`;
  4. grad norm; a non-finite one skips the step on every rank; else optimizer + LR schedule step.

Micro-batches are packed (THD) or padded and sliced per context-parallel rank by `actor.layout`;
log-probs and entropy are those of the sampling distribution softmax(logits / T), T being the
rollout temperature the batch carries.

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
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_bapo.actor import batching
from megatron_bapo.actor import moe
from megatron_bapo.actor.config import ActorConfig
from megatron_bapo.actor.layout import (
    POSITION_KEYS,
    MicroBatchLayout,
    build_microbatch,
    empty_like_microbatch,
    pad_packed_microbatch,
)
from megatron_bapo.actor.logprobs import vocab_parallel_logprobs
from megatron_bapo.actor.metrics import MetricSums, acc_keys, average_steps, staleness_metrics
from megatron_bapo.algorithms import aggregation_weights, clamped_log_ratio, policy_loss, search_clip_bounds
from megatron_bapo.models.builder import build_gpt_model
from megatron_bapo.models.parallel import ParallelGroups, initialize_model_parallel

logger = logging.getLogger(__name__)

REQUIRED_KEYS = ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "advantages")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


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
            # Interleaved schedules exchange one fixed shape instead: `_microbatches` pads to it.
            overrides.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
        chunks = [
            build_gpt_model(hf_config, dtype=dtype, vp_stage=stage if pc.vpp else None,
                            vocab_divisible_by=config.vocab_divisible_by, config_overrides=overrides)
            for stage in range(pc.vpp or 1)
        ]
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
        )
        self.num_updates = 0
        self.num_skipped_steps = 0
        self._temperature = 1.0
        """Sampling temperature of the batch being processed (set by train_step / compute_logprobs)."""
        logger.info("actor built: %s parameters on this rank, %s, %s micro-batches, %s optimizer",
                    f"{sum(p.numel() for m in self.model for p in m.parameters()):,}", config.dtype,
                    "packed" if config.packing else "padded",
                    "distributed" if self.distributed_optimizer else "plain")

    # ------------------------------------------------------------------ batches
    def _check_batch(self, batch: dict[str, Any], keys=REQUIRED_KEYS) -> None:
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

    def _microbatches(self, data: dict[str, torch.Tensor]) -> list[dict]:
        """This rank's micro-batches of `data` (token-aligned `[rows, T]`), same count on every DP rank."""
        lengths = [int(n) for n in data["attention_mask"].sum(-1)]
        pc = self.config.parallel
        plan = batching.plan_microbatches(lengths, self.parallel.dp_size, self.config.max_tokens_per_microbatch,
                                          cost=self.layout.cost, count_multiple=pc.pp if pc.vpp else 1)
        out = []
        for group in plan[self.parallel.dp_rank]:
            if group:
                out.append(build_microbatch(data, group, self.layout))
            else:  # a rank with fewer rows than micro-batches runs a no-loss filler to keep counts equal
                out.append(empty_like_microbatch(build_microbatch(data, [0], self.layout)))
        if pc.vpp:  # one shape for the whole pass (the same on every rank of the pipeline)
            longest = max(int(n) for n in self._local_lengths(plan, lengths))
            out = [pad_packed_microbatch(mb, longest, self.layout) for mb in out]
        for mb in out:
            moe.attach_targets(mb, data)  # recorded MoE routing, when the batch has it
        return out

    def _local_lengths(self, plan: list, lengths: list[int]) -> list[int]:
        """Tokens per rank of every micro-batch of the plan, on every DP rank (for a common shape)."""
        return [self.layout.cost([lengths[i] for i in group]) // self.layout.cp_size
                for shard in plan for group in shard]

    # ------------------------------------------------------------------ model passes
    def _forward_step(self, loss_fn, data_iterator, model):
        mb = next(data_iterator)
        dev = _device()
        packed = None
        if "cu_seqlens" in mb:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = mb["cu_seqlens"].to(dev)
            n = int(mb["max_seqlen"])
            packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                     cu_seqlens_kv_padded=cu, max_seqlen_q=n, max_seqlen_kv=n)
        moe.push_targets(model, mb)
        logits = model(mb["input_ids"].to(dev), mb["position_ids"].to(dev), None, packed_seq_params=packed)
        return logits, partial(loss_fn, mb)

    def _logprobs(self, mb: dict, logits: torch.Tensor, with_entropy: bool = True):
        return vocab_parallel_logprobs(
            logits, mb["labels"].to(logits.device), tp_group=self.parallel.tp_group, vocab_size=self.hf_vocab_size,
            chunk_size=self.config.logprob_chunk_size, with_entropy=with_entropy, temperature=self._temperature,
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
            seq_length=max(int(mb["input_ids"].shape[1]) for mb in mbs),
            micro_batch_size=max(int(mb["input_ids"].shape[0]) for mb in mbs),
            forward_only=forward_only,
        )

    def _eval_loss(self, mb: dict, logits: torch.Tensor):
        lp, ent = self._logprobs(mb, logits)
        return torch.zeros((), device=logits.device), torch.tensor(1, dtype=torch.int), {"lp": lp.detach(), "ent": ent.detach()}

    def _forward_only(self, mbs: list[dict]) -> list:
        for m in self.model:
            m.eval()
        with torch.no_grad():
            return self._run(mbs, self._eval_loss, forward_only=True)

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        """Current log-probs `[B, T]` aligned to the token (0 at position 0 and on padding), at the
        batch's `temperature` (default 1). Collective over all ranks; identical on every rank."""
        self._check_batch(batch, ("input_ids", "attention_mask"))
        self._temperature = float(batch.get("temperature", 1.0))
        data = {"input_ids": batch["input_ids"].long(), "attention_mask": batch["attention_mask"].long()}
        if moe.ROUTED_EXPERTS in batch:
            data[moe.ROUTED_EXPERTS] = batch[moe.ROUTED_EXPERTS]
        for key in POSITION_KEYS:
            data[key] = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
        mbs = self._microbatches(data)
        for mb, res in zip(mbs, self._forward_only(mbs)):
            keep = mb["row"] >= 0
            out[mb["row"][keep], mb["col"][keep]] = res["lp"].double().cpu()[keep]
        return self._share_from_last_stage(out).float()

    def _share_from_last_stage(self, t: torch.Tensor, reduce_dp: bool = True) -> torch.Tensor:
        """Sum over DP x CP on the last stage, then broadcast to the other pipeline stages."""
        t = t.to(_device())
        if self.parallel.is_last_stage and reduce_dp and dist.get_world_size(self.parallel.dp_cp_group) > 1:
            dist.all_reduce(t, group=self.parallel.dp_cp_group)
        if self.parallel.config.pp > 1:
            src = dist.get_global_rank(self.parallel.pp_group, self.parallel.config.pp - 1)
            dist.broadcast(t, src=src, group=self.parallel.pp_group)
        return t.cpu()

    # ------------------------------------------------------------------ training
    def _prepare(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Typed copies; loss only on real tokens after position 0 (it has no prediction)."""
        out = {
            "input_ids": batch["input_ids"].long(),
            "attention_mask": batch["attention_mask"].long(),
            "behavior_logprobs": batch["behavior_logprobs"].float(),
            "advantages": batch["advantages"].float(),
        }
        mask = (batch["loss_mask"] > 0) & (out["attention_mask"] > 0)
        mask[:, 0] = False
        out["loss_mask"] = mask.float()
        if moe.ROUTED_EXPERTS in batch:
            out[moe.ROUTED_EXPERTS] = batch[moe.ROUTED_EXPERTS]
        return out

    def train_step(self, batch: dict[str, Any], *, current_version: Optional[int] = None) -> dict[str, float]:
        """`ppo_epochs` x `n_minibatches` BAPO optimizer steps on the global batch (same on every rank).

        batch: CPU tensors `[B, T]`, right-padded and aligned to the token (value at [b, t] concerns
        input_ids[b, t]): input_ids, attention_mask, loss_mask, behavior_logprobs, advantages and
        optionally versions (policy version per token); plus `temperature` (float, default 1), the
        sampling temperature the behavior log-probs were computed at.
        Staleness (`staleness/*`) counts optimizer steps: a token of version v trained in the k-th
        optimizer step of this call is `(current_version - v) * steps_per_call + k` steps stale
        (`current_version` defaults to the newest version in the batch).
        Returns metrics averaged over the optimizer steps, identical on every rank.
        """
        self._check_batch(batch)
        self._temperature = float(batch.get("temperature", 1.0))
        data = self._prepare(batch)
        slices = batching.minibatch_slices(data["input_ids"].shape[0], self.config.n_minibatches)
        schedule = [sl for _ in range(self.config.ppo_epochs) for sl in slices]
        steps = [self._minibatch_step(data, sl) for sl in schedule]
        out = average_steps(steps)
        out["actor/num_optimizer_steps"] = float(len(steps))
        out["actor/skipped_steps_total"] = float(self.num_skipped_steps)
        out.update(staleness_metrics(batch.get("versions"), data["loss_mask"], current_version, schedule))
        return out

    def _search_group(self):
        g = self.parallel.dp_cp_group
        return g if dist.get_world_size(g) > 1 else None

    def _search(self, lp, beh, adv, mask, acc: MetricSums):
        ratio = torch.exp(clamped_log_ratio(lp.detach().float(), beh) * mask)
        res = search_clip_bounds(ratio, adv, mask, self.config.bapo, rollout_logprobs=beh, group=self._search_group())
        acc.add_search(res.c_low, res.c_high, res.rho_initial, res.rho, res.num_steps)
        return res

    def _train_loss(self, bounds, acc: MetricSums, denominator: float, mb: dict, logits: torch.Tensor):
        lp, ent = self._logprobs(mb, logits)
        dev = lp.device
        mask, beh, adv, weights = (mb[k].to(dev) for k in ("loss_mask", "behavior_logprobs", "advantages", "weights"))
        if bounds is None:  # search_scope "microbatch": one collective per micro-batch, same count on all ranks
            res = self._search(lp, beh, adv, mask, acc)
            bounds = (res.c_low, res.c_high)
        loss, stats = policy_loss(
            lp, beh, adv, mask, bounds[0], bounds[1], dual_clip=self.config.bapo.dual_clip,
            token_weights=weights, denominator=denominator,
        )
        stats["sum_entropy"] = (ent.detach().double() * mask.double()).sum()
        stats["sum_objective"] = loss.detach().double()
        stats["count"] = stats["num_tokens"]
        return loss, stats["num_tokens"].round().to(torch.int).reshape(()), stats

    def _skip(self, reason: str) -> None:
        self.num_skipped_steps += 1
        logger.warning("%s: optimizer step skipped (%d so far)", reason, self.num_skipped_steps)
        if self.num_skipped_steps > self.config.max_skipped_steps:
            raise RuntimeError(
                f"Actor: {self.num_skipped_steps} skipped (non-finite) steps exceed ActorConfig.max_skipped_steps="
                f"{self.config.max_skipped_steps}; check rewards, advantages and behavior log-probs"
            )

    def _skipped_metrics(self) -> dict[str, float]:
        out = MetricSums.finalize(torch.full((len(acc_keys()),), float("nan"), dtype=torch.float64))
        out.update({"actor/grad_norm": float("nan"), "actor/lr": float(self.optimizer.param_groups[0]["lr"])})
        return out

    def _minibatch_step(self, data: dict[str, torch.Tensor], rows: slice) -> dict[str, float]:
        mini = {k: v[rows] for k, v in data.items()}
        keep = mini["loss_mask"] > 0
        # Every rank holds the whole batch, so all ranks agree on skipping without a collective.
        if not (torch.isfinite(mini["behavior_logprobs"][keep]).all() and torch.isfinite(mini["advantages"][keep]).all()):
            self._skip("non-finite behavior log-probs or advantages on loss tokens")
            return self._skipped_metrics()
        mini["weights"], denominator = aggregation_weights(mini["loss_mask"], self.config.loss_agg)
        mini["weights"] = mini["weights"].float()
        # megatron divides the summed gradient by the summed returned counts (the loss tokens, S).
        denominator = denominator / max(float(keep.sum()), 1.0)
        mbs = self._microbatches(mini)
        acc = MetricSums()
        bounds = None
        if self.config.search_scope == "minibatch":
            stored = self._forward_only(mbs)
            if self.parallel.is_last_stage:
                masks = [mb["loss_mask"] > 0 for mb in mbs]
                lp = torch.cat([r["lp"].float().cpu()[k] for r, k in zip(stored, masks)])
                beh = torch.cat([mb["behavior_logprobs"][k] for mb, k in zip(mbs, masks)])
                adv = torch.cat([mb["advantages"][k] for mb, k in zip(mbs, masks)])
                res = self._search(lp, beh, adv, torch.ones_like(lp), acc)
                bounds = (res.c_low, res.c_high)
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        moe.reset_stats(self.routing_tapes)
        stored = self._run(mbs, partial(self._train_loss, bounds, acc, denominator), forward_only=False)
        for stats in stored:
            acc.add_stats(stats)
        sums = self._share_from_last_stage(acc.sums)
        search = self._share_from_last_stage(acc.search, reduce_dp=False)
        metrics = MetricSums.finalize(torch.cat([sums, search]))
        if self.moe_shape is not None:  # the loss pass's routing (moe/*), from every rank
            metrics.update(moe.collect_metrics(self.routing_tapes, num_layers=self.moe_shape[0],
                                               num_experts=self.moe_shape[1], group=self.parallel.world_group,
                                               device=_device()))
        metrics["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        grad_norm = self._grad_norm_or_skip(metrics["actor/loss"])
        if grad_norm is not None:
            self.optimizer.step()
            self.scheduler.step(increment=1)
            self.num_updates += 1
        metrics["actor/grad_norm"] = float("nan") if grad_norm is None else grad_norm
        return metrics

    def _grad_norm_or_skip(self, loss: float) -> Optional[float]:
        """The global grad norm, or None (step skipped and counted) when it or the loss is not finite.

        Every rank decides the same: the norm is reduced over the model-parallel group (and DP for
        the distributed optimizer), DP replicas hold all-reduced gradients, and the flag is
        all-reduced over all actor ranks anyway, so no rank steps while another skips.
        """
        found_inf = bool(self.optimizer.prepare_grads())
        norm = float(self.optimizer.get_grad_norm() or 0.0)
        flag = torch.tensor([0.0 if (not found_inf and math.isfinite(norm) and math.isfinite(loss)) else 1.0],
                            device=_device())
        if dist.get_world_size(self.parallel.world_group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.parallel.world_group)
        if float(flag) == 0.0:
            return norm
        self.optimizer.zero_grad()
        self._skip(f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} (grad norm {norm})")
        return None

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory) -> "Path":
        """Atomic dist_checkpointing save of model, optimizer, scheduler and RNG (see actor.checkpoint)."""
        from megatron_bapo.actor.checkpoint import save_checkpoint

        return save_checkpoint(self, directory)

    def load_checkpoint(self, directory, *, load_optimizer: bool = True) -> dict:
        """Load (and reshard) a checkpoint from `save_checkpoint`; returns its metadata."""
        from megatron_bapo.actor.checkpoint import load_checkpoint

        return load_checkpoint(self, directory, load_optimizer=load_optimizer)
