"""Sampling n responses per prompt through SGLang-compatible `/generate` servers.

Evaluation needs only text and finish reasons (no log-probs, no versions), so any object with an
`async generate(input_ids, sampling_params) -> Sample` method can drive it. `ClientSampler` adapts
the project's one client of the servers (`megatron_bapo.rollout.RolloutClient`: server choice,
retries with backoff and failover, API key), so evaluation, rollout and weight sync share one
connection pool and one retry policy.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol, Sequence

from megatron_bapo.eval.core import Sample

logger = logging.getLogger(__name__)


class Sampler(Protocol):
    async def generate(self, input_ids: list[int], sampling_params: dict) -> Sample: ...


class SamplingError(RuntimeError):
    """A request failed on every server and every retry."""


class ClientSampler:
    """`generate` through a `RolloutClient` (call it on the client's loop, e.g. via `client.run`).

    A request that fails on every retry raises `SamplingError`; a 4xx (a bad request: retrying
    cannot help) gives a `Sample` with `finish_reason="error"`, which scores 0 and is counted.
    """

    def __init__(self, client: Any) -> None:
        self.client = client

    async def generate(self, input_ids: list[int], sampling_params: dict) -> Sample:
        from megatron_bapo.rollout.errors import RequestRejected, RolloutError

        try:
            res = await self.client.agenerate(list(input_ids), dict(sampling_params))
        except RequestRejected as exc:
            logger.warning("a server rejected an evaluation request: %s", exc)
            return Sample(text="", finish_reason="error", num_tokens=0, error=str(exc))
        except RolloutError as exc:
            raise SamplingError(str(exc)) from exc
        return Sample(text=res.text, finish_reason=res.finish_type, num_tokens=len(res.output_ids))


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
