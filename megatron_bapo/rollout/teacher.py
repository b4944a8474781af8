"""The teacher of on-policy distillation: its log-probs of every finished response, and its tokenizer check.

    check_same_tokenizer(student_path, teacher_path)     # at start: ConfigError naming both otherwise
    teacher = TeacherScorer(pools["teacher"])            # `rollout.roles`: the teacher's pool
    stats = teacher.score(groups)                        # Sample.teacher_logprobs of every sample lacking them
    metrics = teacher.complete(done)                     # before training: score what lacks them, drop what still does

When: a group is scored when it finishes (`DynamicSampler`, at rollout time, next to its reward:
`scoring_with_teacher`), so only finished responses are scored (partial rollout scores the whole
response once, never a segment) and, with rollout ahead, the teacher's prefills overlap training.
The log-probs ride on the sample (`Sample.teacher_logprobs`, checkpointed with it) to
`experience.build_experience`, which turns them into per-token advantages (`algorithms.distill`).

How: one prefill per sample (`rollout.prefill`: prompt + response, `max_new_tokens` 0,
`logprob_start_len` at the response), all of a call's samples at once through the teacher pool's
client, whose retries, failover and reply checks are the policy client's. A teacher server that
dies mid-call is restarted by its pool (`ServerPool.retry_after_restart`, at most
`teacher.max_server_restarts` times) and the samples not yet scored are sent again. When that is not
possible (out of restarts, an external server down past `teacher.client.max_retries`, a 4xx) the
samples stay unscored; `complete`, right before the step's batch is built, tries them once more and
drops the groups still lacking log-probs: counted (`distill/num_groups_dropped`), recorded as dropped
in samples.jsonl and logged in one line with the first error. Never a silent zero.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.errors import RolloutError

logger = logging.getLogger(__name__)


def tokenizer_fingerprint(path: str) -> tuple[int, str]:
    """(vocabulary size, sha256 of the token -> id map, added tokens included) of the HF tokenizer at `path`."""
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(path).get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=True).encode()).hexdigest()
    return len(vocab), digest


def check_same_tokenizer(student_path: str, teacher_path: str) -> None:
    """The teacher scores the student's token ids, so both must map tokens to ids the same way; ConfigError
    naming both paths otherwise (a different map would score other text than the student wrote). The
    models' embedding sizes may differ (padding): only the tokenizers are compared."""
    try:
        student, teacher = tokenizer_fingerprint(student_path), tokenizer_fingerprint(teacher_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"teacher.model_path={teacher_path!r}: cannot load its tokenizer or the student's "
                          f"({student_path!r}): {exc}") from None
    if student != teacher:
        what = (f"{teacher[0]} tokens against the student's {student[0]}" if student[0] != teacher[0]
                else f"the same {student[0]} tokens mapped to other ids")
        raise ConfigError(f"teacher.model_path={teacher_path!r} has another tokenizer than the student "
                          f"model.hf_path={student_path!r} ({what}): it would score other text than the student "
                          f"sampled; distill from a teacher with the student's tokenizer")


@dataclass
class TeacherStats:
    """What `TeacherScorer.score` did, summable over a step's calls (`add`), then `metrics()`."""

    num_scored: int = 0
    num_failed: int = 0
    """Samples left without teacher log-probs (their groups are dropped unless `complete` scores them)."""
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def add(self, other: "TeacherStats") -> None:
        self.num_scored += other.num_scored
        self.num_failed += other.num_failed
        self.seconds += other.seconds
        self.errors += other.errors

    def metrics(self) -> dict[str, float]:
        return {"distill/num_teacher_scored": float(self.num_scored),
                "distill/num_teacher_failed": float(self.num_failed), "timing/teacher_s": self.seconds}


class TeacherScorer:
    """Scores samples with the teacher pool (module docstring); safe to call from several threads."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._lock = threading.Lock()  # one call at a time: restarts of the pool must not interleave

    def score(self, groups: Sequence[Any]) -> TeacherStats:
        """Set `teacher_logprobs` on every sample of `groups` that lacks them; a failure after the pool's
        restarts and the client's retries leaves them None (counted, first error kept)."""
        started = time.monotonic()
        todo = [s for g in groups for s in g.samples if s.teacher_logprobs is None]
        stats = TeacherStats()
        if not todo:
            return stats
        with self._lock:
            try:
                self.pool.retry_after_restart(lambda: self.pool.client.run(self._ascore(todo)))
            except RolloutError as exc:
                stats.errors.append(str(exc))
                logger.info("teacher: %d of %d responses not scored (retried before training): %s",
                            sum(s.teacher_logprobs is None for s in todo), len(todo), exc)
        stats.num_failed = sum(s.teacher_logprobs is None for s in todo)
        stats.num_scored = len(todo) - stats.num_failed
        stats.seconds = time.monotonic() - started
        return stats

    async def _ascore(self, samples: list[Any]) -> None:
        """One prefill per sample still unscored (a retry after a restart sends only those); the first
        failure re-raised once every request ended."""
        pending = [s for s in samples if s.teacher_logprobs is None]
        results = await asyncio.gather(*(self._one(s) for s in pending), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for failure in failures:
            if not isinstance(failure, RolloutError):
                raise failure
        if failures:
            raise failures[0]

    async def _one(self, sample: Any) -> None:
        if not sample.response_ids:
            sample.teacher_logprobs = []
            return
        sample.teacher_logprobs = await self.pool.client.aprefill_logprobs(sample.prompt_ids, sample.response_ids)

    def complete(self, done: Any) -> dict[str, float]:
        """Before a step's batch is built from round `done`: its groups lacking teacher log-probs (scoring
        failed at rollout time, or restored from a checkpoint written without them) are scored; those
        still lacking them leave `done.groups` for `done.dropped`, counted and logged in one line."""
        missing = [g for g in done.groups if any(s.teacher_logprobs is None for s in g.samples)]
        if not missing:
            return {"distill/num_groups_dropped": 0.0}
        stats = self.score(missing)
        lost = [g for g in missing if any(s.teacher_logprobs is None for s in g.samples)]
        if lost:
            ids = {id(g) for g in lost}
            done.groups = [g for g in done.groups if id(g) not in ids]
            done.dropped = list(done.dropped) + lost
            logger.warning("teacher: %d of %d group(s) dropped from this step, no teacher log-probs after %d "
                           "restart(s) of its servers and the client's retries (distill/num_groups_dropped): %s",
                           len(lost), len(lost) + len(done.groups), sum(self.pool.restarts),
                           stats.errors[0] if stats.errors else "?")
        return {"distill/num_groups_dropped": float(len(lost)), "distill/num_teacher_rescored": float(stats.num_scored)}


@dataclass
class Scored:
    """One scoring pass's statistics: the reward's (`experience.RewardStats`) and the teacher's, summable
    over a step like `RewardStats` (what `DynamicSampler` expects of `score`'s return value)."""

    reward: Any
    teacher: TeacherStats

    def add(self, other: "Scored") -> None:
        self.reward.add(other.reward)
        self.teacher.add(other.teacher)

    def metrics(self) -> dict[str, float]:
        return {**self.reward.metrics(), **self.teacher.metrics()}


def scoring_with_teacher(score: Callable[[list], Any], teacher: TeacherScorer) -> Callable[[list], Scored]:
    """`score` (rewards), then the teacher's log-probs of the same groups."""
    def run(groups: list) -> Scored:
        return Scored(score(groups), teacher.score(groups))
    return run
