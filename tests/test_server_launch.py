"""The launcher: start on a free loopback port, stop by PID (SIGTERM), and a failed start raises
with the server's log tail instead of hanging."""

from __future__ import annotations

import os
import urllib.request

import pytest

from megatron_bapo.server.launch import ServerStartError, start_server


def health(url: str) -> int:
    with urllib.request.urlopen(url + "/health", timeout=30) as resp:
        return resp.status


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
