"""Stopping and running out of disk lose nothing and say so in one line, through the CLI:

- SIGTERM (`scancel`: SLURM sends SIGKILL 30 s later) while the trainer waits for a server that is
  gone, behind `rollout.client.urls` or behind the real `sglang-router`, ends the run well before
  SLURM's SIGKILL (under 15 s: 1-5 s alone on 2 cores; the bound leaves room for the suite's second
  worker, `tools/run_tests.sh`, and rules out the waits it guards against: a 10-minute health budget,
  a segment, a retry loop) with the SIGTERM line and exit 143: pending waits are cancelled, each cleanup call is tried once,
  briefly, and no asyncio task is left to be destroyed ("Task was destroyed but it is pending!").
- A full disk during the disk weight export (`hf_sync/`, not a checkpoint) removes the partial
  version, names the path, the bytes free and where `--resume` continues, and exits 2.
"""

from __future__ import annotations

STOP_S = 15.0
"""How soon SIGTERM must end a run (module docstring)."""

import json
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dist_harness import free_port
from run_helpers import finish, last_line, run_config, server_pids, start_train, train_env, write_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    return write_assets(tmp_path_factory.mktemp("stop_assets")), tiny_hf_dir


class _Unready(BaseHTTPRequestHandler):
    """A worker that is up but never ready for the trainer: every call from the trainer (aiohttp)
    gets 503, so it waits and retries; anyone else (the router registering it) gets a plausible 200."""

    def do_GET(self):  # noqa: N802
        if "aiohttp" in (self.headers.get("User-Agent") or ""):
            self.server.hits += 1
            self.send_response(503)
            self.end_headers()
            return
        body = json.dumps({"model_path": self.server.model_path, "tokenizer_path": self.server.model_path,
                           "is_generation": True, "tp_size": 1, "weight_version": "0"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args):
        pass


def _unready_server(model_path) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Unready)
    server.hits, server.model_path = 0, str(model_path)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _gone_once_asked(server, out):
    """A readiness test for `_sigterm_after`: once the trainer asked `server`, the server goes away
    (a dead port from then on: the trainer's retries and cleanup calls meet connection refused)."""
    def ready() -> bool:
        if server.hits and not server.closed:
            server.shutdown()
            server.server_close()
            server.closed = True
        return server.hits > 0
    server.closed = False
    return ready


def _sigterm_after(proc, ready, timeout: float = 300) -> tuple[str, float]:
    """SIGTERM `proc` once `ready()` holds; (its console output, seconds from the signal to its exit).
    Checks the exit code too (143)."""
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "timed out waiting for the trainer to wait"
            time.sleep(0.05)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        log = finish(proc, timeout=60)
        seconds = time.monotonic() - signalled
        assert proc.returncode == 143, log[-3000:]
        return log, seconds
    finally:
        if proc.poll() is None:
            proc.kill()


def _check_stopped(log: str, seconds: float) -> None:
    assert re.fullmatch(r"stopped by SIGTERM during step 1 of 3; --resume continues from the newest complete "
                        r"checkpoint in .* \(this run saved none yet\), or from model.hf_path if there is none",
                        last_line(log)), log[-3000:]
    assert "Task was destroyed" not in log and "Traceback" not in log, log[-3000:]
    assert seconds < STOP_S, f"SIGTERM took {seconds:.1f} s to stop the run"


def test_sigterm_while_waiting_for_a_server_behind_urls_stops_in_seconds(assets, tmp_path):
    """The trainer polls the server's health with a 10-minute budget (`health_timeout_s`)."""
    server = _unready_server(assets[1])
    out = tmp_path / "run"
    client = {"urls": [f"http://127.0.0.1:{server.server_address[1]}"], "health_timeout_s": 600}
    config = run_config(assets, out, sections={"rollout": {"client": client}})
    log, seconds = _sigterm_after(start_train(config, assets), _gone_once_asked(server, out))
    _check_stopped(log, seconds)


def test_sigterm_while_retrying_behind_the_router_stops_in_seconds(assets, tmp_path):
    """The real sglang-router (a dev extra) in front of a worker that fails the trainer's calls (it
    retries them with backoff), then goes away."""
    pytest.importorskip("sglang_router")
    worker = _unready_server(assets[1])
    port, metrics_port = free_port(), free_port()
    router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                               str(port), "--prometheus-port", str(metrics_port), "--worker-urls",
                               f"http://127.0.0.1:{worker.server_address[1]}", "--log-level", "warn"],
                              stdout=open(tmp_path / "router.log", "w"), stderr=subprocess.STDOUT)
    try:
        out = tmp_path / "run"
        client = {"router_url": f"http://127.0.0.1:{port}", "health_timeout_s": 600}
        config = run_config(assets, out, sections={"rollout": {"client": client}})
        log, seconds = _sigterm_after(start_train(config, assets), _gone_once_asked(worker, out))
    finally:
        router.terminate()
        router.wait(timeout=30)
    _check_stopped(log, seconds)


def test_sigterm_with_the_driver_process_stops_it_and_its_server(assets, tmp_path):
    """`trainer.driver_process`: the trainer (rank 0) started the driver process, which started the
    built-in server. SIGTERM to the trainer mid-run (rollout running ahead): the driver process stops
    the call in progress, closes the server and exits; the run ends with the SIGTERM line, exit 143."""
    import psutil

    out = tmp_path / "run"
    config = run_config(assets, out, total_steps=200, save_every=0, async_steps=1, driver_process=True)
    proc = start_train(config, assets, "eval.every_n_steps=0")
    tree: dict = {}

    def ready() -> bool:
        ledger = out / "samples.jsonl"
        if not server_pids(out) or not ledger.exists() or len(ledger.read_text().splitlines()) < 2:
            return False
        server = psutil.Process(server_pids(out)[0])
        tree.update(server=server, driver=server.parent(), driver_parent=server.parent().ppid())
        return True

    log, seconds = _sigterm_after(proc, ready)
    driver, server = tree["driver"], tree["server"]
    assert driver.pid != proc.pid and tree["driver_parent"] == proc.pid  # trainer -> driver process -> server
    assert re.fullmatch(r"stopped by SIGTERM during step \d+ of 200; --resume continues from .*", last_line(log)), log[-3000:]
    assert "Task was destroyed" not in log and "Traceback" not in log, log[-3000:]
    assert seconds < STOP_S, f"SIGTERM took {seconds:.1f} s to stop the run"
    for p in (driver, server):
        p.wait(5)  # psutil: returns at once for a process that is gone; raises TimeoutExpired for one that is not
        assert not p.is_running()


def test_a_killed_driver_process_stops_the_run_in_one_line(assets, tmp_path):
    """SIGKILL to the driver process (`trainer.driver_process`) mid-run: the trainer stops with one line
    naming it (exit 2), and the built-in server it started exits too (`parent_watch`)."""
    import psutil

    out = tmp_path / "run"
    config = run_config(assets, out, total_steps=200, save_every=0, driver_process=True)
    proc = start_train(config, assets, "eval.every_n_steps=0")
    try:
        deadline = time.monotonic() + 300
        while not (server_pids(out) and (out / "samples.jsonl").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        server = psutil.Process(server_pids(out)[0])
        server.parent().kill()
        log = finish(proc, timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, log[-3000:]
    assert re.fullmatch(r"driver error: the driver process \d+ (died|closed the pipe|could not be asked to \w+ .*) "
                        r"\(exit code -9\); .*rerun with --resume", last_line(log)), log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    server.wait(10)
    assert not server.is_running()


def test_disk_full_during_the_weight_export_is_one_line_and_keeps_the_checkpoint(assets, tmp_path):
    """`hf_sync/` (a 64 MiB tmpfs of its own, mounted in a user namespace) fills up after the first
    versions are written: the next export fails with one line naming the version's path, the bytes
    free and where `--resume` continues; no partial version is left; the checkpoint is intact and a
    resume from it works (it used to end in a SafetensorError traceback, exit 1)."""
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare -rm` (user namespaces) to mount a small filesystem for the run")
    out = tmp_path / "run"
    sync = out / "hf_sync"
    sync.mkdir(parents=True)
    config = run_config(assets, out, total_steps=8, save_every=2, eval_at_start=False)
    py, ckpts = sys.executable, out / "checkpoints"
    script = f"""
mount -t tmpfs -o size=64m tmpfs {sync}
{py} -m megatron_bapo.train --config {config} eval.every_n_steps=0 > {tmp_path}/log 2>&1 &
pid=$!
while [ ! -f {ckpts}/latest ] && kill -0 $pid 2>/dev/null; do sleep 0.05; done
dd if=/dev/zero of={sync}/filler bs=1M count=64 2>/dev/null  # another writer fills the disk
wait $pid; echo $? > {tmp_path}/rc
(cd {sync} && find . | sort) > {tmp_path}/listing
"""
    subprocess.run(["unshare", "-rm", "sh", "-c", script], env=train_env(assets), timeout=600, check=True)
    log = (tmp_path / "log").read_text()
    assert (tmp_path / "rc").read_text().strip() == "2", log[-4000:]
    last = last_line(log)
    assert re.match(rf"sync error: writing weight version (\d+) to {re.escape(str(sync))}/v0000\d\d failed: .*"
                    rf"(No space left on device|bytes free while writing).*; \d+ bytes \([\d.]+ MiB\) are free there "
                    rf"after removing the partial version; the newest complete checkpoint .*step_0000\d\d is kept, "
                    rf"and --resume continues from it. Free disk space", last), last
    assert "Traceback" not in log
    version = re.match(r"sync error: writing weight version (\d+)", last).group(1)
    listing = (tmp_path / "listing").read_text().split()
    assert not any(p.endswith(".tmp") or p.startswith(f"./v{int(version):06d}") for p in listing), listing
    # The checkpoint named is complete, and a resume (on a disk with room) continues from it.
    kept = re.search(r"the newest complete checkpoint (\S+) is kept", last).group(1)
    proc = start_train(config, assets, "--resume", "eval.every_n_steps=0", f"trainer.total_steps={int(kept[-2:]) + 1}")
    resumed = finish(proc)
    assert proc.returncode == 0, resumed[-3000:]
    assert f"resuming from {kept}" in resumed, resumed[-3000:]
