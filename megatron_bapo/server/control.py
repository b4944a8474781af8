"""Control endpoints: abort, flush, pause/continue, weight version and weight updates, memory.

Reply shapes, status codes and refusals follow SGLang 0.5.23 (spec sections 3, 4, 8, 9, 11, 12, 13):
an update's `flush_cache` (default true) fails the call while requests hold KV, as SGLang's does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from aiohttp import web

from megatron_bapo.server.http import STATE_KEY, read_json, read_object
from megatron_bapo.server.protocol import RequestError
from megatron_bapo.server.state import ServerState
from megatron_bapo.server.weights import load_model
from megatron_bapo.weight_update import FLUSH_REFUSED, PAUSE_MODES as WIRE_PAUSE_MODES

logger = logging.getLogger(__name__)

PAUSE_MODES = tuple(m for m in WIRE_PAUSE_MODES if m is not None)
"""`/pause_generation` modes (the wire protocol's, without None: no pause)."""


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r}", shape=2)
    return value


async def abort_request(request: web.Request) -> web.Response:
    """Always 200 with an empty body. `rid` must be an exact in-flight rid; every rid it prefixes is
    aborted (SGLang's scheduler match). Unknown rids are ignored."""
    state = request.app[STATE_KEY]
    body = read_object(await read_json(request), "/abort_request")
    rid = body.get("rid") or ""
    if not isinstance(rid, str):
        raise RequestError("rid must be a string", shape=2)
    if _flag(body, "abort_all", False):
        state.engine.abort(abort_all=True)
    elif rid and rid in state.active_rids:
        state.engine.abort(rid)
    return web.Response(status=200)


def idle(state: ServerState) -> bool:
    """Nothing holds KV: no running request, and no waiting one unless paused (retracted requests
    wait without KV, so a retract pause leaves the cache flushable, as in SGLang)."""
    running, waiting, _ = state.engine.loads()
    return running == 0 and (waiting == 0 or state.paused)


def flush_after_update(state: ServerState, body: dict) -> Optional[str]:
    """An update's own flush (`flush_cache`, default true), judged as SGLang's scheduler judges it:
    the error message when requests hold KV, else None. There is no prefix cache to clear here; a
    flush SGLang would refuse is refused all the same, so a client that asks for one fails here too."""
    if _flag(body, "flush_cache", True) and not idle(state):
        return FLUSH_REFUSED
    return None


async def flush_cache(request: web.Request) -> web.Response:
    """Plain text; 200 when the scheduler is idle (waiting up to `?timeout=` seconds), else 400."""
    state = request.app[STATE_KEY]
    try:
        timeout = float(request.query.get("timeout", "0") or 0)
    except ValueError:
        return web.Response(status=400, text=f"timeout must be a number, got {request.query.get('timeout')!r}")
    deadline = time.monotonic() + max(timeout, 0.0)
    while not idle(state):
        if time.monotonic() >= deadline:
            msg = "Timed out waiting for idle state." if timeout > 0 else "Flush cache failed."
            return web.Response(status=400, text=msg)
        await asyncio.sleep(0.05)
    return web.Response(status=200, text="Cache flushed.\nPlease check backend logs for more details. "
                                         "(When there are running or waiting requests, the operation will not be performed.)\n")


async def pause_generation(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = read_object(await read_json(request), "/pause_generation")
    mode = body.get("mode") or "abort"
    if mode not in PAUSE_MODES:
        raise RequestError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    await state.set_paused(True)
    if mode == "abort":
        await state.wait_no_inflight()
    else:
        await asyncio.to_thread(state.engine.pause, mode == "retract")
    logger.info("generation paused (mode=%s)", mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    read_object(await read_json(request), "/continue_generation")
    state.engine.resume()
    await state.set_paused(False)
    logger.info("generation continued")
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def update_weight_version(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = read_object(await read_json(request), "/update_weight_version")
    new = body.get("new_version")
    if not isinstance(new, str) or not new:
        raise RequestError("new_version must be a non-empty string")
    if _flag(body, "abort_all_requests", True):
        state.engine.abort(abort_all=True)
    state.weight_version = new
    return web.json_response({"success": True, "message": "Success", "new_version": new})


async def update_weights_from_disk(request: web.Request) -> web.Response:
    """Load an HF directory into a new model and swap it in between decode steps; a failed load
    changes nothing (400). Without a pause, waits for in-flight `/generate` calls (writer lock)."""
    state = request.app[STATE_KEY]
    body = read_object(await read_json(request), "/update_weights_from_disk")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise RequestError("model_path is required (an HF checkpoint directory)")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise RequestError(f"weight_version must be a string or null, got {version!r}")
    abort_all = _flag(body, "abort_all_requests", False)
    async with state.update_lock:
        taken = await state.acquire_writer(abort_all)
        try:
            try:
                model = await asyncio.to_thread(load_model, path, state.config.dtype)
            except Exception as exc:  # noqa: BLE001 - any load failure is a 400 with rollback
                logger.warning("update_weights_from_disk(%s) failed: %s", path, exc)
                return web.json_response({"success": False, "num_paused_requests": 0,
                                          "message": f"Failed to get weights iterator: {exc}. "
                                                     "Rolled back to the previous weights."}, status=400)
            def swap() -> None:  # one unit in a thread: a client disconnect cannot split it
                with state.engine.step_lock:  # no token between the new weights and their version
                    state.engine.swap_model(model)
                    state.model_path = path
                    state.vocab_size = int(model.get_input_embeddings().weight.shape[0])
                    if version is not None:
                        state.weight_version = version

            await asyncio.shield(asyncio.to_thread(swap))
            message = "Succeeded to update model weights."
            if version is not None:
                message += f" Weight version updated to {version}."
            refused = flush_after_update(state, body)
        finally:
            await state.release_writer(taken)
    logger.info("weights updated from %s (version %s)", path, state.weight_version)
    if refused is not None:
        return web.json_response({"success": False, "message": refused, "num_paused_requests": 0}, status=400)
    return web.json_response({"success": True, "message": message, "num_paused_requests": 0})


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    read_object(await read_json(request), "/update_weights_from_tensor")
    return web.json_response({"success": False, "message": (
        "update_weights_from_tensor needs CUDA IPC handles and is not supported by the built-in CPU server; "
        "use /update_weights_from_disk or /update_weights_from_distributed (backend gloo)")}, status=400)


async def release_memory_occupation(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    read_object(await read_json(request), "/release_memory_occupation")
    if not idle(state):
        raise RequestError("release_memory_occupation needs an idle server (no running or waiting requests)")
    return web.json_response(None)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    read_object(await read_json(request), "/resume_memory_occupation")
    return web.json_response(None)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/abort_request", abort_request)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/flush_cache", flush_cache)
        app.router.add_route(method, "/release_memory_occupation", release_memory_occupation)
        app.router.add_route(method, "/resume_memory_occupation", resume_memory_occupation)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/update_weight_version", update_weight_version)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weights_from_tensor", update_weights_from_tensor)
