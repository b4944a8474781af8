"""Math answer checking with math-verify: boxed answers, fractions, LaTeX vs plain, AIME integers.

Why not call `math_verify.parse/verify` directly: their timeouts use `signal.alarm`, which only
works in the main thread; from a worker thread (thread pools, `asyncio.to_thread`) they raise, and
with timeouts disabled a pathological answer (`9^{9^{9^9}}`) hangs sympy forever. Here:

- in the main thread, one `SIGALRM` timer bounds extraction + parsing + comparison together;
- in any other thread, the check runs in a small pool of spawned worker processes (each one a main
  thread, so the same timer works there) and a worker that still does not answer in time is killed
  and replaced (big-integer arithmetic in C cannot be interrupted by signals).

Every response gets a `RewardResult`; missing, malformed or too-slow answers score 0 with a reason.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import signal
import threading
import time
from typing import Any

from megatron_bapo.rewards import workers
from megatron_bapo.rewards.extract import extract_answer, find_boxed
from megatron_bapo.rewards.types import RewardResult

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MathRewardConfig:
    """How responses are checked against reference answers."""

    fallback_last_number: bool = False
    """Without a `\\boxed{}` answer, grade the last number in the response (off: no box = no answer)."""
    timeout_s: float = 5.0
    """Budget for parsing and comparing one response; past it the response scores 0 ("timeout")."""
    max_answer_chars: int = 1000
    """Extracted answers longer than this score 0 ("answer_too_long") without being parsed."""
    num_workers: int = 2
    """Worker processes used when scoring from a thread other than the main thread."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if self.max_answer_chars < 1:
            raise ValueError(f"max_answer_chars must be >= 1, got {self.max_answer_chars!r}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers!r}")


DEFAULT_CONFIG = MathRewardConfig()


class _ScoreTimeout(BaseException):
    """Raised by our SIGALRM handler; a BaseException so math-verify's `except Exception` lets it through."""


class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; we bound time ourselves, so drop that line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@functools.lru_cache(maxsize=1)
def _math_verify() -> Any:
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_QuietTimeoutWarning())
    return math_verify


def _parse(text: str) -> list:
    mv = _math_verify()
    config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    return mv.parse(text, extraction_config=config, parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_reference(answer: str) -> tuple:
    """Parsed reference answer (cached: the same reference is graded n times per problem)."""
    boxes = find_boxed(answer)
    core = boxes[-1] if boxes else answer.strip().strip("$")
    return tuple(_parse("\\boxed{" + core + "}")) if core.strip() else ()


def _score_extracted(extracted: str, answer: str) -> RewardResult:
    """Compare one extracted answer with the reference (no time limit of its own)."""
    gold = list(_parse_reference(answer))
    if not gold:
        return RewardResult(0.0, "bad_reference", extracted, failed=True)
    pred = _parse("\\boxed{" + extracted + "}")
    if not pred:
        return RewardResult(0.0, "unparsable_answer", extracted, failed=True)
    ok = _math_verify().verify(gold, pred, timeout_seconds=None)
    if ok:
        return RewardResult(1.0, "correct", extracted)
    if not any(isinstance(p, _sympy_types()) for p in pred):
        # Only the raw string came back: math-verify could not read it as math ("@@#", "???").
        return RewardResult(0.0, "unparsable_answer", extracted, failed=True)
    return RewardResult(0.0, "wrong", extracted)


@functools.lru_cache(maxsize=1)
def _sympy_types() -> tuple:
    from sympy import Basic, MatrixBase

    return (Basic, MatrixBase)


def _score_with_alarm(extracted: str, answer: str, timeout_s: float) -> RewardResult:
    """`_score_extracted` bounded by a SIGALRM timer (main thread only); restores any outer timer."""

    def on_alarm(signum, frame):
        raise _ScoreTimeout()

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    outer_remaining, _ = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    started = time.monotonic()
    try:
        return _score_extracted(extracted, answer)
    except _ScoreTimeout:
        return RewardResult(0.0, "timeout", extracted, failed=True)
    except Exception as exc:  # sympy can raise almost anything on odd input
        logger.debug("math scoring failed for %r: %r", extracted, exc)
        return RewardResult(0.0, "error", extracted, failed=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if outer_remaining > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer_remaining - (time.monotonic() - started), 1e-3))


def score_math(response: str, answer: str, config: MathRewardConfig = DEFAULT_CONFIG) -> RewardResult:
    """Grade `response` against the reference `answer`; never raises, never hangs past the timeout.

    The answer is the last non-empty `\\boxed{}` (nested braces; optionally the last number), then
    math-verify decides equivalence (`\\frac{1}{2}` == `0.5`, `070` == `70`, `5 cm` == `5`).
    """
    if not isinstance(response, str) or not isinstance(answer, str):
        return RewardResult(0.0, "error", None, failed=True)
    extracted = extract_answer(response, fallback_last_number=config.fallback_last_number)
    if extracted is None:
        return RewardResult(0.0, "no_answer", None, failed=True)
    if len(extracted) > config.max_answer_chars:
        return RewardResult(0.0, "answer_too_long", extracted[:64] + "...", failed=True)
    if threading.current_thread() is threading.main_thread():
        return _score_with_alarm(extracted, answer, config.timeout_s)
    return _score_in_worker(extracted, answer, config.timeout_s, config.num_workers)


def math_reward(response: str, answer: str) -> float:
    """RewardFn: 1.0 when the boxed answer matches the reference, else 0.0."""
    return score_math(response, answer).reward


_LAST_NUMBER_CONFIG = MathRewardConfig(fallback_last_number=True)


def score_math_last_number(response: str, answer: str) -> RewardResult:
    """`score_math` that falls back to the last number when there is no box."""
    return score_math(response, answer, _LAST_NUMBER_CONFIG)


def math_last_number_reward(response: str, answer: str) -> float:
    """RewardFn: like `math_reward`, but a response without a box is graded by its last number."""
    return score_math_last_number(response, answer).reward


# ---------------------------------------------------------------- worker processes (non-main threads)

_KILL_GRACE_S = 5.0
_WORKER_ARGS = ("-m", "megatron_bapo.rewards.math")


def worker_main() -> None:
    """Worker process loop (`python -m megatron_bapo.rewards.math`): one JSON request per stdin line,
    one JSON `RewardResult` per stdout line (`rewards.workers` protocol)."""
    _math_verify()
    workers.serve(lambda req: dataclasses.asdict(
        _score_with_alarm(req["extracted"], req["answer"], float(req["timeout_s"]))))


def _worker_pool(size: int) -> workers.WorkerPool:
    return workers.worker_pool(_WORKER_ARGS, size, "math-verify")


def _score_in_worker(extracted: str, answer: str, timeout_s: float, num_workers: int) -> RewardResult:
    """In a worker process (its own alarm fires at timeout_s; the grace covers IPC and a loaded machine)."""
    reply, status = _worker_pool(num_workers).call({"extracted": extracted, "answer": answer, "timeout_s": timeout_s},
                                                   timeout_s + _KILL_GRACE_S)
    if status == "ok":
        return RewardResult(**reply)
    if status == "timeout":
        logger.warning("math-verify worker stuck on %r past %.1fs; killed", extracted[:64], timeout_s)
    return RewardResult(0.0, status, extracted, failed=True)


if __name__ == "__main__":
    worker_main()
