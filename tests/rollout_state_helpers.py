"""Shared helpers for the tests of a checkpoint's rollout state: a token list that notices when its
values are read, buffers that hold such lists, and a real `Driver` holding a real rollout (manager,
producer, sampler, client loop) without servers (it is checkpointed, never asked to sample)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from megatron_bapo.rollout.types import AgentState, Prompt, RolloutGroup, RolloutRound, Sample, SampleState

READ_WAIT_S = 120.0
"""How long a read off the main thread waits for the test to open the gate (a guard against a hang)."""


class GatedList(list):
    """A token list that notices reads of its values. On the main thread while `armed` (the save's
    pause, which must read no value) a read fails; on any other thread (the driver's writer) it waits
    until `opened` is set, so the test decides when the values are read."""

    armed = False
    opened = threading.Event()
    reads_under_pause = 0

    def _read(self) -> None:
        if threading.current_thread() is threading.main_thread():
            if GatedList.armed:
                GatedList.reads_under_pause += 1
                raise AssertionError("a token value was read under the checkpoint's pause")
        elif not GatedList.opened.wait(READ_WAIT_S):
            raise AssertionError("the test never opened the gate")

    def __iter__(self):
        self._read()
        return super().__iter__()

    def __getitem__(self, index):
        self._read()
        return super().__getitem__(index)


def gated_groups(tokens: int = 3000) -> list[RolloutGroup]:
    """Two groups whose token lists are `GatedList`s: partial, aborted (tool tokens), finished, with
    routing bytes and with none."""
    def sample(seed: int, n: int, state: SampleState, **kw: Any) -> Sample:
        return Sample(prompt_ids=GatedList([5, 6, 7]),
                      response_ids=GatedList((seed * 31 + j) % 151_936 for j in range(n)),
                      response_logprobs=GatedList(-((seed + j) % 97) / 8.0 for j in range(n)),
                      response_versions=GatedList([3] * n), state=state, num_segments=1, **kw)

    first = [sample(1, tokens, SampleState.PARTIAL, routed_experts=bytes(range(200)) * 2, routed_width=2),
             sample(2, tokens // 2, SampleState.ABORTED, agent=AgentState(tool_spans=[[0, 4]])),
             sample(3, 40, SampleState.COMPLETED, reward=1.0,  # scored by a teacher (on-policy distillation)
                    teacher_logprobs=GatedList(-(j % 13) / 3.0 for j in range(40)))]
    second = [sample(4, tokens, SampleState.PARTIAL), sample(5, 0, SampleState.PENDING),
              sample(6, 7, SampleState.PARTIAL)]
    return [RolloutGroup(group_id="a", prompt=Prompt(prompt_ids=GatedList([5, 6, 7]), answer="7", index=4),
                         samples=first, start_version=2),
            RolloutGroup(group_id="b", prompt=Prompt(prompt_ids=GatedList([8]), index=5), samples=second,
                         start_version=3)]


def grow_and_reset(groups: list[RolloutGroup]) -> None:
    """What the rollout does after a checkpoint's pause: segments extend live lists, a tool appends its
    tokens, a routing grows (new bytes), a stale sample is reset (new lists, no teacher log-probs)."""
    a, b = groups
    a.samples[0].response_ids.extend([1, 2, 3])
    a.samples[0].response_logprobs.extend([-0.5, -0.25, -0.125])
    a.samples[0].response_versions.extend([9, 9, 9])
    a.samples[0].routed_experts += b"\x01\x00" * 4
    a.samples[1].append_tool_tokens([11, 12])
    a.samples[2].teacher_logprobs = None  # reset for a regeneration: the teacher's list is replaced, never edited
    b.samples[0].reset()
    b.samples[0].response_ids.extend([42] * 5)


class _Position:
    """The dataset's place in the driver state (`PromptDataset.state_dict`'s shape); no file behind it."""

    def state_dict(self) -> dict[str, Any]:
        return {"format": 1, "epoch": 0, "position": 2, "num_prompts": 10, "seed": 0, "shuffle": False}


def rollout_driver(config: Any, output_dir: Path, groups: list[RolloutGroup]) -> Any:
    """A real `Driver` whose partial-rollout buffer holds `groups[1:]` and whose producer holds a round
    produced ahead with `groups[:1]`; its client's loop runs (the producer pauses and resumes on it),
    its one URL is never asked."""
    from megatron_bapo.driver import Driver
    from megatron_bapo.rollout.client import RolloutClient
    from megatron_bapo.rollout.config import PartialRolloutConfig, RolloutClientConfig
    from megatron_bapo.rollout.dynamic_sampling import DynamicSampler
    from megatron_bapo.rollout.partial import PartialRolloutManager
    from megatron_bapo.rollout.producer import RolloutProducer

    async def never(*_a: Any) -> Any:
        raise AssertionError("the test's driver was asked to sample")

    driver = Driver(config, output_dir)
    driver.client = RolloutClient(RolloutClientConfig(urls=["http://127.0.0.1:9"]))
    manager = PartialRolloutManager(driver.client, PartialRolloutConfig(group_size=3, max_response_tokens=1 << 16,
                                                                        segment_tokens=1 << 16))
    manager.buffer = list(groups[1:])
    driver.producer = RolloutProducer(driver.client, manager, never, ahead=1, served_version=lambda: 0)
    driver.producer.ready = [RolloutRound(prompts=[g.prompt for g in groups[:1]], groups=list(groups[:1]))]
    driver.sampler = DynamicSampler(mode="off", prompts_per_step=1, max_refill_rounds=1, draw=lambda n: [],
                                    advance=never, score=lambda g: None, requeue=lambda g: None)
    driver.dataset = _Position()
    return driver


def driver_state_now(driver: Any) -> dict[str, Any]:
    """The driver's rollout state as plain copies (`to_dict` outside `live_lists`): what a restore must equal."""
    return {"rollout": driver.producer.manager.state_dict(), "rounds": driver.producer.state_dict()}
