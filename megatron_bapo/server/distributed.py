"""Distributed weight sync (spec section 10): `/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`.

The server joins a torch process group of its own (never the default group) at
`tcp://master_address:master_port` as rank `rank_offset` (one TP rank here); the trainer is rank 0
and hosts the store. `init_weights_update_group` below is the same construction SGLang and slime use
(rendezvous store, prefix `group_name`, `_new_process_group_helper`), so a trainer calling it (or
slime's copy) interoperates; on CPU the backend is `gloo`, on GPU `nccl`.

An update receives every tensor first (`broadcast(src=0)` in list order, exactly what the trainer
sends), then checks names/shapes, then copies them into the served model under the engine's step
lock (between decode steps). A bad name therefore fails the update without touching the weights
and without leaving the trainer blocked in a half-finished broadcast sequence.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from typing import Optional

import torch
import torch.distributed as dist
from aiohttp import web

from megatron_bapo.server.app import STATE_KEY, read_json, read_object
from megatron_bapo.server.protocol import RequestError
from megatron_bapo.server.weights import check_named_tensors, load_named_tensors

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "weight_update_group"


def init_weights_update_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int,
    group_name: str = DEFAULT_GROUP, timeout_s: float = 600.0,
):
    """Create (and rendezvous) a standalone process group; blocks until all `world_size` ranks join.

    Used by both sides: the trainer as rank 0 (it hosts the store), each server as
    `rank_offset + tp_rank`. The store is built directly, not through `rendezvous("tcp://...")`:
    under torchrun that handler connects to the launcher's agent store instead of hosting one
    (TORCHELASTIC_USE_AGENT_STORE), and rank 0 would wait forever for a store nobody serves.
    """
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(master_address, int(master_port), world_size, is_master=rank == 0, timeout=timeout,
                     wait_for_workers=False)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weights_update_group(pg) -> None:
    """Forget a group made by `init_weights_update_group` (works without a default group)."""
    from torch.distributed.distributed_c10d import _world

    _world.pg_group_ranks.pop(pg, None)
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the group is unusable either way
        pass


def update_request_body(named: list, *, group_name: str = DEFAULT_GROUP, weight_version: Optional[str] = None,
                        flattened: bool = False) -> dict:
    """Trainer side: the `/update_weights_from_distributed` JSON for `named` = [(hf_name, tensor)]."""
    body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": group_name, "flush_cache": False,
            "weight_version": weight_version}
    if flattened:
        body["load_format"] = "flattened_bucket"
    return body


def broadcast_weights(pg, named: list, *, flattened: bool = False) -> None:
    """Trainer side (rank 0): broadcast `named` in list order, matching `receive_tensors` on the servers.
    Post the update request first (asynchronously), then call this, then await the replies."""
    if flattened:
        dtypes = {t.dtype for _, t in named}
        if len(dtypes) != 1:
            raise ValueError(f"a flattened bucket needs one dtype, got {sorted(map(str, dtypes))}")
        dist.broadcast(torch.cat([t.detach().reshape(-1) for _, t in named]), src=0, group=pg)
        return
    for _, t in named:
        dist.broadcast(t.detach().contiguous(), src=0, group=pg)


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise RequestError(f"unknown dtype {name!r} (use torch names without 'torch.', e.g. 'bfloat16')")
    return dt


def receive_tensors(pg, names: list, dtypes: list, shapes: list, flattened: bool, device: str = "cpu") -> list:
    """Receive the broadcasts of rank 0 in list order; returns [(name, tensor)] on `device`
    ("cuda" for nccl: NCCL only moves GPU memory; the copy into the CPU model happens at load)."""
    if flattened:
        numels = [int(torch.Size(s).numel()) for s in shapes]
        flat = torch.empty(sum(numels), dtype=dtypes[0], device=device)
        dist.broadcast(flat, src=0, group=pg)
        out, offset = [], 0
        for name, shape, numel in zip(names, shapes, numels):
            out.append((name, flat[offset: offset + numel].view(shape)))
            offset += numel
        return out
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0, group=pg)
        out.append((name, t))
    return out


async def init_group(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = read_object(await read_json(request), "/init_weights_update_group")
    try:
        address, port = str(body["master_address"]), int(body["master_port"])
        offset, world = int(body.get("rank_offset", 1)), int(body["world_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise RequestError(f"init_weights_update_group needs master_address, master_port, rank_offset, "
                           f"world_size ({exc!r})") from exc
    group_name = str(body.get("group_name") or DEFAULT_GROUP)
    backend = str(body.get("backend") or "nccl")
    if backend == "nccl" and not torch.cuda.is_available():
        return _fail("backend 'nccl' needs CUDA, which this server does not have; send backend 'gloo'")
    if group_name in state.weight_groups:
        return _fail(f"group {group_name!r} already exists; destroy it first")
    try:
        pg = await asyncio.to_thread(init_weights_update_group, backend, address, port, offset, world, group_name)
    except Exception as exc:  # noqa: BLE001
        logger.warning("init_weights_update_group failed: %s", exc)
        return _fail(f"Failed to initialize custom process group: {exc}.")
    state.weight_groups[group_name] = (pg, backend)
    logger.info("joined weight update group %s as rank %d of %d (%s)", group_name, offset, world, backend)
    return web.json_response({"success": True, "message": "Succeeded to initialize custom process group."})


def _fail(message: str) -> web.Response:
    return web.json_response({"success": False, "message": message}, status=400)


async def update_from_distributed(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = read_object(await read_json(request), "/update_weights_from_distributed")
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not (
            len(names) == len(dtypes) == len(shapes)):
        raise RequestError("names, dtypes and shapes must be lists of the same length")
    group_name = str(body.get("group_name") or DEFAULT_GROUP)
    if group_name not in state.weight_groups:
        raise RequestError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
    pg, backend = state.weight_groups[group_name]
    device = "cuda" if backend == "nccl" else "cpu"
    torch_dtypes = [_dtype(d) for d in dtypes]
    load_format: Optional[str] = body.get("load_format")
    flattened = load_format == "flattened_bucket"
    if load_format not in (None, "flattened_bucket"):
        raise RequestError(f"load_format must be null or 'flattened_bucket', got {load_format!r}")
    if flattened and len(set(torch_dtypes)) > 1:
        raise RequestError("load_format 'flattened_bucket' needs one dtype for the whole bucket")
    version = body.get("weight_version")
    abort_all = bool(body.get("abort_all_requests") or False)
    async with state.update_lock:
        taken = await state.acquire_writer(abort_all)
        try:
            def receive_and_load() -> Optional[str]:
                """One unit in a thread (a client disconnect cannot split it); an error message or None."""
                try:
                    named = receive_tensors(pg, names, torch_dtypes, shapes, flattened, device)
                except Exception as exc:  # noqa: BLE001
                    return f"Failed to receive weights: {exc}. Weights may be partially updated; discard them."
                try:
                    _load(state.engine, named)
                except ValueError as exc:
                    return f"Failed to update weights: {exc}. The served weights are unchanged."
                if version is not None:
                    state.weight_version = str(version)
                return None

            error = await asyncio.shield(asyncio.to_thread(receive_and_load))
            if error is not None:
                return _fail(error)
        finally:
            await state.release_writer(taken)
    return web.json_response({"success": True, "message": "Succeeded to update parameter online from distributed."})


def _load(engine, named: list) -> None:
    with engine.step_lock:
        check_named_tensors(engine.model, [n for n, _ in named], [tuple(t.shape) for _, t in named])
        load_named_tensors(engine.model, named)


async def destroy_group(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = read_object(await read_json(request), "/destroy_weights_update_group")
    group_name = str(body.get("group_name") or DEFAULT_GROUP)
    entry = state.weight_groups.pop(group_name, None)
    if entry is None:
        return _fail(f"no weight update group {group_name!r}")
    destroy_weights_update_group(entry[0])
    return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/init_weights_update_group", init_group)
    app.router.add_post("/update_weights_from_distributed", update_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_group)
