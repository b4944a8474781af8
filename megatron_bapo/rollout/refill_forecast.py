"""How many prompts a `refill` round draws, so that a step needs about one rollout round.

Why: under partial rollout a group drawn now finishes `depth` rounds later (the 32B recipe: 64k
responses in 16k segments, 4 rounds). Drawing only the step's shortfall, and counting only the
step's own refill draws as in flight, made refill cost 5 rollout rounds per step at 64 prompts x 16
with 30% equal-reward groups (one round is a 16k-token segment: minutes), where `filter` needs 1.

The rule keeps the pipeline full instead. Every unfinished buffered group is in flight, and each
is expected to yield a group with signal with probability `1 - share` (`share`: the equal-reward
share observed over the last `window` scored groups). A round draws

    n = ceil((prompts_per_step * depth * (1 + headroom) - pending) / (1 - share)) - in_flight

new prompts, where `depth` is the observed number of rounds a group takes from its draw to its end
(the mean over the last `window` finished groups; before any finished, the age of the oldest group
in flight plus one), `pending` the finished groups with signal already waiting (carried from the
last step, or kept by this step's earlier rounds) and `headroom` a reserve of groups finished ahead
that absorbs the variance of the equal-reward count (a shortfall then needs no extra round). In
steady state each round draws `prompts_per_step * (1 + headroom) / (1 - share)` prompts and
finishes as many groups, so the step's first round keeps `prompts_per_step` of them; surplus
groups wait in the buffer for the next step (`DynamicSampler`'s carry), which then draws fewer.

State (`state_dict`, JSON-safe, in the checkpoint): the rounds counted, the round each prompt still
in flight was drawn in, and the two windows; a resumed run draws what the uninterrupted one would.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Iterable

MAX_SHARE = 0.9
"""The equal-reward share is clipped here: a run where nearly every group has equal rewards draws
at most 10x the groups it needs per round (`rollout/refill_cap_hit` then says it falls short)."""
_FORGET_ROUNDS = 64
"""A drawn prompt not seen finishing after this many rounds (its group failed) is forgotten."""


class RefillForecast:
    """The draw size of each refill-mode round (module docstring); fed by the sampler's rounds."""

    def __init__(self, *, prompts_per_step: int, headroom: float, window: int) -> None:
        if headroom < 0 or window < 1:
            raise ValueError(f"RefillForecast: headroom ({headroom}) must be >= 0 and window ({window}) >= 1")
        self.prompts_per_step, self.headroom = prompts_per_step, headroom
        self.rounds = 0
        self.drawn_at: dict[int, int] = {}
        """prompt index -> the round it was drawn in, for prompts whose group has not finished yet."""
        self.zero: collections.deque[bool] = collections.deque(maxlen=window)
        self.depths: collections.deque[int] = collections.deque(maxlen=window)

    @property
    def share(self) -> float:
        """Observed equal-reward share (0 before any group was scored), clipped to MAX_SHARE."""
        return min(sum(self.zero) / len(self.zero), MAX_SHARE) if self.zero else 0.0

    @property
    def depth(self) -> float:
        """Rounds a group takes from its draw to its end (module docstring)."""
        if self.depths:
            return sum(self.depths) / len(self.depths)
        return 1.0 + max((self.rounds - r for r in self.drawn_at.values()), default=0)

    def draw_size(self, *, pending: int, in_flight: int) -> int:
        """New prompts for the next round, given the finished groups with signal waiting (`pending`)
        and the unfinished groups buffered (`in_flight`)."""
        need = self.prompts_per_step * self.depth * (1.0 + self.headroom) - pending
        return max(0, math.ceil(need / (1.0 - self.share) - 1e-9) - in_flight)

    def round_started(self, prompt_indices: Iterable[int]) -> None:
        self.rounds += 1
        for i in prompt_indices:
            self.drawn_at.setdefault(int(i), self.rounds)
        stale = [i for i, r in self.drawn_at.items() if self.rounds - r > _FORGET_ROUNDS]
        for i in stale:
            del self.drawn_at[i]

    def group_finished(self, prompt_index: int, zero_variance: bool, *, scored_now: bool) -> None:
        """A group came back finished this round; `scored_now`: first time (not a carried surplus group)."""
        drawn = self.drawn_at.pop(int(prompt_index), None)
        if drawn is not None:
            self.depths.append(self.rounds - drawn + 1)
        if scored_now:
            self.zero.append(bool(zero_variance))

    def state_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "drawn_at": [[i, r] for i, r in self.drawn_at.items()],
                "zero": [int(z) for z in self.zero], "depths": list(self.depths)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state.get("rounds", 0))
        self.drawn_at = {int(i): int(r) for i, r in state.get("drawn_at", [])}
        self.zero.clear()
        self.zero.extend(bool(z) for z in state.get("zero", []))
        self.depths.clear()
        self.depths.extend(int(d) for d in state.get("depths", []))
