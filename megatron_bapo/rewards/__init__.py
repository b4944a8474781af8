"""Rewards: `reward_fn(response, answer) -> float`, built-in by name or a plugin by import path.

Built-ins (explicit registry, imported lazily so `arithmetic` does not pull in sympy):
- "math": math-verify on the last `\\boxed{}` answer (`megatron_bapo.rewards.math`);
- "math_last_number": the same, grading the last number when there is no box;
- "arithmetic": the tiny default's synthetic task (`megatron_bapo.rewards.arithmetic`);
- "arithmetic_final": the same rule on the final answer after the last tool result (the tiny tool task).

Any other spec must be "package.module:function"; "judge" (a judge model's verdict) is not a function
but `rewards.judge.JudgeReward`, which the driver and evaluation call where a run config selects it. `score_batch` scores many responses and counts
the ones that could not be judged, so bad samples show up in metrics instead of crashing a run.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import logging
from math import isfinite  # not `import math`: the submodule `rewards.math` would shadow it
from collections import Counter
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from megatron_bapo.rewards.types import DetailedRewardFn, RewardFn, RewardResult

logger = logging.getLogger(__name__)

BUILTIN_REWARDS: dict[str, str] = {
    "math": "megatron_bapo.rewards.math:math_reward",
    "math_last_number": "megatron_bapo.rewards.math:math_last_number_reward",
    "arithmetic": "megatron_bapo.rewards.arithmetic:arithmetic_reward",
    "arithmetic_final": "megatron_bapo.rewards.arithmetic:arithmetic_final_reward",
}
"""Built-in reward name -> import path of its float `RewardFn`."""

BUILTIN_DETAILED_REWARDS: dict[str, str] = {
    "math": "megatron_bapo.rewards.math:score_math",
    "math_last_number": "megatron_bapo.rewards.math:score_math_last_number",
}
"""Built-ins that can also say why a response scored 0 (returning `RewardResult`)."""


class RewardSpecError(ValueError):
    """A reward spec cannot be resolved; the message names the spec and what to fix."""


def import_callable(spec: str, path: str, *, kind: str, builtins: Iterable[str],
                    error: type[ValueError]) -> Callable:
    """The callable at `path` ("package.module:function") that `spec` (a built-in name or that path)
    names; `error` says, naming the `kind` ("reward", "tool") and the spec, what is wrong. One home for
    the plugin lookup of rewards and tools."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise error(f"{kind} spec {spec!r}: expected a built-in name ({', '.join(sorted(builtins))}) "
                    "or an import path 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise error(f"{kind} spec {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{kind} spec {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise error(f"{kind} spec {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def _import_path(spec: str, path: str) -> Callable:
    return import_callable(spec, path, kind="reward", builtins=BUILTIN_REWARDS, error=RewardSpecError)


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve a built-in name or "package.module:function" to a `RewardFn(response, answer) -> float`."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec == "judge":
        raise RewardSpecError("reward 'judge' is a judge model's verdict, not a function: the judge servers of a "
                              "run config's reward.judge score it (tools/evaluate.py: --judge-config RUN.yaml)")
    return _import_path(spec, BUILTIN_REWARDS.get(spec, spec))


def load_detailed_reward_fn(spec: Union[str, RewardFn]) -> DetailedRewardFn:
    """Like `load_reward_fn`, but returning `RewardResult`s.

    Built-ins with a detailed form report their own reasons; any other reward is wrapped: an
    exception or a non-finite / non-numeric value scores 0 and is marked failed.
    """
    if isinstance(spec, str) and spec.strip() in BUILTIN_DETAILED_REWARDS:
        return _import_path(spec, BUILTIN_DETAILED_REWARDS[spec.strip()])
    fn = load_reward_fn(spec) if isinstance(spec, str) else spec
    if not callable(fn):
        raise RewardSpecError(f"reward must be a spec string or a callable, got {fn!r}")
    return _Wrapped(fn)


@dataclasses.dataclass(frozen=True)
class _Wrapped:
    """A plain float reward as a detailed one (a class, not a closure, so it pickles)."""

    fn: RewardFn

    def __call__(self, response: str, answer: str) -> RewardResult:
        try:
            value = self.fn(response, answer)
        except Exception as exc:  # a plugin bug must not stop training by itself; it is counted
            logger.debug("reward %r raised", self.fn, exc_info=True)
            return RewardResult(0.0, "error", None, failed=True, error=f"{type(exc).__name__}: {exc}"[:500])
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)) or not isfinite(value):
            return RewardResult(0.0, "invalid_reward", None, failed=True, error=f"returned {value!r}, not a finite number"[:500])
        return RewardResult(float(value), "scored")


@dataclasses.dataclass
class BatchScores:
    """Scores of a batch in input order, with failure counts by reason."""

    results: list[RewardResult]

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.results]

    @property
    def num_failed(self) -> int:
        return sum(r.failed for r in self.results)

    @property
    def failure_counts(self) -> dict[str, int]:
        return dict(Counter(r.reason for r in self.results if r.failed))

    @property
    def num_fn_failures(self) -> int:
        """Responses the reward function itself could not score (raised, hung, non-finite)."""
        return sum(r.reward_fn_failed for r in self.results)


def score_batch(
    reward: Union[str, RewardFn, DetailedRewardFn],
    responses: Sequence[str],
    answers: Sequence[str],
    *,
    num_workers: int = 0,
    detailed: bool = False,
    timeout_s: Optional[float] = None,
) -> BatchScores:
    """Score `responses[i]` against `answers[i]` for all i; never raises on a bad response.

    `reward` is a spec string, a `RewardFn`, or (with `detailed=True`) a function returning
    `RewardResult`. `num_workers > 0` scores on a thread pool (the math reward then checks in
    worker processes with hard timeouts); 0 scores in the calling thread. With `timeout_s`, a
    plugin spec ("package.module:function") runs in worker processes (`rewards.sandbox`) and a
    call still running after `timeout_s` scores 0 as "timeout".
    """
    if len(responses) != len(answers):
        raise ValueError(f"score_batch: {len(responses)} responses but {len(answers)} answers")
    if num_workers < 0:
        raise ValueError(f"score_batch: num_workers must be >= 0, got {num_workers}")
    if timeout_s is not None and isinstance(reward, str) and reward.strip() not in BUILTIN_REWARDS:
        load_reward_fn(reward)  # a bad spec fails here, naming it, not in every worker
        from megatron_bapo.rewards.sandbox import SandboxedReward

        fn: DetailedRewardFn = SandboxedReward(reward.strip(), timeout_s=timeout_s, num_workers=max(num_workers, 1))
    else:
        fn = reward if detailed and callable(reward) else load_detailed_reward_fn(reward)  # type: ignore[assignment]
    if num_workers == 0 or len(responses) <= 1:
        return BatchScores([fn(r, a) for r, a in zip(responses, answers)])
    with concurrent.futures.ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="reward") as pool:
        return BatchScores(list(pool.map(fn, responses, answers)))


__all__ = [
    "BUILTIN_REWARDS",
    "BatchScores",
    "DetailedRewardFn",
    "RewardFn",
    "RewardResult",
    "RewardSpecError",
    "load_detailed_reward_fn",
    "load_reward_fn",
    "score_batch",
]
