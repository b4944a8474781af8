"""How many requests each server can hold at once: from what it reports, not from a guess.

SGLang admits a request when its KV fits and retracts (re-queues, to be prefilled again) running
requests when the KV cache runs out. A client that keeps more contexts in flight than the cache holds
makes the servers retract and re-run work all the time: the 32B recipe's 2048 concurrent requests of
~30k tokens are ~60M tokens against ~1.7M tokens of KV per server. So the client sizes its
concurrency per server from `/server_info`:

    cap(server) = min(max_running_requests, max_total_num_tokens // min(tokens_per_request, context_length))

`tokens_per_request` is the KV one request of this run holds, on average, when its segment ends
(`PartialRolloutConfig.kv_tokens_per_request`): with partial rollout a response's segments end at
prompt + seg, prompt + 2 seg, ..., prompt + S seg tokens, so a request holds prompt + seg (S + 1) / 2
on average. Unknown (a client used alone, e.g. for evaluation): the context length, the most one
request can hold. A configured `rollout.client.max_concurrency` wins; when it exceeds what the servers
hold, the client warns once with the numbers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional

from megatron_bapo.rollout.errors import RolloutError

logger = logging.getLogger(__name__)

DEFAULT_CAP = 256
"""Per-server cap when a server reports neither its KV size nor a running-request limit."""


def _positive_int(value: Any) -> Optional[int]:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def context_length(info: dict) -> Optional[int]:
    """A server's context length from its `/server_info` (SGLang may report only `max_req_input_len`)."""
    ctx = _positive_int(info.get("context_length"))
    max_input = _positive_int(info.get("max_req_input_len"))
    return ctx or (max_input + 1 if max_input else None)


def server_cap(info: dict, tokens_per_request: Optional[int]) -> int:
    """Requests one server holds at once without running out of KV (>= 1); see the module docstring."""
    ctx = context_length(info)
    need = tokens_per_request or ctx
    if need and ctx:
        need = min(need, ctx)
    kv = _positive_int(info.get("max_total_num_tokens"))
    running = _positive_int(info.get("max_running_requests"))
    caps = [c for c in (kv // need if kv and need else None, running) if c is not None]
    return max(1, min(caps)) if caps else DEFAULT_CAP


def too_many_message(configured: int, caps: dict[str, int], infos: dict[str, dict],
                     tokens_per_request: Optional[int]) -> str:
    """The one warning for a configured concurrency the servers cannot hold."""
    kv = sum(_positive_int((infos.get(u) or {}).get("max_total_num_tokens")) or 0 for u in caps)
    per = f"~{tokens_per_request} tokens per request" if tokens_per_request else "up to the context length per request"
    return (f"rollout.client.max_concurrency={configured} requests cannot fit the servers' KV cache: {len(caps)} "
            f"server(s) hold {kv:,} tokens in total (max_total_num_tokens), {per}, so at most {sum(caps.values())} "
            f"requests fit at once ({', '.join(f'{u}: {c}' for u, c in caps.items())}); the servers would retract "
            f"and re-run the rest. Set rollout.client.max_concurrency: null to follow the servers")


class Slots:
    """A semaphore whose size can change (the client resizes it when it fits the servers); FIFO."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    async def __aenter__(self) -> "Slots":
        async with self._cond:
            await self._cond.wait_for(lambda: self.used < self.limit())
            self.used += 1
        return self

    async def __aexit__(self, *exc: Any) -> None:
        async with self._cond:
            self.used -= 1
            self._cond.notify()

    async def resized(self) -> None:
        """Wake the waiters after the limit grew."""
        async with self._cond:
            self._cond.notify_all()


class ConcurrencyMixin:
    """The client's side of the above. Needs `config`, `server_caps`, `_fitted_for`,
    `_warned_concurrency`, `_fit_locks`, `_session()`, `run()`, `aworker_urls()`, `aget_server_info()`."""

    @property
    def max_in_flight(self) -> int:
        """Requests in flight at once over the pool: `max_concurrency` when configured, else the sum
        of the fitted per-server caps (before a fit: `DEFAULT_CAP` per server)."""
        if self.config.max_concurrency is not None:
            return int(self.config.max_concurrency)
        if self.server_caps:
            return sum(self.server_caps.values())
        return DEFAULT_CAP * max(1, len(self.config.urls))

    async def afit_concurrency(self, tokens_per_request: Optional[int] = None) -> int:
        """Size the concurrency from every server's `/server_info` for requests holding
        `tokens_per_request` KV tokens (None: the context length); warns once when a configured
        `max_concurrency` exceeds what the servers hold. Cheap when nothing changed. Returns
        `max_in_flight`."""
        workers = tuple(await self.aworker_urls())
        key = (workers, tokens_per_request)
        if key == self._fitted_for:
            return self.max_in_flight
        infos = await self.aget_server_info()
        caps = {u: server_cap(infos[u] or {}, tokens_per_request) for u in workers}
        grew = self.server_caps is None or sum(caps.values()) > sum(self.server_caps.values())
        self.server_caps, self._fitted_for = caps, key
        configured = self.config.max_concurrency
        if configured is not None and configured > sum(caps.values()) and not self._warned_concurrency:
            logger.warning(too_many_message(configured, caps, infos, tokens_per_request))
            self._warned_concurrency = True
        logger.info("rollout concurrency %d (%s; ~%s KV tokens per request)", self.max_in_flight,
                    ", ".join(f"{u}: {c}" for u, c in caps.items()), tokens_per_request or "context length")
        if grew:
            await self._session()[1].resized()
        return self.max_in_flight

    def fit_concurrency(self, tokens_per_request: Optional[int] = None) -> int:
        return self.run(self.afit_concurrency(tokens_per_request))

    async def _fit_lazily(self) -> None:
        """A client used alone (no run sizes its requests) fits once, by the context length; servers
        that cannot be asked keep the default caps (the request's own retries handle them)."""
        loop = asyncio.get_running_loop()
        lock = self._fit_locks.setdefault(loop, asyncio.Lock())
        async with lock:
            if self.server_caps is not None:
                return
            try:
                await self.afit_concurrency()
            except RolloutError as exc:
                logger.debug("cannot size the concurrency from /server_info yet: %s", exc)
