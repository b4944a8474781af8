"""The engine's waiting queue and its index of live requests by rid (scheduler-thread state).

Why a separate index: aborts must cost O(1) per request, whatever the queue holds. Every live
request (waiting or running) is in a dict by rid, and in a sorted rid list for SGLang's prefix
match (`"s_1"` also aborts `"s_10"`: one bisection, then the matching run). An aborted waiting
request is not searched for in the queue: it is finished at once and skipped when it reaches the
head (lazy deletion), so `num_waiting` counts only requests that will still run.

Not thread-safe by itself: only the scheduler thread (or `Engine.pause` under the step lock) uses it.
"""

from __future__ import annotations

import bisect
import collections
from typing import Callable

from megatron_bapo.server.req import Req


class WaitingQueue:
    """FIFO of waiting requests plus the rid index of all live requests."""

    def __init__(self) -> None:
        self._queue: collections.deque = collections.deque()
        self._live: dict[str, Req] = {}
        self._sorted_rids: list[str] = []
        self.num_waiting = 0
        """Waiting requests that will still run (aborted ones excluded); read by other threads."""

    def add(self, req: Req) -> bool:
        """Queue a new request; False (nothing done) when its rid is already live."""
        if req.rid in self._live:
            return False
        self._live[req.rid] = req
        bisect.insort(self._sorted_rids, req.rid)
        self._queue.append(req)
        self.num_waiting += 1
        return True

    def requeue_front(self, reqs: list) -> None:
        """Put live requests (retracted from the running batch) back at the head, in order."""
        self._queue.extendleft(reversed(reqs))
        self.num_waiting += len(reqs)

    def forget(self, req: Req) -> None:
        """Drop a finished request from the index (it may still sit in the queue: skipped later)."""
        if self._live.get(req.rid) is req:
            del self._live[req.rid]
            i = bisect.bisect_left(self._sorted_rids, req.rid)
            if i < len(self._sorted_rids) and self._sorted_rids[i] == req.rid:
                del self._sorted_rids[i]

    def left_queue(self) -> None:
        """A waiting request was finished in place (aborted); it no longer counts as waiting."""
        self.num_waiting -= 1

    def exact(self, rids: list) -> list:
        return [self._live[r] for r in rids if r in self._live]

    def with_prefix(self, prefix: str) -> list:
        out = []
        for i in range(bisect.bisect_left(self._sorted_rids, prefix), len(self._sorted_rids)):
            rid = self._sorted_rids[i]
            if not rid.startswith(prefix):
                break
            out.append(self._live[rid])
        return out

    def all_live(self) -> list:
        return list(self._live.values())

    def pop_admissible(self, room: int, fits: Callable[[Req, int], bool]) -> list:
        """Take up to `room` waiting requests in FIFO order while `fits(req, num_taken_so_far)`."""
        batch: list = []
        while self._queue and len(batch) < room:
            req = self._queue[0]
            if req.finish_reason is not None:  # aborted while waiting
                self._queue.popleft()
                continue
            if not fits(req, len(batch)):
                break
            batch.append(self._queue.popleft())
        self.num_waiting -= len(batch)
        return batch

    def drain(self) -> list:
        """Empty the queue; returns the requests in it that have not finished."""
        left = [r for r in self._queue if r.finish_reason is None]
        self._queue.clear()
        self.num_waiting = 0
        return left
