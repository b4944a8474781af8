"""Exact save/load of megatron-core's DistributedOptimizer state, with torch Adam as well as TE/Apex.

megatron-core 0.16.1 restores the distributed optimizer inexactly (or not at all) when its inner
optimizer is torch's Adam/AdamW, which is what it uses without Apex/Transformer Engine (CPU). Root
cause, in megatron/core/optimizer/distrib_optimizer.py:

1. `load_state_dict` (lines 817-825, the `not HAVE_APEX_OR_TE` branch) builds ONE `step` tensor and
   puts that same object into every parameter's state. torch's `Optimizer.load_state_dict` keeps
   `step` uncopied (torch/optim/optimizer.py `_process_value_according_to_param_policy`: for key
   "step" it returns `value` itself unless fused/capturable), so all parameters share one counter,
   and torch Adam's per-parameter `step_t += 1` advances it once per parameter per optimizer step:
   after a resume the bias corrections use step ~ (steps x #params) instead of steps.
   (`MegatronOptimizer._restore_common_per_param_step`, used by the FP32 optimizer, deep-copies it.)
2. `dp_reshardable` stores `step` as a `LocalNonpersistentObject` wrapping the step tensor that
   existed when the sharded state dict was built, i.e. BEFORE the load (lines 1664-1667), and
   `load_parameter_state_from_dp_reshardable` -> `_set_main_param_and_optimizer_states` copies it
   back over the restored step (lines 938-940): the step comes back stale (the note's symptom).
3. `fully_reshardable` never saves `step` (line 1496) and its loader skips it (line 2101), but
   `_set_main_param_and_optimizer_states` (lines 938-940) iterates over the DESTINATION state keys,
   which for torch Adam include `step`: `KeyError: 'step'`.
4. `state_dict` (lines 640-642) asserts that the per-parameter states hold exactly one step value;
   torch Adam creates its state lazily, so a fresh optimizer (resume before any step, or a save at
   step 0) fails the assert.
5. The default format `fully_sharded_model_space` uses `ShardedTensor.flattened_range`, which 0.16.1's
   dist_checkpointing rejects on any device (dist_checkpointing/mapping.py:133-134).
6. `fully_reshardable` saves the wrong slice for every parameter after the first bucket of a grad
   buffer. `get_parameter_state_dp_zero` packs the buckets back to back WITHOUT the padding that ends
   each bucket (lines 1104-1118), and `sharded_param_state_fully_reshardable` slices that packing at
   `param_index_map` offsets, which count the padding (lines 1475-1501; the zero-filled overshoot is
   its "param range exceeds unpadded buffer" warning, line 1512). A buffer has several buckets when PP > 1 ties
   the embeddings (megatron puts the shared embedding in a bucket of its own, so that both stages
   shard it alike): on the first stage the embedding follows the padded layer bucket, so its saved
   fp32 weights and Adam moments were those of the neighbouring elements (one row over, on the tiny
   models), and a resume overwrote the loaded weights with them. Upstream fix: Megatron-LM PR 5077.

With TE/Apex FusedAdam (GPU) `step` lives in the param groups, not in per-parameter state, so
1-4 do not arise there; 5 and 6 do.

What we do (no change to megatron-core):
- save and load with `fully_reshardable`: model-space tensors, so TP/PP/DP may all change on load;
- before building a sharded state dict, give torch Adam parameters without state the state torch
  would create at their first step (step 0, zero moments), exactly what `_init_group` does lazily
  (so the fresh-optimizer assert in 4 cannot fire and the following step is unchanged);
- load in megatron's own two stages, but around the parameter-state stage take the per-parameter
  `step` out (so 3 cannot raise) and put back one independent tensor per parameter holding the
  saved step (fixes 1; 2 does not apply to this format);
- build the format's per-parameter tensors ourselves (`_param_state`, in place of megatron's
  `sharded_param_state_fully_reshardable` during our calls): the same keys, shapes and replica ids,
  sliced at the packed offsets (fixes 6; a megatron-core with the fix packs the same way);
- check that a checkpoint's fp32 main weights are its model weights (`mismatched_main_params`, which
  `actor.checkpoint` runs on every rank before loading the optimizer): one written with 6 (by an
  older megatron_bapo) is refused, naming the parameters, instead of resuming on shifted weights.
On GPU with TE/Apex FusedAdam there is no per-parameter `step`: both step edits find nothing to do,
and the load is exactly megatron's `load_state_dict` (param groups, including their `step`, then
`load_parameter_state_from_fully_reshardable`).

Mixture-of-experts models get a chain of two distributed optimizers (dense parameters over the
data-parallel group, expert parameters over the expert-data-parallel group); megatron's
`ChainedOptimizer` saves them as one entry per member, and each member is loaded as above.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

SHARDING_TYPE = "fully_reshardable"
# Megatron's default for this format, which `_param_state` always follows: every DP rank all-gathers its
# TPxPP shard's state during the save and writes part of it (parallel).
METADATA = {"distrib_optim_sharding_type": SHARDING_TYPE, "distrib_optim_fully_reshardable_mem_efficient": False}


def _members(optimizer) -> list:
    """The optimizers chained in the actor's megatron optimizer (one for a dense model; dense and
    expert parameters for a mixture of experts)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(opt, DistributedOptimizer)


def _torch_adam(opt) -> bool:
    """Whether a DistributedOptimizer's inner optimizer is torch Adam/AdamW (per-parameter `step`)."""
    return isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW))


def _init_torch_adam_state(opt) -> None:
    """Create the state torch Adam would create lazily at its first step (see module docstring, 4)."""
    if not _torch_adam(opt):
        return
    inner = opt.optimizer
    for group in inner.param_groups:
        if group.get("amsgrad", False):
            raise ValueError("amsgrad state is not handled by megatron's distributed optimizer checkpoint")
        for p in group["params"]:
            if len(inner.state[p]) == 0:
                inner.state[p]["step"] = torch.zeros((), dtype=torch.float32)
                inner.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                inner.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _bucket_shifts(buffer) -> list[int]:
    """Per bucket of a grad buffer: its start in the buffer (what `param_index_map` counts) minus its
    start in `get_parameter_state_dp_zero`'s packing (buckets back to back, end padding dropped)."""
    shifts, packed = [], 0
    for bucket in buffer.buckets:
        shifts.append(bucket.offset - packed)
        packed += bucket.numel_unpadded
    return shifts


def _param_state(opt, model_sharded_state_dict: dict, is_loading: bool = False, metadata: Any = None) -> dict:
    """The `fully_reshardable` parameter state, `{param index: {"param" | "exp_avg" | "exp_avg_sq":
    ShardedTensor}}` in megatron's parameter order and keys, each tensor sliced where its parameter
    lies in the packed world tensors (module docstring, 6). On load the tensors are empty templates."""
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    # Every rank gets the whole DP-gathered state (METADATA's "not mem efficient"): parallel save.
    world = opt.get_parameter_state_dp_zero(use_gloo_comm=False, empty_data=is_loading, return_on_all_ranks=True)
    tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
    model_entry = {sh.data: sh for sh in nested_values(tensors)}  # the parameter itself -> its checkpoint entry
    out: dict = {}
    for gbuf_idx in range(len(opt.gbuf_ranges)):  # megatron's order (its loader counts the same way)
        buffer = opt.buffers[gbuf_idx]
        [packed] = world[gbuf_idx].values()  # one dtype per buffer
        shifts = _bucket_shifts(buffer)
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            entry = model_entry.get(param)
            if entry is None:
                raise ValueError(f"{opt._param_name(param)} has no entry in the model's sharded state dict")
            lo, hi = start - shifts[bucket_id], end - shifts[bucket_id]
            state = {}
            for key, flat in packed.items():
                if key == "numel_unpadded":
                    continue
                if hi > flat.numel():
                    raise RuntimeError(f"{opt._param_name(param)}: elements [{lo}, {hi}) lie outside the optimizer's "
                                       f"packed state ({flat.numel()} elements); megatron-core's packing changed")
                data = flat[lo:hi].reshape(entry.data.shape)
                kwargs = dict(key=f"optimizer.state.{key}.{entry.key}", data=data, replica_id=entry.replica_id)
                if not isinstance(entry, ShardedTensorFactory):
                    kwargs["dtype"] = data.dtype
                state[key] = replace(entry, **kwargs)
                state[key].validate_metadata_integrity()
            out[len(out)] = state
    return out


def sharded_state_dict(optimizer, model_sharded_state_dict: dict, *, is_loading: bool) -> dict:
    """`optimizer.sharded_state_dict` in the format above; works on a fresh optimizer too."""
    members = [opt for opt in _members(optimizer) if _is_distributed(opt)]
    for opt in members:
        _init_torch_adam_state(opt)
        # megatron's sharded_state_dict asks this method for the format's parameter state: ours, for this call
        opt.sharded_param_state_fully_reshardable = partial(_param_state, opt)
    try:
        return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading, metadata=METADATA)
    finally:
        for opt in members:
            del opt.sharded_param_state_fully_reshardable


def _mismatched(opt, param_state: dict) -> list[str]:
    """Names of `opt`'s parameters whose fp32 main weights in `param_state` (as loaded) are not the
    model's current weights (cast to the model's dtype)."""
    from megatron.core.fp8_utils import is_float8tensor

    wrong, index = [], 0
    for gbuf_idx in range(len(opt.gbuf_ranges)):  # the order of `_param_state` and megatron's loader
        for param in opt.buffers[gbuf_idx].param_index_map:
            saved = param_state[index].get("param", param_state[index].get("fp32_param"))
            index += 1
            if saved is None or is_float8tensor(param):
                continue
            if not torch.equal(saved.to(device=param.device, dtype=param.dtype).reshape(param.shape), param.detach()):
                wrong.append(opt._param_name(param))
    return wrong


def mismatched_main_params(optimizer, state_dict: Any) -> list[str]:
    """The parameters (on this rank) whose fp32 main weights in a loaded optimizer state are not the
    model weights the model holds now; call it after loading the same checkpoint's model weights.

    megatron writes the model's weights from the main ones after every step, so in a checkpoint they
    agree exactly. One written with the offset bug (module docstring, 6: an older megatron_bapo,
    PP > 1 with tied embeddings) does not: its loader refuses it, naming these, instead of
    overwriting the loaded weights with their neighbours'. Empty for a non-distributed optimizer.
    """
    members = _members(optimizer)
    if not any(_is_distributed(opt) for opt in members):
        return []
    states = [state_dict] if len(members) == 1 else [v for _, v in sorted(state_dict.items())]
    return [name for opt, state in zip(members, states) if _is_distributed(opt)
            for name in _mismatched(opt, state["param_state"])]


def _load_distributed(opt, state_dict: dict) -> None:
    """`DistributedOptimizer.load_state_dict` for our format, with the per-parameter step restored."""
    state_dict = dict(state_dict)
    param_state = state_dict.pop("param_state")
    kind = state_dict.pop("param_state_sharding_type")
    if kind != SHARDING_TYPE:
        raise ValueError(f"distributed optimizer state saved as {kind!r}; this loader reads {SHARDING_TYPE!r} only")
    # Stage 1 (megatron): param groups (lr, wd, and TE's group `step`), grad scaler, state allocation.
    opt.load_state_dict(state_dict)
    inner = opt.optimizer
    saved_steps = {g["step"] for g in state_dict["optimizer"]["param_groups"] if g.get("step") is not None}
    # Stage 2 (megatron): fp32 main params, exp_avg, exp_avg_sq -- without `step` in the destination
    # (module docstring, 3). With TE/Apex there is no per-parameter `step` and nothing is taken out.
    taken = {p: s.pop("step") for p, s in inner.state.items() if "step" in s}
    opt.load_parameter_state_from_fully_reshardable(param_state)
    if taken:
        if len(saved_steps) != 1:
            raise ValueError(f"expected one optimizer step in the checkpoint's param groups, got {saved_steps}")
        step = float(saved_steps.pop())
        for p, old in taken.items():  # one tensor per parameter, never shared (module docstring, 1)
            inner.state[p]["step"] = torch.tensor(step, dtype=old.dtype, device=old.device)


def load_state_dict(optimizer, state_dict: Any) -> None:
    """Load what `dist_checkpointing.load` returned for `sharded_state_dict(..., is_loading=True)`."""
    members = _members(optimizer)
    if not any(_is_distributed(opt) for opt in members):
        optimizer.load_state_dict(state_dict)
        return
    states = [state_dict] if len(members) == 1 else [v for _, v in sorted(state_dict.items())]
    if len(states) != len(members):
        raise ValueError(f"the checkpoint holds {len(states)} optimizer state(s), this optimizer chains {len(members)}")
    for opt, state in zip(members, states):
        if _is_distributed(opt):
            _load_distributed(opt, state)
        else:
            opt.load_state_dict(state)
    if len(members) > 1:
        optimizer._synchronize_steps()
