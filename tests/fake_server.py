"""A deterministic stand-in for an SGLang server (the native API subset the client uses), no model.

A test double: it lives with the tests (and the client benchmark), not in the library.

For client tests and `benchmarks/bench_client.py`: replies are a pure function of the token prefix
and the loaded "weights" (a seed derived from `model_path`), so a test can recompute every token,
log-prob and version it should have received. Tokens come out `token_delay_s` apart, so aborts,
pauses and killed servers land mid-request.

    python tests/fake_server.py --port 31000 [--token-delay-s 0.01] [--fail-first 2]

Model: next token = `next_token(prefix, seed)` (or a test's own `policy(prefix, seed)`, e.g. the
scripted tool user of `tests/agent_helpers.py`); its log-prob = `token_logprob(prefix, token, seed)`;
EOS id 1 stops unless ignore_eos. Weight updates wait for in-flight requests (SGLang's writer
lock) unless generation is paused. `requests` and `params` keep the `input_ids` and
`sampling_params` of every `/generate`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import time
import uuid
from typing import Any, Optional

from aiohttp import web

from megatron_bapo.rollout.config import SAMPLING_KEYS

EOS_ID = 1
VOCAB = 64


def weights_seed(model_path: str) -> int:
    return int.from_bytes(hashlib.sha256(model_path.encode()).digest()[:4], "little")


def next_token(prefix: list[int], seed: int) -> int:
    h = seed
    for t in prefix[-8:]:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    h = (h * 31 + len(prefix)) % 2_147_483_647
    return 2 + h % (VOCAB - 2) if h % 23 else EOS_ID  # EOS about 1 in 23 steps


def token_logprob(prefix: list[int], token: int, seed: int) -> float:
    return -((seed + 7 * token + 13 * len(prefix)) % 997) / 311.0 - 1e-3


class FakeServer:
    def __init__(self, model_path: str = "init", token_delay_s: float = 0.0, fail_first: int = 0,
                 weight_version: str = "default", workers: Optional[list[str]] = None,
                 policy: Optional[Any] = None) -> None:
        self.model_path, self.seed = model_path, weights_seed(model_path)
        self.weight_version = weight_version
        self.token_delay_s, self.fail_left = token_delay_s, fail_first
        self.running: dict[str, dict] = {}
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.num_generate = 0
        self.max_running = 0
        self.workers = workers
        self.policy = policy or next_token
        self.requests: list[list[int]] = []
        self.params: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 28)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/abort_request", self.abort)
        r.add_route("*", "/flush_cache", self.flush)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_weight_version", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/server_info", self.server_info)
        if self.workers is not None:  # acting as an sglang-router front: GET /workers (0.3.x REST shape)
            r.add_get("/workers", self.list_workers)
        r.add_post("/update_weights_from_disk", self.update)
        r.add_post("/pause_generation", self.pause)
        r.add_post("/continue_generation", self.cont)
        return app

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "malformed JSON")
        ids, params = body.get("input_ids"), body.get("sampling_params") or {}
        if not ids or not isinstance(ids, list):
            return _error(400, "input_ids must be a non-empty list")
        bad = sorted(set(params) - SAMPLING_KEYS)
        if bad:
            return _error(400, f"unknown sampling field(s) {bad}")
        max_new = params.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or max_new < 0:
            return _error(400, f"max_new_tokens must be >= 0, got {max_new}")
        rid = body.get("rid") or uuid.uuid4().hex
        if rid in self.running:
            return _error(400, "Duplicate request ID detected")
        self.num_generate += 1
        self.requests.append([int(x) for x in ids])
        self.params.append(dict(params))
        if self.fail_left > 0:
            self.fail_left -= 1
            return web.Response(status=500, text="Internal Server Error")
        await self.unpaused.wait()
        state = self.running[rid] = {"aborted": False}
        self.max_running = max(self.max_running, len(self.running))
        stops = set(params.get("stop_token_ids") or []) | ({EOS_ID} if not params.get("ignore_eos") else set())
        out: list[int] = []
        logprobs: list[list[Any]] = []
        finish: dict[str, Any] = {"type": "length", "length": max_new}
        t0 = time.monotonic()
        try:
            prefix = [int(x) for x in ids]
            while len(out) < max_new:
                if state["aborted"]:
                    finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                    break
                if self.token_delay_s:
                    await asyncio.sleep(self.token_delay_s)
                tok = self.policy(prefix, self.seed)
                logprobs.append([token_logprob(prefix, tok, self.seed), tok, None])
                prefix.append(tok)
                out.append(tok)
                if tok in stops:
                    finish = {"type": "stop", "matched": tok}
                    break
        finally:
            self.running.pop(rid, None)
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(ids), "completion_tokens": len(out),
                "cached_tokens": 0, "weight_version": self.weight_version, "input_token_logprobs": [],
                "output_token_logprobs": logprobs, "output_token_logprobs_length": len(out),
                "e2e_latency": time.monotonic() - t0}
        if not body.get("return_logprob"):
            for k in ("input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length"):
                meta.pop(k)
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    async def abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        for rid, state in self.running.items():
            if body.get("abort_all") or (body.get("rid") and rid.startswith(body["rid"])):
                state["aborted"] = True
        return web.Response(status=200)

    async def flush(self, request: web.Request) -> web.Response:
        if self.running:
            return web.Response(status=400, text="Flush cache failed.")
        return web.Response(text="Cache flushed.")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.unpaused.is_set() else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True, "preferred_sampling_params": None,
                                  "weight_version": self.weight_version})

    async def list_workers(self, request: web.Request) -> web.Response:
        workers = [{"id": str(i), "url": u, "worker_type": "regular", "is_healthy": True}
                   for i, u in enumerate(self.workers or [])]
        return web.json_response({"workers": workers, "total": len(workers)})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "weight_version": self.weight_version,
                                  "num_generate": self.num_generate, "max_running": self.max_running,
                                  "num_running": len(self.running)})

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        path = body.get("model_path")
        if not path or path.startswith("/nonexistent"):
            return web.json_response({"success": False, "message": f"Failed to get weights iterator: {path}",
                                      "num_paused_requests": 0}, status=400)
        while self.running and self.unpaused.is_set():  # SGLang's writer lock waits for in-flight requests
            await asyncio.sleep(0.005)
        self.model_path, self.seed = path, weights_seed(path)
        msg = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
            msg += f" Weight version updated to {self.weight_version}."
        return web.json_response({"success": True, "message": msg, "num_paused_requests": 0})

    async def pause(self, request: web.Request) -> web.Response:
        self.unpaused.clear()
        for state in self.running.values():
            state["aborted"] = True
        while self.running:
            await asyncio.sleep(0.005)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(self, request: web.Request) -> web.Response:
        self.unpaused.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


class ThreadedFakeServer:
    """A FakeServer on its own event loop thread in this process, on a free loopback port."""

    def __init__(self, **kwargs: Any) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fake-sglang", daemon=True)
        self.thread.start()
        self.server, self.runner, port = asyncio.run_coroutine_threadsafe(self._start(kwargs), self.loop).result(30)
        self.url = f"http://127.0.0.1:{port}"

    async def _start(self, kwargs: dict) -> tuple:
        server = FakeServer(**kwargs)
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return server, runner, runner.addresses[0][1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __enter__(self) -> "ThreadedFakeServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model-path", default="init")
    p.add_argument("--token-delay-s", type=float, default=0.0)
    p.add_argument("--fail-first", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    server = FakeServer(args.model_path, args.token_delay_s, args.fail_first)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
