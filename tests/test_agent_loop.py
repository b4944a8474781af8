"""The agent loop of multi-turn rollouts against a scripted server over real loopback HTTP, with the
tools in real worker processes: token in, token out; who wrote each token; partial rollout and exact
resume across turns (mid-turn and between a turn and its tool call); staleness of sampled tokens
only; tools that hang, crash, exit or print megabytes; evaluation through the same loop.
"""

from __future__ import annotations

import json
import sys

import pytest

from agent_helpers import (EOS_ID, agent_config, calculator_user, call_text, decoded_spans, junk_byte_id, prompt_ids,
                           scripted_policy, tokenizer, write_plugins)
from fake_server import ThreadedFakeServer, token_logprob, weights_seed
from megatron_bapo.rollout import (PartialRolloutConfig, PartialRolloutManager, Prompt, RolloutClient,
                                   RolloutClientConfig, SampleState, build_batch)
from megatron_bapo.rollout.agent import AgentLoop, ToolConfig
from megatron_bapo.rollout.batch import build_batch, mask_stale_tokens
from megatron_bapo.rollout.tool_calls import ToolCallFormat
from megatron_bapo.rollout.types import NO_VERSION

TOK = tokenizer()


@pytest.fixture
def serve():
    """`serve(policy, **server_kwargs)` -> (server, client); everything stopped afterwards."""
    opened = []

    def start(policy, **kw):
        srv = ThreadedFakeServer(policy=policy, weight_version=kw.pop("weight_version", "0"), **kw)
        client = RolloutClient(RolloutClientConfig(urls=[srv.url], max_retries=1, backoff_s=0.05))
        opened.append((srv, client))
        return srv, client

    yield start
    for srv, client in opened:
        client.close()
        srv.stop()


@pytest.fixture
def agents():
    made = []

    def make(**overrides):
        agent = AgentLoop(agent_config(**overrides), TOK)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()


def manager(client, agent, *, group_size=2, max_response_tokens=160, segment_tokens=None, max_staleness=None,
            max_group_staleness=None):
    config = PartialRolloutConfig(group_size=group_size, max_response_tokens=max_response_tokens,
                                  segment_tokens=segment_tokens, max_staleness=max_staleness,
                                  max_group_staleness=max_group_staleness)
    return PartialRolloutManager(client, config, agent=agent)


def turn_ids(expression: str, tool: str = "calculator") -> list[int]:
    """The scripted user's first turn up to the end of its call (where the server stops)."""
    return [junk_byte_id(TOK)] + TOK.encode(call_text(tool, expression))


def test_each_request_is_the_ids_sampled_so_far_plus_the_tools_ids(serve, agents):
    srv, client = serve(calculator_user(), weight_version="3")
    prompt = prompt_ids(TOK, "482*37")
    (group,) = manager(client, agents()).step([Prompt(prompt, answer="17834", index=0)], 3).groups
    turn, tool = turn_ids("482*37"), TOK.encode("<tool_response>17834</tool_response>")
    answer = TOK.encode("17834") + [EOS_ID]
    for s in group.samples:
        assert s.state is SampleState.COMPLETED and s.agent.ended_by == "answer"
        assert s.response_ids == turn + tool + answer
        assert s.agent.tool_spans == [[len(turn), len(turn) + len(tool)]]
    # Two requests per sample: the prompt, then EXACTLY prompt + the sampled turn + the tool's ids.
    assert sorted(srv.server.requests, key=len) == [prompt] * 2 + [prompt + turn + tool] * 2
    # The test can fail: decoding and re-tokenizing the sampled turn changes its ids (the lone byte).
    assert TOK.encode(TOK.decode(prompt + turn)) != prompt + turn
    # The turn stopped at the call's end: the loop asked for it (one token: a stop token id).
    assert all(p["stop_token_ids"] == [TOK.convert_tokens_to_ids("</tool_call>")] for p in srv.server.params)


def test_tool_tokens_are_context_only_in_the_sample_and_the_batch(serve, agents):
    srv, client = serve(calculator_user(), weight_version="3")
    prompt = prompt_ids(TOK, "12*34")
    (group,) = manager(client, agents()).step([Prompt(prompt, answer="408", index=0)], 3).groups
    s = group.samples[0]
    (start, end), = s.agent.tool_spans
    seed = weights_seed("init")
    for i, tok in enumerate(s.response_ids):
        if start <= i < end:  # written by the tool: no log-prob, no version
            assert (s.response_logprobs[i], s.response_versions[i], s.model_mask[i]) == (0.0, NO_VERSION, False)
        else:  # sampled: the server's log-prob and version
            expected = token_logprob(prompt + s.response_ids[:i], tok, seed)
            assert s.response_logprobs[i] == pytest.approx(expected) and s.response_versions[i] == 3
    assert s.model_versions == [3] * (len(s.response_ids) - (end - start))
    batch = build_batch(group.samples, advantages=[1.5, -0.5])
    p = len(prompt)
    row = {k: batch[k][0, p:p + len(s.response_ids)].tolist() for k in ("loss_mask", "versions", "behavior_logprobs",
                                                                          "advantages")}
    assert row["loss_mask"] == [float(m) for m in s.model_mask]
    assert row["versions"] == [3 if m else -1 for m in s.model_mask]
    assert row["advantages"] == [1.5 if m else 0.0 for m in s.model_mask]
    assert all(v == 0.0 for v, m in zip(row["behavior_logprobs"], s.model_mask) if not m)
    assert batch["attention_mask"][0, p + start:p + end].tolist() == [1] * (end - start)  # still context


def _run(client, agent, segment_tokens, *, round_trip: bool, prompts, rounds=60, inspect=None):
    """Rounds until every group is back; with `round_trip` the manager is rebuilt from its JSON state
    after every round (a resumed run). `inspect(manager, round)` sees the state between rounds."""
    m = manager(client, agent, segment_tokens=segment_tokens)
    done = m.step(prompts, 0).groups
    for r in range(rounds):
        if inspect is not None:
            inspect(m, r)
        if not m.buffer:
            break
        if round_trip:
            state = json.loads(json.dumps(m.state_dict()))
            m = manager(client, agent, segment_tokens=segment_tokens)
            m.load_state_dict(state)
        done += m.step([], 0).groups
    assert not m.buffer
    return {g.prompt.index: [(s.response_ids, s.response_logprobs, s.response_versions, s.agent.tool_spans,
                              s.state.value) for s in g.samples] for g in done}


def test_partial_rollout_across_turns_resumes_exactly_mid_turn_and_between_a_turn_and_its_call(serve, agents):
    srv, client = serve(calculator_user(calls=2))
    agent = agents(max_turns=3)
    prompts = [Prompt(prompt_ids(TOK, e), answer="", index=i) for i, e in enumerate(["482*37", "6*7", "99*99"])]
    whole = _run(client, agent, None, round_trip=False, prompts=prompts)
    first_turn = len(turn_ids("482*37"))
    seen = {"pending": 0, "mid_turn": 0}

    def inspect(m, r):
        for g in m.buffer:
            for s in g.samples:
                if s.agent and s.agent.pending:  # the round ended right after a turn: its call is pending
                    seen["pending"] += 1
                    assert s.state is SampleState.PARTIAL and s.response_ids[-1] == TOK.convert_tokens_to_ids("</tool_call>")
                elif s.state is SampleState.PARTIAL:
                    seen["mid_turn"] += 1

    # A budget of exactly the first turn: every round boundary falls between a turn and its call, or
    # inside a turn; state round trips through JSON between rounds, as a checkpoint does.
    for segment in (first_turn, 7, 30):
        resumed = _run(client, agent, segment, round_trip=True, prompts=prompts, inspect=inspect)
        assert resumed == whole, f"segment_tokens={segment}"
    assert seen["pending"] > 0 and seen["mid_turn"] > 0
    s = whole[0][0]
    assert len(s[3]) == 2 and s[4] == "completed"  # two tool rounds, then the answer


def test_staleness_counts_sampled_tokens_only(serve, agents):
    srv, client = serve(calculator_user(calls=2), weight_version="5")
    m = manager(client, agents(max_turns=3), segment_tokens=80, max_staleness=0, max_group_staleness=0)
    m.step([Prompt(prompt_ids(TOK, "6*7"), answer="42", index=0)], 5)
    (group,) = m.buffer
    assert all(s.agent.tool_spans and s.state is SampleState.PARTIAL for s in group.samples)
    assert any(v == NO_VERSION for s in group.samples for v in s.response_versions)
    # Version 5 everywhere it was sampled: not past a hard cap of 0 at 5 (the tool's -1 would be).
    assert not m._too_stale(group.samples[0], 5) and m._too_stale(group.samples[0], 6)
    done = m.step([], 5).groups
    assert m.totals["num_regenerated"] == 0 and not m.buffer
    # At training time (per token, max_staleness 0): nothing leaves the loss at version 5; at 6 every
    # sampled token does, and the tool's tokens were never in it.
    samples = [s for g in done for s in g.samples]
    sampled = sum(len(s.model_versions) for s in samples)
    for version, masked in ((5, 0), (6, sampled)):
        batch = build_batch(samples)
        assert mask_stale_tokens(batch, version, 0)["staleness/num_masked_tokens"] == masked
    assert int(batch["loss_mask"].sum()) == 0 and sampled < sum(len(s.response_ids) for s in samples)


@pytest.mark.slow
def test_tools_that_hang_crash_exit_or_print_megabytes_give_bounded_errors_and_are_counted(serve, agents, tmp_path,
                                                                                          monkeypatch):
    module = write_plugins(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))  # the workers import it too
    srv, client = serve(calculator_user())
    agent = agents(tools=[ToolConfig("calculator", f"{module}:misbehave")], tool_timeout_s=2.0, max_result_chars=120,
                   num_tool_workers=2)
    cases = ["hang", "crash", "exit", "spam", "huge", "6*7"]
    m = manager(client, agent, group_size=1, max_response_tokens=400)
    first = m.step([Prompt(prompt_ids(TOK, e), answer="", index=i) for i, e in enumerate(cases)], 0)
    groups = first.groups
    results = {cases[g.prompt.index]: decoded_spans(TOK, g.samples[0])[0] for g in groups}
    assert sorted(results) == sorted(cases)  # every sample finished: the run goes on
    inner = {k: v[len("<tool_response>"):-len("</tool_response>")] for k, v in results.items()}
    assert "still running after 2 s" in inner["hang"]
    assert inner["crash"] == "error: RuntimeError: the tool broke"
    assert "worker process died" in inner["exit"]
    for k in ("spam", "huge"):
        assert len(inner[k]) == 120 and "characters in all" in inner[k]
    assert inner["spam"].startswith("xxxx") and inner["6*7"] == "42"
    metrics = first.metrics
    assert (metrics["rollout/num_tool_calls"], metrics["rollout/num_tool_timeouts"], metrics["rollout/num_tool_errors"],
            metrics["rollout/num_tool_truncated"]) == (6, 1, 2, 2)
    assert metrics["rollout/tool_s"] >= 2.0
    # The pools replaced their killed and dead workers: the same tool works in the next step.
    (again,) = m.step([Prompt(prompt_ids(TOK, "8*8"), answer="", index=9)], 0).groups
    assert decoded_spans(TOK, again.samples[0]) == ["<tool_response>64</tool_response>"]


@pytest.mark.parametrize("turn, expected", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+"}}</tool_call>',
     "error: cannot parse '1+': invalid syntax"),
    pytest.param('<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>',
                 "error: expression must be a string, got int", marks=pytest.mark.slow),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "error: unknown tool 'search'; available: calculator"),
    ("<tool_call>{not json}</tool_call>", "error: the tool call is not valid JSON"),
    pytest.param('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>', "6",
                 marks=pytest.mark.slow),
    pytest.param('<tool_call>["calculator"]</tool_call>', 'error: the tool call must be a JSON object with a "name"',
                 marks=pytest.mark.slow),
])
def test_malformed_and_unknown_calls_become_error_messages(serve, agents, turn, expected):
    srv, client = serve(scripted_policy(lambda expr, results: turn if not results else "done"))
    (group,) = manager(client, agents(), group_size=1).step([Prompt(prompt_ids(TOK, "x"), answer="", index=0)], 0).groups
    s = group.samples[0]
    (span,) = decoded_spans(TOK, s)
    assert span.startswith("<tool_response>" + expected)
    assert s.state is SampleState.COMPLETED and s.agent.num_tool_errors == (expected != "6")


def test_max_turns_max_calls_per_turn_and_no_room_for_a_result(serve, agents):
    srv, client = serve(calculator_user(calls=5))
    (group,) = manager(client, agents(max_turns=3), group_size=1, max_response_tokens=300).step(
        [Prompt(prompt_ids(TOK, "2*2"), answer="", index=0)], 0).groups
    s = group.samples[0]
    assert len(s.agent.tool_spans) == 2 and s.agent.ended_by == "max_turns" and s.state is SampleState.COMPLETED
    assert s.response_ids[-1] == TOK.convert_tokens_to_ids("</tool_call>")  # the third call was written, not run

    two = call_text("calculator", "1+1") + call_text("calculator", "2+2") + call_text("calculator", "3+3")
    srv, client = serve(scripted_policy(lambda expr, results: two if not results else "ok"))
    agent = agents(max_calls_per_turn=2, format=ToolCallFormat(stop_at_call_end=False))  # the turn ends at EOS
    (group,) = manager(client, agent, group_size=1, max_response_tokens=400).step(
        [Prompt(prompt_ids(TOK, "y"), answer="", index=0)], 0).groups
    (span,) = decoded_spans(TOK, group.samples[0])
    assert span == ("<tool_response>2</tool_response><tool_response>4</tool_response><tool_response>error: more "
                    "than 2 tool calls in one turn; this one was not run</tool_response>")

    srv, client = serve(calculator_user())
    first = len(turn_ids("3*3"))
    (group,) = manager(client, agents(), group_size=1, max_response_tokens=first + 3).step(
        [Prompt(prompt_ids(TOK, "3*3"), answer="", index=0)], 0).groups
    s = group.samples[0]  # the result's 3 tokens would leave no room for an answer
    assert s.state is SampleState.TRUNCATED and s.agent.ended_by == "no_room" and not s.agent.tool_spans


def test_rollout_metrics_count_turns_tools_and_tokens(serve, agents):
    srv, client = serve(calculator_user())
    m = manager(client, agents(), group_size=2)
    out = m.step([Prompt(prompt_ids(TOK, e), answer="", index=i) for i, e in enumerate(["2*3", "40*50"])], 0).metrics
    tool_tokens = [len(TOK.encode(f"<tool_response>{r}</tool_response>")) for r in ("6", "2000")]
    assert out["rollout/num_tool_calls"] == 4 and out["rollout/num_tool_tokens"] == 2 * sum(tool_tokens)
    assert out["rollout/turns_mean"] == 2.0 and out["rollout/tool_call_rate"] == 1.0
    assert out["rollout/tool_calls_per_sample"] == 1.0 and out["rollout/frac_max_turns"] == 0.0
    assert out["rollout/tool_tokens_mean"] == sum(tool_tokens) / 2
    assert out["rollout/model_tokens_mean"] + out["rollout/tool_tokens_mean"] == out["rollout/response_len_mean"]
    assert m.totals["num_tool_calls"] == 4 and "rollout/tool_s" in out


def test_evaluation_runs_the_same_agent_loop(serve, agents):
    from megatron_bapo.eval import EvalConfig
    from megatron_bapo.eval.core import EvalProblem
    from megatron_bapo.eval.runner import evaluate_dataset
    from megatron_bapo.eval.sampling import AgentSampler

    srv, client = serve(calculator_user())
    problems = [EvalProblem(0, "482*37=", "17834"), EvalProblem(1, "6*7=", "42"), EvalProblem(2, "1*1=", "2")]
    config = EvalConfig(n=2, max_new_tokens=160, temperature=1.0, top_p=1.0, reward="arithmetic_final", concurrency=2)
    records, metrics = client.run(evaluate_dataset(AgentSampler(client, agents(), TOK), TOK, problems, config))
    assert metrics["avg@2"] == pytest.approx(2 / 3)  # the user copies the result; "1*1" is graded against "2"
    assert (metrics["tool_call_rate"], metrics["tool_calls_mean"], metrics["turns_mean"]) == (1.0, 1.0, 2.0)
    response = records[0]["responses"][0]
    assert response["num_tool_calls"] == 1 and response["text"].endswith("</tool_response>17834")
    assert len(srv.server.requests) == 3 * 2 * 2


@pytest.mark.slow  # the evaluation's agent loop stays in the inner loop (the test above)
def test_evaluate_tool_takes_the_agent_section_of_a_run_config(serve, tiny_hf_dir, tmp_path, capsys):
    from megatron_bapo.eval.cli import main

    srv, _ = serve(calculator_user())
    data = tmp_path / "t.jsonl"
    data.write_text('{"prompt": "12*12=", "answer": "144"}\n{"prompt": "7*6=", "answer": "41"}\n')
    rc = main(["--model-path", str(tiny_hf_dir), "--data", str(data), "--n", "2", "--temperature", "1.0",
               "--top-p", "1.0", "--max-new-tokens", "160", "--reward", "arithmetic_final", "--server-url", srv.url,
               "--agent-config", "examples/configs/tiny_tools.yaml", "--output", str(tmp_path / "out")])
    assert rc == 0
    summary = json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"]
    assert summary["eval/t/avg@2"] == 0.5 and summary["eval/t/tool_call_rate"] == 1.0
    assert "tool_call_rate" in capsys.readouterr().out
    assert main(["--model-path", str(tiny_hf_dir), "--data", str(data), "--agent-config",
                 "examples/configs/tiny_bapo.yaml"]) == 2  # no tools there: one line, exit 2


def test_an_abort_while_a_tool_runs_ends_the_round_and_the_next_resumes_it(serve, agents, tmp_path, monkeypatch):
    """A checkpoint (or a weight update's pause) aborts the round in flight: a sample whose tool is
    running keeps the result and sends no new turn until the next round, which finishes it as an
    uninterrupted round would have."""
    import time

    module = write_plugins(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + ":".join(sys.path))
    marker = tmp_path / "started"
    srv, client = serve(calculator_user())
    agent = agents(tools=[ToolConfig("calculator", f"{module}:slow", {"marker": str(marker)})])
    prompts = [Prompt(prompt_ids(TOK, "21*2"), answer="42", index=0)]
    whole = manager(client, agent, group_size=1).step(prompts, 0).groups[0].samples[0]
    marker.unlink()
    m = manager(client, agent, group_size=1)
    future = client.submit(m.astep(prompts, 0))
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:  # the tool is running now
        time.sleep(0.01)
    sent = len(srv.server.requests)
    client.abort_all()
    first = future.result(60)
    assert first.groups == [] and len(srv.server.requests) == sent  # no next turn was sent after the abort
    (s,) = m.buffer[0].samples
    assert s.state is SampleState.ABORTED and decoded_spans(TOK, s) == ["<tool_response>42</tool_response>"]
    (group,) = m.step([], 0).groups
    assert (group.samples[0].response_ids, group.samples[0].response_logprobs) == (whole.response_ids,
                                                                                   whole.response_logprobs)
