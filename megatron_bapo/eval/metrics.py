"""Evaluation metrics over n samples per problem: avg@n, unbiased pass@k, majority vote.

All are means over problems of a per-problem number, so datasets of different sizes are
comparable and a dataset's metric equals the mean of its per-problem records.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: 1 - C(n-c, k) / C(n, k) (Chen et al., 2021).

    n samples of which c are correct; the chance that k samples drawn without replacement contain
    a correct one. Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), never forming the binomials,
    which overflow floats for n in the hundreds.
    """
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_k_values(n: int) -> list[int]:
    """The k reported for n samples: powers of two up to n (1, 2, 4, ..., <= n)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    return ks


def majority_vote(keys: Sequence[Optional[str]], correct: Sequence[bool]) -> tuple[Optional[str], bool]:
    """The most common answer key and whether it is correct.

    `keys[i]` is response i's normalised answer (None = no answer: it does not vote). Ties go to
    the answer seen first. The winner is correct when its first response is correct (responses
    sharing a key share a grade, up to normalisation). No votes at all: (None, False).
    """
    if len(keys) != len(correct):
        raise ValueError(f"majority_vote: {len(keys)} keys but {len(correct)} grades")
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return None, False
    best = max(counts.values())
    winner = next(k for k in keys if k is not None and counts[k] == best)
    return winner, bool(correct[keys.index(winner)])


def problem_metrics(rewards: Sequence[float], correct: Sequence[bool], maj_correct: bool) -> dict[str, float]:
    """Per-problem numbers whose means over problems are the dataset metrics."""
    n = len(rewards)
    if n == 0:
        raise ValueError("a problem needs at least one sample")
    c = sum(bool(x) for x in correct)
    out = {f"avg@{n}": sum(rewards) / n, f"maj@{n}": float(maj_correct)}
    for k in pass_k_values(n):
        out[f"pass@{k}"] = pass_at_k(n, c, k)
    return out


def mean_metrics(per_problem: Sequence[dict[str, float]]) -> dict[str, float]:
    """Mean of each key over problems (every problem must report the same keys)."""
    if not per_problem:
        return {}
    keys = list(per_problem[0])
    for i, m in enumerate(per_problem):
        if list(m) != keys:
            raise ValueError(f"problem {i} reports {sorted(m)}, expected {sorted(keys)} (same n for all problems)")
    return {k: sum(m[k] for m in per_problem) / len(per_problem) for k in keys}
