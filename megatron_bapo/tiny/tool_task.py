"""The tiny tool task: 3-digit multiplication that a calculator call makes easy.

"482*375=" asks for "180750". The tiny model cannot multiply 3-digit numbers (its direct answers
are almost never right), but it can learn to call the calculator and copy the result:

    <tool_call>{"name":"calculator","arguments":{"expression":"482*375"}}</tool_call>   (model)
    <tool_response>180750</tool_response>                                               (tool)
    180750<|endoftext|>                                                                 (model)

The SFT warm start (`tiny.sft`, `SFTConfig.tool_fraction`) shows this on a share of its examples
and a direct answer on the rest, so the base calls the tool on about that share of its samples: RL
then has a behaviour to reinforce, and evaluation reports both the accuracy and the tool-call rate.
The demonstrations are built with the agent loop's own format (`rollout.tool_calls`), so the SFT
tokens are the ones the loop produces; the RL run's config (`examples/configs/tiny_tools.yaml`)
names the same tool and format.

`agent_answers` decodes the base in-process (KV cache, the calculator called directly) to measure it
after SFT; the RL run measures it through the real agent loop and servers.

Calibration (2 cores, the default tiny model, SFT batch 64; sampled accuracy / tool-call rate on 200
training problems at temperature 1): with 30% call demonstrations at lr 1e-3, 0.000 / 0.16 after 100
steps, 0.040 / 0.23 after 200, 0.155 / 0.265 after 300 (84 s; the steps `TinyAssetsConfig.tools()` runs),
0.110 / 0.155 after 400; at lr 3e-3 the copy never forms (0.000 after 500 steps). So the base calls the
tool on about the share it was shown and copies its result on about 60-70% of those calls: RL has both
to improve, and does within 20 steps (README).
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Optional, Sequence

import torch

from megatron_bapo.rewards.arithmetic import arithmetic_final_reward
from megatron_bapo.rollout.tool_calls import ToolCallFormat, encode_text, parse_tool_calls, render_results
from megatron_bapo.rollout.tools import ToolError
from megatron_bapo.rollout.tools.calculator import calculator

TOOL_NAME = "calculator"
"""The name the demonstrations call the calculator by (`rollout.agent.tools[].name` in the RL config)."""
FORMAT = ToolCallFormat()
"""The call format of the demonstrations: the agent loop's default (raw Hermes, stop at `</tool_call>`)."""


def call_text(expression: str) -> str:
    """The model's call turn for `expression` (compact JSON: fewer tokens for a char-level model)."""
    body = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expression}}, separators=(",", ":"))
    return FORMAT.call_start + body + FORMAT.call_end


def run_calls(turn_text: str) -> Optional[str]:
    """The tool's result text for a turn's calls as the agent loop would write it back (in-process
    calculator); None when the turn has no call."""
    calls = parse_tool_calls(turn_text, FORMAT)
    if not calls:
        return None
    results = []
    for call in calls:
        if call.error is not None or call.name != TOOL_NAME:
            results.append(f"error: {call.error or f'unknown tool {call.name!r}'}")
            continue
        try:
            results.append(calculator(**call.arguments))
        except (ToolError, TypeError) as exc:
            results.append(f"error: {exc}")
    return render_results(results, FORMAT)


def demo_ids(tokenizer, row: dict) -> tuple[list[int], list[bool]]:
    """A tool-use demonstration for a dataset row: (response ids, which of them the model writes)."""
    turn = encode_text(tokenizer, call_text(row["prompt"].rstrip("=")))
    result = encode_text(tokenizer, run_calls(call_text(row["prompt"].rstrip("="))))
    answer = encode_text(tokenizer, row["answer"]) + [tokenizer.eos_token_id]
    return turn + result + answer, [True] * len(turn) + [False] * len(result) + [True] * len(answer)


@torch.inference_mode()
def _continue(model, contexts: Sequence[list[int]], max_new_tokens: int, stop_ids: set, temperature: float,
              generator: Optional[torch.Generator]) -> list[list[int]]:
    """New tokens for each context (all of one length), each cut after its first stop id (kept)."""
    out = model(input_ids=torch.tensor(list(contexts), dtype=torch.long), use_cache=True)
    stop = torch.tensor(sorted(stop_ids))
    done = torch.zeros(len(contexts), dtype=torch.bool)
    new = []
    for _ in range(max_new_tokens):
        logits = out.logits[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator).squeeze(1)
        new.append(nxt)
        done |= torch.isin(nxt, stop)
        if bool(done.all()):
            break
        out = model(input_ids=nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
    rows = torch.stack(new, 1).tolist()
    cut = []
    for row in rows:
        ends = [i for i, t in enumerate(row) if t in stop_ids]
        cut.append(row[: ends[0] + 1] if ends else row)
    return cut


def _by_length(model, contexts: Sequence[list[int]], max_new_tokens: int, stop_ids: set, temperature: float,
               generator: Optional[torch.Generator]) -> list[list[int]]:
    """`_continue` over contexts of any lengths (batched per length: no padding)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, c in enumerate(contexts):
        groups[len(c)].append(i)
    out: list[list[int]] = [[] for _ in contexts]
    for idx in groups.values():
        for i, new in zip(idx, _continue(model, [contexts[i] for i in idx], max_new_tokens, stop_ids, temperature,
                                         generator)):
            out[i] = new
    return out


def agent_answers(model, tokenizer, prompts: Sequence[str], *, temperature: float = 0.0, seed: int = 0,
                  max_call_tokens: int = 80, max_answer_tokens: int = 10) -> list[tuple[str, bool]]:
    """(decoded response, whether it called the tool) per prompt: a turn until `</tool_call>` or EOS,
    the calculator's result, then the answer until EOS (one tool round, as `max_turns: 2`)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    call_end = encode_text(tokenizer, FORMAT.call_end)
    prompt_ids = [encode_text(tokenizer, p) for p in prompts]
    try:
        turns = _by_length(model, prompt_ids, max_call_tokens, {eos, *call_end}, temperature, generator)
        results = [run_calls(tokenizer.decode(t, skip_special_tokens=False)) if t and t[-1] != eos else None
                   for t in turns]
        tool = [encode_text(tokenizer, r) if r is not None else [] for r in results]
        todo = [i for i, r in enumerate(results) if r is not None]
        answers = _by_length(model, [prompt_ids[i] + turns[i] + tool[i] for i in todo], max_answer_tokens, {eos},
                             temperature, generator)
    finally:
        model.train(was_training)
    final = {i: a for i, a in zip(todo, answers)}
    return [(tokenizer.decode(turns[i] + tool[i] + final.get(i, []), skip_special_tokens=True), results[i] is not None)
            for i in range(len(prompts))]


def agent_accuracy(model, tokenizer, rows: Sequence[dict], *, temperature: float = 0.0, seed: int = 0) -> dict:
    """{"accuracy", "tool_call_rate"} of `agent_answers` on dataset rows (reward "arithmetic_final")."""
    if not rows:
        raise ValueError("agent_accuracy needs at least one row")
    answers = agent_answers(model, tokenizer, [r["prompt"] for r in rows], temperature=temperature, seed=seed)
    return {"accuracy": sum(arithmetic_final_reward(text, r["answer"]) for (text, _), r in zip(answers, rows)) / len(rows),
            "tool_call_rate": sum(called for _, called in answers) / len(rows)}
