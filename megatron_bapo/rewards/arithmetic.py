"""Exact-answer reward for the tiny default's arithmetic task (`megatron_bapo.tiny.task`).

The policy answers a prompt like "47+38=" with the sum's digits least-significant first ("58") and
then EOS. The response counts as correct iff its first whitespace-delimited word, read up to the first
end-of-sequence marker, equals the reference exactly:

- text after an EOS marker (`<|endoftext|>`, `<|im_end|>`) is ignored, in case a server returns it;
- leading whitespace is skipped and the answer ends at the first whitespace ("58\\n..." counts);
- no normalisation beyond that: "058", "5 8", "58." and "+58" are wrong, so the reward cannot be gamed
  by emitting extra characters, and an empty response or empty reference scores 0.

`arithmetic_final_reward` ("arithmetic_final", the tiny tool task) applies the same rule to the
model's final answer: the text after the last tool result (`</tool_response>`), or the whole
response when it called no tool.
"""

from __future__ import annotations

EOS_MARKERS: tuple[str, ...] = ("<|endoftext|>", "<|im_end|>")
"""Strings that end a response (the tiny tokenizer's EOS and chat end-of-turn tokens)."""


def extract_arithmetic_answer(response: str) -> str:
    """The first whitespace-delimited word of `response` before any EOS marker ("" when none)."""
    for marker in EOS_MARKERS:
        response = response.split(marker, 1)[0]
    words = response.split(None, 1)
    return words[0] if words else ""


def arithmetic_reward(response: str, answer: str) -> float:
    """1.0 iff `extract_arithmetic_answer(response) == answer.strip()` (non-empty), else 0.0."""
    predicted = extract_arithmetic_answer(response)
    reference = answer.strip()
    return 1.0 if predicted and predicted == reference else 0.0


TOOL_RESULT_END = "</tool_response>"
"""Where a tool's result ends in the response (the Hermes/Qwen3 markup of `rollout.tool_calls`)."""


def arithmetic_final_reward(response: str, answer: str) -> float:
    """`arithmetic_reward` of the text after the last tool result (the whole response without one)."""
    return arithmetic_reward(response.rsplit(TOOL_RESULT_END, 1)[-1], answer)
