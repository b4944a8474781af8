"""Reward result types shared by the built-in rewards, the batch scorer and evaluation."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

RewardFn = Callable[[str, str], float]
"""`reward_fn(response, answer) -> float`: the contract every reward (built-in or plugin) follows."""


@dataclasses.dataclass(frozen=True)
class RewardResult:
    """One scored response with the reason behind the number.

    `failed` marks responses that could not be judged (no answer, unparsable answer, timeout, a
    crashing plugin): they score 0 and are counted, so a bad sample never stops a long job.
    """

    reward: float
    reason: str
    """"correct", "wrong", "scored" (plugin reward, judge), or a failure: "no_answer", "unparsable_answer",
    "answer_too_long", "bad_reference", "timeout", "error", "invalid_reward", and the judge's
    "judge_timeout", "judge_unparseable", "judge_error" (`rewards.judge`)."""
    extracted: Optional[str] = None
    """The answer string taken from the response (None when none was found)."""
    failed: bool = False
    error: Optional[str] = None
    """What went wrong when the reward function itself failed (exception text, invalid value, timeout)."""

    @property
    def reward_fn_failed(self) -> bool:
        """The reward function could not score (raised, hung, returned a non-number), as opposed to
        the response having no valid answer: what `reward.max_failure_rate` limits."""
        return self.reason in REWARD_FN_FAILURES


REWARD_FN_FAILURES = frozenset({"error", "timeout", "invalid_reward", "judge_timeout", "judge_unparseable", "judge_error"})
"""What the reward, not the response, failed at (a judge's missing verdict included): limited by
`reward.max_failure_rate`."""


DetailedRewardFn = Callable[[str, str], RewardResult]
