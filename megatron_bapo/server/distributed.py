"""Distributed weight sync (spec section 10): `/init_weights_update_group`, `/begin_weight_update`,
`/update_weights_from_distributed`, `/end_weight_update`, `/destroy_weights_update_group`.

As in SGLang 0.5.23, an update must run inside a session: `/begin_weight_update` opens it (refused
while one is open), `/update_weights_from_distributed` outside one answers `success: false` (400)
before receiving anything, `/end_weight_update` closes it (refused without one). Begin and end take
the writer lock unless paused, like the updates themselves. An update's `flush_cache` (default
true) fails it when requests hold KV (`control.flush_after_update`).

The server joins a torch process group of its own (never the default group) at
`tcp://master_address:master_port` as rank `rank_offset` (one TP rank here); the trainer is rank 0
and hosts the store. The group construction and the tensor order are `megatron_bapo.weight_update`,
the module both sides import (the trainer never imports this server application); on CPU the
backend is `gloo`, on GPU `nccl`.

An update receives every tensor first (`broadcast(src=0)` in list order, exactly what the trainer
sends), then checks names/shapes, then copies them into the served model under the engine's step
lock (between decode steps). A bad name therefore fails the update without touching the weights
and without leaving the trainer blocked in a half-finished broadcast sequence.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import torch
from aiohttp import web

from megatron_bapo.server.control import flush_after_update
from megatron_bapo.server.http import STATE_KEY, read_json, read_object
from megatron_bapo.server.protocol import RequestError
from megatron_bapo.server.weights import check_named_tensors, load_named_tensors
from megatron_bapo.weight_update import (
    DEFAULT_GROUP,
    destroy_weights_update_group,
    init_weights_update_group,
    receive_tensors,
    torch_dtype,
)

logger = logging.getLogger(__name__)

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
    if not state.weight_update_session:  # checked first, as SGLang 0.5.23 does (also without a group: seen live)
        return _fail("update_weights_from_distributed must run between begin_weight_update() and end_weight_update()")
    if group_name not in state.weight_groups:
        raise RequestError(f"no weight update group {group_name!r}; call /init_weights_update_group first")
    pg, backend = state.weight_groups[group_name]
    device = "cuda" if backend == "nccl" else "cpu"
    try:
        torch_dtypes = [torch_dtype(d) for d in dtypes]
    except ValueError as exc:
        raise RequestError(str(exc)) from None
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
                with state.engine.step_lock:  # no token between the new weights and their version
                    try:
                        _load(state.engine, named)
                    except ValueError as exc:
                        return f"Failed to update weights: {exc}. The served weights are unchanged."
                    if version is not None:
                        state.weight_version = str(version)
                return None

            error = await asyncio.shield(asyncio.to_thread(receive_and_load))
            if error is None:
                error = flush_after_update(state, body)
        finally:
            await state.release_writer(taken)
    if error is not None:
        return _fail(error)
    return web.json_response({"success": True, "message": "Succeeded to update parameter online."})


async def _session_call(request: web.Request, endpoint: str, opening: bool) -> web.Response:
    """Begin / end a weight-update session under the writer lock (skipped while paused)."""
    state = request.app[STATE_KEY]
    read_object(await read_json(request), endpoint)
    async with state.update_lock:
        taken = await state.acquire_writer(False)
        try:
            if opening and state.weight_update_session:
                return _fail("a weight-update session is already open; call end_weight_update() first")
            if not opening and not state.weight_update_session:
                return _fail("no weight-update session is open; call begin_weight_update() first")
            state.weight_update_session = opening
        finally:
            await state.release_writer(taken)
    return web.json_response({"success": True, "message": "Success"})


async def begin_weight_update(request: web.Request) -> web.Response:
    return await _session_call(request, "/begin_weight_update", True)


async def end_weight_update(request: web.Request) -> web.Response:
    return await _session_call(request, "/end_weight_update", False)


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
        return _fail("The group to be destroyed does not exist.")  # SGLang 0.5.23's reply
    destroy_weights_update_group(entry[0])
    return web.json_response({"success": True, "message": "Succeeded to destroy custom process group."})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/init_weights_update_group", init_group)
    app.router.add_post("/update_weights_from_distributed", update_from_distributed)
    app.router.add_post("/destroy_weights_update_group", destroy_group)
    app.router.add_post("/begin_weight_update", begin_weight_update)
    app.router.add_post("/end_weight_update", end_weight_update)
