"""`/weights_checker` as SGLang 0.5.23 answers it: the hash of every tensor the server serves.

Request (GET or POST, body optional; SGLang's `CheckWeightsReqInput`): `action` ("checksum", the
default), `skip_tensor_list` (substrings: tensors whose name contains one are left out), `selector`
("target", "draft" or "all"; this server has no draft model), `allow_quant_error` (ignored: nothing
is quantized). Reply 200:

    {"success": true, "message": "Success.",
     "ranks": [{"checksums": {"model.layers.0.self_attn.qkv_proj.weight": "16c1260899dd48f2", ...},
                "per_gpu_checksum": "<sha256 hex>",
                "parallelism_info": [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0,
                                      "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]}],
     "per_engine_checksum": "<sha256 over the ranks' per_gpu_checksum>"}

The names, the layout (fused `qkv_proj` / `gate_up_proj`, padded vocabulary rows, no tied head) and
the hash (sha256 of the raw bytes on a CPU) are SGLang's (`convert.served_layout`), so a trainer
compares either engine's reply with the same expectation (`sync.verify=checksum`). SGLang's other
actions (snapshot, compare, reset_tensors) are refused here (400), as is a model family without a
server layout; with `selector: "draft"` the reply has no `ranks` (no draft model), as in SGLang.
"""

from __future__ import annotations

import asyncio
import hashlib

from aiohttp import web

from megatron_bapo.server.http import STATE_KEY, read_json, read_object
from megatron_bapo.server.protocol import RequestError
from megatron_bapo.server.state import ServerState

ACTIONS = ("snapshot", "reset_tensors", "compare", "checksum")
PARALLELISM = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
               "pp_size": 1, "rank": 0, "size": 1}


def checksums(state: ServerState, skip: list[str]) -> dict[str, str]:
    """{SGLang name: hash} of the served model, read between decode steps (no update lands midway)."""
    from megatron_bapo.convert.served_layout import served_tensors, tensor_hash

    with state.engine.step_lock:
        model = state.engine.model
        dtype = next(model.parameters()).dtype
        named = [(n, p.detach()) for n, p in model.named_parameters()]
        return {name: tensor_hash(t, "cpu") for name, t in served_tensors(named, model.config, dtype)
                if not any(s in name for s in skip)}


def _body(body: dict) -> tuple[str, list[str], str]:
    action = body.get("action", "checksum")
    if not isinstance(action, str):
        raise RequestError(f"action must be a string, got {action!r}", shape=2)
    skip = body.get("skip_tensor_list") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise RequestError(f"skip_tensor_list must be a list of strings or null, got {skip!r}", shape=2)
    selector = body.get("selector", "all")
    if selector not in ("target", "draft", "all"):
        raise RequestError(f"selector must be 'target', 'draft' or 'all', got {selector!r}", shape=2)
    return action, skip, selector


async def weights_checker(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    action, skip, selector = _body(read_object(await read_json(request), "/weights_checker"))
    if action not in ACTIONS:
        return web.json_response({"success": False, "message": f"Unsupported action={action!r}"}, status=400)
    if action != "checksum":
        return web.json_response({"success": False, "message": f"action={action!r} is not supported by the "
                                  f"built-in server (only 'checksum')"}, status=400)
    if selector == "draft":  # no draft model: no runner answers
        return web.json_response({"success": True, "message": "Success."})
    try:
        sums = await asyncio.to_thread(checksums, state, skip)
    except ValueError as exc:  # a family without a server layout
        return web.json_response({"success": False, "message": str(exc)}, status=400)
    from megatron_bapo.convert.served_layout import overall_checksum

    per_gpu = overall_checksum(sums)
    rank = {"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": [dict(PARALLELISM)]}
    engine = hashlib.sha256(per_gpu.encode()).hexdigest()
    return web.json_response({"success": True, "message": "Success.", "ranks": [rank], "per_engine_checksum": engine})


def add_routes(app: web.Application) -> None:
    for method in ("GET", "POST"):
        app.router.add_route(method, "/weights_checker", weights_checker)
