"""Rollout rounds produced ahead of training (`trainer.async_steps`), on the rollout client's loop.

A round is one step's rollout, `produce(version)`: draw the step's new prompts (unless older groups
still wait unstarted: `manager.ready_for_prompts`), advance every buffered sample by one segment
(`PartialRolloutManager.astep`), collect and score the groups that finished and keep the ones the
step trains (`rollout.dynamic_sampling.DynamicSampler`, which may run more such rounds in the step
to refill it). A sync's "abort" pause ends the round in flight at once (the requests running return
their partial tokens, the ones still waiting in the client are not sent): the trainer takes it
without waiting for a tail, and the next round continues every response on the new weights. The
producer runs rounds as a task on the client's event loop and hands them to the trainer thread in
order (`next`):

- pacing: round r may start once the trainer has asked for round r - `ahead`. With `ahead` = 0 a
  round starts only when the trainer asks for it (the synchronous loop: generate, then train); with
  `ahead` = k the rounds of steps n+1..n+k run while the actor trains step n.
- versions: `produce` gets `served_version` (the server pool's) and reads it before each of the
  step's rounds (a refilling step runs several; a sync can land between them), and passes the version
  the servers serve to the manager, which labels tokens with the servers' reported versions. Staleness is judged per
  token when the round is trained (the driver masks tokens older than `rollout.max_staleness`), so
  a finished group is always handed over as it is.
- results: every round's groups, metrics and rejections are `produce`'s return value; the producer
  never reads or writes the manager's state.
- checkpoints: `pause()` lets the running round finish and starts no new one; then `state_dict()`
  holds the finished rounds not yet handed over (prompts, tokens, log-probs, versions) next to the
  manager's buffer, and nothing is in flight. With `pause(abort=True)` the round in flight is cut
  and the step is interrupted (`RoundInterrupted`) instead of handed over short: the sampler keeps
  it (and checkpoints it), and after `resume()` it first sends the segments the abort cut, then
  completes the step (a refilling step its further rounds), so a checkpoint never shortens a round. `resume()` goes on. A restored producer hands the
  saved rounds over first, so no prompt is lost or drawn twice across a kill and resume.
- errors: a round that fails (RolloutError: every server failed; its groups stay buffered) stops
  the producer and the trainer's next `next()` raises it, as the synchronous loop would; the prompts
  it drew are reported by the round that completes the step (the sampler keeps them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Optional

from megatron_bapo.rollout.errors import RoundInterrupted
from megatron_bapo.rollout.partial import PartialRolloutManager
from megatron_bapo.rollout.types import RolloutRound

logger = logging.getLogger(__name__)

__all__ = ["RolloutProducer", "RolloutRound"]


class RolloutProducer:
    """Produces rounds on `client`'s event loop; the trainer thread calls `next`, `pause`, `resume`."""

    def __init__(self, client: Any, manager: PartialRolloutManager, produce: Callable[[int], Awaitable[RolloutRound]],
                 *, ahead: int, served_version: Callable[[], int],
                 interrupt: Optional[Callable[[bool], None]] = None) -> None:
        """`produce(version)`: one step's round (`DynamicSampler.produce`; `dynamic_sampling.rollout_round`
        without rewards). `served_version`: the version the servers serve now (`ServerPool.version`),
        read when a round starts. `interrupt(flag)`: told True by `pause(abort=True)` and False by
        `resume()` (`DynamicSampler.interrupt`), so that a refilling step stops between its rounds."""
        if ahead < 0:
            raise ValueError(f"RolloutProducer: ahead must be >= 0, got {ahead}")
        self.client, self.manager, self.produce, self.ahead = client, manager, produce, ahead
        self.served_version, self.interrupt = served_version, interrupt
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
            try:
                done = await self.produce(self.served_version)  # read before each of the step's rounds
            except RoundInterrupted:  # paused with abort mid-step: the sampler keeps the step, resume completes it
                async with cond:
                    self._busy = False
                    cond.notify_all()
                continue
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
    async def _next(self) -> tuple[RolloutRound, float]:
        started = time.monotonic()
        async with self._cond:
            self.requested += 1
            self._cond.notify_all()
            await self._cond.wait_for(lambda: self.ready or self._error is not None)
            if not self.ready:
                self.requested -= 1  # not handed over: asking again after a restart is the same request
                raise self._error
            done = self.ready.pop(0)
        return done, time.monotonic() - started

    def next(self) -> tuple[RolloutRound, float]:
        """The next round (waiting for it) and the seconds the trainer waited. Raises the producer's
        error if it stopped."""
        return self.client.run(self._next())

    async def _pause(self, abort: bool) -> None:
        async with self._cond:
            self._paused = True
            busy = self._busy
        if abort and busy:  # the round's requests come back now, with the tokens they have (kept, resumed later)
            if self.interrupt is not None:
                self.interrupt(True)
            await self.client.aabort_all()
        async with self._cond:
            await self._cond.wait_for(lambda: not self._busy)

    def pause(self, *, abort: bool = False) -> None:
        """Start no new round and wait for the running one (nothing in flight afterwards). `abort`: do
        not let it run to its end: its requests are aborted, and every response keeps the tokens it
        has as a partial rollout (state ABORTED, resumed by the next round); the groups it finished are
        its result. A checkpoint pauses so: at 64k tokens a round runs for minutes, while every rank waits."""
        self.client.run(self._pause(abort))

    async def _resume(self) -> None:
        if self.interrupt is not None:
            self.interrupt(False)
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
