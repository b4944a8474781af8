"""The launcher: start on a free loopback port, stop by PID (SIGTERM), and a failed start raises
with the server's log tail instead of hanging."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from megatron_bapo.server.launch import ServerStartError, start_server


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def health(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=30) as resp:
        return resp.status


@pytest.mark.slow
def test_launcher_stops_by_pid_and_reports_failed_start(tmp_path, tiny_hf_dir):
    handle = start_server(tiny_hf_dir, extra_args=["--num-threads", "1"], log_path=tmp_path / "log.txt")
    pid = handle.pid
    assert health(handle.url) == 200 and handle.url.startswith("http://127.0.0.1:")
    handle.stop()
    assert not handle.alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert "serving" in (tmp_path / "log.txt").read_text()
    with pytest.raises(ServerStartError, match="config.json|exited"):
        start_server(tmp_path, startup_timeout_s=120)


@pytest.mark.slow
def test_server_exits_when_its_launcher_is_killed(tmp_path, tiny_hf_dir):
    """A launcher killed with SIGKILL cannot stop its server: the server's parent watch does."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "launcher.py"
    pid_file = tmp_path / "server.pid"
    script.write_text(
        "import sys, time\n"
        "from megatron_bapo.server.launch import start_server\n"
        f"h = start_server({str(tiny_hf_dir)!r})\n"
        f"open({str(pid_file)!r}, 'w').write(str(h.pid))\n"
        "time.sleep(600)\n")
    launcher = subprocess.Popen([sys.executable, str(script)])
    try:
        deadline = time.monotonic() + 180
        while not (pid_file.exists() and pid_file.read_text()):
            assert launcher.poll() is None and time.monotonic() < deadline, "launcher failed to start the server"
            time.sleep(0.2)
        server_pid = int(pid_file.read_text())
        os.kill(server_pid, 0)  # running
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 60
    while True:
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            break
        if _is_zombie(server_pid):  # exited; its new parent (PID 1 of a container) may not reap it
            break
        assert time.monotonic() < deadline, f"server pid {server_pid} outlived its killed launcher"
        time.sleep(0.2)


def test_api_key_and_graceful_sigterm_with_a_request_in_flight(tiny_hf_dir):
    """--api-key: 401 without the bearer key except on /health; SIGTERM answers in-flight calls."""
    import threading
    import urllib.error

    def post(url: str, body: dict, key=None):
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"null")

    with start_server(tiny_hf_dir, extra_args=["--api-key", "s3cret", "--context-length", "4096"]) as handle:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
        assert post(handle.url + "/generate", body) == (401, {"error": "Unauthorized"})
        assert post(handle.url + "/generate", body, key="wrong")[0] == 401
        assert post(handle.url + "/generate", body, key="s3cret")[0] == 200
        result = {}
        long_body = {"input_ids": [3], "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        worker = threading.Thread(target=lambda: result.update(r=post(handle.url + "/generate", long_body, "s3cret")))
        worker.start()
        while True:  # wait until it runs
            req = urllib.request.Request(handle.url + "/v1/loads", headers={"Authorization": "Bearer s3cret"})
            with urllib.request.urlopen(req, timeout=30) as resp:
                if json.loads(resp.read())["loads"][0]["num_running_reqs"]:
                    break
        assert handle.stop() == 0  # SIGTERM: clean exit
        worker.join(timeout=60)
    status, out = result["r"]
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) < 4000
