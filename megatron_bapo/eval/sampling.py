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

MAX_AGENT_ROUNDS = 100
"""Rounds the agent sampler waits for samples that keep coming back aborted before it gives up."""

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


class AgentSampler:
    """Evaluation through the agent loop of multi-turn rollouts (`rollout.agent`): the same loop,
    call format and tools as training, run by a partial-rollout manager of its own (n samples per
    problem as one group, the whole response in one round). A request the server rejects (4xx)
    drops its group, whose n samples then score 0 as errors; one that fails on every server raises
    `SamplingError`."""

    def __init__(self, client: Any, agent: Any, tokenizer: Any) -> None:
        self.client, self.agent, self.tokenizer = client, agent, tokenizer

    async def sample_many(self, prompts_ids: Sequence[list[int]], n: int, sampling_params: dict, *,
                          concurrency: int = 64) -> list[list[Sample]]:
        """n samples per prompt; `concurrency` bounds the samples in flight (whole groups)."""
        from megatron_bapo.rollout import PartialRolloutConfig, PartialRolloutManager, Prompt, RolloutError, SamplingConfig

        params = dict(sampling_params)
        sampling = SamplingConfig(temperature=params.pop("temperature", 1.0), top_p=params.pop("top_p", 1.0),
                                  extra={k: v for k, v in params.items() if k != "max_new_tokens"})
        config = PartialRolloutConfig(group_size=n, max_response_tokens=int(sampling_params["max_new_tokens"]),
                                      segment_tokens=None, max_staleness=None, sampling=sampling)
        manager = PartialRolloutManager(self.client, config, agent=self.agent)
        manager._warned_version = True  # evaluation labels no versions: the servers' "default" is fine
        out: list[list[Sample]] = [[Sample(text="", finish_reason="error", error="request rejected")] * n
                                   for _ in prompts_ids]
        chunk = max(1, concurrency // n)
        for first in range(0, len(prompts_ids), chunk):
            prompts = [Prompt(list(ids), index=first + k) for k, ids in enumerate(prompts_ids[first:first + chunk])]
            try:
                groups = (await manager.astep(prompts, 0)).groups
                for _ in range(MAX_AGENT_ROUNDS):
                    if not manager.buffer:
                        break
                    groups += (await manager.astep([], 0)).groups
            except RolloutError as exc:
                raise SamplingError(str(exc)) from exc
            if manager.buffer:
                raise SamplingError(f"{len(manager.buffer)} evaluation groups still unfinished after "
                                    f"{MAX_AGENT_ROUNDS} rounds (their requests keep being aborted)")
            for g in groups:
                out[g.prompt.index] = [self._sample(s) for s in g.samples]
        return out

    def _sample(self, s: Any) -> Sample:
        from megatron_bapo.rollout import SampleState

        agent = s.agent
        tool_tokens = agent.num_tool_tokens if agent else 0
        return Sample(text=self.tokenizer.decode(s.response_ids, skip_special_tokens=True),
                      finish_reason="stop" if s.state is SampleState.COMPLETED else "length",
                      num_tokens=s.response_length - tool_tokens, num_tool_calls=agent.num_tool_calls if agent else 0,
                      num_turns=len(agent.tool_spans) + 1 if agent else 1)
