"""The optimizer step of the actor, in megatron's two halves, with non-finite steps skipped everywhere.

The actor needs the global gradient norm before it steps (to skip a non-finite step on every rank),
so it runs megatron's `ChainedOptimizer.step()` (megatron/core/optimizer/optimizer.py) in its two
halves instead of computing the norm and then calling `step()`, which would prepare the gradients
and all-reduce the norm a second time: `grad_norm_or_skip` (prepare_grads, get_grad_norm, the skip
flag), then `step_with_norm` (clip by that norm, `step_with_ready_grads`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist


def grad_norm_or_skip(optimizer: Any, loss: float, world_group: "dist.ProcessGroup",
                      device: torch.device) -> tuple[Optional[float], float]:
    """(the global grad norm, or None when it or `loss` is not finite on any rank; the norm as seen here).

    `prepare_grads`, then `get_grad_norm` (one all-reduce over the grad-stats group). Every rank
    decides the same: the norm is reduced over the model-parallel group (and DP for the distributed
    optimizer), DP replicas hold all-reduced gradients, and the flag is all-reduced over
    `world_group` (every actor rank; a device group, so the flag lives on `device`) anyway, so no
    rank steps while another skips. A skipped step's gradients are zeroed.
    """
    found_inf = bool(optimizer.prepare_grads())
    norm = float(optimizer.get_grad_norm() or 0.0)
    flag = torch.tensor([0.0 if (not found_inf and math.isfinite(norm) and math.isfinite(loss)) else 1.0],
                        device=device)
    if dist.get_world_size(world_group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=world_group)
    if float(flag) == 0.0:
        return norm, norm
    optimizer.zero_grad()
    return None, norm


def step_with_norm(optimizer: Any, grad_norm: float) -> None:
    """The rest of megatron's `ChainedOptimizer.step()`: clip every optimizer's gradients by the norm
    already computed, then `step_with_ready_grads`."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = opt.get_parameters()
        if opt.config.clip_grad > 0.0 and params and not getattr(opt, "is_stub_optimizer", False):
            clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )
    optimizer.step_with_ready_grads()
