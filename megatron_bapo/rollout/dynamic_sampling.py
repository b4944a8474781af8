"""Dynamic sampling (DAPO): which finished groups a step trains, and refilling the step when too few carry signal.

A group whose G rewards are all equal has GRPO advantage 0 on every token: it costs a forward and
backward and teaches nothing. `rollout.dynamic_sampling` decides, per RL step, from the rewards of
the groups that finished in it (scored here, at rollout time, by `experience.score_groups`):

- `off`: train every finished group (the default, as before);
- `filter`: drop the zero-variance groups (the step trains fewer than `prompts_per_step`);
- `refill`: drop them and run further rollout rounds in the same step until `prompts_per_step`
  groups with non-zero variance are kept or `rollout.max_refill_rounds` extra rounds ran
  (`rollout/refill_cap_hit` then says the step trains fewer). Every refill-mode round (the step's
  first included) draws enough new prompts to keep the pipeline of unfinished groups full for the
  rounds a group takes to finish, oversampled by the observed equal-reward share plus a headroom
  (`rollout.refill_headroom`; the rule and why: `rollout.refill_forecast`), so in steady state the
  step's first round already finishes enough groups with signal and a refill round is the exception.
  A round advances every buffered sample, so refill also finishes the partial rollouts of earlier
  steps. Finished groups beyond `prompts_per_step` go back to the front of the partial-rollout
  buffer (`requeue`), scored: the next round returns them first, under the buffer's staleness
  rule, and nothing is scored twice; the next draws count them as pending.

One `DynamicSampler.produce(version)` is one step's round for the producer (`rollout.producer`),
running on the rollout client's loop: with `trainer.async_steps` = k, refill happens k steps ahead.
`version` may be a callable, read before each of the step's rounds (the producer passes the server
pool's): a sync that lands between two refill rounds is seen by the next one (its staleness cap,
its groups' `start_version`, its request seeds).

A checkpoint pauses the producer with abort (`interrupt`): a round it cuts (segments came back
aborted) is not handed over short. The step is kept (`RoundInterrupted`, saved by the checkpoint)
and the next `produce` first continues the round, sending the segments the abort cut (and only
those), then goes on as the step would have.
State: everything a step's rounds draw and finish lives in the data position and the partial-rollout
buffer, which the checkpoint holds; the sampler keeps the number of groups it carried into the next
step and a step whose round failed half-way (the prompts it drew, the groups it kept or dropped)
until the retried round completes it, and saves both (`state_dict`). A resumed run therefore draws
exactly the prompts the uninterrupted one would.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence, Union

from megatron_bapo.rollout.errors import RoundInterrupted
from megatron_bapo.rollout.refill_forecast import RefillForecast
from megatron_bapo.rollout.types import Prompt, RolloutGroup, RolloutRound, Sample, SampleState

MODES = ("off", "filter", "refill")
_LAST_VALUE = ("rollout/buffer_groups", "rollout/buffer_samples_partial")
"""Round metrics that describe the buffer after the round: the step reports the last round's."""
_SECONDS = ("rollout/step_s", "rollout/tool_s")
"""Round metrics in seconds: the step reports their sum (like the `rollout/num_*` counters)."""


def zero_variance(group: RolloutGroup) -> bool:
    """Every sample of the (scored) group has the same reward: GRPO's advantages are all 0."""
    rewards = [s.reward for s in group.samples]
    return all(r == rewards[0] for r in rewards)


@dataclass
class _Step:
    """One step's progress across its rounds (kept when a round fails, until the retry completes it)."""

    drawn: list[Prompt] = field(default_factory=list)
    kept: list[RolloutGroup] = field(default_factory=list)
    dropped: list[RolloutGroup] = field(default_factory=list)
    scored: list[RolloutGroup] = field(default_factory=list)
    """Groups that finished and were scored in this step (each group once: length and variance stats)."""
    first_round_done: bool = False
    """The step's first round (its `prompts_per_step - carried` new prompts) ran: a resumed step only refills."""
    cut: bool = False
    """A checkpoint's abort cut the step's last round: the next `produce` continues it first."""
    refill_rounds: int = 0
    num_refill_prompts: int = 0
    counters: dict[str, float] = field(default_factory=collections.Counter)
    last: dict[str, float] = field(default_factory=dict)
    rejections: list[str] = field(default_factory=list)
    rewards: Any = None
    """The step's `experience.RewardStats` (None until a group was scored)."""

    def to_dict(self) -> dict[str, Any]:
        return {"drawn": [p.to_dict() for p in self.drawn], "kept": [g.to_dict() for g in self.kept],
                "dropped": [g.to_dict() for g in self.dropped],
                "first_round_done": self.first_round_done, "cut": self.cut, "refill_rounds": self.refill_rounds,
                "num_refill_prompts": self.num_refill_prompts}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "_Step":
        return cls(drawn=[Prompt.from_dict(p) for p in d.get("drawn", [])],
                   kept=[RolloutGroup.from_dict(g) for g in d.get("kept", [])],
                   dropped=[RolloutGroup.from_dict(g) for g in d.get("dropped", [])],
                   first_round_done=bool(d.get("first_round_done", False)), cut=bool(d.get("cut", False)), refill_rounds=int(d.get("refill_rounds", 0)),
                   num_refill_prompts=int(d.get("num_refill_prompts", 0)))


Version = Union[int, Callable[[], int]]
"""A policy version, or a callable that reads the one the servers serve now."""


class DynamicSampler:
    """One RL step's round: draw, advance, score, keep / drop / refill (module docstring).

    `draw(n)`: the next n prompts. `advance(prompts, version, only_aborted=False)`: one
    partial-rollout round (start groups for `prompts`, advance every buffered sample one segment;
    `only_aborted`: only the samples an abort cut) as a `RolloutRound` of the groups that finished.
    `score(groups)`: store each sample's reward, return the statistics (`experience.score_groups`;
    run in a worker thread, off the event loop); groups its `dropped_group_ids` names (a judge
    verdict missing, `reward.judge.on_failure: drop_group`) are dropped in every mode. `requeue(groups)`: put finished groups back at the
    front of the buffer. `in_flight()`: the unfinished groups buffered (refill's draw counts them;
    None: the prompts this sampler drew that have not come back). `sample_metrics(samples)`: extra
    per-sample `rollout/*` means over the samples the step finished (the agent loop's turns and
    tool tokens). `headroom`, `window`: `rollout.refill_forecast.RefillForecast`.
    """

    def __init__(self, *, mode: str, prompts_per_step: int, max_refill_rounds: int,
                 draw: Callable[[int], Sequence[Prompt]],
                 advance: Callable[..., Awaitable[RolloutRound]],
                 score: Callable[[list[RolloutGroup]], Any], requeue: Callable[[list[RolloutGroup]], None],
                 sample_metrics: Optional[Callable[[list[Sample]], dict[str, float]]] = None,
                 in_flight: Optional[Callable[[], int]] = None, headroom: float = 0.1,
                 window: Optional[int] = None) -> None:
        if mode not in MODES:
            raise ValueError(f"DynamicSampler: mode must be one of {MODES}, got {mode!r}")
        if prompts_per_step < 1 or max_refill_rounds < 1:
            raise ValueError(f"DynamicSampler: prompts_per_step ({prompts_per_step}) and max_refill_rounds "
                             f"({max_refill_rounds}) must be >= 1")
        self.mode, self.prompts_per_step, self.max_refill_rounds = mode, prompts_per_step, max_refill_rounds
        self.draw, self.advance, self.score, self.requeue = draw, advance, score, requeue
        self.sample_metrics, self.in_flight = sample_metrics, in_flight
        self.forecast = RefillForecast(prompts_per_step=prompts_per_step, headroom=headroom,
                                       window=window or 4 * prompts_per_step)
        self._step = _Step()
        self._carried = 0
        """Finished groups the last step put back into the buffer (refill): pending for the next draws."""
        self._interrupted = False

    def interrupt(self, flag: bool) -> None:
        """While set, a step stops after a round the abort cut, or before its next refill round
        (`RoundInterrupted`), and is kept: a checkpoint then saves it (`state_dict`) and the next
        `produce` completes it."""
        self._interrupted = flag

    async def produce(self, version: Version) -> RolloutRound:
        """The step's round at policy `version` (a callable is read before each round): its drawn
        prompts (refill draws included), the groups it trains (scored), the groups it dropped, and
        its metrics."""
        step = self._step
        if step.cut:  # a checkpoint's abort cut the last round: send what it cut before anything else
            step.cut = False
            await self._round(0, version, step, only_aborted=True)
            self._stop_if_cut(step)
        if not step.first_round_done:
            await self._round(self._first_draw(), version, step)
            step.first_round_done = True
            self._stop_if_cut(step)
        if self.mode == "refill":
            while len(step.kept) < self.prompts_per_step and step.refill_rounds < self.max_refill_rounds:
                if self._interrupted:
                    raise RoundInterrupted(f"step interrupted after {step.refill_rounds} refill round(s)")
                step.refill_rounds += 1
                num_new = self.forecast.draw_size(pending=len(step.kept), in_flight=self._in_flight())
                await self._round(num_new, version, step, refill=True)
                self._stop_if_cut(step)
        target = self.prompts_per_step if self.mode == "refill" else len(step.kept)
        trained, surplus = step.kept[:target], step.kept[target:]
        if surplus:
            self.requeue(surplus)
        metrics = self._metrics(step, trained, surplus)
        self._step, self._carried = _Step(), len(surplus)
        return RolloutRound(prompts=step.drawn, groups=trained, dropped=step.dropped, metrics=metrics,
                            rejections=step.rejections)

    def _first_draw(self) -> int:
        if self.mode != "refill":
            return self.prompts_per_step
        return self.forecast.draw_size(pending=self._carried, in_flight=self._in_flight())

    def _in_flight(self) -> int:
        return self.in_flight() if self.in_flight is not None else len(self.forecast.drawn_at)

    @staticmethod
    def _stop_if_cut(step: _Step) -> None:
        if step.cut:
            raise RoundInterrupted("a round was cut by an abort (checkpoint); the next produce continues it")

    async def _round(self, num_new: int, version: Version, step: _Step, *, refill: bool = False,
                     only_aborted: bool = False) -> None:
        prompts = list(self.draw(num_new)) if num_new > 0 else []
        step.drawn += prompts  # recorded before the round runs: a failed round's prompts stay buffered
        if refill:
            step.num_refill_prompts += len(prompts)
        if not only_aborted:
            self.forecast.round_started(p.index for p in prompts)
        current = version() if callable(version) else version
        if only_aborted:
            done = await self.advance(prompts, current, only_aborted=True)
        else:
            done = await self.advance(prompts, current)
        for key, value in done.metrics.items():
            if key in _LAST_VALUE:
                step.last[key] = value
            elif key.startswith("rollout/num_") or key in _SECONDS:
                step.counters[key] += value
        step.rejections += done.rejections
        fresh = [g for g in done.groups if any(s.reward is None for s in g.samples)]
        lost: set[str] = set()
        if fresh:
            stats = await asyncio.get_running_loop().run_in_executor(None, self.score, fresh)
            lost = set(getattr(stats, "dropped_group_ids", ()))
            if step.rewards is None:
                step.rewards = stats
            else:
                step.rewards.add(stats)
        step.scored += fresh
        fresh_ids = {id(g) for g in fresh}
        for g in done.groups:
            unusable = g.group_id in lost or zero_variance(g)
            self.forecast.group_finished(g.prompt.index, unusable, scored_now=id(g) in fresh_ids)
            drop = g.group_id in lost or (self.mode != "off" and zero_variance(g))
            (step.dropped if drop else step.kept).append(g)
        if self._interrupted and done.metrics.get("rollout/num_aborted_segments", 0) > 0:
            step.cut = True

    def _metrics(self, step: _Step, trained: list[RolloutGroup], surplus: list[RolloutGroup]) -> dict[str, float]:
        out = dict(step.counters)
        out.update(step.last)
        seconds = out.get("rollout/step_s", 0.0)
        out["rollout/tokens_per_s"] = out.get("rollout/num_tokens_generated", 0.0) / seconds if seconds > 0 else 0.0
        samples = [s for g in step.scored for s in g.samples]
        if samples:
            lengths = [s.response_length for s in samples]
            out["rollout/response_len_mean"] = sum(lengths) / len(lengths)
            out["rollout/response_len_max"] = float(max(lengths))
            out["rollout/frac_truncated"] = sum(s.state is SampleState.TRUNCATED for s in samples) / len(samples)
            out["rollout/segments_per_sample"] = sum(s.num_segments for s in samples) / len(samples)
            if self.sample_metrics is not None:
                out.update(self.sample_metrics(samples))
        if step.rewards is not None:
            out.update(step.rewards.metrics())
        lost = set(getattr(step.rewards, "dropped_group_ids", None) or ())  # no verdict: judge/num_groups_dropped
        judged = [g for g in step.scored if g.group_id not in lost]
        num_zero = sum(zero_variance(g) for g in judged)
        out["rollout/num_zero_variance_groups"] = float(num_zero)
        if judged:
            out["rollout/zero_variance_frac"] = num_zero / len(judged)
        out["rollout/num_prompts_drawn"] = float(len(step.drawn))
        if self.mode != "off":
            out["experience/num_groups_filtered"] = float(sum(g.group_id not in lost for g in step.dropped))
        if self.mode == "refill":
            out["rollout/refill_rounds"] = float(step.refill_rounds)
            out["rollout/refill_prompts"] = float(step.num_refill_prompts)
            out["rollout/refill_cap_hit"] = float(len(trained) < self.prompts_per_step)
            out["rollout/num_surplus_groups"] = float(len(surplus))
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: a step a failed round or a checkpoint's abort interrupted, the carried count, the forecast."""
        return {"step": self._step.to_dict(), "carried": self._carried, "forecast": self.forecast.state_dict()}

    def load_state_dict(self, state: dict[str, Any], *, legacy_unrecorded: Sequence[dict] = ()) -> None:
        """Restore `state_dict`; `legacy_unrecorded`: prompts an older producer saved as drawn by a
        failed round (reported with the next step's)."""
        self._step = _Step.from_dict(state.get("step", {}))
        self._carried = int(state.get("carried", 0))
        self.forecast.load_state_dict(state.get("forecast", {}))
        self._step.drawn[:0] = [Prompt.from_dict(p) for p in legacy_unrecorded]


def manager_round(manager: Any) -> Callable[..., Awaitable[RolloutRound]]:
    """`advance` for a `PartialRolloutManager`: one `astep` as a `RolloutRound`."""
    async def advance(prompts: Sequence[Prompt], version: int, only_aborted: bool = False) -> RolloutRound:
        return await manager.astep(list(prompts), version, only_aborted=only_aborted)
    return advance


def in_flight_of(manager: Any) -> Callable[[], int]:
    """`in_flight` for a `PartialRolloutManager`: its unfinished, unfailed buffered groups."""
    def in_flight() -> int:
        return sum(1 for g in manager.buffer if not g.finished and not g.failed)
    return in_flight


def requeue_into(manager: Any) -> Callable[[list[RolloutGroup]], None]:
    """`requeue` for a `PartialRolloutManager`: finished groups back at the front of its buffer."""
    def requeue(groups: list[RolloutGroup]) -> None:
        manager.buffer[:0] = groups
    return requeue


def rollout_round(manager: Any, draw: Callable[[], Sequence[Prompt]]) -> Callable[[Version], Awaitable[RolloutRound]]:
    """A producer's round without dynamic sampling or rewards: `draw()` then one `astep` (tests, tools)."""
    advance = manager_round(manager)

    async def produce(version: Version) -> RolloutRound:
        return await advance(list(draw()), version() if callable(version) else version)
    return produce

