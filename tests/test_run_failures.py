"""A run never trains nothing silently: `python -m megatron_bapo.train` as a user runs it, with the
settings and faults users hit. A wrong setting is one line naming the field, before the model is
built; a reward that keeps failing stops the run and says why; a built-in server killed mid-run is
restarted and the run completes; an external server gone for good is named; an API key reaches
every call; a resumed run samples what the uninterrupted one would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
import yaml

from megatron_bapo.metrics import read_jsonl_metrics
from megatron_bapo.server.launch import start_server
from run_helpers import finish, kill_the_server_then_finish, last_line, pid_alive, pids_running, run_config, server_pids, start_train, train_env, write_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    return write_assets(tmp_path_factory.mktemp("failure_assets")), tiny_hf_dir


def _warnings(log: str) -> list[str]:
    return [ln for ln in log.splitlines() if " WARNING " in ln]


def _wait_for_step(proc, out, step: int, timeout: float = 600) -> None:
    ledger = out / "samples.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"trainer exited early: {proc.stdout.read()[-4000:]}")
        if ledger.exists() and any(json.loads(ln)["step"] >= step for ln in ledger.read_text().splitlines()):
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for step {step}")


@pytest.mark.parametrize("case", ["data_path", "model_path", "reward_typo", "response_over_context",
                                  "response_over_context+driver_process"])
def test_wrong_setting_is_one_line_before_the_model_is_built(assets, tmp_path, case):
    """`+driver_process`: found in the driver's own process (`trainer.driver_process`), which started the
    server: the same line, and the server is gone too."""
    case, _, driver_process = case.partition("+")
    sections, field = {
        "data_path": ({"data": {"path": str(tmp_path / "missing.jsonl")}}, "data.path"),
        "model_path": ({"model": {"hf_path": str(tmp_path / "no_model")}}, "model.hf_path"),
        "reward_typo": ({"reward": {"fn": "parity_reward_mod:parity_rewad"}}, "parity_rewad"),
        # The tiny model's context is 512 tokens: every request would be rejected (400).
        "response_over_context": ({"rollout": {"max_response_tokens": 600, "segment_tokens": 300}}, "rollout.max_response_tokens"),
    }[case]
    out = tmp_path / "run"
    config = run_config(assets, out, sections=sections, log_level="info", driver_process=bool(driver_process))
    started = time.monotonic()
    proc = start_train(config, assets)
    log = finish(proc)
    assert proc.returncode == 2, log[-4000:]
    last = last_line(log)
    assert last.startswith("config error:") and field in last, log[-4000:]
    assert "Traceback" not in log
    full = (out / "logs" / "train.log").read_text()  # every INFO record; the console has warnings only
    assert f"stopped: {last}" in full, full[-4000:]
    assert "actor built" not in full, "the model was built before the setting was checked"
    assert time.monotonic() - started < 120
    assert not any(pid_alive(p) for p in server_pids(out)) and pids_running(config) == []


def test_reward_that_keeps_failing_stops_the_run_and_says_why(assets, tmp_path):
    out = tmp_path / "run"
    config = run_config(assets, out, sections={"reward": {"fn": "parity_reward_mod:broken_reward"}}, total_steps=4)
    proc = start_train(config, assets)
    log = finish(proc)
    assert proc.returncode == 2, log[-4000:]
    last = last_line(log)
    assert last.startswith("reward error: reward 'parity_reward_mod:broken_reward' failed on"), last
    assert "KeyError: 'answer_format'" in last and "reward.max_failure_rate" in last
    assert "Traceback" not in log
    records = read_jsonl_metrics(out / "tb")
    assert not any("bapo/c_high" in r for r in records), "an update was made on failed rewards"


def test_step_whose_requests_the_servers_reject_stops_the_run_with_their_message(assets, tmp_path):
    """A setting every request fails on (here a malformed stop_token_ids in rollout.sampling.extra): the first
    step stops the run with the server's 400 message instead of dropping every group for the whole
    run and exiting 0 having trained nothing."""
    out = tmp_path / "run"
    config = run_config(assets, out, sections={"rollout": {"sampling": {"extra": {"stop_token_ids": "7"}}}},
                        total_steps=4)
    proc = start_train(config, assets)
    log = finish(proc)
    assert proc.returncode == 2, log[-4000:]
    last = last_line(log)
    assert last.startswith("rollout error: the servers rejected (4xx) the requests of 3 of 3 groups"), last
    assert "stop_token_ids must be a list of integers" in last and "rollout.max_failed_group_rate" in last
    assert len(_warnings(log)) <= 3, "\n".join(_warnings(log))


def test_rejection_threshold_of_one_trains_on_with_one_warning_per_step(assets, tmp_path):
    """rollout.max_failed_group_rate=1 turns the stop off: the run goes on, one warning per step."""
    out = tmp_path / "run"
    rollout = {"sampling": {"extra": {"stop_token_ids": "7"}}, "max_failed_group_rate": 1.0}
    config = run_config(assets, out, sections={"rollout": rollout}, total_steps=2, save_every=0)
    proc = start_train(config, assets, "eval.every_n_steps=0")
    log = finish(proc)
    assert proc.returncode == 0, log[-4000:]
    rejected = [ln for ln in _warnings(log) if "rollout request(s) rejected (4xx)" in ln]
    assert len(rejected) == 2, "\n".join(_warnings(log))


def test_builtin_server_out_of_restarts_stops_the_run_naming_it(assets, tmp_path):
    """rollout.max_server_restarts=0: a built-in server that dies is not restarted; the run stops
    with one line naming the server and its log."""
    out = tmp_path / "run"
    rollout = {"client": {"health_timeout_s": 180, "max_retries": 2, "backoff_s": 0.2}, "max_server_restarts": 0}
    config = run_config(assets, out, sections={"rollout": rollout}, total_steps=5, save_every=0)
    proc = start_train(config, assets)
    log, killed = kill_the_server_then_finish(proc, out, lambda: _wait_for_step(proc, out, 2))
    assert proc.returncode == 2, log[-4000:]
    last = last_line(log)
    assert last.startswith("rollout error: built-in server") and "after 0 restart(s)" in last, last
    assert "server_0.log" in last


def test_killed_builtin_server_is_restarted_and_the_run_completes(assets, tmp_path):
    out = tmp_path / "run"
    client = {"health_timeout_s": 180, "max_retries": 2, "backoff_s": 0.2}
    config = run_config(assets, out, sections={"rollout": {"client": client}}, total_steps=5, save_every=0)
    proc = start_train(config, assets)
    log, killed = kill_the_server_then_finish(proc, out, lambda: _wait_for_step(proc, out, 2))
    assert proc.returncode == 0, log[-4000:]
    assert "died with exit code -9; restarting it (1 of 3)" in log, log[-4000:]
    assert len(_warnings(log)) <= 6, "\n".join(_warnings(log))
    [restarted] = server_pids(out)
    assert restarted != killed and not pid_alive(restarted)  # stopped at the end, as the first one would be
    lines = [json.loads(ln) for ln in (out / "samples.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3, 4, 5]
    trained = [g for ln in lines for g, _ in ln["trained"]]
    assert trained and len(set(trained)) == len(trained)
    # Training went on past the kill: updates after step 2, served by the restarted server.
    records = read_jsonl_metrics(out / "tb")
    assert [r["step"] for r in records if "bapo/c_high" in r][-1] == 5


def test_external_server_gone_for_good_is_named_in_one_line(assets, tmp_path, tiny_hf_dir):
    out = tmp_path / "run"
    server = start_server(tiny_hf_dir, log_path=tmp_path / "external.log")
    try:
        client = {"urls": [server.url], "health_timeout_s": 5, "max_retries": 2, "backoff_s": 0.2,
                  "control_timeout_s": 10}
        config = run_config(assets, out, sections={"rollout": {"client": client}}, total_steps=5, save_every=0)
        proc = start_train(config, assets)
        _wait_for_step(proc, out, 2)
        server.proc.kill()
        log = finish(proc)
    finally:
        server.stop()
    assert proc.returncode == 2, log[-4000:]
    last = last_line(log)
    assert last.startswith("rollout error:") and server.url in last, log[-4000:]
    assert "Traceback" not in log
    assert len(_warnings(log)) <= 6, "\n".join(_warnings(log))


def test_api_key_reaches_every_call_and_is_never_written(assets, tmp_path, tiny_hf_dir):
    """Servers behind a key: generation, control, weight sync and evaluation all authenticate (a run
    without the key is refused by the server), and the key is not in the run directory."""
    key = "k3y-" + os.urandom(6).hex()
    server = start_server(tiny_hf_dir, log_path=tmp_path / "keyed.log", extra_args=["--api-key", key])
    try:
        client = {"urls": [server.url], "health_timeout_s": 30, "max_retries": 1, "backoff_s": 0.2}
        keyed = run_config(assets, tmp_path / "keyed", sections={"rollout": {"client": client}}, total_steps=3)
        proc = start_train(keyed, assets, env=train_env(assets, ROLLOUT_API_KEY=key))
        log = finish(proc)
        assert proc.returncode == 0, log[-4000:]
        records = read_jsonl_metrics(tmp_path / "keyed" / "tb")
        assert any("eval/t/avg@2" in r for r in records) and any("bapo/c_high" in r for r in records)
        # In the config instead of the environment: masked in the run directory's config.yaml.
        in_config = {**client, "api_key": key}
        written = run_config(assets, tmp_path / "in_config", sections={"rollout": {"client": in_config}},
                             total_steps=1, eval_at_start=False)
        proc = start_train(written, assets)
        log = finish(proc)
        assert proc.returncode == 0, log[-4000:]
        saved = (tmp_path / "in_config" / "config.yaml").read_text()
        assert key not in saved and yaml.safe_load(saved)["rollout"]["client"]["api_key"] == "***"
        for path in (tmp_path / "keyed").rglob("*"):
            if path.is_file() and path.stat().st_size < 10_000_000:
                assert key.encode() not in path.read_bytes(), f"the API key was written to {path}"
        # Without the key the server refuses the run's first call, and the error says so.
        unkeyed = run_config(assets, tmp_path / "unkeyed", sections={"rollout": {"client": client}}, total_steps=1)
        proc = start_train(unkeyed, assets)
        log = finish(proc)
        assert proc.returncode == 2 and "401" in log.splitlines()[-1], log[-4000:]
    finally:
        server.stop()


SEEDED = {"rollout": {"deterministic_inference": True}}  # seeds are sent only to servers that honour them


@pytest.fixture(scope="module")
def whole_run(assets, tmp_path_factory):
    """A finished seeded 3-step run (checkpoint at step 2), read only: the uninterrupted reference of
    the resume test and the earlier run the start-over test replaces (in a copy)."""
    out = tmp_path_factory.mktemp("whole") / "whole"
    config = run_config(assets, out, sections=SEEDED, total_steps=3, save_every=2)
    proc = start_train(config, assets, "eval.every_n_steps=0")
    log = finish(proc)
    assert proc.returncode == 0, log[-4000:]
    return out


def test_resumed_run_samples_as_the_uninterrupted_one(assets, tmp_path, whole_run):
    """Per-request sampling seeds from (run seed, prompt, start version, sample, tokens so far): a
    run stopped after step 2 and resumed samples step 3 exactly as a run that never stopped."""
    split = run_config(assets, tmp_path / "split", sections=SEEDED, total_steps=2, save_every=2)
    for extra in (["trainer.total_steps=2"], ["--resume", "trainer.total_steps=3"]):
        proc = start_train(split, assets, *extra, "eval.every_n_steps=0")
        log = finish(proc)
        assert proc.returncode == 0, log[-4000:]
    assert "resuming from" in log and "step_000002" in log

    def step3(run: str) -> dict:
        [rec] = [r for r in read_jsonl_metrics(tmp_path / run / "tb") if r["step"] == 3 and "rollout/reward_mean" in r]
        return rec

    [a] = [r for r in read_jsonl_metrics(whole_run / "tb") if r["step"] == 3 and "rollout/reward_mean" in r]
    b = step3("split")
    for tag in ("rollout/reward_mean", "rollout/response_len_mean", "experience/num_samples"):
        assert a[tag] == b[tag], (tag, a[tag], b[tag])
    # Functions of the sampled tokens and their behaviour log-probs: equal only if the same tokens were drawn.
    for tag in ("actor/kl", "actor/entropy", "bapo/c_high", "bapo/rho_before"):
        assert a[tag] == pytest.approx(b[tag], rel=1e-4, abs=1e-9), (tag, a[tag], b[tag])  # float noise only


def test_the_driver_process_samples_and_trains_as_the_inline_driver(assets, tmp_path, whole_run):
    """`trainer.driver_process`: servers, client, rewards, ledger and metrics in a process of its own,
    each step's slices cut there, the weights handed to its sender in shared memory (the distributed
    gloo sync): the seeded run of the inline driver, step for step, checkpoint included."""
    out = tmp_path / "proc"
    sections = {**SEEDED, "sync": {"method": "distributed", "backend": "gloo"}}
    config = run_config(assets, out, sections=sections, total_steps=3, save_every=2, driver_process=True)
    proc = start_train(config, assets, "eval.every_n_steps=0")
    log = finish(proc)
    assert proc.returncode == 0, log[-4000:]
    full = (out / "logs" / "train.log").read_text()
    assert "driver process" in full and re.search(r"weight sync v\d+: \d+ tensors over gloo", full), full[-3000:]
    want = {r["step"]: r for r in read_jsonl_metrics(whole_run / "tb") if "rollout/reward_mean" in r}
    got = {r["step"]: r for r in read_jsonl_metrics(out / "tb") if "rollout/reward_mean" in r}
    assert sorted(got) == sorted(want) and len(got) >= 2
    for step, a in want.items():
        b = got[step]
        for tag in ("rollout/reward_mean", "rollout/response_len_mean", "experience/num_samples"):
            assert a[tag] == b[tag], (step, tag, a[tag], b[tag])
        for tag in ("actor/kl", "actor/entropy", "bapo/c_high", "bapo/rho_before"):
            assert a[tag] == pytest.approx(b[tag], rel=1e-4, abs=1e-9), (step, tag, a[tag], b[tag])
        assert b["timing/driver_rank0_s"] >= 0 and "timing/batch_prepare_s" in b

    def prompts(run) -> list:  # per step: drawn, trained (group ids are fresh uuids in every run)
        lines = [json.loads(ln) for ln in (run / "samples.jsonl").read_text().splitlines()]
        return [(r["step"], r["drawn"], [p for _, p in r["trained"]]) for r in lines]

    assert prompts(out) == prompts(whole_run)
    assert (out / "checkpoints" / "step_000002" / "trainer.json").exists()


def test_starting_over_in_a_used_directory_does_not_mix_the_runs_metrics(assets, tmp_path, whole_run):
    """`--no-resume` into a directory holding an earlier run (a copy of the 3-step one): its metrics
    (and samples ledger) are replaced, not appended to, so curves and summaries show one run."""
    shutil.copytree(whole_run, tmp_path / "run")
    earlier = [json.loads(ln)["step"] for ln in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert earlier == [1, 2, 3]
    config = run_config(assets, tmp_path / "run", sections=SEEDED, total_steps=3, save_every=0)
    proc = start_train(config, assets, "--no-resume", "trainer.total_steps=2", "eval.every_n_steps=0")
    log = finish(proc)
    assert proc.returncode == 0, log[-4000:]
    steps = [r["step"] for r in read_jsonl_metrics(tmp_path / "run" / "tb") if "timing/step_s" in r]
    assert steps == [1, 2]
    ledger = [json.loads(ln)["step"] for ln in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert ledger == [1, 2]
