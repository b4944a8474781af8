"""Control calls of the rollout client: sent to EACH worker, never through the router.

The router forwards neither `/abort_request` nor pause/continue nor weight updates (spec section
15), so with only a router configured the workers are listed from it first. Every call has a
coroutine (`a*`) and, for the trainer, a plain method running it on the client's background loop.

One retry policy for the whole client (`RolloutClient._backoff`): idempotent calls (health, info,
abort, flush, pause/continue, weight updates from disk) are retried on connection errors, timeouts
and 5xx with the same exponential backoff as generation; calls that join or feed a collective
(`/init_weights_update_group`, `/update_weights_from_distributed`) are sent once, because a retry
cannot rejoin a half-done rendezvous or broadcast. A 4xx, or a 200 with `"success": false`, is the
call's own failure and is never retried.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Optional

import aiohttp

from megatron_bapo.rollout.config import API_KEY_ENV
from megatron_bapo.rollout.errors import RolloutError
from megatron_bapo.rollout.protocol import parse_version
from megatron_bapo.weight_update import FLUSH_REFUSED, PAUSE_MODES

logger = logging.getLogger(__name__)
CLEANUP_TIMEOUT_S = 2.0
"""Once the client is `stopping` (the run ends, by SIGTERM or an error), each call is one attempt of at
most this long: SLURM kills 30 s after SIGTERM, and a dead server must not hold the teardown."""


class ControlMixin:
    """Needs `config`, `_session()`, `run()`, `_backoff()`, `_abort_epoch`, `_rid_url`, `_workers`,
    `max_weight_version`, `stopping`, `process_exit`, and the pause state `_pause_epoch`, `_held`,
    `_held_waiters`, `_sent`, `_cut`."""

    # ------------------------------------------------------------------ one request, one policy
    def _exit_code(self, url: str) -> Optional[int]:
        """The exit code of the process behind `url` once it died (`process_exit`, set by the pool
        that started it); None while it runs, and for a server nobody here started."""
        process_exit = getattr(self, "process_exit", None)
        return process_exit(url) if process_exit is not None else None

    async def _request(self, method: str, url: str, path: str, body: Optional[dict] = None,
                       timeout: Optional[float] = None, *, retry: bool = True) -> tuple[int, str]:
        """(status, text) of one control request; transport failures and 5xx retried when `retry`."""
        session, _ = self._session()
        timeout = timeout or self.config.control_timeout_s
        attempts = self.config.max_retries + 1 if retry else 1
        if self.stopping:  # teardown: one short attempt (CLEANUP_TIMEOUT_S)
            timeout, attempts = min(timeout, CLEANUP_TIMEOUT_S), 1
        t = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, self.config.connect_timeout_s))
        last: Any = None
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            try:
                async with session.request(method, f"{url}{path}", json=body, timeout=t) as resp:
                    status, text = resp.status, await resp.text()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last = exc
                code = self._exit_code(url)
                if code is not None:  # a retry would fail the same way until the pool restarts it
                    raise RolloutError(f"{url}{path} failed: its server process died (exit code {code}); "
                                       f"{exc!r}") from exc
                continue
            if status < 500:
                return status, text
            last = f"HTTP {status}: {text[:200]}"
        if isinstance(last, BaseException):
            raise RolloutError(f"{url}{path} failed after {attempts} attempt(s): {last!r}") from last
        raise RolloutError(f"{url}{path} failed after {attempts} attempt(s): {last}")

    async def _expect_success(self, url: str, path: str, body: Optional[dict] = None, *, retry: bool = True,
                              timeout: Optional[float] = None) -> dict:
        """POST; the JSON reply, or RolloutError naming the worker unless it is 200 without
        `"success": false` (SGLang's success convention for control calls)."""
        status, text = await self._request("POST", url, path, body, timeout, retry=retry)
        try:
            reply = json.loads(text) if text else {}
        except ValueError:
            reply = {"message": text}
        if status != 200 or (isinstance(reply, dict) and reply.get("success", True) is False):
            message = reply.get("message", text) if isinstance(reply, dict) else text
            raise RolloutError(f"{url}{path} failed ({status}): {str(message)[:300]}")
        return reply if isinstance(reply, dict) else {"reply": reply}

    async def aworker_urls(self) -> list[str]:
        """Worker URLs for control calls: `urls`, or the router's worker list."""
        if self._workers:
            return list(self._workers)
        router = self.config.router_url
        for path in ("/workers", "/list_workers"):
            try:
                status, text = await self._request("GET", router, path, None, 30)
                data = json.loads(text) if status == 200 else {}
            except (RolloutError, ValueError):
                continue
            urls = [w["url"] for w in data.get("workers", [])] if "workers" in data else list(data.get("urls", []))
            if urls:
                self._workers = [u.rstrip("/") for u in urls]
                return list(self._workers)
        raise RolloutError(f"could not list workers from router {router} (GET /workers and /list_workers); "
                           "set the worker URLs (rollout.client.urls)")

    def worker_urls(self) -> list[str]:
        return self.run(self.aworker_urls())

    async def _each(self, coro_fn, *, skip_unhealthy: bool = False) -> dict[str, Any]:
        urls = await self.aworker_urls()
        if skip_unhealthy:
            healthy = set(self.healthy_urls()) if self.config.urls else set(urls)
            urls = [u for u in urls if u in healthy]
        results = await asyncio.gather(*(coro_fn(u) for u in urls), return_exceptions=True)
        return dict(zip(urls, results))

    async def _each_or_raise(self, what: str, coro_fn) -> dict[str, Any]:
        out = await self._each(coro_fn)
        _raise_failures(what, out)
        return out

    # ------------------------------------------------------------------ abort
    async def aabort_all(self) -> None:
        """`abort_all` to every worker; requests still waiting for a client slot are not sent.

        Fire-and-forget on the server side: in-flight `/generate` calls return later with
        finish_reason abort and their partial tokens.
        """
        self._abort_epoch += 1
        out = await self._each(lambda u: self._request("POST", u, "/abort_request", {"rid": "", "abort_all": True}, 30))
        for url, res in out.items():
            if isinstance(res, BaseException):  # at teardown a dead server is expected: not a warning
                (logger.info if self.stopping else logger.warning)("abort_all on %s failed: %r", url, res)

    def abort_all(self) -> None:
        """Sync `aabort_all`; safe to call from another thread while a rollout step runs."""
        if self._background is None:
            self._abort_epoch += 1
            return
        self.run(self.aabort_all())

    async def aabort_request(self, rid: str) -> None:
        """Abort one in-flight request on the worker it was sent to (every worker via a router)."""
        url = self._rid_url.get(rid)
        urls = [url] if url and url != self.config.router_url else await self.aworker_urls()
        await asyncio.gather(*(self._request("POST", u, "/abort_request", {"rid": rid, "abort_all": False}, 30)
                               for u in urls), return_exceptions=True)

    # ------------------------------------------------------------------ cache, weights, versions
    async def aflush_cache(self) -> None:
        """`/flush_cache` on every worker, polled 1 s apart until 200 (it fails while busy)."""
        await self._each_or_raise("flush_cache", self._aflush_one)

    async def _aflush_one(self, url: str) -> None:
        deadline = time.monotonic() + self.config.flush_cache_timeout_s
        while True:
            status, text = await self._request("POST", url, "/flush_cache", None, 30)
            if status == 200:
                return
            if time.monotonic() > deadline or self.stopping:
                raise RolloutError(f"{url}/flush_cache did not succeed within "
                                   f"{self.config.flush_cache_timeout_s} s: {text[:200]}")
            await asyncio.sleep(1.0)

    async def _aupdate(self, url: str, path: str, body: dict, **kw: Any) -> dict:
        """An update call; an update whose own flush was refused (`weight_update.FLUSH_REFUSED`) is
        completed by polling `/flush_cache` (client.flush_cache_timeout_s), as SGLang's reply asks."""
        try:
            return await self._expect_success(url, path, body, **kw)
        except RolloutError as exc:
            if not (body.get("flush_cache") and FLUSH_REFUSED in str(exc)):
                raise
        logger.info("%s%s: weights in, the flush met a request still in the scheduler; flushing again", url, path)
        await self._aflush_one(url)
        return {"success": True}

    def flush_cache(self) -> None:
        self.run(self.aflush_cache())

    async def aupdate_weights_from_disk(self, model_path: str, weight_version: int, *, flush_cache: bool = True,
                                        abort_all_requests: bool = False, only: Optional[list[str]] = None) -> None:
        """Every worker (or the workers in `only`) loads the HF checkpoint at `model_path` and reports
        `weight_version`; `flush_cache` is sent explicitly (SGLang 0.5.23 refuses the update's flush
        while requests hold KV, e.g. paused in place: `weight_update.flushes_cache`).

        Raises RolloutError naming each worker that failed (unreachable, 400, success false): a
        worker left on old weights would silently serve a different policy.
        """
        body = {"model_path": str(model_path), "weight_version": str(int(weight_version)),
                "abort_all_requests": abort_all_requests, "flush_cache": bool(flush_cache)}
        self._published(int(weight_version))

        async def one(url: str) -> Any:
            if only is not None and url not in only:
                return None
            return await self._aupdate(url, "/update_weights_from_disk", body)
        await self._each_or_raise("update_weights_from_disk", one)

    def update_weights_from_disk(self, model_path: str, weight_version: int, *, flush_cache: bool = True,
                                 abort_all_requests: bool = False, only: Optional[list[str]] = None) -> None:
        self.run(self.aupdate_weights_from_disk(model_path, weight_version, flush_cache=flush_cache,
                                                abort_all_requests=abort_all_requests, only=only))

    async def aget_server_info(self) -> dict[str, dict]:
        """`/server_info` of every worker (its launch arguments: `tp_size` for the distributed weight
        group, `context_length`, `enable_deterministic_inference`, `disable_radix_cache`).
        SGLang 0.5.23 logs `/get_server_info` as deprecated; both name the same handler."""
        async def one(url: str) -> dict:
            status, text = await self._request("GET", url, "/server_info", None, 30)
            if status != 200:
                raise RolloutError(f"{url}/server_info returned {status}: {text[:200]}")
            return json.loads(text)
        return await self._each_or_raise("server_info", one)

    async def abegin_weight_update(self) -> None:
        """`/begin_weight_update` on every worker: SGLang 0.5.23 refuses a distributed (or tensor)
        update outside such a session. Takes the writer lock unless paused."""
        await self._each_or_raise("begin_weight_update", lambda u: self._expect_success(
            u, "/begin_weight_update", {}, retry=False))

    async def aend_weight_update(self) -> None:
        """`/end_weight_update` on every worker: closes the session `abegin_weight_update` opened."""
        await self._each_or_raise("end_weight_update", lambda u: self._expect_success(
            u, "/end_weight_update", {}, retry=False))

    async def ainit_weights_update_group(self, bodies: dict[str, dict], timeout: Optional[float] = None) -> None:
        """`/init_weights_update_group` to each worker with its own body (its `rank_offset`); each call
        returns only when the rendezvous completes, so the caller joins the group meanwhile."""
        await self._each_or_raise("init_weights_update_group", lambda u: self._expect_success(
            u, "/init_weights_update_group", bodies[u], retry=False, timeout=timeout))

    async def aclear_weight_group(self, group_name: str) -> dict[str, list[str]]:
        """End an open weight-update session and destroy the weight group `group_name` on every worker,
        one attempt each; returns what each worker held ([] for a clean one, which answers both calls
        with an error: nothing open). A server outlives a trainer that died (SIGKILL, a node lost): it
        keeps the dead trainer's group (and its session, when killed mid-update), and a new trainer's
        join under the same name is refused (`group ... already exists`) until that group is destroyed."""
        async def one(url: str) -> list[str]:
            held = []
            for path, body, what in (("/end_weight_update", {}, "an open weight-update session"),
                                     ("/destroy_weights_update_group", {"group_name": group_name},
                                      f"the weight group {group_name!r}")):
                status, text = await self._request("POST", url, path, body, retry=False)
                try:
                    ok = status == 200 and json.loads(text or "{}").get("success", True) is not False
                except ValueError:
                    ok = False
                if ok:
                    held.append(what)
            return held
        return await self._each_or_raise("clearing the weight group", one)

    async def adestroy_weights_update_group(self, group_name: str) -> None:
        await self._each_or_raise("destroy_weights_update_group", lambda u: self._expect_success(
            u, "/destroy_weights_update_group", {"group_name": group_name}, timeout=60))

    async def aupdate_weights_from_distributed(self, body: dict, timeout: Optional[float] = None) -> None:
        """`/update_weights_from_distributed` to every worker (inside a begin/end session); each
        returns once it received the bucket, which the caller broadcasts meanwhile."""
        if body.get("weight_version") is not None and parse_version(body["weight_version"]) is not None:
            self._published(parse_version(body["weight_version"]))
        await self._each_or_raise("update_weights_from_distributed", lambda u: self._aupdate(
            u, "/update_weights_from_distributed", body, retry=False, timeout=timeout))

    async def aget_weight_versions(self) -> dict[str, str]:
        """`weight_version` of each worker (strings, as on the wire) from `/model_info`."""
        async def one(url: str) -> str:
            status, text = await self._request("GET", url, "/model_info", None, 30)
            if status != 200:
                raise RolloutError(f"{url}/model_info returned {status}: {text[:200]}")
            return str(json.loads(text).get("weight_version"))
        return await self._each_or_raise("model_info", one)

    def get_weight_version(self) -> Optional[int]:
        """The workers' common weight version as an int (None for "default"); raises if they differ."""
        versions = self.run(self.aget_weight_versions())
        distinct = set(versions.values())
        if len(distinct) != 1:
            raise RolloutError(f"workers disagree on weight_version: {versions}")
        return parse_version(distinct.pop())

    def _published(self, version: int) -> None:
        """Replies may report `version` from now on (raised before the update is sent: an in-place
        update's first tokens can come back before its call returns)."""
        self.max_weight_version = max(version, self.max_weight_version or 0)

    # ------------------------------------------------------------------ pause, health
    async def apause_generation(self, mode: Optional[str] = None) -> None:
        """`/pause_generation` on every worker (`mode` "abort"/"retract"/"in_place" on SGLang >= 0.5.15;
        None: the server's default, "abort").

        The pause holds in the client too, so no request runs a whole segment into a paused server:
        "abort" (and None) ends the requests in flight (the servers return their partial tokens) and
        every request still waiting in the client comes back aborted without being sent (its sample
        goes out again as a fresh segment, on the new weights); "retract" / "in_place" keep the
        requests in flight running across the update. Requests made during any pause wait in the
        client until continue.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if mode in (None, "abort"):
            self._abort_epoch += 1
            self._pause_epoch = self._abort_epoch
            self.stats["num_abort_pauses"] += 1
        self._held = True
        body = {} if mode is None else {"mode": mode}
        try:
            await self._each_or_raise("pause_generation", lambda u: self._expect_success(u, "/pause_generation", body))
        except BaseException:
            self._release_pause()
            raise

    def pause_generation(self, mode: Optional[str] = None) -> None:
        self.run(self.apause_generation(mode))

    async def acontinue_generation(self, *, release: bool = True) -> None:
        """`/continue_generation` on every worker. After an "abort" pause, requests sent before it that
        are still unanswered were held by the paused servers without running (the ones running came
        back aborted): they are cut first, so none runs a whole segment on the new weights in a round
        that should have ended (they come back aborted with no tokens, and go out again next round).
        `release=False`: the servers run again but new requests keep waiting in the client until
        `release_generation` (the served weights are verified in between: `ServerPool.update`)."""
        cut = [(rid, post) for rid, (epoch, post) in self._sent.items()
               if self._pause_epoch is not None and epoch < self._pause_epoch and not post.done()]
        for rid, post in cut:
            self._cut.add(rid)
            post.cancel()
        if cut:
            await asyncio.gather(*(post for _, post in cut), return_exceptions=True)
        try:
            await self._each_or_raise("continue_generation",
                                      lambda u: self._expect_success(u, "/continue_generation", {}))
        except BaseException:
            self._release_pause()
            raise
        if release:
            self._release_pause()

    def _release_pause(self) -> None:
        """Requests held in the client go out (or, after an "abort" pause, new ones do)."""
        self._pause_epoch, self._held = None, False
        waiters, self._held_waiters = self._held_waiters, []
        for fut in waiters:
            fut.get_loop().call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))

    async def _wait_while_held(self) -> None:
        """Wait while a pause holds new requests in the client."""
        while self._held:
            fut = asyncio.get_running_loop().create_future()
            self._held_waiters.append(fut)
            await fut

    def continue_generation(self, *, release: bool = True) -> None:
        self.run(self.acontinue_generation(release=release))

    def hold_generation(self) -> None:
        """New requests wait in the client (the servers are not paused) until `release_generation`."""
        self._held = True

    def release_generation(self) -> None:
        """New requests go out again (after `hold_generation` or `continue_generation(release=False)`)."""
        self._release_pause()

    # ------------------------------------------------------------------ what a server serves
    async def ascore(self, url: str, input_ids: list[int]) -> list[float]:
        """log p(ids[t] | ids[:t]) for t >= 1 as the worker `url` computes them: one prefill
        (`max_new_tokens` 0, `return_logprob`, `logprob_start_len` 0) sent past any pause hold of the
        client (it verifies weights while rollout requests wait: `ServerPool.update`)."""
        body = {"input_ids": [int(i) for i in input_ids], "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}
        status, text = await self._request("POST", url, "/generate", body)
        if status != 200:
            raise RolloutError(f"{url}/generate (the weight probe) failed ({status}): {text[:300]}")
        try:
            entries = json.loads(text)["meta_info"]["input_token_logprobs"]
            return [float(e[0]) for e in entries[1:]]
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise RolloutError(f"{url}/generate (the weight probe) replied without input log-probs: {text[:300]}") from exc

    async def aweights_checksum(self, url: str) -> dict:
        """`/weights_checker {"action": "checksum"}` of the worker `url` (SGLang 0.5.23): per engine rank
        the hash of every tensor it serves, in its own layout (`convert.served_layout`)."""
        return await self._expect_success(url, "/weights_checker", {"action": "checksum"})

    async def await_healthy(self, timeout_s: Optional[float] = None) -> None:
        """Poll `/health_generate` on every worker (and `/health` on the router) until 200."""
        timeout_s = self.config.health_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s

        async def one(url: str, path: str) -> None:
            last = ""
            while time.monotonic() < deadline:
                try:
                    status, text = await self._request("GET", url, path, None, 30, retry=False)
                except RolloutError as exc:
                    status, text = None, str(exc)
                if status == 200:
                    if url in self._unhealthy_until:
                        self._unhealthy_until[url] = 0.0
                    return
                if status in (401, 403):  # waiting cannot fix a key: say so now, not after the timeout
                    raise RolloutError(f"{url}{path} refused the client's API key: {status} {text[:100]}; set "
                                       f"this pool's client.api_key (or the {API_KEY_ENV} environment variable) "
                                       f"to the server's --api-key")
                last = text if status is None else f"{status} {text[:100]}"
                await asyncio.sleep(0.5)
            raise RolloutError(f"{url}{path} not healthy after {timeout_s} s: {last}")
        tasks = [one(u, "/health_generate") for u in self.config.urls]
        if self.config.router_url:
            tasks.append(one(self.config.router_url, "/health"))
        results = await asyncio.gather(*tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise RolloutError("; ".join(str(e) for e in errors))

    def wait_healthy(self, timeout_s: Optional[float] = None) -> None:
        self.run(self.await_healthy(timeout_s))


def _raise_failures(what: str, results: dict[str, Any]) -> None:
    errors = {u: r for u, r in results.items() if isinstance(r, BaseException)}
    if errors:
        detail = "; ".join(f"{u}: {e}" for u, e in errors.items())
        raise RolloutError(f"{what} failed on {len(errors)}/{len(results)} worker(s): {detail}")
