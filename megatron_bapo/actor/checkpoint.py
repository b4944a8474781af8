"""Actor checkpoints with `megatron.core.dist_checkpointing`: model, optimizer, scheduler, RNG.

Layout of a checkpoint directory:
    <dir>/            dist_checkpointing files (model + optimizer shards, common state)
    <dir>/rng/rank<N>.pt   per-rank CPU/CUDA generator and megatron RNG-tracker states
    <dir>/actor_meta.json  layout (tp, pp, dp), num_updates; written last

Atomic: everything is written to `<dir>.tmp`, then rank 0 renames it to `<dir>` (an older `<dir>` is
moved aside and deleted only after the rename), so a job killed mid-save leaves the previous
checkpoint intact; a save that fails (a full disk) removes `<dir>.tmp` before raising. Model and optimizer state reshard on load (save TP=2, load TP=1); RNG states are
restored only when the layout is unchanged (they are per-rank streams), which exact resume needs.
A checkpoint without Transformer Engine's `_extra_state` objects (converted offline, or saved by a
local-spec actor) loads into a TE actor (`load_tolerating_extra_state`); nothing else may be absent.

The distributed optimizer's state goes through `actor.distopt_state`: megatron-core 0.16.1 restores
it inexactly with torch's Adam (CPU, no Apex/TE) -- every parameter ends up sharing one Adam `step`
tensor -- and its default format cannot be saved at all; that module explains the root cause and
saves/loads in the `fully_reshardable` format with the per-parameter step restored and each
parameter's state sliced where it lies, so resume is exact on CPU and GPU; before loading that state
every rank checks that its fp32 weights are the model weights just loaded (one shifted by the
megatron-core bug that module describes is refused on every rank). Barriers and that check's
all-reduce name `actor.parallel.world_group` (all ranks).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_bapo.actor import distopt_state
from megatron_bapo.run_state import out_of_space, replace_dir

if TYPE_CHECKING:
    from megatron_bapo.actor.actor import Actor

logger = logging.getLogger(__name__)
META = "actor_meta.json"
EXTRA_STATE = "_extra_state"


def _fast_results_queue() -> None:
    """Give dist_checkpointing an in-process results queue instead of its Manager.

    Megatron's default is a spawn-context `Manager().Queue()` (re-imports __main__, ~7 s per save),
    and any Manager is a server process that outlives a SIGKILLed trainer. Our saves are synchronous:
    the write results are put and read by this process, so a thread-safe `queue.Queue` is enough.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _sharded_state(actor: "Actor", *, is_loading: bool, with_optimizer: bool) -> dict:
    state: dict = {}
    model_sd: dict = {}
    for i, m in enumerate(actor.model):
        sd = m.module.sharded_state_dict()
        state[_model_key(i, len(actor.model))] = sd
        model_sd.update(sd)
    if with_optimizer:
        state["optimizer"] = distopt_state.sharded_state_dict(actor.optimizer, model_sd, is_loading=is_loading)
        state["scheduler"] = actor.scheduler.state_dict()
    return state


def _layout(actor: "Actor") -> dict:
    p = actor.parallel
    return {"tp": p.config.tp, "pp": p.config.pp, "cp": p.config.cp, "vpp": p.config.vpp, "dp": p.dp_size}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def load_tolerating_extra_state(sharded_state: dict, path: Path, *, log: bool = True) -> tuple[dict, set[str]]:
    """`dist_checkpointing.load` that forgives exactly one mismatch: `_extra_state` objects this model
    has and the checkpoint lacks. Returns `(state, the tolerated keys)`.

    Transformer Engine modules carry an `_extra_state` object each (FP8 scaling state); a checkpoint
    written with the local layer spec (`tools/convert_hf.py`, a CPU actor) has empty ones for the
    linears (megatron's local linears save None) and none for the core attention, and megatron's
    default strictness refuses to load it into a TE model ("Missing key in checkpoint state_dict:
    ..._extra_state"). Those modules keep their initial extra state (what TE starts a run with); one
    log line says so. Any other key absent from the checkpoint is an error naming it. The reverse
    (a TE checkpoint into a local-spec model) needs nothing: unread checkpoint entries are allowed.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    # megatron calls a requested key that the checkpoint lacks "unexpected"; it drops it from the load.
    state, _, absent = dist_checkpointing.load(sharded_state, str(path), strict=StrictHandling.RETURN_UNEXPECTED)
    others = sorted(k for k in absent if not k.endswith(EXTRA_STATE))
    if others:
        raise KeyError(f"{path} lacks {len(others)} entries this actor needs, e.g. {others[:4]}: it was saved for a "
                       "different model or optimizer (load converted weights with load_optimizer=False)")
    if absent and log:
        logger.info("%s lacks %d %s entries (%s) that this model's Transformer Engine modules have (saved with the "
                    "local layer spec): those modules keep their initial state", path, len(absent), EXTRA_STATE,
                    ", ".join(sorted(absent)[:3]))
    return state, set(absent)


def load_module_state(module: torch.nn.Module, state_dict: dict, *, tolerate_extra_state: bool) -> None:
    """`module.load_state_dict`, strict except for the `_extra_state` entries `load_tolerating_extra_state`
    left out."""
    result = module.load_state_dict(state_dict, strict=False)
    missing = [k for k in result.missing_keys if not (tolerate_extra_state and k.endswith(EXTRA_STATE))]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"loading {type(module).__name__}: missing {missing[:4]}, unexpected "
                           f"{list(result.unexpected_keys)[:4]}")


def save_checkpoint(actor: "Actor", directory: str | os.PathLike) -> Path:
    """Save everything needed to resume exactly; collective over all ranks. Returns the final path."""
    from megatron.core import dist_checkpointing

    final = Path(directory).absolute()
    tmp = final.with_name(final.name + ".tmp")
    rank = actor.parallel.rank
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier(group=actor.parallel.world_group)
    _fast_results_queue()
    try:
        # Into an empty directory: megatron-core warns "Overwriting old incomplete / corrupted
        # checkpoint..." for a non-empty one, so the RNG files are written after it.
        dist_checkpointing.save(_sharded_state(actor, is_loading=False, with_optimizer=True), str(tmp))
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(_rng_state(), tmp / "rng" / f"rank{rank}.pt")
        dist.barrier(group=actor.parallel.world_group)
        if rank == 0:
            meta = {
                "layout": _layout(actor), "world_size": actor.parallel.world_size, "num_updates": actor.num_updates,
                "num_skipped_steps": actor.num_skipped_steps, "distributed_optimizer": actor.distributed_optimizer,
            }
            (tmp / META).write_text(json.dumps(meta, indent=2))
            replace_dir(tmp, final)
    except BaseException as exc:
        # A failed save (a full disk, a signal) leaves no partial directory behind; `final` is untouched.
        # torch reports a full disk in its own words: name it (ENOSPC) while the space is still used.
        full = out_of_space(tmp, exc)
        shutil.rmtree(tmp, ignore_errors=True)
        if full is not None:
            raise full from exc
        raise
    dist.barrier(group=actor.parallel.world_group)
    logger.info("actor checkpoint saved to %s (%d updates)", final, actor.num_updates)
    return final


def _apply_optim_config(actor: "Actor") -> None:
    """Put the config's optimizer hyperparameters into every parameter group after the saved state was
    loaded (it brings the old run's betas, eps and momentum along): a changed value is applied on
    resume, as `megatron_bapo.resume_policy` promises. The learning rate itself and the weight decay
    are set by the scheduler from these bounds (`override_opt_param_scheduler`)."""
    oc = actor.config.optim
    for group in actor.optimizer.param_groups:
        # megatron's groups carry their own schedule bounds, which the scheduler prefers to its own
        if "max_lr" in group:
            group["max_lr"] = oc.lr
        if "min_lr" in group:
            group["min_lr"] = oc.min_lr
        if "betas" in group:
            group["betas"] = (oc.adam_beta1, oc.adam_beta2)
        if "eps" in group:
            group["eps"] = oc.adam_eps
        if "momentum" in group:
            group["momentum"] = oc.sgd_momentum


def _check_optimizer_matches_model(actor: "Actor", optimizer_state: dict, path: Path) -> None:
    """Refuse, on every rank, optimizer state whose fp32 main weights are not the checkpoint's model
    weights (loaded just before): `distopt_state.mismatched_main_params` says why that happens."""
    wrong = distopt_state.mismatched_main_params(actor.optimizer, optimizer_state)
    count = torch.tensor([len(wrong)], dtype=torch.int64, device=actor.device)
    dist.all_reduce(count, group=actor.parallel.world_group)  # every rank stops, not only those that see it
    if int(count.item()):
        here = f"; on this rank: {', '.join(wrong[:4])}" if wrong else ""
        raise ValueError(
            f"{path}: its optimizer state does not belong to its model weights: the fp32 main weights of "
            f"{int(count.item())} parameter(s) differ from the model's{here}. Distributed-optimizer checkpoints "
            "with several grad buckets (PP > 1 with tied embeddings) written before actor.distopt_state fixed "
            "megatron-core's fully_reshardable offsets hold shifted optimizer state; their model weights are right: "
            "load them with load_optimizer=False (a fresh optimizer), or resume an older checkpoint")


def load_checkpoint(actor: "Actor", directory: str | os.PathLike, *, load_optimizer: bool = True) -> dict:
    """Load a checkpoint saved by `save_checkpoint`, resharding model/optimizer to this layout.

    With `load_optimizer=False` only the weights are loaded (e.g. to start RL from converted
    weights). RNG states are restored when the layout matches the saved one. Returns the metadata.
    """
    from megatron.core import dist_checkpointing

    path = Path(directory).absolute()
    meta_file = path / META
    if not meta_file.is_file():
        raise FileNotFoundError(f"{path} is not a complete actor checkpoint (no {META}); incomplete saves end in .tmp")
    meta = json.loads(meta_file.read_text())
    if load_optimizer and meta.get("distributed_optimizer", False) != actor.distributed_optimizer:
        raise ValueError(
            f"{path}: saved with distributed_optimizer={meta.get('distributed_optimizer')}, this actor uses "
            f"{actor.distributed_optimizer}; load with load_optimizer=False or match ActorConfig.use_distributed_optimizer"
        )
    state, tolerated = load_tolerating_extra_state(
        _sharded_state(actor, is_loading=True, with_optimizer=load_optimizer), path, log=actor.parallel.rank == 0
    )
    for i, m in enumerate(actor.model):
        load_module_state(m.module, state[_model_key(i, len(actor.model))], tolerate_extra_state=bool(tolerated))
    if load_optimizer:
        _check_optimizer_matches_model(actor, state["optimizer"], path)
        distopt_state.load_state_dict(actor.optimizer, state["optimizer"])
        _apply_optim_config(actor)
        actor.scheduler.load_state_dict(state["scheduler"])  # lr and weight decay from the config's schedule
        actor.num_updates = int(meta["num_updates"])
        actor.num_skipped_steps = int(meta.get("num_skipped_steps", 0))
        same_layout = meta["layout"] == _layout(actor) and meta["world_size"] == actor.parallel.world_size
        rng_file = path / "rng" / f"rank{actor.parallel.rank}.pt"
        if not same_layout:
            logger.warning("checkpoint layout %s differs from %s: RNG states not restored", meta["layout"], _layout(actor))
        elif not rng_file.is_file():
            logger.warning("%s is missing: RNG states not restored (resume is not exact)", rng_file)
        else:
            _set_rng_state(torch.load(rng_file, weights_only=False))
    dist.barrier(group=actor.parallel.world_group)
    return meta
