"""The few control calls weight sync makes, posted to every server from a private event loop.

The distributed update needs HTTP calls in flight *while* the calling thread blocks in a
rendezvous or a broadcast, so requests run on an asyncio loop in a daemon thread and the caller
gets `concurrent.futures.Future`s back.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Optional

import aiohttp


class WeightSyncError(RuntimeError):
    """A server refused or failed a weight-sync call; the message names the server and its reply."""


class ControlCalls:
    """POST JSON bodies to server URLs from a background event loop."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-sync-http", daemon=True)
        self._thread.start()
        self._session: Optional[aiohttp.ClientSession] = None

    async def _post(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        async with self._session.post(url.rstrip("/") + path, json=body) as resp:
            text = await resp.text()
        try:
            import json

            reply = json.loads(text) if text else {}
        except ValueError:
            reply = {"message": text}
        ok = resp.status == 200 and (not isinstance(reply, dict) or reply.get("success", True) is not False)
        if not ok:
            message = reply.get("message", text) if isinstance(reply, dict) else text
            raise WeightSyncError(f"{url}{path} failed with HTTP {resp.status}: {message}")
        return reply if isinstance(reply, dict) else {"reply": reply}

    async def _get(self, url: str, path: str) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        async with self._session.get(url.rstrip("/") + path) as resp:
            if resp.status != 200:
                raise WeightSyncError(f"{url}{path} failed with HTTP {resp.status}: {await resp.text()}")
            return await resp.json(content_type=None)

    def post(self, url: str, path: str, body: dict[str, Any]) -> Future:
        """Start a POST now; the Future resolves to the JSON reply or raises WeightSyncError."""
        return asyncio.run_coroutine_threadsafe(self._post(url, path, body), self._loop)

    def get(self, url: str, path: str) -> Future:
        return asyncio.run_coroutine_threadsafe(self._get(url, path), self._loop)

    def post_all(self, urls: list[str], path: str, bodies: list[dict[str, Any]]) -> list[Future]:
        return [self.post(u, path, b) for u, b in zip(urls, bodies)]

    @staticmethod
    def wait_all(futures: list[Future], timeout_s: Optional[float] = None) -> list[Any]:
        """Results of all futures; raises the first error only after every call has finished."""
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result(timeout=timeout_s))
            except Exception as exc:  # noqa: BLE001 - re-raised below once all are done
                errors.append(exc)
                results.append(None)
        if errors:
            raise errors[0] if isinstance(errors[0], WeightSyncError) else WeightSyncError(str(errors[0]))
        return results

    def close(self) -> None:
        async def shutdown() -> None:
            if self._session is not None:
                await self._session.close()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
