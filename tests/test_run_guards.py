"""A run that cannot learn stops loudly, impossible server replies never reach the optimizer, and a
resume refuses what it cannot resume: `python -m megatron_bapo.train` as a user runs it, with the
faults of issue 24 (a resume that kept a newer run's weight versions and lost its server, replies
rewritten by a proxy, a changed config on resume, SIGTERM, a data file without a usable row, a disk
that fills up during a save). Each fault ends in training or in one line and a non-zero exit.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_bapo import run_state
from megatron_bapo.metrics import read_jsonl_metrics
from megatron_bapo.server.launch import start_server
from run_helpers import finish, kill_the_server_then_finish, last_line, pid_alive, run_config, server_pids, start_train, train_env, write_assets
from sglang_proxy import RecordingProxy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    return write_assets(tmp_path_factory.mktemp("guard_assets")), tiny_hf_dir


def last_line(log: str) -> str:
    return [ln for ln in log.splitlines() if ln.strip()][-1]


def _wait_for(proc, ready, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"trainer exited before {what}: {proc.stdout.read()[-4000:]}")
        if ready():
            return
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _ledger_steps(out) -> list[int]:
    path = out / "samples.jsonl"
    return [json.loads(ln)["step"] for ln in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def stopped(assets, tmp_path_factory):
    """A 6-step run (a checkpoint every 2 steps) stopped by SIGTERM in step 5, after step 4's save
    (completed at the end of step 5, or on the way out if the signal comes first: `checkpoint_save`):
    (output_dir, console log, exit code, seconds from the signal to the exit)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    config = run_config(assets, out, total_steps=6, save_every=2, eval_at_start=False, log_level="info")
    proc = start_train(config, assets, "eval.every_n_steps=0")
    _wait_for(proc, lambda: 5 in _ledger_steps(out), "step 5")
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    log = finish(proc, timeout=60)
    return out, log, proc.returncode, time.monotonic() - signalled


def test_sigterm_is_one_line_naming_the_step_and_where_resume_continues(stopped):
    out, log, code, seconds = stopped
    assert code == 143, log[-4000:]
    assert seconds < 10, f"SIGTERM took {seconds:.1f} s to stop the run"
    last = last_line(log)
    assert re.fullmatch(r"stopped by SIGTERM during step [56] of 6; --resume continues from the newest checkpoint, "
                        r"step_000004 \(.*step_000004\)", last), log[-4000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000004"
    assert run_state.latest_checkpoint(out) == run_state.checkpoint_dir(out, 4)
    assert "Traceback" not in log
    assert not any(pid_alive(p) for p in server_pids(out))


@pytest.mark.usefixtures("beside")  # starts the last three tests' runs now, beside this one
def test_resume_past_newer_weight_versions_with_a_server_crash_trains_on(assets, stopped, tmp_path):
    """Issue 24, reproduction 1: resume from an older checkpoint while `hf_sync/` holds the killed run's
    later versions, then lose the built-in server after the resume's first weight sync. Those versions
    are discarded (not the one just published), the restarted server gets the resumed version, and
    every step after the resume updates the policy (it used to stall: no update, exit 0)."""
    out = tmp_path / "run"
    shutil.copytree(stopped[0], out)
    shutil.rmtree(run_state.checkpoint_dir(out, 4))  # as a kill after step 4, before its checkpoint, leaves it
    state = json.loads((run_state.checkpoint_dir(out, 2) / "trainer.json").read_text())
    assert state["version"] == 1
    newer = sorted(int(p.name[1:]) for p in (out / "hf_sync").glob("v*"))
    assert newer and min(newer) > 1, newer
    moved = tmp_path / "moved.jsonl"  # the same data at another path: a resume that is allowed (and logged)
    shutil.copy(assets[0] / "train.jsonl", moved)
    config = run_config(assets, out, total_steps=5, save_every=0, eval_at_start=False, log_level="info",
                        sections={"data": {"path": str(moved)}})
    train_log = out / "logs" / "train.log"
    offset = train_log.stat().st_size
    proc = start_train(config, assets, "--resume", "eval.every_n_steps=0")
    log, _ = kill_the_server_then_finish(proc, out, lambda: _wait_for(
        proc, lambda: "weight sync v1: " in train_log.read_text()[offset:], "the resume's first sync"))
    assert proc.returncode == 0, log[-4000:]
    assert "died with exit code -9; restarting it (1 of 3)" in log, log[-4000:]
    assert "resume: data file moved" in log
    records = [r for r in read_jsonl_metrics(out / "tb") if "timing/step_s" in r and r["step"] > 2]
    assert [r["step"] for r in records] == [3, 4, 5]
    assert [r["step"] for r in records if "bapo/c_high" in r] == [3, 4, 5], "a step after the resume trained nothing"
    assert sum(r.get("rollout/num_regenerated", 0) for r in records) == 0
    assert re.search(r"^done: steps 3-5 in \d+ s, 3 of 3 steps updated the policy", log, re.M), log[-2000:]
    assert sorted(p.name for p in (out / "hf_sync").iterdir()) == ["v000003", "v000004"]


def test_resume_refuses_what_it_cannot_honour_in_one_line(assets, stopped, tmp_path):
    """Issue 24, reproduction 3: another data file with as many rows, another group size, the other
    optimizer layout and a model of another shape. Each used to resume silently or end in a traceback;
    now the resume stops before anything is built, one line naming every field, old and new value."""
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    out = tmp_path / "run"
    shutil.copytree(stopped[0], out)
    rows = (assets[0] / "train.jsonl").read_text().splitlines()
    other = tmp_path / "other.jsonl"
    other.write_text("".join(ln.replace("=", " =") + "\n" for ln in rows))  # as many rows, other prompts
    deeper = make_tiny_hf_checkpoint(tmp_path / "deeper", seed=0, num_hidden_layers=3)
    config = run_config(assets, out, total_steps=8, sections={
        "data": {"path": str(other)}, "model": {"hf_path": str(deeper)}, "rollout": {"group_size": 2},
        "actor": {"use_distributed_optimizer": False}})
    train_log = out / "logs" / "train.log"
    offset = train_log.stat().st_size
    proc = start_train(config, assets, "--resume")
    log = finish(proc)
    assert proc.returncode == 2, log[-4000:]
    last = last_line(log)
    assert last.startswith("checkpoint error: cannot resume from ") and "step_000004" in last, last
    for field in (f"data.path: {other}", "rollout.group_size 4 -> 2", "actor.use_distributed_optimizer True -> False",
                  "model.hf_path", "num_layers 2 -> 3", "--no-resume", "trainer.output_dir"):
        assert field in last, (field, last)
    assert "Traceback" not in log
    assert "actor built" not in train_log.read_text()[offset:], "the model was built before the resume was checked"


def test_impossible_replies_are_retried_counted_never_trained_then_stop_the_run(assets, tmp_path, tiny_hf_dir):
    """Issue 24, reproduction 2: a proxy rewrites well-formed /generate replies. While it corrupts one
    reply in four (log-prob +5, five times the tokens asked, an id outside the vocabulary, a version
    from the future) every bad reply is refused, counted in `rollout/num_bad_replies` and retried, and
    the updates see only sane log-probs; once every reply is impossible the run stops with one line
    naming the server and the field (it used to train on them, or crash in the embedding)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_hf_dir).vocab_size
    kinds = ["logprob", "length", "vocab", "version"]
    seen = {"generate": 0, "always": False, **{k: 0 for k in kinds}}

    def rewrite(path, request, reply):
        if path != "/generate" or not reply["meta_info"].get("output_token_logprobs"):
            return reply
        seen["generate"] += 1
        if not seen["always"] and seen["generate"] % 4:
            return reply
        kind = "logprob" if seen["always"] else kinds[(seen["generate"] // 4) % 4]
        seen[kind] += 1
        meta = reply["meta_info"]
        entries = meta["output_token_logprobs"]
        if kind == "logprob":
            entries[0][0] = 5.0
        elif kind == "length":
            meta["output_token_logprobs"] = entries * 5
            reply["output_ids"] = reply["output_ids"] * 5
        elif kind == "vocab":
            entries[0][1] = reply["output_ids"][0] = vocab + 5
        else:  # both ways a server reports versions (the spans of SGLang 0.5.23, the reply's version)
            meta["weight_version"] = "100"
            meta["weight_versions"] = [{"version": "100", "start": 0, "end": len(entries)}]
        return reply

    server = start_server(tiny_hf_dir, log_path=tmp_path / "server.log")
    try:
        with RecordingProxy(server.url, rewrite=rewrite) as proxy:
            client = {"urls": [proxy.url], "health_timeout_s": 60, "max_retries": 3, "backoff_s": 0.05,
                      "unhealthy_cooldown_s": 0.1}
            out = tmp_path / "run"
            config = run_config(assets, out, total_steps=8, save_every=0, eval_at_start=False,
                                sections={"rollout": {"client": client}})
            proc = start_train(config, assets, "eval.every_n_steps=0")
            try:
                _wait_for(proc, lambda: 3 in _ledger_steps(out), "step 3")
                corrupted = sum(seen[k] for k in kinds)  # steps 1-3 (no request is in flight while step 3 trains)
                seen["always"] = True
                log = finish(proc)
            finally:
                if proc.poll() is None:
                    proc.kill()
    finally:
        server.stop()
    assert proc.returncode == 2, log[-4000:]
    last = last_line(log)
    assert last.startswith("rollout error:") and f"{proxy.url}/generate reply: meta_info.output_token_logprobs[0] " \
        "log-prob 5.0" in last and "a log-probability is <= 0" in last, log[-4000:]
    assert "Traceback" not in log
    assert all(seen[k] for k in kinds), seen
    records = [r for r in read_jsonl_metrics(out / "tb") if "timing/step_s" in r]
    trained = [r for r in records if "actor/kl" in r]
    assert len(trained) >= 2
    for r in trained:  # behavior log-probs of the served weights: the update's ratios stay near 1
        assert abs(r["actor/kl"]) < 0.05 and r["actor/clipfrac_neg"] < 0.5, r
    assert [r["step"] for r in records] == [1, 2, 3]
    assert sum(r.get("rollout/num_bad_replies", 0) for r in records) == corrupted > 0, seen


def _stuck_on_an_old_version(assets, tmp_path, tiny_hf_dir):
    def stuck(path, request, reply):
        if path == "/generate":
            meta = reply["meta_info"]
            meta["weight_version"] = "0"
            n = len(meta.get("output_token_logprobs") or [])
            meta["weight_versions"] = [{"version": "0", "start": 0, "end": n}]
        return reply

    server = start_server(tiny_hf_dir, log_path=tmp_path / "server.log")
    try:
        with RecordingProxy(server.url, rewrite=stuck) as proxy:
            client = {"urls": [proxy.url], "health_timeout_s": 60}
            out = tmp_path / "run"
            config = run_config(assets, out, total_steps=20, save_every=0, eval_at_start=False,
                                sections={"rollout": {"client": client}})
            proc = start_train(config, assets, "eval.every_n_steps=0")
            log = finish(proc)
    finally:
        server.stop()
    return proc.returncode, log, out


@pytest.fixture(scope="module")
def beside(assets, stopped, tmp_path_factory, tiny_hf_dir):
    """The runs of the last three tests, started once `stopped` is done (its SIGTERM is timed) and run
    one after another beside the resume tests (a run uses about one core): {test: future of what the
    test checks}. Each test checks its own as before."""
    root = tmp_path_factory.mktemp("beside")
    jobs = {"old_version": _stuck_on_an_old_version, "no_usable_row": _no_usable_row, "disk_full": _disk_full}
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guard-run")
    futures = {}
    for name, job in jobs.items():
        (root / name).mkdir()
        futures[name] = pool.submit(job, assets, root / name, tiny_hf_dir)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_a_run_whose_servers_stay_on_an_old_version_stops_with_the_reason(beside):
    """The progress watchdog, with its derived default: servers that keep reporting version 0 (as a
    restarted server serving the base model did) make every token too stale to train once the trainer
    is more than rollout.max_staleness (2) versions ahead, so no update is made after the first ones.
    The run stops after `2 x (2 segments + 0 ahead) + 2 = 6` such steps with the reason, instead of
    running to its end and exiting 0."""
    code, log, out = beside["old_version"].result()  # _stuck_on_an_old_version
    assert code == 2, log[-4000:]
    last = last_line(log)
    assert re.match(r"progress error: no optimizer update in 6 consecutive steps \((\d+)-(\d+); "
                    r"trainer.max_steps_without_update=6\), so the run cannot learn: step \d+: all \d+ token\(s\) too "
                    r"stale to train \(rollout.max_staleness\)", last), last
    steps = [r["step"] for r in read_jsonl_metrics(out / "tb") if "timing/step_s" in r]
    assert steps[-1] < 20 and "Traceback" not in log


def _no_usable_row(assets, tmp_path, tiny_hf_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(50)))  # no answers
    out = tmp_path / "run"
    proc = start_train(run_config(assets, out, sections={"data": {"path": str(bad)}}), assets)
    log = finish(proc)
    return proc.returncode, log, bad


def test_data_file_without_a_usable_row_is_one_line(beside):
    code, log, bad = beside["no_usable_row"].result()  # _no_usable_row
    assert code == 2, log[-4000:]
    lines = [ln for ln in log.splitlines() if ln.strip() and not ln.startswith("megatron_bapo: ")]
    assert len(lines) == 1, log[-4000:]
    assert lines[0].startswith(f"config error: data.path={str(bad)!r} has no usable prompt among 50 rows (50 bad") \
        and "row 0: missing or empty 'answer'" in lines[0], lines[0]


def _disk_full(assets, tmp_path, tiny_hf_dir):
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare -rm` (user namespaces) to mount a small filesystem for the run")
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    config = run_config(assets, out, total_steps=4, save_every=2, eval_at_start=False)
    py, ckpts = sys.executable, out / "checkpoints"
    script = f"""
mount -t tmpfs -o size=64m tmpfs {ckpts}
{py} -m megatron_bapo.train --config {config} eval.every_n_steps=0 > {tmp_path}/log 2>&1 &
pid=$!
while [ ! -f {ckpts}/latest ] && kill -0 $pid 2>/dev/null; do sleep 0.05; done
dd if=/dev/zero of={ckpts}/filler bs=1M count=64 2>/dev/null  # another writer fills the disk
wait $pid; echo $? > {tmp_path}/rc
(cd {ckpts} && find . | sort) > {tmp_path}/listing
{py} -c "from megatron_bapo import run_state; print(run_state.latest_checkpoint('{out}'))" > {tmp_path}/resumes_from
"""
    subprocess.run(["unshare", "-rm", "sh", "-c", script], env=train_env(assets), timeout=600, check=True)
    return ckpts


def test_disk_full_during_a_save_is_one_line_and_leaves_the_previous_checkpoint(beside):
    """Issue 24, reproduction 4: the checkpoint filesystem (a 64 MiB tmpfs of its own, mounted in a
    user namespace) fills up after the step-2 checkpoint; the step-4 save fails with one line naming
    the path, the bytes free and the checkpoint kept, leaves no partial directory, and the kept
    checkpoint is what a resume picks."""
    ckpts = beside["disk_full"].result()  # _disk_full (skips without `unshare -rm`)
    out = ckpts.parent
    tmp_path = out.parent
    log = (tmp_path / "log").read_text()
    assert (tmp_path / "rc").read_text().strip() == "2", log[-4000:]
    last = last_line(log)
    assert last.startswith(f"checkpoint error: saving checkpoint {ckpts / 'step_000004'} failed: "), last
    assert re.search(r"; \d+ bytes \([\d.]+ MiB\) are free there after removing the partial save; the newest complete "
                     r"checkpoint .*step_000002 is kept, and --resume continues from it", last), last
    assert "Traceback" not in log
    listing = (tmp_path / "listing").read_text().split()
    assert not any(p.endswith(".tmp") or "step_000004" in p for p in listing), listing
    assert "./step_000002/manifest.json" in listing
    assert (tmp_path / "resumes_from").read_text().strip() == str(ckpts / "step_000002")
