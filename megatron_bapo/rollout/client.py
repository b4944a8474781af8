"""Async HTTP client for a pool of SGLang servers (or an sglang-router), with a sync facade.

Why this shape:
- One `/generate` per sample (as slime does): SGLang's `n` fan-out replaces request ids, which
  would make them unreachable by `/abort_request`.
- Request ids are fixed-length uuid hex: the scheduler aborts every rid that STARTS WITH the
  given one, so variable-length ids could abort their neighbours.
- All requests go out at once up to the concurrency the servers' KV cache holds (`concurrency.py`:
  per server from `/server_info`, unless `max_concurrency` is set) and each goes to the healthy
  server with the most room left, so a slow server or a slow request never holds back the others.
- A pause for a weight update is also the client's: under an "abort" pause, requests still waiting
  in the client are not sent (they come back aborted with no tokens and go out as fresh segments on
  the new weights), and requests the paused servers held without running are cut before
  continue; under "retract" / "in_place" new requests wait in the client until continue. Nothing
  runs a whole segment into a paused server (control.py).
- A request that fails (connection error, timeout, 5xx, a reply that fails the checks of
  `protocol.parse_generate_reply`: impossible log-probs, token counts, ids or versions) is retried with
  exponential backoff on another server; the failing server gets no new work for
  `unhealthy_cooldown_s`. A 4xx is the request's own fault and is not retried.
- The trainer is synchronous: `run(coro)` executes coroutines on one background event loop, and
  every control call has a plain method (`update_weights_from_disk`) next to its coroutine
  (`aupdate_weights_from_disk`); `submit(coro)` starts one without waiting (a weight update posted
  while the calling thread joins the broadcast it announces).
- This is the project's one client of the servers: rollout, weight sync, evaluation and a
  teacher's prefill log-probs (`prefill.py`) all go through it, with one session per event loop
  and one retry policy (`_backoff`, control.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import random
import threading
import time
import uuid
import weakref
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

import aiohttp

from megatron_bapo.rollout import concurrency
from megatron_bapo.rollout.config import API_KEY_ENV, SAMPLING_KEYS, RolloutClientConfig
from megatron_bapo.rollout.control import ControlMixin
from megatron_bapo.rollout.errors import ProtocolError, RequestRejected, RolloutError
from megatron_bapo.rollout.prefill import PrefillMixin
from megatron_bapo.rollout.protocol import aborted_result, parse_generate_reply
from megatron_bapo.rollout.types import GenerateResult

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Statuses worth retrying elsewhere even though they are 4xx: timeouts and rate limits.
_RETRYABLE_4XX = frozenset({408, 429})
RETRIED = (aiohttp.ClientError, asyncio.TimeoutError, ProtocolError, OSError)
"""What a `/generate` attempt may fail with and be retried on another server after (`_attempt_failed`)."""


class _LoopThread:
    """A daemon thread running one asyncio event loop, for the synchronous API."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-client-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T], timeout: Optional[float] = None) -> T:
        return self.submit(coro).result(timeout)

    def submit(self, coro: Awaitable[T]) -> "concurrent.futures.Future[T]":
        if threading.current_thread() is self.thread:
            raise RuntimeError("RolloutClient.run() called from its own event loop; await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


class RolloutClient(ControlMixin, PrefillMixin, concurrency.ConcurrencyMixin):
    """`await client.agenerate(ids, params)` in a loop, or sync control calls from the trainer.

    Use as a context manager or call `close()`; `async` users in their own loop call `aclose()`.
    """

    def __init__(self, config: RolloutClientConfig, *, vocab_size: Optional[int] = None,
                 weight_version: Optional[int] = None) -> None:
        """`vocab_size`: the served model's vocabulary (token ids at or above it are refused);
        `weight_version`: the version the trainer has published so far (replies claiming a later
        one are refused; raised by every weight update sent through this client). None: unchecked."""
        if not config.urls and not config.router_url:
            raise ValueError("RolloutClient needs server URLs (rollout.client.urls) or a router (rollout.client.router_url)")
        self.config = config
        self.vocab_size = vocab_size
        self.max_weight_version = weight_version
        self.api_key = config.api_key or os.environ.get(API_KEY_ENV) or None
        self._per_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple]" = weakref.WeakKeyDictionary()
        self._background: Optional[_LoopThread] = None
        self._unhealthy_until: dict[str, float] = {u: 0.0 for u in config.urls}
        self._in_flight: dict[str, int] = {u: 0 for u in config.urls}
        self._rid_url: dict[str, str] = {}
        self._abort_epoch = 0
        self._workers: Optional[list[str]] = list(config.urls) or None
        self.process_exit: Optional[Callable[[str], Optional[int]]] = None
        """The exit code of the process behind a URL once it died, None while it runs (set by the
        `ServerPool` that started the servers; None for external ones). A request that fails on a dead
        process while no other server is healthy is not retried: every retry would fail the same way,
        each holding its concurrency slot through its backoff, so a round of many requests took
        minutes to fail before the pool could restart the server."""
        self.stopping = False
        """The run is ending (SIGTERM, an error, or its end): no retries, every control call one short
        attempt (`control.CLEANUP_TIMEOUT_S`), so teardown never waits on a dead server. Set from
        any thread (a signal handler included)."""
        self.stats: dict[str, int] = {"num_requests": 0, "num_retries": 0, "num_rejected": 0,
                                      "num_aborted_before_send": 0, "num_bad_replies": 0, "num_cut_by_pause": 0,
                                      "num_abort_pauses": 0}
        """`num_bad_replies`: 200 replies refused by `protocol.parse_generate_reply` (retried elsewhere);
        `num_aborted_before_send`: requests an abort or an "abort" pause found still waiting in the client;
        `num_cut_by_pause`: requests a paused server held without running them, cut before continue;
        `num_abort_pauses`: "abort" pauses so far (a round they cut short may go on: `PartialRolloutManager`)."""
        # Pauses (control.py): the abort epoch an "abort" pause began at (requests sent before it and
        # still unanswered at continue were held, not run), and the hold of the other modes.
        self._pause_epoch: Optional[int] = None
        self._held = False
        self._held_waiters: list[asyncio.Future] = []
        self._sent: dict[str, tuple[int, asyncio.Future]] = {}  # rid -> (abort epoch when sent, its POST)
        self._cut: set[str] = set()
        # Concurrency (concurrency.py): per-server caps once fitted, the request size they were fitted for.
        self.server_caps: Optional[dict[str, int]] = None
        """Requests each server holds at once (from its `/server_info`), once fitted; None before."""
        self._fitted_for: Optional[tuple] = None
        self._warned_concurrency = False
        self._fit_locks: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock]" = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ plumbing
    def run(self, coro: Awaitable[T], timeout: Optional[float] = None) -> T:
        """Run a coroutine on the client's background loop and return its result (sync API). A caller
        that stops waiting (a timeout, or SIGTERM raising in the waiting thread) cancels the coroutine:
        nothing keeps polling a server for a run that has moved on."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def submit(self, coro: Awaitable[T]) -> "concurrent.futures.Future[T]":
        """Start a coroutine on the client's background loop; its Future, without waiting."""
        if self._background is None:
            self._background = _LoopThread()
        return self._background.submit(coro)

    @property
    def loop_thread_id(self) -> Optional[int]:
        """The native id of the thread running the client's loop (None before first use): where
        rank 0's rollout work runs, next to training (`Driver` reports its CPU time per step)."""
        return None if self._background is None else self._background.thread.native_id

    @property
    def abort_epoch(self) -> int:
        """Counts `abort_all` calls: work that began at epoch e was aborted since when it differs
        (the agent loop ends a sample's round there instead of sending its next turn)."""
        return self._abort_epoch

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The background event loop (started on first use)."""
        if self._background is None:
            self._background = _LoopThread()
        return self._background.loop

    def _backoff(self, attempt: int) -> float:
        """Delay before retry `attempt` (1-based): exponential from backoff_s, capped, jittered."""
        delay = min(self.config.backoff_s * 2 ** (attempt - 1), self.config.backoff_max_s)
        return delay * (0.75 + 0.5 * random.random())

    def _session(self) -> tuple[aiohttp.ClientSession, concurrency.Slots]:
        """The session and concurrency slots of the running loop (aiohttp objects are per loop)."""
        loop = asyncio.get_running_loop()
        state = self._per_loop.get(loop)
        if state is None or state[0].closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            # limit=0: the slots cap concurrency; the pool must not queue requests behind it.
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers)
            state = (session, concurrency.Slots(lambda: self.max_in_flight))
            self._per_loop[loop] = state
        return state

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        state = self._per_loop.pop(loop, None)
        if state is not None:
            await state[0].close()

    async def _cancel_pending(self) -> None:
        """Cancel every other task of the background loop and let it finish (at most
        `CLEANUP_TIMEOUT_S`): a loop stopped under pending tasks makes asyncio print
        "Task was destroyed but it is pending!" with each task's stack."""
        from megatron_bapo.rollout.control import CLEANUP_TIMEOUT_S

        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLEANUP_TIMEOUT_S)

    def close(self) -> None:
        """Cancel what still runs on the background loop, close the session, stop the loop."""
        if self._background is not None:
            self.stopping = True
            try:
                self._background.run(self._cancel_pending())
                self._background.run(self.aclose())
            finally:
                self._background.stop()
                self._background = None

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ server choice
    def _pick_url(self, avoid: Optional[str] = None) -> str:
        """Router if configured; else the healthy worker with the most room left (fewest requests in
        flight relative to its cap: `server_caps`)."""
        if self.config.router_url:
            return self.config.router_url
        now = time.monotonic()
        urls = self.config.urls
        healthy = [u for u in urls if self._unhealthy_until[u] <= now]
        if avoid is not None and len(healthy) > 1:
            healthy = [u for u in healthy if u != avoid] or healthy
        if not healthy:  # every server failed recently: try the one that failed longest ago
            return min(urls, key=lambda u: self._unhealthy_until[u])
        caps = self.server_caps or {}
        return min(healthy, key=lambda u: (self._in_flight[u] / caps.get(u, 1), random.random()))

    def _mark_unhealthy(self, url: str, reason: str) -> None:
        """No new requests to `url` for a cooldown; one WARNING when it turns unhealthy (a dead server
        fails every request sent to it: one line per request would drown the log)."""
        if url in self._unhealthy_until:
            now = time.monotonic()
            was_healthy = self._unhealthy_until[url] <= now
            self._unhealthy_until[url] = now + self.config.unhealthy_cooldown_s
            if was_healthy:
                logger.warning("rollout server %s marked unhealthy for %.0f s: %s", url,
                               self.config.unhealthy_cooldown_s, reason)

    def healthy_urls(self) -> list[str]:
        now = time.monotonic()
        return [u for u in self.config.urls if self._unhealthy_until[u] <= now]

    # ------------------------------------------------------------------ generation
    async def agenerate(self, input_ids: Sequence[int], sampling_params: dict[str, Any], *,
                        routed_experts_start_len: Optional[int] = None) -> GenerateResult:
        """One `/generate` with `return_logprob`; retried and failed over until it succeeds.

        Returns the parsed segment (ids, behavior log-probs, per-token versions, finish type).
        `routed_experts_start_len` set: also ask for the routed experts of positions from there on
        (SGLang's `return_routed_experts`, servers launched with --enable-return-routed-experts).
        A request still waiting for a slot when `abort_all` is called is not sent and comes back
        as an abort with no tokens. Raises RequestRejected on a 4xx, RolloutError when every
        retry failed.
        """
        bad = sorted(set(sampling_params) - SAMPLING_KEYS)
        if bad:
            raise ValueError(f"sampling_params has unknown key(s) {bad}; allowed: {sorted(SAMPLING_KEYS)}")
        if not input_ids:
            raise ValueError("agenerate: input_ids is empty")
        if self.config.max_concurrency is None and self.server_caps is None:
            await self._fit_lazily()
        session, slots = self._session()
        epoch = self._abort_epoch
        payload: dict[str, Any] = {"input_ids": [int(x) for x in input_ids], "sampling_params": dict(sampling_params),
                                   "return_logprob": True}
        if routed_experts_start_len is not None:
            payload.update(return_routed_experts=True, routed_experts_start_len=int(routed_experts_start_len))
        last_url: Optional[str] = None
        last_error: Optional[BaseException] = None
        async with slots:
            for attempt in range(self.config.max_retries + 1):
                if attempt and self.stopping:
                    break
                if attempt:
                    self.stats["num_retries"] += 1
                    await asyncio.sleep(self._backoff(attempt))
                # An abort, or an "abort" pause, that began while it waited for a slot ends it unsent; a
                # request made during a pause waits for continue (it then runs on the new weights).
                for held in (False, True):
                    if held:
                        await self._wait_while_held()
                    if epoch != self._abort_epoch:
                        self.stats["num_aborted_before_send"] += 1
                        return aborted_result(uuid.uuid4().hex, last_url or "")
                url = self._pick_url(avoid=last_url)
                last_url = url
                rid = uuid.uuid4().hex  # fresh per attempt: a retry must not collide with an in-flight id
                try:
                    return await self._send(session, url, rid, payload)
                except RequestRejected:
                    self.stats["num_rejected"] += 1
                    raise
                except RETRIED as exc:
                    last_error = exc
                    self._attempt_failed(url, rid, exc, attempt)
        raise self._out_of_retries("/generate", last_url, last_error)

    def _attempt_failed(self, url: str, rid: str, exc: BaseException, attempt: int) -> None:
        """One failed `/generate` attempt (`RETRIED`): the server gets no new work for a cooldown, a timed-out
        request is aborted there, and a request whose server process died while no other server is
        healthy ends at once (RolloutError with the exit code: every retry would fail the same way)."""
        self._mark_unhealthy(url, repr(exc))
        code = self._exit_code(url)
        if code is not None and not self.healthy_urls():
            raise RolloutError(f"/generate on {url} failed: its server process died (exit code {code}) "
                               f"and no other server is healthy; {exc!r}") from exc
        logger.debug("generate on %s failed (attempt %d/%d): %r", url, attempt + 1, self.config.max_retries + 1, exc)
        if isinstance(exc, asyncio.TimeoutError):
            asyncio.ensure_future(self._abort_quietly(url, rid))

    def _out_of_retries(self, what: str, last_url: Optional[str], last_error: Optional[BaseException]) -> RolloutError:
        down = [u for u in self.config.urls if self._unhealthy_until[u] > time.monotonic()]
        detail = str(last_error) if isinstance(last_error, ProtocolError) else repr(last_error)
        return RolloutError(f"{what} failed after {self.config.max_retries + 1} attempts, the last on {last_url}: "
                            f"{detail}; servers failing now: {down or [last_url]}")

    async def _send(self, session: aiohttp.ClientSession, url: str, rid: str, payload: dict) -> GenerateResult:
        """`_post_generate`, cut short (an abort with no tokens) when a pause found it held unrun by a paused server."""
        post = asyncio.ensure_future(self._post_generate(session, url, rid, payload))
        self._sent[rid] = (self._abort_epoch, post)
        try:
            return await post
        except asyncio.CancelledError:
            if rid not in self._cut:
                raise
            self._cut.discard(rid)
            self.stats["num_cut_by_pause"] += 1
            return aborted_result(rid, url)
        finally:
            self._sent.pop(rid, None)

    async def _post_generate(self, session: aiohttp.ClientSession, url: str, rid: str, payload: dict,
                             parse: Optional[Callable[[Any, str, str], Any]] = None) -> Any:
        """POST one `/generate`; its reply checked by `parse(body, rid, url)` (default
        `protocol.parse_generate_reply`; a prefill's: `prefill.parse_prefill_reply`)."""
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s)
        self.stats["num_requests"] += 1
        if url in self._in_flight:
            self._in_flight[url] += 1
        self._rid_url[rid] = url
        try:
            async with session.post(f"{url}/generate", json={**payload, "rid": rid}, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status == 200:
                    try:
                        try:
                            body = await resp.json(content_type=None)
                        except ValueError as exc:
                            raise ProtocolError(f"{url}/generate replied 200 with non-JSON {text[:200]!r}") from exc
                        if parse is not None:
                            return parse(body, rid, url)
                        return parse_generate_reply(body, rid=rid, url=url, vocab_size=self.vocab_size,
                                                    max_new_tokens=payload["sampling_params"].get("max_new_tokens"),
                                                    max_version=self.max_weight_version)
                    except ProtocolError:
                        self.stats["num_bad_replies"] += 1
                        raise
                if 400 <= resp.status < 500 and resp.status not in _RETRYABLE_4XX:
                    raise RequestRejected(resp.status, f"{url}/generate rejected the request ({resp.status}): {text[:500]}")
                raise ProtocolError(f"{url}/generate returned {resp.status}: {text[:300]}")
        finally:
            self._rid_url.pop(rid, None)
            if url in self._in_flight:
                self._in_flight[url] -= 1

    async def _abort_quietly(self, url: str, rid: str) -> None:
        try:
            session, _ = self._session()
            async with session.post(f"{url}/abort_request", json={"rid": rid, "abort_all": False},
                                    timeout=aiohttp.ClientTimeout(total=10)) as resp:
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass

    def generate(self, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> GenerateResult:
        """Sync `agenerate` (one request; use the partial-rollout manager for many)."""
        return self.run(self.agenerate(input_ids, sampling_params))

