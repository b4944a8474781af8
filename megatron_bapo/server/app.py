"""aiohttp application: `/generate`, health and info routes, and the process entry (`serve`).

Control routes (abort, flush, pause, weight updates, memory) live in `control.py`, the distributed
weight sync in `distributed.py`; all three share `http.py` and import nothing of each other.

The event loop only moves bytes and futures: JSON parsing of large bodies, request parsing and
tokenization, and reply building (detokenization, JSON) run in `ServerState.pool`, and the engine
is reached only through its non-blocking methods, so `/health` answers while any of that runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import signal
import time
import uuid
from typing import Any, Optional

import torch
from aiohttp import web

from megatron_bapo.server import control, distributed, weights_checker
from megatron_bapo.server.config import ServerConfig
from megatron_bapo.server.engine import Engine
from megatron_bapo.server.http import (STATE_KEY, body_too_large, error_response, parse_json, read_body)
from megatron_bapo.server.req import LockedTokenizer, Req
from megatron_bapo.server.protocol import (GenerateItem, GenerateRequest, RequestError, RequestLimits, SamplingParams,
                                            check_context, parse_generate)
from megatron_bapo.server.response import build_output
from megatron_bapo.server.state import ServerState
from megatron_bapo.server.weights import eos_token_ids, load_model
from megatron_bapo.weight_update import nccl_version

logger = logging.getLogger(__name__)

SERVER_VERSION = "0.0.0+megatron.bapo.builtin"
HEALTH_CHECK_TIMEOUT_S = 20.0
LINGERING_TIME_S = 2.0
"""After refusing a body unread (413, 401), how long the server keeps reading and discarding what
the client still sends before closing, so the client sees the reply instead of a reset. aiohttp's
default (10 s) would read ~10 s of a 1 GiB upload."""


class ApiKeyCheck:
    """`Authorization: Bearer <key>` check in constant time: `hmac.compare_digest` over UTF-8 bytes
    takes the same time wherever a guess first differs (a `!=` on strings returns at the first
    difference and leaks the key prefix by timing). Any header text is accepted (non-ASCII too)."""

    def __init__(self, key: str):
        self._expected = f"Bearer {key}".encode("utf-8", "surrogateescape")

    def __call__(self, header: Optional[str]) -> bool:
        return self.matches((header or "").encode("utf-8", "surrogateescape"))

    def matches(self, got: bytes) -> bool:
        """The compare alone (the encode before it copies the header: its time says nothing of the key)."""
        return hmac.compare_digest(got, self._expected)


OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""Paths a keyed server answers without the key (SGLang's list)."""


@web.middleware
async def error_middleware(request: web.Request, handler):
    """API key check when configured, body-size gate, RequestError -> SGLang's error shapes."""
    state = request.app[STATE_KEY]
    # Open paths as SGLang 0.5.23 has them (`decide_request_auth`: prefixes /health, /ready, /metrics, so
    # /health_generate too: launchers and liveness probes); everything else needs the bearer key.
    if state.api_key_check is not None and not request.path.startswith(OPEN_PREFIXES) and not state.api_key_check(
            request.headers.get("Authorization")):
        return web.json_response({"error": "Unauthorized"}, status=401)
    limit = state.config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return error_response(body_too_large(limit))  # refused before a byte of the body is read
    try:
        return await handler(request)
    except RequestError as exc:
        return error_response(exc)


def _validate_items(state: ServerState, items: list[GenerateItem]) -> None:
    """Checks that need the model: vocabulary, context, tokenizer; rid clashes inside the request
    (clashes with in-flight requests are checked by `enter_generate`). Runs in the pool."""
    seen_rids: set = set()
    seen_prompts: set = set()
    for item in items:
        if id(item.input_ids) not in seen_prompts:  # the n samples of a prompt share its list
            seen_prompts.add(id(item.input_ids))
            bad = [t for t in item.input_ids if not 0 <= t < state.vocab_size]
            if bad:
                raise RequestError(f"input_ids contain token id {bad[0]} outside the vocabulary [0, {state.vocab_size})")
        bias = item.params.logit_bias or {}
        bad = [t for t in bias if not 0 <= t < state.vocab_size]
        if bad:
            raise RequestError(f"sampling_params.logit_bias: token id {bad[0]} is outside the vocabulary "
                               f"[0, {state.vocab_size})")
        check_context(item, state.context_length)
        if state.tokenizer is None and (item.params.stop or item.params.stop_regex):
            raise RequestError("stop strings need the tokenizer (server started with --skip-tokenizer-init); "
                               "use stop_token_ids")
        if item.rid in seen_rids:
            raise RequestError("Duplicate request ID detected.")
        seen_rids.add(item.rid)


def parse_request(state: ServerState, raw: bytes) -> GenerateRequest:
    """Body bytes -> validated items (JSON, caps, tokenization, model checks). Runs in the pool."""
    body = parse_json(raw, allow_empty=False)
    tokenize = None if state.tokenizer is None else (lambda text: state.tokenizer(text)["input_ids"])
    parsed = parse_generate(body, tokenize, state.limits)
    _validate_items(state, parsed.items)
    if not state.config.enable_deterministic_inference:
        for item in parsed.items:  # SGLang ignores seeds without --enable-deterministic-inference
            item.params.sampling_seed = None
    return parsed


def reply_json(state: ServerState, reqs: list[Req], single: bool) -> web.Response:
    """The reply for finished requests (a 4xx/5xx if one of them failed with a status). Runs in the pool.
    `weight_version` is read here, when the reply is built (SGLang semantics)."""
    for req in reqs:
        code = (req.finish_reason or {}).get("status_code")
        if code in (400, 500, 503):
            return web.json_response({"error": {"message": req.finish_reason.get("message", "")}}, status=code)
    # One json.dumps per sequence (a single dumps of a large batch would hold the GIL, and so stall
    # the event loop, for seconds).
    parts = [json.dumps(build_output(r, weight_version=state.weight_version, tokenizer=state.tokenizer)) for r in reqs]
    return web.Response(text=parts[0] if single else "[" + ",".join(parts) + "]", content_type="application/json")


async def run_items(state: ServerState, items: list[GenerateItem]) -> list[Req]:
    """Submit items to the engine and wait for all of them to finish."""
    loop = asyncio.get_running_loop()
    futures = []
    for item in items:
        fut = loop.create_future()

        def done(req: Req, fut=fut) -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

        state.engine.submit(item, done)
        futures.append(fut)
    try:
        return list(await asyncio.gather(*futures))
    except asyncio.CancelledError:
        state.engine.abort_rids([item.rid for item in items])  # one O(len) message, never a queue scan
        raise


async def generate(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    raw = await read_body(request)
    parsed = await state.offload(parse_request, state, raw)
    rids = [it.rid for it in parsed.items]
    if parsed.stream:
        return await stream_generate(request, state, parsed)
    await state.enter_generate(rids)
    try:
        reqs = await run_items(state, parsed.items)
    finally:
        await state.exit_generate(rids)
    return await state.offload(reply_json, state, reqs, parsed.single)


def sse_event(state: ServerState, req: Req, upto: Optional[int], index: Optional[int]) -> bytes:
    """One `data:` event: the output so far (`upto` tokens) or, once finished, the final output or
    an error. Runs in the pool (detokenization)."""
    code = (req.finish_reason or {}).get("status_code") if upto is None else None
    if code in (400, 500, 503):
        chunk = {"error": {"message": req.finish_reason.get("message", ""), "code": code}}
    else:
        chunk = build_output(req, weight_version=state.weight_version, tokenizer=state.tokenizer, upto=upto)
    if index is not None:
        chunk["index"] = index
    return f"data: {json.dumps(chunk)}\n\n".encode()


async def stream_generate(request: web.Request, state: ServerState, parsed) -> web.StreamResponse:
    """`stream: true`: server-sent events with cumulative outputs (SGLang 0.5.15), `index` on batches,
    an error event for a failed sequence, then `data: [DONE]`."""
    rids = [it.rid for it in parsed.items]
    await state.enter_generate(rids)
    try:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        reqs = [state.engine.submit(
            item,
            on_done=lambda req, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, None)),
            on_token=lambda req, n, i=i: loop.call_soon_threadsafe(events.put_nowait, (i, n)))
            for i, item in enumerate(parsed.items)]
        remaining = len(reqs)
        try:
            while remaining:
                i, upto = await events.get()
                remaining -= upto is None
                await resp.write(await state.offload(sse_event, state, reqs[i], upto, None if parsed.single else i))
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            state.engine.abort_rids(rids)
            raise
        await resp.write_eof()
        return resp
    finally:
        await state.exit_generate(rids)


async def health(request: web.Request) -> web.Response:
    """200 while the scheduler runs; 503 while paused or shutting down, as SGLang 0.5.23 answers (its
    /health is a generation probe, which waits at the pause gate: seen live). No probe here, so it
    answers at once under any load (see health_generate for the probe)."""
    state = request.app[STATE_KEY]
    ok = state.engine.alive and not state.shutting_down and not state.paused
    return web.Response(status=200 if ok else 503)


async def health_generate(request: web.Request) -> web.Response:
    """A 1-token greedy probe through the scheduler; 503 while paused, shutting down or on timeout."""
    state = request.app[STATE_KEY]
    if state.shutting_down or state.paused or not state.engine.alive:
        return web.Response(status=503)
    item = GenerateItem(input_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0),
                        rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
    try:
        await asyncio.wait_for(run_items(state, [item]), HEALTH_CHECK_TIMEOUT_S)
    except asyncio.TimeoutError:
        return web.Response(status=503)
    return web.Response(status=200)


def model_info(state: ServerState) -> dict:
    cfg = state.engine.model.config
    return {
        "model_path": state.model_path,
        "tokenizer_path": state.config.tokenizer_path or state.config.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.weight_version,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None),
        "architectures": list(getattr(cfg, "architectures", None) or [type(state.engine.model).__name__]),
        "served_model_name": state.config.served_model_name or state.model_path,
    }


async def get_model_info(request: web.Request) -> web.Response:
    return web.json_response(model_info(request.app[STATE_KEY]))


def load_entry(state: ServerState) -> dict:
    running, waiting, used = state.engine.loads()
    return {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_used_tokens": used,
            "num_total_tokens": state.config.max_total_tokens or state.context_length * state.config.max_running_requests}


async def get_server_info(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    # The launch arguments, as SGLang 0.5.23 reports them: `model_path` and `weight_version` stay what the
    # server was started with (the current ones are in /model_info; checked live, tests/test_server_contract.py).
    info = dataclasses.asdict(state.config)
    info.pop("api_key", None)
    info.update(tp_size=1, dp_size=1, pp_size=1, context_length=state.context_length,
                max_total_num_tokens=load_entry(state)["num_total_tokens"],
                max_req_input_len=state.context_length - 1, internal_states=[load_entry(state)],
                version=SERVER_VERSION, backend="megatron_bapo.server (transformers, CPU)",
                disable_radix_cache=True,  # there is no prefix cache across calls (server/README.md)
                nccl_version=nccl_version())
    return web.json_response(info)


async def get_loads(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return web.json_response({"timestamp": stamp, "version": SERVER_VERSION, "loads": [load_entry(state)]})


def create_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=state.config.max_body_bytes)
    app[STATE_KEY] = state
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    for path, handler in (("/health", health), ("/health_generate", health_generate),
                          ("/get_model_info", get_model_info), ("/model_info", get_model_info),
                          ("/get_server_info", get_server_info), ("/server_info", get_server_info),
                          ("/v1/loads", get_loads)):  # 0.5.23 has no /get_weight_version, /get_load
        app.router.add_get(path, handler)
    control.add_routes(app)
    distributed.add_routes(app)
    weights_checker.add_routes(app)
    return app


def build_state(config: ServerConfig) -> ServerState:
    """Load tokenizer and model and create the (not yet started) engine."""
    from transformers import AutoTokenizer

    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    tokenizer = None
    if not config.skip_tokenizer_init:
        tokenizer = LockedTokenizer(AutoTokenizer.from_pretrained(config.tokenizer_path or config.model_path))
    model = load_model(config.model_path, config.dtype)
    ctx = config.context_length or int(getattr(model.config, "max_position_embeddings", 0) or 4096)
    engine = Engine(model, tokenizer, eos_ids=eos_token_ids(model, tokenizer), max_running=config.max_running_requests,
                    seed=config.random_seed, original_logprob=config.return_original_logprob,
                    max_total_tokens=config.max_total_tokens, capture_routing=config.enable_return_routed_experts,
                    decode_delay_s=config.decode_delay_ms / 1000.0)
    limits = RequestLimits(max_sampling_n=config.max_sampling_n, max_batch_size=config.max_batch_size,
                           max_prompt_tokens=min(config.max_prompt_tokens or ctx - 1, ctx - 1),
                           max_prompt_chars=config.max_prompt_chars)
    state = ServerState(config=config, engine=engine, tokenizer=tokenizer, model_path=config.model_path,
                        weight_version=config.weight_version, context_length=ctx,
                        vocab_size=int(model.get_input_embeddings().weight.shape[0]), limits=limits,
                        api_key_check=ApiKeyCheck(config.api_key) if config.api_key else None)
    engine.version_label = lambda: state.weight_version  # per-token versions (`weight_versions` spans)
    return state


async def serve(config: ServerConfig) -> None:
    """Load, listen, run until SIGTERM/SIGINT, then stop the scheduler and close the listener."""
    state = await asyncio.to_thread(build_state, config)
    state.bind_loop()
    state.engine.start()
    # handler_cancellation: a client that disconnects cancels its /generate, which aborts its requests
    # (SGLang aborts on disconnect too), so timed-out client retries do not pile up work here.
    runner = web.AppRunner(create_app(state), access_log=None, handler_cancellation=True,
                           lingering_time=LINGERING_TIME_S)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    if config.port_file:
        tmp = f"{config.port_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, config.port_file)
    logger.info("serving %s on http://%s:%d (context %d, pid %d)", config.model_path, config.host, port,
                state.context_length, os.getpid())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("shutting down")
    state.shutting_down = True
    await asyncio.to_thread(state.engine.shutdown)
    await runner.cleanup()
    state.pool.shutdown(wait=False, cancel_futures=True)
