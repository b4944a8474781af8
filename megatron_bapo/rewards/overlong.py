"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13): a length penalty added to the reward.

A response cut at the token limit is scored like a wrong answer, which tells the policy nothing
about length. DAPO adds a penalty that grows linearly over the last `L_cache` tokens before the
limit `L_max`:

    R_length(|y|) = 0                                  |y| <= L_max - L_cache
                    ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                    -1                                 L_max < |y|

times `factor` (DAPO: 1), added to the task reward (`reward.overlong_buffer_tokens`,
`reward.overlong_penalty`; `experience.score_groups` applies it). Here `L_max` is
`rollout.max_response_tokens`, so a response that reached the limit gets exactly `-factor`.
"""

from __future__ import annotations


def overlong_penalty(length: int, max_tokens: int, buffer_tokens: int, factor: float = 1.0) -> float:
    """`factor * R_length(length)` (<= 0; 0 when `buffer_tokens` is 0: shaping off)."""
    if buffer_tokens <= 0:
        return 0.0
    if not 0 < buffer_tokens <= max_tokens:
        raise ValueError(f"overlong_penalty: buffer_tokens must be in (0, max_tokens={max_tokens}], got {buffer_tokens}")
    start = max_tokens - buffer_tokens
    if length <= start:
        return 0.0
    if length > max_tokens:
        return -float(factor)
    return factor * (start - length) / buffer_tokens
