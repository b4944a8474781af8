"""HTTP helpers shared by the built-in server's route modules (`app`, `control`, `distributed`):
the state key, body reading and JSON parsing with SGLang's error shapes. Its own module so the
route modules import it and not each other.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from megatron_bapo.server.protocol import RequestError
from megatron_bapo.server.state import ServerState

STATE_KEY = web.AppKey("bapo_server_state", ServerState)
INLINE_JSON_BYTES = 64 << 10
"""Bodies up to this size are parsed on the event loop (~1 ms); larger ones in the pool."""


def body_too_large(limit: int) -> RequestError:
    return RequestError(f"the request body is larger than this server's limit max_body_bytes={limit} "
                        "(--max-body-bytes)", status=413, shape=2)


def error_response(exc: RequestError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


async def read_body(request: web.Request) -> bytes:
    """The raw body, at most `max_body_bytes` (aiohttp's `client_max_size`; 413 naming it above)."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise body_too_large(request.app[STATE_KEY].config.max_body_bytes) from None


def parse_json(raw: bytes, *, allow_empty: bool = True) -> Any:
    """Bytes -> JSON; an empty body is `{}` when allowed. Bad JSON -> RequestError (shape 2)."""
    if not raw.strip():
        if allow_empty:
            return {}
        raise RequestError("the request body is empty; send a JSON object", shape=2)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, over-long ints, deep nesting
        raise RequestError(f"JSON decode error: {exc}", shape=2) from None


async def read_json(request: web.Request, *, allow_empty: bool = True) -> Any:
    """The body as JSON (parsed in the pool when large)."""
    raw = await read_body(request)
    if len(raw) <= INLINE_JSON_BYTES:
        return parse_json(raw, allow_empty=allow_empty)
    return await request.app[STATE_KEY].offload(parse_json, raw, allow_empty=allow_empty)


def read_object(body: Any, endpoint: str) -> dict:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise RequestError(f"{endpoint}: the body must be a JSON object, got {type(body).__name__}", shape=2)
    return body
