"""The tiny tool task: data, SFT demonstrations built with the agent loop's own format, the reward,
the in-process agent decode, and `make_tiny.py --task tools`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent_helpers import make_tool_model, tokenizer
from megatron_bapo.rewards import load_reward_fn
from megatron_bapo.rollout.tool_calls import ToolCallFormat, encode_text, parse_tool_calls, render_results
from megatron_bapo.rollout.tools.calculator import calculator
from megatron_bapo.tiny.sft import IGNORE_INDEX, make_sft_batch
from megatron_bapo.tiny.task import TaskConfig, generate_splits, make_problem
from megatron_bapo.tiny.tool_task import agent_answers, demo_ids

REPO = Path(__file__).resolve().parents[1]


def test_the_task_is_multiplication_written_normally():
    assert make_problem(482, 375, "*", reverse_answer=False) == {"prompt": "482*375=", "answer": "180750",
                                                                 "a": 482, "b": 375}
    train, test = generate_splits(TaskConfig.tools())
    assert len(train) == 4000 and all(100 <= r["a"] <= 999 and r["answer"] == str(r["a"] * r["b"]) for r in test)


def test_demonstrations_are_what_the_agent_loop_produces_and_label_only_the_model():
    tok = tokenizer()
    row = make_problem(482, 375, "*", reverse_answer=False)
    ids, model_wrote = demo_ids(tok, row)
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == ('<tool_call>{"name":"calculator","arguments":{"expression":"482*375"}}</tool_call>'
                    "<tool_response>180750</tool_response>180750<|endoftext|>")
    (call,) = parse_tool_calls(text, ToolCallFormat())
    result = encode_text(tok, render_results([calculator(**call.arguments)], ToolCallFormat()))
    start = ids.index(tok.convert_tokens_to_ids("<tool_response>"))
    assert ids[start:start + len(result)] == result  # the agent loop would append exactly these ids
    assert model_wrote == [i < start or i >= start + len(result) for i in range(len(ids))]
    batch = make_sft_batch(tok, [row, {"prompt": "2*3=", "answer": "6"}], tool_demo=[True, False])
    prompt = len(tok.encode("482*375="))
    labels = batch["labels"][0].tolist()
    assert labels[:prompt] == [IGNORE_INDEX] * prompt
    assert [t != IGNORE_INDEX for t in labels[prompt:prompt + len(ids)]] == model_wrote
    assert batch["labels"][1].tolist()[len(tok.encode("2*3=")):][:2] == tok.encode("6") + [1]


def test_reward_grades_the_answer_after_the_last_tool_result():
    reward = load_reward_fn("arithmetic_final")
    assert reward("<tool_call>{}</tool_call><tool_response>6</tool_response>6", "6") == 1.0
    assert reward("<tool_response>7</tool_response><tool_response>6</tool_response>6<|endoftext|>", "6") == 1.0
    assert reward("<tool_call>{}</tool_call><tool_response>6</tool_response>7", "6") == 0.0
    assert reward("6", "6") == 1.0 and reward("6<tool_response>", "6") == 0.0  # no call: the strict first word
    assert reward("<tool_call>{}</tool_call>", "6") == 0.0


@pytest.mark.slow
def test_in_process_agent_decode_runs_the_calculator_on_the_models_call(tmp_path):
    model_dir = make_tool_model(tmp_path / "m")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = tokenizer()
    answers = agent_answers(model, tok, ["482*375=", "123*456="])
    for text, called in answers:
        assert called, text
        (call,) = parse_tool_calls(text, ToolCallFormat())
        result = text.split("<tool_response>", 1)[1].split("</tool_response>", 1)[0]
        assert result == calculator(**call.arguments)  # whatever expression the model wrote


@pytest.mark.slow
def test_make_tiny_cli_builds_the_tool_task(tmp_path):
    out = tmp_path / "tools"
    cmd = [sys.executable, str(REPO / "tools" / "make_tiny.py"), "--out", str(out), "--task", "tools",
           "--sft-steps", "3", "--num-eval", "16"]  # 16 problems per evaluation: the defaults decode for minutes
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    info = json.loads((out / "info.json").read_text())
    assert (info["task"], info["reward"], info["sft"]["num_steps"]) == ("tools", "arithmetic_final", 3)
    assert {"greedy", "sampled_t1", "tool_call_rate_greedy", "tool_call_rate_sampled_t1"} <= set(info["base_accuracy"])
    assert info["base_accuracy"]["num_problems"] == 16 and [c["step"] for c in info["sft"]["curve"]] == [3]
    assert info["config"]["sft"]["tool_fraction"] == 0.3 and info["config"]["task"]["operation"] == "*"
    assert info["config"]["sft"]["target_accuracy"] is None and "machine" in info  # a fixed step count, as addition
    assert json.loads((out / "data" / "test.jsonl").read_text().splitlines()[0])["prompt"].count("*") == 1
