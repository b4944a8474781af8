"""Multi-turn rollouts end to end with a real model: a tiny Qwen2 taught to write calculator calls
(`agent_helpers.make_tool_model`, a few seconds of SFT), served by the built-in server.

1. The agent loop against the server, through a recording proxy: every `/generate` the server
   received holds exactly the prompt, the tokens it sampled before and the tools' result ids, with
   round boundaries inside turns and between a turn and its call (partial rollout), and state
   round-tripped through JSON between rounds.
2. The trainer CLI with `rollout.agent`: a tool that hangs, raises or prints megabytes on most calls,
   rollout one step ahead, partial rollout, DAPO's refill (`rollout.dynamic_sampling`); the run
   finishes, counts the failures, refills from multi-turn groups and evaluates through the agent loop.

The first runs against both engines: the built-in server (seeded) and live SGLang 0.5.23 on CPU
(`.venv-sglang`; no seeds: SGLang's deterministic mode needs GPU attention kernels).
"""

from __future__ import annotations

import json

import pytest

from agent_helpers import make_tool_model, tokenizer, write_plugins
from contract_helpers import SGLANG_PYTHON
from megatron_bapo.metrics import read_jsonl_metrics
from megatron_bapo.rollout import PartialRolloutConfig, PartialRolloutManager, Prompt, RolloutClient, RolloutClientConfig
from megatron_bapo.rollout.agent import AgentConfig, AgentLoop, ToolConfig
from megatron_bapo.tiny.task import TaskConfig, generate_splits, write_jsonl
from run_helpers import finish_later, run_config, start_train, train_env
from sglang_proxy import RecordingProxy

pytestmark = pytest.mark.slow
TOK = tokenizer()


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_assets")
    model = make_tool_model(root / "model")
    train, test = generate_splits(TaskConfig(min_operand=100, max_operand=999, operation="*", reverse_answer=False,
                                             num_train=200, num_test=8))
    write_jsonl(train, root / "train.jsonl")
    write_jsonl(test, root / "test.jsonl")
    write_plugins(root)
    return root, model


@pytest.fixture(scope="module")
def cli_run(tool_assets, tmp_path_factory):
    """The run `test_cli_run_with_a_misbehaving_tool_finishes_and_counts_it` checks, started beside the
    agent-loop tests (it mostly waits: on its tools' 1 s timeouts, its server's start, its imports):
    (output_dir, the process, its console output to come)."""
    root, model = tool_assets
    out = tmp_path_factory.mktemp("cli_run") / "run"
    config = run_config((root, model), out, total_steps=4, save_every=2, async_steps=1, sections={
        "data": {"path": str(root / "train.jsonl"), "apply_chat_template": False, "max_prompt_tokens": 32},
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_response_tokens": 96, "segment_tokens": 48,
                    "max_staleness": 3, "client": {"health_timeout_s": 180},
                    "dynamic_sampling": "refill", "max_refill_rounds": 1,
                    "agent": {"tools": [{"name": "calculator", "fn": "tool_plugins_mod:flaky"}], "max_turns": 2,
                              "tool_timeout_s": 1.0, "max_result_chars": 200}},
        "reward": {"fn": "tool_plugins_mod:length_mod3", "num_workers": 0},
        "eval": {"every_n_steps": 4, "datasets": [{"name": "t", "path": str(root / "test.jsonl")}], "n": 2,
                 "max_new_tokens": 96, "temperature": 1.0, "top_p": 1.0, "reward": "arithmetic_final"},
    })
    proc = start_train(config, (root, model), env=train_env((root, model)))
    yield out, proc, finish_later(proc, timeout=600)
    if proc.poll() is None:
        proc.kill()


@pytest.mark.usefixtures("cli_run")  # starts that run now, beside these
@pytest.mark.parametrize("engine", ["builtin", "sglang"])
def test_agent_loop_sends_the_exact_ids_to_a_real_server(tool_assets, tmp_path, engine):
    from megatron_bapo.rollout.sglang_launch import SGLangLaunchConfig, start_sglang_server
    from megatron_bapo.server.launch import start_server

    root, model = tool_assets
    records = tmp_path / "requests.jsonl"
    prompts = [Prompt(TOK.encode(p), index=i) for i, p in enumerate(["482*375=", "123*456=", "907*118="])]
    agent = AgentLoop(AgentConfig(tools=[ToolConfig("calculator", "calculator")], max_turns=3), TOK)
    config = PartialRolloutConfig(group_size=2, max_response_tokens=96, segment_tokens=24, max_staleness=None)
    if engine == "builtin":
        server, seed = start_server(model, extra_args=["--enable-deterministic-inference", "--num-threads", "1"]), 7
    else:
        if not SGLANG_PYTHON.exists():
            pytest.fail(f"{SGLANG_PYTHON} is missing: run bash tools/install.sh --with-sglang (tools/run_tests.sh does)")
        server, seed = start_sglang_server(SGLangLaunchConfig(python=str(SGLANG_PYTHON), device="cpu"),
                                           model_path=str(model), log_path=tmp_path / "sglang.log",
                                           random_seed=0), None
    try:
        with RecordingProxy(server.url, records) as proxy, RolloutClient(RolloutClientConfig(urls=[proxy.url])) as client:
            m = PartialRolloutManager(client, config, seed=seed, agent=agent)
            done = m.step(prompts, 0).groups
            for _ in range(10):
                if not m.buffer:
                    break
                state = json.loads(json.dumps(m.state_dict()))  # a checkpoint between every two rounds
                m = PartialRolloutManager(client, config, seed=seed, agent=agent)
                m.load_state_dict(state)
                done += m.step([], 0).groups
    finally:
        server.stop()
        agent.close()
    samples = [s for g in done for s in g.samples]
    assert len(samples) == 6 and not m.buffer
    called = [s for s in samples if s.agent.tool_spans]
    assert len(called) >= 3, [TOK.decode(s.response_ids) for s in samples]  # the model does write calls
    sent = [r["body"]["input_ids"] for r in map(json.loads, records.read_text().splitlines())
            if r["path"] == "/generate"]
    # Every request is a prefix of its sample's final ids: the prompt, what the server sampled, the
    # tools' ids; and each sample's last request is everything it holds but the last segment's tokens.
    finals = [s.prompt_ids + s.response_ids for s in samples]
    assert all(any(f[:len(ids)] == ids for f in finals) for ids in sent)
    for s in called:
        (start, end), *_ = s.agent.tool_spans
        boundary = s.prompt_ids + s.response_ids[:end]
        assert boundary in sent  # the turn after the call started from exactly these ids
        assert TOK.decode(s.response_ids[start:end]).startswith("<tool_response>")


def test_cli_run_with_a_misbehaving_tool_finishes_and_counts_it(cli_run):
    out, _, log = cli_run
    log = log.result()
    assert "done: steps 1-4" in log, log[-3000:]
    records = read_jsonl_metrics(out / "tb")
    total = {k: sum(float(r.get(f"rollout/{k}", 0)) for r in records)
             for k in ("num_tool_calls", "num_tool_timeouts", "num_tool_errors", "num_tool_truncated")}
    assert total["num_tool_calls"] > 0 and total["num_tool_timeouts"] + total["num_tool_errors"] > 0, total
    assert any("rollout/turns_mean" in r and "rollout/model_tokens_mean" in r for r in records)
    refill = [r for r in records if "rollout/refill_rounds" in r]
    assert len(refill) == 4 and all(r["rollout/refill_rounds"] <= 1 for r in refill), refill
    # Each step trains 2 informative groups unless its one refill round found too few (and says so) or
    # a group was found too stale when the trainer took the round (regenerated).
    assert all(r.get("experience/num_groups", 0) == 2 or r["rollout/refill_cap_hit"] == 1
               or r.get("rollout/num_regenerated", 0) > 0 for r in refill), refill
    assert any(r.get("experience/num_groups", 0) == 2 for r in refill), refill  # multi-turn groups were trained
    evals = [r for r in records if "eval/t/tool_call_rate" in r]
    assert [r["step"] for r in evals] == [0, 4] and all(0 <= r["eval/t/tool_call_rate"] <= 1 for r in evals)
    state = json.loads((out / "checkpoints" / "step_000004" / "trainer.json").read_text())
    buffered = [s for g in state["rollout"]["groups"] for s in g["samples"]]
    assert all("agent" in s for s in buffered)
