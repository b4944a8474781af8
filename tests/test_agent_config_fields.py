"""Every field of `rollout.agent` reaches the code that acts on it: each check runs the agent loop
against a scripted server (loopback HTTP, real tool workers) with a non-default value and looks at
what the loop did with it; `test_every_field_has_a_check` fails when a field is added without one.
The run config carries the section to the driver (`test_the_run_config_carries_the_agent_section`).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from agent_helpers import agent_config, call_text, decoded_spans, prompt_ids, scripted_policy, tokenizer, write_plugins
from fake_server import ThreadedFakeServer
from sandbox_helpers import can_filter, run_without_kernel_isolation
from megatron_bapo.rollout import PartialRolloutConfig, PartialRolloutManager, Prompt, RolloutClient, RolloutClientConfig
from megatron_bapo.rollout import tool_calls
from megatron_bapo.rollout.agent import AgentConfig, AgentLoop, ToolConfig
from megatron_bapo.rollout.tool_calls import ToolCall, ToolCallFormat

TOK = tokenizer()


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    module = write_plugins(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))
    return module


def run(next_turn, expressions=("6*7",), group_size=1, **agent_overrides):
    """One round (no partial rollout) of a scripted user; (samples, request params, agent)."""
    with ThreadedFakeServer(policy=scripted_policy(next_turn), weight_version="0") as srv, \
            RolloutClient(RolloutClientConfig(urls=[srv.url])) as client:
        agent = AgentLoop(agent_config(**agent_overrides), TOK)
        try:
            m = PartialRolloutManager(client, PartialRolloutConfig(group_size=group_size, max_response_tokens=600),
                                      agent=agent)
            groups = m.step([Prompt(prompt_ids(TOK, e), index=i) for i, e in enumerate(expressions)], 0).groups
        finally:
            agent.close()
        return [s for g in groups for s in g.samples], srv.server.params, agent


def calls(n=1, tool="calculator", start="<tool_call>", end="</tool_call>"):
    """A user calling `tool` on its expression n times (each call in its own turn), then answering."""
    return lambda expr, results: call_text(tool, expr, start, end) if len(results) < n else "done"


def result(samples, i=0):
    return decoded_spans(TOK, samples[0])[i]


def check_tools_name(p):
    samples, _, _ = run(calls(tool="abacus"), tools=[ToolConfig("abacus", "calculator")])
    return result(samples) == "<tool_response>42</tool_response>"


def check_tools_fn(p):
    samples, _, _ = run(calls(), tools=[ToolConfig("calculator", f"{p}:with_options")])
    return result(samples) == "<tool_response>6*7:none:1</tool_response>"


def check_tools_options(p):
    samples, _, _ = run(calls(), tools=[ToolConfig("calculator", f"{p}:with_options", {"unit": "km", "scale": 3})])
    return result(samples) == "<tool_response>6*7:km:3</tool_response>"


def check_max_turns(p):
    spans = [len(run(calls(n=5), max_turns=t)[0][0].agent.tool_spans) for t in (2, 4)]
    return spans == [1, 3]


def check_max_calls_per_turn(p):
    three = lambda expr, results: call_text("calculator", "1+1") * 3 if not results else "done"  # noqa: E731
    fmt = ToolCallFormat(stop_at_call_end=False)
    errors = [run(three, max_calls_per_turn=k, format=fmt)[0][0].agent.num_tool_errors for k in (1, 3)]
    return errors == [2, 0]


def check_tool_timeout_s(p):
    samples, _, _ = run(calls(), ["hang"], tools=[ToolConfig("calculator", f"{p}:misbehave")], tool_timeout_s=1.0)
    return samples[0].agent.num_tool_timeouts == 1 and "still running after 1 s" in result(samples)


def check_num_tool_workers(p):
    # Four calls at once, each 0.5 s: served by as many worker processes as the pool may hold.
    pids = [len({result([s])[len("<tool_response>"):-len("</tool_response>")] for s in
                 run(calls(), ["1", "2"], group_size=2, tools=[ToolConfig("calculator", f"{p}:pid")],
                     num_tool_workers=k)[0]}) for k in (1, 2)]
    return pids == [1, 2]


def check_max_result_chars(p):
    samples, _, _ = run(calls(), ["huge"], tools=[ToolConfig("calculator", f"{p}:misbehave")], max_result_chars=50)
    inner = result(samples)[len("<tool_response>"):-len("</tool_response>")]
    return len(inner) == 50 and samples[0].agent.num_tool_truncated == 1


def check_format_parser(p):
    seen = []

    def upper(text, fmt):  # a parser of its own: "CALL:<expr>" (the turn's text keeps its special tokens)
        seen.append(text)
        expr = text.split("CALL:", 1)[-1].split("<|", 1)[0]
        return [ToolCall("calculator", {"expression": expr})] if "CALL:" in text else []

    tool_calls.PARSERS["upper"] = upper
    try:
        samples, _, _ = run(lambda expr, results: f"CALL:{expr}" if not results else "done",
                            format=ToolCallFormat(parser="upper", stop_at_call_end=False))
    finally:
        del tool_calls.PARSERS["upper"]
    return bool(seen) and result(samples) == "<tool_response>42</tool_response>"


def check_format_call_start(p):
    samples, _, _ = run(calls(start="[[CALL", end="]]"), format=ToolCallFormat(call_start="[[CALL", call_end="]]"))
    return result(samples) == "<tool_response>42</tool_response>"


def check_format_call_end(p):
    samples, params, _ = run(calls(start="<tool_call>", end="@@"), format=ToolCallFormat(call_end="@@"))
    return result(samples) == "<tool_response>42</tool_response>" and params[0].get("stop") == ["@@"]


def check_format_stop_at_call_end(p):
    stop_id = TOK.convert_tokens_to_ids("</tool_call>")
    on = run(calls(), format=ToolCallFormat(stop_at_call_end=True))
    off = run(calls(), format=ToolCallFormat(stop_at_call_end=False))
    # Without the stop the scripted user's turn runs on to its EOS after the call.
    return (on[1][0].get("stop_token_ids") == [stop_id] and "stop_token_ids" not in off[1][0]
            and on[0][0].response_ids[on[0][0].agent.tool_spans[0][0] - 1] == stop_id
            and off[0][0].response_ids[off[0][0].agent.tool_spans[0][0] - 1] == 1)


def _fmt_result(**kw):
    return result(run(calls(), format=ToolCallFormat(**kw))[0])


def check_format_response_prefix(p):
    return _fmt_result(response_prefix="<|im_end|>\nuser\n") == "<|im_end|>\nuser\n<tool_response>42</tool_response>"


def check_format_response_template(p):
    return _fmt_result(response_template="<tool_response>\n{result}\n</tool_response>") == \
        "<tool_response>\n42\n</tool_response>"


def check_format_response_separator(p):
    two = lambda expr, results: call_text("calculator", "1+1") + call_text("calculator", "2+2") if not results else "ok"  # noqa: E731,E501
    samples, _, _ = run(two, format=ToolCallFormat(response_separator="\n", stop_at_call_end=False))
    return result(samples) == "<tool_response>2</tool_response>\n<tool_response>4</tool_response>"


def check_format_response_suffix(p):
    return _fmt_result(response_suffix="<|im_end|>\nassistant\n") == \
        "<tool_response>42</tool_response><|im_end|>\nassistant\n"


def check_allow_unisolated_python(p):
    # Where the kernel cannot isolate the python tool (sandbox_helpers): the loop refuses to start
    # naming the field, unless it is true; then the code runs (behind the audit hook alone).
    if not can_filter():
        pytest.skip("needs Linux seccomp on x86_64 or aarch64 to take the kernel's isolation away")
    script = """
import asyncio, json
from agent_helpers import agent_config, tokenizer
from megatron_bapo.rollout.agent import AgentLoop, ToolConfig
out = {}
for allow in (False, True):
    try:
        loop = AgentLoop(agent_config(tools=[ToolConfig("py", "python")], allow_unisolated_python=allow), tokenizer())
    except Exception as exc:
        out[str(allow)] = f"{type(exc).__name__}: {exc}"
        continue
    try:
        out[str(allow)] = asyncio.run(loop.runner.call("py", {"code": "print(6 * 7)"})).text
    finally:
        loop.close()
print(json.dumps(out))
"""
    out = json.loads(run_without_kernel_isolation(script).strip().splitlines()[-1])
    return "set rollout.agent.allow_unisolated_python=true" in out["False"] and out["True"] == "42\n"


CHECKS = {
    "tools.name": check_tools_name, "tools.fn": check_tools_fn, "tools.options": check_tools_options,
    "max_turns": check_max_turns, "max_calls_per_turn": check_max_calls_per_turn,
    "tool_timeout_s": check_tool_timeout_s, "num_tool_workers": check_num_tool_workers,
    "max_result_chars": check_max_result_chars, "allow_unisolated_python": check_allow_unisolated_python,
    "format.parser": check_format_parser,
    "format.call_start": check_format_call_start, "format.call_end": check_format_call_end,
    "format.stop_at_call_end": check_format_stop_at_call_end, "format.response_prefix": check_format_response_prefix,
    "format.response_template": check_format_response_template,
    "format.response_separator": check_format_response_separator,
    "format.response_suffix": check_format_response_suffix,
}


def _field_paths() -> set[str]:
    nested = {"tools": ToolConfig, "format": ToolCallFormat}
    out = set()
    for f in dataclasses.fields(AgentConfig):
        out |= {f"{f.name}.{g.name}" for g in dataclasses.fields(nested[f.name])} if f.name in nested else {f.name}
    return out


def test_every_field_has_a_check():
    assert set(CHECKS) == _field_paths(), f"fields without a check: {sorted(_field_paths() - set(CHECKS))}"


# The inner loop (-m "not slow") skips the fields whose check takes 4-8 s here; the full suite checks all.
SLOW_FIELDS = {"allow_unisolated_python", "format.response_separator", "format.stop_at_call_end",
               "max_calls_per_turn", "max_turns", "num_tool_workers"}


@pytest.mark.parametrize("field", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FIELDS else f
                                   for f in sorted(CHECKS)])
def test_every_field_reaches_where_it_acts(field, plugins):
    assert CHECKS[field](plugins), field


def test_the_run_config_carries_the_agent_section(tmp_path):
    from megatron_bapo.config import load_run_config
    from megatron_bapo.config_io import ConfigError

    cfg = load_run_config("examples/configs/tiny_tools.yaml", ["rollout.agent.max_turns=3",
                                                               "rollout.agent.format.response_suffix=X"])
    agent = cfg.rollout.agent
    assert agent.enabled and agent.max_turns == 3 and agent.format.response_suffix == "X"
    assert agent.tools == [ToolConfig("calculator", "calculator")]
    for override, needle in [("rollout.agent.max_turns=1", "rollout.agent.max_turns=1 leaves no turn"),
                             ("rollout.agent.tools=[{name: a, fn: calculator}, {name: a, fn: python}]", "duplicate"),
                             ("rollout.agent.format.parser=xml", "parser must be one of"),
                             ("rollout.agent.tool_timeout_s=0", "tool_timeout_s must be > 0"),
                             ("rollout.agent.allow_unisolated_python=yes please",
                              "allow_unisolated_python: expected true/false"),
                             ("rollout.agent.tools=[{name: a, fn: calculator, opts: {}}]", "rollout.agent.tools[0].opts")]:
        with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            load_run_config("examples/configs/tiny_tools.yaml", [override])
    assert not load_run_config("examples/configs/tiny_bapo.yaml").rollout.agent.enabled
