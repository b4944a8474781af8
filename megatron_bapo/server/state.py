"""Server-wide state shared by the HTTP handlers: the engine, the pause gate and the reader/writer
discipline between `/generate` calls and weight updates (SGLang's semantics, spec sections 2, 9, 12).

- `/generate` calls are readers: they wait while paused or while a weight update waits, then count
  themselves in `inflight` until they reply.
- A weight update that is not under a pause is a writer: it waits until no `/generate` is in flight
  (after aborting them when `abort_all_requests`). Under a pause it proceeds at once; the engine's
  step lock still keeps the swap between decode steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Optional

from megatron_bapo.server.config import ServerConfig
from megatron_bapo.server.engine import Engine
from megatron_bapo.server.protocol import RequestError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class ServerState:
    config: ServerConfig
    engine: Engine
    tokenizer: object
    model_path: str
    weight_version: str
    context_length: int
    vocab_size: int
    paused: bool = False
    shutting_down: bool = False
    inflight: int = 0
    writers_waiting: int = 0
    active_rids: set = dataclasses.field(default_factory=set)
    cond: Optional[asyncio.Condition] = None
    update_lock: Optional[asyncio.Lock] = None
    weight_groups: dict = dataclasses.field(default_factory=dict)

    def bind_loop(self) -> None:
        """Create the asyncio primitives on the running loop."""
        self.cond = asyncio.Condition()
        self.update_lock = asyncio.Lock()

    async def enter_generate(self, rids: list) -> None:
        """Wait at the pause gate and behind waiting writers, then register `rids` as in flight."""
        async with self.cond:
            await self.cond.wait_for(lambda: not self.paused and self.writers_waiting == 0)
            if self.active_rids.intersection(rids):
                raise RequestError("Duplicate request ID detected.")
            self.inflight += 1
            self.active_rids.update(rids)

    async def exit_generate(self, rids: list) -> None:
        async with self.cond:
            self.inflight -= 1
            self.active_rids.difference_update(rids)
            self.cond.notify_all()

    async def set_paused(self, paused: bool) -> None:
        async with self.cond:
            self.paused = paused
            self.cond.notify_all()

    async def acquire_writer(self, abort_all: bool) -> bool:
        """Writer side of the lock; returns False (nothing taken) while paused, as SGLang skips it."""
        if self.paused:
            if abort_all:
                self.engine.abort(abort_all=True)
            return False
        async with self.cond:
            self.writers_waiting += 1
        if abort_all:
            self.engine.abort(abort_all=True)
        async with self.cond:
            await self.cond.wait_for(lambda: self.inflight == 0)
        return True

    async def release_writer(self, taken: bool) -> None:
        if not taken:
            return
        async with self.cond:
            self.writers_waiting -= 1
            self.cond.notify_all()

    async def wait_no_inflight(self, *, abort_every_s: float = 1.0) -> None:
        """Pause(mode=abort): abort everything, repeatedly, until no `/generate` is in flight."""
        while True:
            self.engine.abort(abort_all=True)
            async with self.cond:
                try:
                    await asyncio.wait_for(self.cond.wait_for(lambda: self.inflight == 0), abort_every_s)
                    return
                except asyncio.TimeoutError:
                    continue
