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
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from megatron_bapo.server.config import ServerConfig
from megatron_bapo.server.engine import Engine
from megatron_bapo.server.protocol import RequestError, RequestLimits

logger = logging.getLogger(__name__)

POOL_WORKERS = 4
"""Threads for request parsing/tokenization and reply building. A few large requests occupy them
and later ones queue behind; the event loop itself (health, loads, aborts) is never among them."""


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
    weight_update_session: bool = False
    """A `/begin_weight_update` session is open (distributed updates are refused outside one)."""
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)
    api_key_check: Optional[Callable[[Optional[str]], bool]] = None
    """None: no API key configured (everything open)."""
    pool: ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: ThreadPoolExecutor(POOL_WORKERS, thread_name_prefix="bapo-http"))

    async def offload(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in `pool`, off the event loop (its exceptions propagate)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

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
