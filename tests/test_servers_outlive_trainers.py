"""Servers outlive trainers (issue 35, point 1): SGLang servers (and the built-in one) keep a crashed
trainer's weight group, and its update session when it died mid-update, and refuse a new join under
the same name (`group 'weight_update_group' already exists`). Through the CLI: a trainer syncing to
external servers over the distributed (gloo) method is SIGKILLed after its first sync; the resumed
run ends the stale session, destroys the stale group with one line, and trains on. A refused join
stops the wait at once, the server's reply in the error (it used to wait out sync.group_timeout_s)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_bapo.server.launch import start_server
from run_helpers import ROOT, finish, run_config, start_train, train_env, write_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    return write_assets(tmp_path_factory.mktemp("outlive_assets")), tiny_hf_dir


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@pytest.mark.usefixtures("refused_join")  # starts the last test's server and joins now, beside this test
def test_a_resumed_trainer_clears_what_a_killed_one_left_on_its_servers(assets, tmp_path, tiny_hf_dir):
    server = start_server(tiny_hf_dir, log_path=tmp_path / "server.log")
    try:
        out = tmp_path / "run"
        sections = {"rollout": {"client": {"urls": [server.url], "health_timeout_s": 60}},
                    "sync": {"method": "distributed", "backend": "gloo", "group_timeout_s": 120}}
        config = run_config(assets, out, sections=sections, total_steps=4, save_every=2, eval_at_start=False)
        proc = start_train(config, assets, "eval.every_n_steps=0")
        train_log = out / "logs" / "train.log"
        try:
            deadline = time.monotonic() + 300
            while not (train_log.exists() and "weight sync v1:" in train_log.read_text()):
                assert proc.poll() is None, proc.stdout.read()[-3000:]
                assert time.monotonic() < deadline, "no distributed sync happened"
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGKILL)  # no teardown: the server keeps the group
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        # As if the trainer had died inside an update: the session stays open too.
        assert _post(server.url, "/begin_weight_update", {})[0] == 200
        assert _post(server.url, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
            "group_name": "weight_update_group", "backend": "gloo"})[1]["message"].startswith(
            "group 'weight_update_group' already exists"), "the killed trainer's group is not on the server"
        started = time.monotonic()
        proc = start_train(config, assets, "--resume", "eval.every_n_steps=0")
        log = finish(proc)
        assert proc.returncode == 0, log[-4000:]
        assert time.monotonic() - started < 120 + 60
        held = [ln for ln in log.splitlines() if "of an earlier trainer" in ln]
        assert len(held) == 1 and server.url in held[0], log[-4000:]
        assert "an open weight-update session and the weight group 'weight_update_group'" in held[0], held
        records = [json.loads(ln) for ln in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
        assert max(r["step"] for r in records) == 4
        info = json.loads(urllib.request.urlopen(server.url + "/model_info", timeout=30).read())
        assert int(info["weight_version"]) >= 1  # the resumed run's syncs reached it
    finally:
        server.stop()


JOIN = """
import sys, time
from megatron_bapo.rollout.client import RolloutClient
from megatron_bapo.rollout.config import RolloutClientConfig
from megatron_bapo.rollout.weight_group import DistributedWeightSender
client = RolloutClient(RolloutClientConfig(urls=[sys.argv[1]]))
sender = DistributedWeightSender(client, backend="gloo", timeout_s=float(sys.argv[2]))
started = time.monotonic()
try:
    sender.connect([1])
    print("joined", flush=True)
except Exception as exc:
    print(f"{time.monotonic() - started:.1f} s: {exc}", flush=True)
if sys.argv[3] == "hold":
    time.sleep(600)  # killed by the test, leaving the group on the server
"""


def _join_twice(tmp_path, tiny_hf_dir) -> subprocess.CompletedProcess:
    """A joiner that is killed holding the group on a server of its own, then a second join: the
    second's output."""
    server = start_server(tiny_hf_dir, log_path=tmp_path / "server.log")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        holder = subprocess.Popen([sys.executable, "-c", JOIN, server.url, "120", "hold"], env=env,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "joined"
        finally:
            holder.kill()
            holder.wait(timeout=30)
        return subprocess.run([sys.executable, "-c", JOIN, server.url, "600", "exit"], env=env, capture_output=True,
                              text=True, timeout=300)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def refused_join(tmp_path_factory, tiny_hf_dir):
    """`_join_twice`, started beside the first test's runs (a run uses about one core): its future."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="join-twice")
    future = pool.submit(_join_twice, tmp_path_factory.mktemp("refused_join"), tiny_hf_dir)
    yield future
    pool.shutdown(wait=True)


def test_a_refused_join_stops_the_wait_at_once_with_the_servers_reply(refused_join):
    done = refused_join.result()
    line = done.stdout.strip()
    assert "a server refused to join the weight update group 'weight_update_group'" in line, done.stdout + done.stderr
    assert "group 'weight_update_group' already exists" in line, line
    assert float(line.split(" s:")[0]) < 60, line  # not the 600 s group timeout
