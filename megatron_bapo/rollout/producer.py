"""Rollout rounds produced ahead of training (`trainer.async_steps`), on the rollout client's loop.

A round is one step's rollout, `produce(version)`: draw the step's new prompts, advance every buffered
sample by one segment (`PartialRolloutManager.astep`), collect and score the groups that finished and
keep the ones the step trains (`rollout.dynamic_sampling.DynamicSampler`, which may run more such
rounds in the step to refill it). The producer runs rounds as a task on the client's event loop and
hands them to the trainer thread in order (`next`):

- pacing: round r may start once the trainer has asked for round r - `ahead`. With `ahead` = 0 a
  round starts only when the trainer asks for it (the synchronous loop: generate, then train); with
  `ahead` = k the rounds of steps n+1..n+k run while the actor trains step n.
- versions: a round passes the newest version the trainer published (`publish`) to the manager,
  which labels tokens with the servers' reported versions; when a round is handed over, groups
  holding a token more than `max_staleness` versions behind the trainer's version are reset into
  the buffer (regenerated, counted), so the cap bounds what is TRAINED, not only what is resumed.
- checkpoints: `pause()` lets the running round finish and starts no new one; then `state_dict()`
  holds the finished rounds not yet handed over (prompts, tokens, log-probs, versions) next to the
  manager's buffer, and nothing is in flight. `resume()` goes on. A restored producer hands the
  saved rounds over first, so no prompt is lost or drawn twice across a kill and resume.
- errors: a round that fails (RolloutError: every server failed; its groups stay buffered) stops
  the producer and the trainer's next `next()` raises it, as the synchronous loop would; the prompts
  it drew are reported by the round that completes the step (the sampler keeps them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

from megatron_bapo.rollout.partial import PartialRolloutManager
from megatron_bapo.rollout.types import Prompt, RolloutGroup

logger = logging.getLogger(__name__)


@dataclass
class RolloutRound:
    """One round: the prompts it drew, the groups it trains, the groups it dropped, its `rollout/*` metrics."""

    prompts: list[Prompt]
    groups: list[RolloutGroup]
    metrics: dict[str, float] = field(default_factory=dict)
    rejections: list[str] = field(default_factory=list)
    """The servers' messages for requests they rejected (4xx) in this round (their groups were dropped)."""
    dropped: list[RolloutGroup] = field(default_factory=list)
    """Finished groups not trained because their rewards are all equal (`rollout.dynamic_sampling`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"prompts": [p.to_dict() for p in self.prompts], "groups": [g.to_dict() for g in self.groups],
                "metrics": dict(self.metrics), "rejections": list(self.rejections),
                "dropped": [g.to_dict() for g in self.dropped]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RolloutRound":
        return cls(prompts=[Prompt.from_dict(p) for p in d["prompts"]],
                   groups=[RolloutGroup.from_dict(g) for g in d["groups"]], metrics=dict(d.get("metrics", {})),
                   rejections=list(d.get("rejections", [])),
                   dropped=[RolloutGroup.from_dict(g) for g in d.get("dropped", [])])


class RolloutProducer:
    """Produces rounds on `client`'s event loop; the trainer thread calls `next`, `publish`, `pause`."""

    def __init__(self, client: Any, manager: PartialRolloutManager, produce: Callable[[int], Awaitable[RolloutRound]],
                 *, ahead: int, version: int = 0) -> None:
        """`produce(version)`: one step's round (`DynamicSampler.produce`; `dynamic_sampling.rollout_round`
        without rewards)."""
        if ahead < 0:
            raise ValueError(f"RolloutProducer: ahead must be >= 0, got {ahead}")
        self.client, self.manager, self.produce, self.ahead = client, manager, produce, ahead
        self.version = version
        self.ready: list[RolloutRound] = []
        self.requested = 0
        """Rounds the trainer has asked for (handed over or being waited for)."""
        self.produced = 0
        self._paused = False
        self._busy = False
        self._error: Optional[BaseException] = None
        self._task: Optional[asyncio.Task] = None
        self._cond = asyncio.Condition()  # binds to the client's loop on first use

    # ------------------------------------------------------------------ the producing task
    async def _run(self) -> None:
        cond = self._cond
        while True:
            async with cond:
                await cond.wait_for(lambda: not self._paused and self.produced < self.requested + self.ahead)
                self._busy = True
                version = self.version
            try:
                done = await self.produce(version)
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer thread by next()
                # The failed round's groups stay buffered; the round that completes the step reports its prompts.
                async with cond:
                    self._error, self._busy = exc, False
                    cond.notify_all()
                return
            async with cond:
                self.ready.append(done)
                self.produced += 1
                self._busy = False
                cond.notify_all()

    async def _start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def start(self) -> None:
        """Start producing (rounds restored by `load_state_dict` are handed over first)."""
        self.client.run(self._start())

    # ------------------------------------------------------------------ the trainer's side
    async def _next(self, version: int) -> tuple[RolloutRound, float]:
        started = time.monotonic()
        async with self._cond:
            self.requested += 1
            self._cond.notify_all()
            await self._cond.wait_for(lambda: self.ready or self._error is not None)
            if not self.ready:
                self.requested -= 1  # not handed over: asking again after a restart is the same request
                raise self._error
            done = self.ready.pop(0)
        kept = self._drop_stale(done.groups, version)
        regenerated = sum(len(g.samples) for g in done.groups if all(g is not k for k in kept))
        if regenerated:  # the step that trains this round reports them with the round's own
            done.metrics["rollout/num_regenerated"] = done.metrics.get("rollout/num_regenerated", 0.0) + regenerated
        done.groups = kept
        return done, time.monotonic() - started

    def next(self, version: int) -> tuple[RolloutRound, float]:
        """The next round (waiting for it), its stale groups sent back for regeneration, and the
        seconds the trainer waited. Raises the producer's error if it stopped."""
        return self.client.run(self._next(version))

    def _drop_stale(self, groups: list[RolloutGroup], version: int) -> list[RolloutGroup]:
        """Groups too stale to train at `version` go back into the manager's buffer, reset."""
        cap = self.manager.config.max_staleness
        if cap is None:
            return groups
        keep, stale = [], []
        for g in groups:
            oldest = min((v for s in g.samples for v in s.response_versions), default=version)
            (stale if version - oldest > cap else keep).append(g)
        for g in stale:
            for s in g.samples:
                s.reset()
                s.num_regenerations += 1
            self.manager.totals["num_regenerated"] += len(g.samples)
        self.manager.buffer[:0] = stale  # regenerated first, as the oldest groups
        if stale:
            logger.info("%d finished group(s) more than %d versions behind version %d: regenerated", len(stale), cap, version)
        return keep

    async def _publish(self, version: int) -> None:
        async with self._cond:
            self.version = version

    def publish(self, version: int) -> None:
        """The servers now serve `version`: rounds started from now on use it."""
        self.client.run(self._publish(version))

    async def _pause(self) -> None:
        async with self._cond:
            self._paused = True
            await self._cond.wait_for(lambda: not self._busy)

    def pause(self) -> None:
        """Let the running round finish and start no new one (nothing in flight afterwards)."""
        self.client.run(self._pause())

    async def _resume(self) -> None:
        async with self._cond:
            self._paused = False
            self._cond.notify_all()

    def resume(self) -> None:
        self.client.run(self._resume())

    async def _restart(self) -> None:
        async with self._cond:
            self._error = None
        self._task = asyncio.ensure_future(self._run())

    def restart(self) -> None:
        """Produce again after a failed round (its groups stayed in the buffer: nothing is lost)."""
        self.client.run(self._restart())

    def stop(self) -> None:
        """Cancel the producing task (in-flight requests are aborted by the caller)."""
        if self._task is not None:
            self.client.loop.call_soon_threadsafe(self._task.cancel)
            self._task = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe: finished rounds not handed over yet (call while paused; the buffer is the manager's)."""
        if self._busy:
            raise RuntimeError("RolloutProducer.state_dict while a round runs; pause() first")
        return {"ready": [r.to_dict() for r in self.ready]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before `start()`: the saved rounds are handed over first, in order."""
        self.ready = [RolloutRound.from_dict(r) for r in state.get("ready", [])]
        self.produced = len(self.ready)
