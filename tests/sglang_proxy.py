"""A recording HTTP proxy for the SGLang conformance test: sits between the trainer and one
built-in server on loopback, forwards every request unchanged and records it (method, path, query,
JSON body, status, and the reply of control calls) in the order the server received them.

With `rewrite`, it also stands for a server that answers impossibly (the reply-check tests):
`rewrite(path, request_body, reply_body)` returns the JSON reply to send instead of a 200 reply.
`peak_generate` is the most `/generate` calls it had in flight at once (the concurrency tests)."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import aiohttp
from aiohttp import web


class RecordingProxy:
    """`with RecordingProxy(upstream_url, records_path) as proxy:` ... point the client at `proxy.url`."""

    def __init__(self, upstream: str, records: Optional[Path] = None,
                 rewrite: Optional[Callable[[str, Any, Any], Any]] = None) -> None:
        self.upstream, self.records, self.rewrite = upstream.rstrip("/"), records, rewrite
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="recording-proxy", daemon=True)
        self._runner: Optional[web.AppRunner] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._lock = threading.Lock()
        self.generate_in_flight = 0
        self.peak_generate = 0

    async def _handle(self, request: web.Request) -> web.Response:
        if request.path != "/generate":
            return await self._forward(request)
        self.generate_in_flight += 1  # the proxy's own loop: no lock needed
        self.peak_generate = max(self.peak_generate, self.generate_in_flight)
        try:
            return await self._forward(request)
        finally:
            self.generate_in_flight -= 1

    async def _forward(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw.strip() else None
        except ValueError:
            body = {"__unparsable__": raw[:200].decode(errors="replace")}
        rec = {"method": request.method, "path": request.path, "query": dict(request.query), "body": body}
        if self.records is not None:
            with self._lock:  # the order the requests reached the server in
                with open(self.records, "a", encoding="utf-8") as f:
                    f.write(json.dumps(rec) + "\n")
        async with self._session.request(request.method, self.upstream + request.path_qs, data=raw,
                                         headers={k: v for k, v in request.headers.items()
                                                  if k.lower() in ("content-type", "authorization")}) as resp:
            data = await resp.read()
            if self.rewrite is not None and resp.status == 200 and resp.content_type == "application/json":
                with self._lock:
                    data = json.dumps(self.rewrite(request.path, body, json.loads(data))).encode()
            if self.records is not None and request.path in ("/server_info", "/get_server_info") and resp.status == 200:
                with self._lock, open(self.records, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"method": "GET", "path": request.path, "query": {}, "body": None,
                                        "reply": json.loads(data), "replay": True}) + "\n")
            return web.Response(status=resp.status, body=data, content_type=resp.content_type)

    async def _start(self) -> str:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _stop(self) -> None:
        await self._session.close()
        await self._runner.cleanup()

    def __enter__(self) -> "RecordingProxy":
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: Any) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
