"""The Megatron actor: builds the model/optimizer and runs BAPO optimizer steps.

One `train_step(batch)` = `ppo_epochs` x `n_minibatches` optimizer steps. Per mini-batch:
  1. (search_scope "minibatch") forward-only pass over the mini-batch for the current log-probs;
  2. `search_clip_bounds` on the last pipeline stage over the DP x CP group (one collective);
  3. megatron's `get_forward_backward_func()` over token-budget micro-batches with `policy_loss`;
  4. optimizer step + LR schedule step.

Global token mean: the loss function returns the micro-batch's SUM of token losses and its token
count; with `calculate_per_token_loss` megatron sums gradients over micro-batches and DP ranks and
divides once by the total count (`finalize_model_grads`), which is exactly the single-process mean
over the mini-batch for any DP/micro-batch split.
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
from megatron_bapo.actor.config import ActorConfig
from megatron_bapo.actor.logprobs import token_aligned_logprobs
from megatron_bapo.actor.metrics import MetricSums, acc_keys, average_steps, staleness_metrics
from megatron_bapo.algorithms import policy_loss, search_clip_bounds
from megatron_bapo.models.builder import build_gpt_model
from megatron_bapo.models.parallel import ParallelGroups, initialize_model_parallel

logger = logging.getLogger(__name__)

REQUIRED_KEYS = ("input_ids", "attention_mask", "loss_mask", "behavior_logprobs", "advantages")


class Actor:
    """Megatron-core policy model under TP/PP/DP with BAPO updates.

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
        dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
        self.distributed_optimizer = config.use_distributed_optimizer
        torch.manual_seed(config.seed)  # identical initial weights on every DP rank
        vpp = config.parallel.vpp
        # Micro-batches have different shapes (token budget); PP must then exchange shapes.
        # (megatron rejects variable lengths with the default MoE dispatcher even for dense models.)
        overrides = dict(calculate_per_token_loss=True, **config.recompute_overrides())
        if config.parallel.pp > 1:
            overrides.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
        chunks = []
        for stage in range(vpp or 1):
            chunks.append(
                build_gpt_model(
                    hf_config, dtype=dtype, vp_stage=stage if vpp else None,
                    vocab_divisible_by=config.vocab_divisible_by, config_overrides=overrides,
                )
            )
        self.hf_vocab_size = chunks[0].hf_vocab_size
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.distributed_optimizer,
            check_for_nan_in_grad=False,
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

    # ------------------------------------------------------------------ batches
    def _check_batch(self, batch: dict[str, torch.Tensor], keys=REQUIRED_KEYS) -> None:
        missing = [k for k in keys if k not in batch]
        if missing:
            raise ValueError(f"Actor batch is missing {missing}; required: {list(keys)}")
        shape = batch["input_ids"].shape
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape != shape:
                raise ValueError(f"Actor batch[{k!r}] has shape {tuple(v.shape)}, expected {tuple(shape)}")

    def _microbatches(self, batch: dict[str, torch.Tensor], rows: slice | list[int]) -> list[dict]:
        """This DP rank's micro-batches of the given rows, each trimmed to its longest sequence."""
        index = list(range(batch["input_ids"].shape[0]))[rows] if isinstance(rows, slice) else list(rows)
        lengths = [int(batch["attention_mask"][i].sum()) for i in index]
        plan = batching.plan_microbatches(lengths, self.parallel.dp_size, self.config.max_tokens_per_microbatch)
        mine = plan[self.parallel.dp_rank]
        out = []
        for group in mine:
            if group:
                rows_g = [index[i] for i in group]
                length = max(max(lengths[i] for i in group), 2)
                mb = batching.gather_rows(batch, rows_g, length)
                mb["rows"] = torch.tensor(rows_g, dtype=torch.long)
            else:  # a rank with fewer rows than micro-batches runs a no-loss filler to keep counts equal
                mb = batching.gather_rows(batch, [index[0]], 2)
                mb["loss_mask"] = torch.zeros_like(mb["loss_mask"])
                mb["rows"] = torch.tensor([-1], dtype=torch.long)
            out.append(mb)
        return out

    # ------------------------------------------------------------------ model passes
    def _forward_step(self, loss_fn, data_iterator, model):
        mb = next(data_iterator)
        ids = mb["input_ids"]
        pos = torch.arange(ids.shape[1], dtype=torch.long).unsqueeze(0).expand_as(ids)
        if torch.cuda.is_available():
            ids, pos = ids.cuda(), pos.cuda()
        return model(ids, pos, None), partial(loss_fn, mb)

    def _logprobs(self, mb: dict, logits: torch.Tensor, with_entropy: bool = True):
        ids = mb["input_ids"].to(logits.device)
        return token_aligned_logprobs(
            logits, ids, tp_group=self.parallel.tp_group, vocab_size=self.hf_vocab_size,
            chunk_size=self.config.logprob_chunk_size, with_entropy=with_entropy,
        )

    def _run(self, mbs: list[dict], loss_fn, *, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        iters = [iter(mbs) for _ in self.model] if len(self.model) > 1 else iter(mbs)
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

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def compute_logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Current log-probs `[B, T]` aligned to the token (0 at position 0 and on padding).

        Collective over all ranks; the result is identical on every rank.
        """
        self._check_batch(batch, ("input_ids", "attention_mask"))
        keys = ("input_ids", "attention_mask")
        data = {k: batch[k] for k in keys}
        data["loss_mask"] = batch["attention_mask"]
        for m in self.model:
            m.eval()
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float64)
        mbs = self._microbatches(data, slice(None))
        stored = self._run(mbs, self._eval_loss, forward_only=True)
        for mb, res in zip(mbs, stored):
            if int(mb["rows"][0]) < 0:
                continue
            lp = res["lp"].double().cpu() * mb["attention_mask"].to(torch.float64)
            out[mb["rows"], : lp.shape[1]] = lp
        return self._share_from_last_stage(out).float()

    def _share_from_last_stage(self, t: torch.Tensor, reduce_dp: bool = True) -> torch.Tensor:
        """Sum over DP x CP on the last stage, then broadcast to the other pipeline stages."""
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        t = t.to(dev)
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
        return out

    def train_step(self, batch: dict[str, torch.Tensor], *, current_version: Optional[int] = None) -> dict[str, float]:
        """`ppo_epochs` x `n_minibatches` BAPO optimizer steps on the global batch (same on every rank).

        batch: CPU tensors `[B, T]`, right-padded and aligned to the token (value at [b, t] concerns
        input_ids[b, t]): input_ids, attention_mask, loss_mask, behavior_logprobs, advantages and
        optionally versions (policy version per token; staleness is measured against
        `current_version`, default the newest in the batch).
        Returns metrics averaged over the optimizer steps, identical on every rank.
        """
        self._check_batch(batch)
        data = self._prepare(batch)
        slices = batching.minibatch_slices(data["input_ids"].shape[0], self.config.n_minibatches)
        steps = [self._minibatch_step(data, sl) for _ in range(self.config.ppo_epochs) for sl in slices]
        out = average_steps(steps)
        out["actor/num_optimizer_steps"] = float(len(steps))
        out["actor/skipped_steps_total"] = float(self.num_skipped_steps)
        out.update(staleness_metrics(batch.get("versions"), data["loss_mask"], current_version))
        return out

    def _search_group(self):
        g = self.parallel.dp_cp_group
        return g if dist.get_world_size(g) > 1 else None

    def _search(self, lp, beh, adv, mask, acc: MetricSums):
        ratio = torch.exp((lp.detach().float() - beh) * mask)
        res = search_clip_bounds(ratio, adv, mask, self.config.bapo, rollout_logprobs=beh, group=self._search_group())
        acc.add_search(res.c_low, res.c_high, res.rho_initial, res.rho, res.num_steps)
        return res

    def _train_loss(self, bounds, acc: MetricSums, mb: dict, logits: torch.Tensor):
        lp, ent = self._logprobs(mb, logits)
        dev = lp.device
        mask, beh, adv = (mb[k].to(dev) for k in ("loss_mask", "behavior_logprobs", "advantages"))
        if bounds is None:  # search_scope "microbatch": one collective per micro-batch, same count on all ranks
            res = self._search(lp, beh, adv, mask, acc)
            bounds = (res.c_low, res.c_high)
        agg = self.config.loss_agg
        loss, stats = policy_loss(
            lp, beh, adv, mask, bounds[0], bounds[1], dual_clip=self.config.bapo.dual_clip, agg=agg,
            num_global_tokens=1.0, num_global_seqs=1.0,
        )
        count = stats["num_tokens"] if agg == "token-mean" else stats["num_seqs"]
        stats["sum_entropy"] = (ent.detach().double() * mask.double()).sum()
        stats["sum_objective"] = loss.detach().double()
        stats["count"] = count
        return loss, count.round().to(torch.int).reshape(()), stats

    def _skip(self, reason: str) -> None:
        self.num_skipped_steps += 1
        logger.warning("%s: optimizer step skipped (%d so far)", reason, self.num_skipped_steps)
        if self.num_skipped_steps > self.config.max_skipped_steps:
            raise RuntimeError(
                f"Actor: {self.num_skipped_steps} skipped (non-finite) steps exceed ActorConfig.max_skipped_steps="
                f"{self.config.max_skipped_steps}; check rewards, advantages and behavior log-probs"
            )

    def _minibatch_step(self, data: dict[str, torch.Tensor], rows: slice) -> dict[str, float]:
        # Every rank holds the whole batch, so all ranks agree on skipping without a collective.
        keep = data["loss_mask"][rows] > 0
        if not (torch.isfinite(data["behavior_logprobs"][rows][keep]).all() and torch.isfinite(data["advantages"][rows][keep]).all()):
            self._skip("non-finite behavior log-probs or advantages on loss tokens")
            out = MetricSums.finalize(torch.full((len(acc_keys()),), float("nan"), dtype=torch.float64))
            out.update({"actor/grad_norm": float("nan"), "actor/lr": float(self.optimizer.param_groups[0]["lr"])})
            return out
        mbs = self._microbatches(data, rows)
        acc = MetricSums()
        bounds = None
        if self.config.search_scope == "minibatch":
            for m in self.model:
                m.eval()
            with torch.no_grad():
                stored = self._run(mbs, self._eval_loss, forward_only=True)
            if self.parallel.is_last_stage:
                keep = [mb["loss_mask"] > 0 for mb in mbs]
                lp = torch.cat([r["lp"].float().cpu()[k] for r, k in zip(stored, keep)])
                beh = torch.cat([mb["behavior_logprobs"][k] for mb, k in zip(mbs, keep)])
                adv = torch.cat([mb["advantages"][k] for mb, k in zip(mbs, keep)])
                res = self._search(lp, beh, adv, torch.ones_like(lp), acc)
                bounds = (res.c_low, res.c_high)
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        stored = self._run(mbs, partial(self._train_loss, bounds, acc), forward_only=False)
        for stats in stored:
            acc.add_stats(stats)
        sums = self._share_from_last_stage(acc.sums)
        search = self._share_from_last_stage(acc.search, reduce_dp=False)
        metrics = MetricSums.finalize(torch.cat([sums, search]))
        lr = float(self.optimizer.param_groups[0]["lr"])
        if not math.isfinite(metrics["actor/loss"]):
            self._skip("non-finite loss")
            self.optimizer.zero_grad()
            grad_norm = float("nan")
        else:
            _, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            self.num_updates += 1
        metrics["actor/grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["actor/lr"] = lr
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, directory) -> "Path":
        """Atomic dist_checkpointing save of model, optimizer, scheduler and RNG (see actor.checkpoint)."""
        from megatron_bapo.actor.checkpoint import save_checkpoint

        return save_checkpoint(self, directory)

    def load_checkpoint(self, directory, *, load_optimizer: bool = True) -> dict:
        """Load (and reshard) a checkpoint from `save_checkpoint`; returns its metadata."""
        from megatron_bapo.actor.checkpoint import load_checkpoint

        return load_checkpoint(self, directory, load_optimizer=load_optimizer)
