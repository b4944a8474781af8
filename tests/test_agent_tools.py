"""The built-in tools (calculator, python), the tool runner's worker processes, and the Hermes call format."""

from __future__ import annotations

import asyncio
import re
import sys

import pytest

from agent_helpers import tokenizer, write_plugins
from megatron_bapo.rollout.tool_calls import (ToolCall, ToolCallFormat, encode_text, parse_tool_calls, render_results,
                                              stop_params)
from megatron_bapo.rollout.tools import ToolDef, ToolError, ToolRunner, ToolSpecError, bound_text, load_tool_fn
from megatron_bapo.rollout.tools.calculator import calculator
from megatron_bapo.rollout.tools.python import python


@pytest.mark.parametrize("expression, value", [
    ("482*375", "180750"), ("6/2", "3"), ("7/2", "3.5"), ("2**10", "1024"), ("(1+2)*3-4", "5"), ("-7//2", "-4"),
    ("sqrt(16)+abs(-1)", "5"), ("max(3, 9, 4)", "9"), ("10 % 4", "2"), (" 1e3 ", "1000"),
])
def test_calculator_computes(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression, needle", [
    ("__import__('os')", "calling __import__ is not allowed"), ("(1).real.conjugate()", "Call is not allowed"),
    ("open('/etc/passwd')", "calling open is not allowed"), ("x + 1", "name x is not allowed"),
    ("(1).__class__", "Attribute is not allowed"), ("'a' * 3", "not a number"), ("9**9**9", "exponent"),
    ("10**5000", "digits"), ("1/0", "division by zero"), ("exp(1000)", "OverflowError"), ("1e308*10", "not finite"),
    ("1 +", "cannot parse"), ("[1, 2]", "List is not allowed"), ("1" * 1001, "longer than 1000"),
])
def test_calculator_refuses_what_is_not_arithmetic(expression, needle):
    with pytest.raises(ToolError, match=re.escape(needle)):
        calculator(expression)


def test_python_tool_runs_code_and_enforces_its_limits():
    assert python("print(6 * 7)") == "42\n"
    assert "ZeroDivisionError" in python("1/0")  # the code's own error is ordinary output
    assert python("import os; print(len(os.listdir('.')))") == "1\n"  # an empty working directory (+ its output file)
    for code, needle in [("import socket; socket.socket()", "socket.__new__ is not allowed"),
                         ("import urllib.request; urllib.request.urlopen('http://127.0.0.1:9')", "not allowed"),
                         ("import os; os.fork()", "os.fork is not allowed"),
                         ("import subprocess; subprocess.run(['true'])", "import subprocess is not allowed"),
                         ("import ctypes", "import ctypes is not allowed"),
                         ("x = bytearray(1 << 31)", "MemoryError")]:
        assert needle in python(code), code
    with pytest.raises(ToolError, match="more than 1 s of CPU time"):
        python("while True: pass", cpu_s=1, wall_s=20)
    with pytest.raises(ToolError, match="longer than 1 s"):
        python("import time; print('before', flush=True); time.sleep(60)", wall_s=1)
    with pytest.raises(ToolError, match="printed more than 1000 bytes") as err:
        python("while True: print('x' * 100)", max_output_bytes=1000)
    assert len(str(err.value)) < 1100
    assert python("print('y' * 999)", max_output_bytes=1000) == "y" * 999 + "\n"  # exactly the limit: fine


def test_bound_text_keeps_the_head_and_says_how_long_it_was():
    assert bound_text("abc", 5) == ("abc", False)
    text, cut = bound_text("x" * 500, 60)
    assert cut and len(text) == 60 and text.startswith("xxx") and text.endswith("[cut: 500 characters in all]")
    assert bound_text("x" * 10, 60, total=9000)[0].endswith("[cut: 9000 characters in all]")


def test_runner_binds_options_the_model_cannot_override(tmp_path, monkeypatch):
    module = write_plugins(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))
    runner = ToolRunner([ToolDef("convert", f"{module}:with_options", {"unit": "km"}), ToolDef("calc", "calculator")],
                        timeout_s=20, num_workers=1, max_result_chars=100)
    try:
        call = lambda name, args: asyncio.run(runner.call(name, args))  # noqa: E731
        assert call("convert", {"expression": "3"}).text == "3:km:1"
        assert call("convert", {"expression": "3", "scale": 2}).text == "3:km:2"
        refused = call("convert", {"expression": "3", "unit": "mi"})
        assert refused.status == "error" and "fixed by the configuration" in refused.text
        assert call("calc", {"expression": "2+2"}).text == "4"
        bad = call("calc", {"expression": "2+2", "extra": 1})
        assert bad.status == "error" and "unexpected keyword argument 'extra'" in bad.text
        assert call("calc", ["2+2"]).status == "error" and call("nope", {}).text.startswith("error: unknown tool")
    finally:
        runner.close()
    with pytest.raises(ToolSpecError, match="cannot import module 'no_such_mod'"):
        load_tool_fn("no_such_mod:f")
    with pytest.raises(ToolSpecError, match="built-in name"):
        load_tool_fn("abacus")


def test_hermes_calls_are_parsed_from_complete_blocks_in_order():
    fmt = ToolCallFormat()
    text = ('think <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call> and '
            '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call><tool_call>{"name": "c"')
    assert parse_tool_calls(text, fmt) == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": 2})]  # c never closed
    assert parse_tool_calls("no call here", fmt) == []
    assert parse_tool_calls('<tool_call>{"name": "a"}</tool_call>', fmt) == [ToolCall("a", {})]
    (bad,) = parse_tool_calls('<tool_call>{"name": "a", "arguments": 3}</tool_call>', fmt)
    assert bad.name == "a" and "must be a JSON object" in bad.error
    custom = ToolCallFormat(call_start="[[", call_end="]]")
    assert parse_tool_calls('[[{"name": "z", "arguments": {}}]]', custom) == [ToolCall("z", {})]


def test_results_render_with_prefix_template_separator_and_suffix_and_tokenize_alone():
    qwen3 = ToolCallFormat(response_prefix="<|im_end|>\n<|im_start|>user\n",
                           response_template="<tool_response>\n{result}\n</tool_response>", response_separator="\n",
                           response_suffix="<|im_end|>\n<|im_start|>assistant\n")
    text = render_results(["1", "{not a field}"], qwen3)
    assert text == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n"
                    "{not a field}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    tok = tokenizer()
    assert encode_text(tok, text)[0] == tok.convert_tokens_to_ids("<|im_end|>")  # no BOS, the added token first
    assert stop_params(tok, ToolCallFormat()) == {"stop_token_ids": [261]}
    assert stop_params(tok, ToolCallFormat(call_start="[[", call_end="]]")) == {"stop": ["]]"]}  # two tokens: a string
    assert stop_params(tok, ToolCallFormat(stop_at_call_end=False)) == {}
    with pytest.raises(ValueError, match="response_template must contain"):
        ToolCallFormat(response_template="<r></r>")
    with pytest.raises(ValueError, match="parser must be one of"):
        ToolCallFormat(parser="pythonic")
