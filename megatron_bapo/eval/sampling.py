"""Sampling n responses per prompt through SGLang-compatible `/generate` servers.

Evaluation needs only text and finish reasons (no log-probs, no versions), so any object with an
`async generate(input_ids, sampling_params) -> Sample` method can drive it: `HttpSampler` below
(plain round-robin over server URLs with retries and failover) or an adapter over the project's
rollout client (`megatron_bapo.eval.runner.as_sampler`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from typing import Optional, Protocol, Sequence

from megatron_bapo.eval.core import Sample

logger = logging.getLogger(__name__)


class Sampler(Protocol):
    async def generate(self, input_ids: list[int], sampling_params: dict) -> Sample: ...


class SamplingError(RuntimeError):
    """A request failed on every server and every retry."""


class HttpSampler:
    """POST `/generate` with `input_ids` to a pool of servers (or one router URL).

    One request per sample (as slime does; SGLang's `n` fan-out drops request ids). A request that
    fails (connection error, 5xx, timeout) is retried with exponential backoff on the next server;
    `SamplingError` after the last retry. A 4xx (a bad request: retrying cannot help) gives a
    `Sample` with `finish_reason="error"`, which scores 0 and is counted, not raised.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        request_timeout_s: float = 3600.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
    ) -> None:
        if not urls:
            raise ValueError("HttpSampler needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._next = itertools.cycle(range(len(self.urls)))
        self._session = None

    async def __aenter__(self) -> "HttpSampler":
        import aiohttp

        # limit=0: concurrency is capped by the caller's semaphore, not by the connection pool.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s), connector=aiohttp.TCPConnector(limit=0)
        )
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def generate(self, input_ids: list[int], sampling_params: dict) -> Sample:
        import aiohttp

        if self._session is None:
            raise RuntimeError("use `async with HttpSampler(...)` before generate()")
        payload = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params), "rid": uuid.uuid4().hex}
        last_error: Optional[BaseException] = None
        for attempt in range(self.max_retries + 1):
            url = self.urls[next(self._next)]
            try:
                async with self._session.post(f"{url}/generate", json=payload) as resp:
                    if 400 <= resp.status < 500:
                        # The request itself is bad (e.g. prompt + max_new_tokens over the context):
                        # retrying cannot help; the sample is recorded as an error and counted.
                        message = (await resp.text())[:500]
                        logger.warning("%s/generate rejected a request (%d): %s", url, resp.status, message)
                        return Sample(text="", finish_reason="error", num_tokens=0, error=f"{resp.status}: {message}")
                    if resp.status != 200:
                        raise SamplingError(f"{url}/generate returned {resp.status}: {(await resp.text())[:200]}")
                    body = await resp.json()
                return _to_sample(body)
            except (aiohttp.ClientError, asyncio.TimeoutError, SamplingError) as exc:
                last_error = exc
                logger.warning("generate on %s failed (attempt %d/%d): %r", url, attempt + 1, self.max_retries + 1, exc)
                payload["rid"] = uuid.uuid4().hex  # a retried request must not reuse an in-flight id
                await asyncio.sleep(self.backoff_s * (2**attempt))
        raise SamplingError(f"generate failed on {self.urls} after {self.max_retries + 1} attempts: {last_error!r}")


def _to_sample(body: dict) -> Sample:
    meta = body.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
    num_tokens = meta.get("completion_tokens")
    if num_tokens is None:
        num_tokens = len(body.get("output_ids") or [])
    return Sample(text=body.get("text") or "", finish_reason=kind, num_tokens=int(num_tokens))


async def sample_all(
    sampler: Sampler,
    prompts_ids: Sequence[list[int]],
    n: int,
    sampling_params: dict,
    *,
    concurrency: int = 64,
) -> list[list[Sample]]:
    """n samples for every prompt, all requests in flight together up to `concurrency`."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(ids: list[int]) -> Sample:
        async with semaphore:
            return await sampler.generate(ids, sampling_params)

    tasks = [asyncio.ensure_future(one(ids)) for ids in prompts_ids for _ in range(n)]
    try:
        flat = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
    return [list(flat[i * n : (i + 1) * n]) for i in range(len(prompts_ids))]
