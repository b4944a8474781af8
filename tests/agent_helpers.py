"""Helpers for the agent-loop tests: scripted tool users for `tests/fake_server.py`, tool plugins
that misbehave, and a tiny model that writes tool calls for the built-in server.

A scripted user is a pure function of the token prefix (as the fake server's model is), so a test
can recompute everything the loop should have sent and received. For a prompt "EXPR=" its first
turn starts with one raw byte that is not valid UTF-8 on its own (decoding and re-tokenizing the
turn would change its ids); each turn is the text `next_turn(EXPR, results so far)` followed by EOS
(the server stops earlier at `</tool_call>` when the loop asks it to). `calculator_user` calls
`<tool_call>{"name": TOOL, "arguments": {"expression": "EXPR"}}</tool_call>` `calls` times and then
writes the last result as its answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from megatron_bapo.tiny.tokenizer import _bytes_to_unicode, build_tiny_tokenizer

EOS_ID = 1
TOOL_PLUGINS = '''
import os, sys, time

def misbehave(expression: str):
    if expression == "hang":
        time.sleep(3600)
    if expression == "crash":
        raise RuntimeError("the tool broke")
    if expression == "exit":
        os._exit(3)
    if expression == "spam":
        print("x" * 5_000_000)
        sys.stdout.flush()
        os.write(1, b"y" * 1_000_000)  # C level, onto fd 1 itself
        return None
    if expression == "huge":
        return "z" * 5_000_000
    from megatron_bapo.rollout.tools.calculator import calculator
    return calculator(expression)


def with_options(expression: str, *, unit: str = "none", scale: int = 1):
    return f"{expression}:{unit}:{scale}"


def length_mod3(response: str, answer: str) -> float:
    """A reward with signal in ~4 of 5 groups of 4 (a third of responses score 1), where the tiny tool
    model's arithmetic scores 0 everywhere: refill's draws then stay small and its check has teeth."""
    return float(len(response) % 3 == 0)


def flaky(expression: str):
    """By the expression's digits: hang, raise, print megabytes, or compute (a tool gone bad in a run)."""
    kind = sum(map(ord, expression)) % 4
    if kind == 0:
        time.sleep(3600)
    if kind == 1:
        raise ConnectionError("the backend went away")
    if kind == 2:
        print("x" * 3_000_000)
        return None
    from megatron_bapo.rollout.tools.calculator import calculator
    return calculator(expression)


def slow(expression: str, *, marker: str):
    """Say it started (the file `marker`), then take a second and a half to compute."""
    open(marker, "w").write("started")
    time.sleep(1.5)
    from megatron_bapo.rollout.tools.calculator import calculator
    return calculator(expression)


def pid(expression: str):
    time.sleep(0.5)  # long enough for concurrent calls to overlap
    return str(os.getpid())


print("a plugin printing while it is imported")
'''


def write_plugins(root: Path) -> str:
    """Write the plugin module under `root` (put it on PYTHONPATH); returns its module name."""
    (root / "tool_plugins_mod.py").write_text(TOOL_PLUGINS)
    return "tool_plugins_mod"


def tokenizer():
    return build_tiny_tokenizer()


def junk_byte_id(tok) -> int:
    """The id of byte 0x80 (a lone UTF-8 continuation byte: decodes to U+FFFD, which encodes to 3 other ids)."""
    return tok.convert_tokens_to_ids(_bytes_to_unicode()[0x80])


def call_text(tool: str, expression: str, start: str = "<tool_call>", end: str = "</tool_call>") -> str:
    return start + json.dumps({"name": tool, "arguments": {"expression": expression}}) + end


def scripted_policy(next_turn: Callable[[str, list[str]], str]) -> Callable[[list[int], int], int]:
    """The fake server's `policy` (module docstring)."""
    tok = tokenizer()
    equals = tok.convert_tokens_to_ids("=")
    open_id, close_id = tok.convert_tokens_to_ids("<tool_response>"), tok.convert_tokens_to_ids("</tool_response>")
    junk = junk_byte_id(tok)
    cache: dict[tuple, list[int]] = {}

    def policy(prefix: list[int], seed: int) -> int:
        start = prefix.index(equals) + 1
        response = prefix[start:]
        results, turn_start, opened = [], 0, None
        for i, t in enumerate(response):
            if t == open_id:
                opened = i
            elif t == close_id and opened is not None:
                results.append(tok.decode(response[opened + 1:i]))
                turn_start = i + 1
        key = (tuple(prefix[:start]), tuple(results))
        if key not in cache:
            text = next_turn(tok.decode(prefix[:start - 1]), results)
            cache[key] = ([] if results else [junk]) + tok.encode(text) + [EOS_ID]
        turn = cache[key]
        k = len(response) - turn_start
        return turn[k] if k < len(turn) else EOS_ID

    return policy


def calculator_user(tool: str = "calculator", calls: int = 1) -> Callable[[list[int], int], int]:
    return scripted_policy(lambda expr, results: call_text(tool, expr) if len(results) < calls else results[-1])


def prompt_ids(tok, expression: str) -> list[int]:
    return tok.encode(expression + "=")


def agent_config(**overrides: Any):
    from megatron_bapo.rollout.agent import AgentConfig, ToolConfig

    tools = overrides.pop("tools", [ToolConfig("calculator", "calculator")])
    return AgentConfig(tools=tools, **{"tool_timeout_s": 20.0, **overrides})


def make_tool_model(out_dir: Path, steps: int = 120, seed: int = 0) -> Path:
    """A tiny random Qwen2 (hidden 64, 2 layers) after `steps` SFT steps on calculator-call demonstrations
    only (about 5 s on 2 cores): it writes well-formed calls (it does not copy the expression reliably)."""
    from megatron_bapo.tiny.checkpoint import build_tiny_model, save_quietly
    from megatron_bapo.tiny.sft import SFTConfig, run_sft
    from megatron_bapo.tiny.task import TaskConfig, generate_splits

    tok = tokenizer()
    train, _ = generate_splits(TaskConfig.tools())
    model = build_tiny_model(tok, seed=seed)
    run_sft(model, tok, train, SFTConfig(max_steps=steps, target_accuracy=2.0, eval_every=10 ** 6, loop_fraction=0.0,
                                         tool_fraction=1.0, lr=3e-3, batch_size=32, seed=seed))
    save_quietly(model, out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def decoded_spans(tok, sample) -> list[str]:
    """The text of each tool span of a sample."""
    return [tok.decode(sample.response_ids[a:b]) for a, b in sample.agent.tool_spans]

