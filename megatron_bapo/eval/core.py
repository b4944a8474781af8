"""Evaluation core: problems in, responses scored, per-problem records and dataset metrics out.

No HTTP and no model here: `evaluate_records` takes the sampled texts, so it is tested on
hand-made cases and shared by the standalone tool and the in-training hook.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from megatron_bapo.eval.metrics import majority_vote, mean_metrics, problem_metrics
from megatron_bapo.rewards import BatchScores, DetailedRewardFn, RewardFn, load_detailed_reward_fn, score_batch
from megatron_bapo.rewards.judge import JUDGE_FAILURES, METRIC, judge_counts
from megatron_bapo.rewards.types import RewardResult
from megatron_bapo.rewards.extract import extract_answer, normalize_answer

logger = logging.getLogger(__name__)

Prompt = Union[str, list[dict[str, str]]]


@dataclasses.dataclass
class EvalProblem:
    """One problem: the prompt as text or chat messages, and its reference answer."""

    index: int
    """Position of the row in its file (kept through skipped rows, so records point back at the data)."""
    prompt: Prompt
    answer: str


@dataclasses.dataclass
class Sample:
    """One generated response as the sampler returns it."""

    text: str
    finish_reason: str = "stop"
    """"stop", "length" (hit max_new_tokens), "abort", or "error" (the server rejected the request)."""
    num_tokens: int = 0
    error: Optional[str] = None
    """The server's message when finish_reason is "error"."""
    num_tool_calls: Optional[int] = None
    """Tool calls the response made (multi-turn evaluation through the agent loop); None: single-turn."""
    num_turns: Optional[int] = None
    """Model turns of the response (multi-turn evaluation); None: single-turn."""


def is_correct(reward: float) -> bool:
    """A sample counts as correct for pass@k and maj@n when its reward reaches 1 (math rewards are 0/1)."""
    return reward >= 1.0


def evaluate_records(
    problems: Sequence[EvalProblem],
    samples: Sequence[Sequence[Union[Sample, str]]],
    reward: Union[str, RewardFn, DetailedRewardFn] = "math",
    *,
    dataset: str = "eval",
    num_workers: int = 0,
    judged: Optional[Sequence[RewardResult]] = None,
    drop_failed: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Score `samples[i]` (n responses) for `problems[i]`; return per-problem records and metrics.

    `judged`: the judge's results of the flattened samples (`rewards.judge`, `eval.reward: judge`),
    used instead of `reward`; the metrics then count them by reason (`judge_num_scored`,
    `judge_num_timeout`, `judge_num_unparseable`, `judge_num_error`), and with `drop_failed`
    (`reward.judge.on_failure: drop_group`) a problem with a missing verdict is left out of the means
    (its record says `"judge_dropped": true`; `judge_num_problems_dropped`) instead of averaging its 0.

    Every problem must have the same n. Metrics (unprefixed): `avg@n` (mean reward), `pass@k`
    for k = 1, 2, 4, ... <= n (unbiased estimator), `maj@n` (majority vote over normalised
    extracted answers), plus counts: `num_problems`, `num_samples`, `num_answer_failures`
    (responses with no/unparsable answer or a reward error), `num_request_errors` (requests the
    server rejected; they score 0), `truncated_frac`, `response_tokens_mean` (sampled tokens); with
    multi-turn samples also `tool_call_rate` (share of responses with a tool call), `tool_calls_mean`,
    `turns_mean`.
    Each metric is the mean of the same key over the records.
    """
    if len(problems) != len(samples):
        raise ValueError(f"evaluate_records: {len(problems)} problems but {len(samples)} sample lists")
    if not problems:
        return [], {"num_problems": 0.0, "num_samples": 0.0, "num_answer_failures": 0.0}
    sizes = {len(s) for s in samples}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"evaluate_records: every problem needs the same n >= 1 samples, got sizes {sorted(sizes)}")
    n = sizes.pop()
    flat = [s if isinstance(s, Sample) else Sample(text=s) for group in samples for s in group]
    if judged is not None:
        if len(judged) != len(flat):
            raise ValueError(f"evaluate_records: {len(judged)} judge results for {len(flat)} samples")
        scores = BatchScores(list(judged))
    else:
        detailed = reward if isinstance(reward, str) else load_detailed_reward_fn(reward)
        scores = score_batch(detailed, [s.text for s in flat], [p.answer for p in problems for _ in range(n)],
                             num_workers=num_workers, detailed=not isinstance(detailed, str))
    num_dropped = 0
    records: list[dict[str, Any]] = []
    per_problem: list[dict[str, float]] = []
    for i, problem in enumerate(problems):
        group = flat[i * n : (i + 1) * n]
        results = scores.results[i * n : (i + 1) * n]
        rewards = [r.reward for r in results]
        correct = [is_correct(x) for x in rewards]
        keys = [
            normalize_answer(r.extracted if r.extracted is not None else extract_answer(s.text, fallback_last_number=True))
            for r, s in zip(results, group)
        ]
        maj_key, maj_ok = majority_vote(keys, correct)
        metrics = problem_metrics(rewards, correct, maj_ok)
        lost = drop_failed and any(r.reason in JUDGE_FAILURES for r in results)
        num_dropped += lost
        if not lost:
            per_problem.append(metrics)
        records.append(
            {
                "dataset": dataset,
                "index": problem.index,
                "prompt": problem.prompt,
                "answer": problem.answer,
                "n": n,
                "num_correct": sum(correct),
                **metrics,
                **({"judge_dropped": True} if lost else {}),
                "maj_answer": maj_key,
                "responses": [
                    {
                        "text": s.text,
                        "reward": r.reward,
                        "correct": c,
                        "reason": r.reason,
                        "extracted": r.extracted,
                        "finish_reason": s.finish_reason,
                        "num_tokens": s.num_tokens,
                        **({"error": s.error} if s.error else {}),
                        **({"reward_error": r.error} if r.error else {}),
                        **({"num_tool_calls": s.num_tool_calls, "num_turns": s.num_turns}
                           if s.num_tool_calls is not None else {}),
                    }
                    for s, r, c in zip(group, results, correct)
                ],
            }
        )
    out = mean_metrics(per_problem)
    out["num_problems"] = float(len(problems))
    out["num_samples"] = float(len(flat))
    out["num_answer_failures"] = float(scores.num_failed)
    if judged is not None:
        out.update({METRIC[k].replace("/", "_"): float(v) for k, v in judge_counts(scores.results).items()})
        out["judge_num_problems_dropped"] = float(num_dropped)
    out["num_request_errors"] = float(sum(s.finish_reason == "error" for s in flat))
    out["truncated_frac"] = sum(s.finish_reason == "length" for s in flat) / len(flat)
    out["response_tokens_mean"] = sum(s.num_tokens for s in flat) / len(flat)
    if any(s.num_tool_calls is not None for s in flat):  # multi-turn: how the model used its tools
        out["tool_call_rate"] = sum(bool(s.num_tool_calls) for s in flat) / len(flat)
        out["tool_calls_mean"] = sum(s.num_tool_calls or 0 for s in flat) / len(flat)
        out["turns_mean"] = sum(s.num_turns or 1 for s in flat) / len(flat)
    if scores.num_failed:
        logger.info("%s: %d of %d responses had no gradable answer: %s", dataset, scores.num_failed, len(flat),
                    scores.failure_counts)
    return records, out


def write_records(records: Sequence[dict[str, Any]], path: Union[str, Path]) -> Path:
    """Write per-problem records as JSON lines (atomically: temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def read_records(path: Union[str, Path]) -> list[dict[str, Any]]:
    """Per-problem records written by `write_records`."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def load_problems(path: Union[str, Path], *, max_problems: Optional[int] = None) -> tuple[list[EvalProblem], int]:
    """Problems from a jsonl or parquet file; rows without a usable prompt or answer are skipped.

    Returns (problems, num_skipped). Answers are turned into strings (AIME answers are often ints).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"eval data file {str(path)!r} does not exist")
    rows = _read_rows(path)
    problems: list[EvalProblem] = []
    skipped = 0
    for i, row in enumerate(rows):
        if max_problems is not None and len(problems) >= max_problems:
            break
        problem = _to_problem(i, row)
        if problem is None:
            skipped += 1
            logger.warning("%s row %d skipped: needs a non-empty 'prompt' (text or messages) and an 'answer'", path, i)
            continue
        problems.append(problem)
    return problems, skipped


def _read_rows(path: Path) -> list[Any]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                logger.warning("%s line %d is not JSON (%s); skipped", path, lineno + 1, exc)
                rows.append(None)
        return rows
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"eval data file {str(path)!r}: expected .jsonl or .parquet")


def _to_problem(index: int, row: Any) -> Optional[EvalProblem]:
    if not isinstance(row, dict):
        return None
    prompt, answer = row.get("prompt"), row.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(int(answer)) if float(answer).is_integer() else str(answer)
    if not isinstance(answer, str) or not answer.strip():
        return None
    if isinstance(prompt, str) and prompt.strip():
        return EvalProblem(index, prompt, answer)
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        return EvalProblem(index, [{"role": m["role"], "content": m["content"]} for m in prompt], answer)
    return None
