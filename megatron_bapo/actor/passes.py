"""The actor's model passes: megatron's schedules over this rank's micro-batches, forward-only
(log-probs and entropy) or forward-backward (a loss), and results shared from the last pipeline stage.

A mixin of `actor.actor.Actor` (its model, parallel groups, layout and config); the BAPO step that
uses these passes is there. Log-probs and entropy are those of softmax(logits / T), T the rollout
temperature the batch carries, computed vocab-parallel in chunks (`actor.logprobs`); every tensor a
collective over a device (NCCL) group carries lives on `device` (docs/parallelism.md).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron_bapo.actor import moe
from megatron_bapo.actor.layout import POSITION_KEYS, local_position_ids
from megatron_bapo.actor.logprobs import vocab_parallel_logprobs
from megatron_bapo.actor.scatter import check_batch, local_microbatches, plan


class ModelPasses:
    """Needs `model`, `parallel`, `layout`, `config`, `hf_vocab_size`, `moe_shape`, `chunk_tapes`,
    `routing_tapes`, `batch_spec`, `coords`, `device`."""

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
