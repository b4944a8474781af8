"""Start the built-in server as a subprocess on a free loopback port and stop it by PID.

Used by the trainer (one-machine default), the eval tool and tests; `launch_process` (the process
handling: health wait, log, parent watch, stop) also starts the real SGLang (`rollout.sglang_launch`). The port is chosen by the
server itself (`--port 0`) and reported through `--port-file`, so two launchers never race for the
same port. Stopping sends SIGTERM to that PID (graceful: the scheduler finishes, the socket closes),
then SIGKILL after `stop_timeout_s`; nothing is ever killed by name.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence, Union

logger = logging.getLogger(__name__)


class ServerStartError(RuntimeError):
    """The server process exited or did not become healthy in time (message has its log tail)."""


class ServerHandle:
    """A running built-in server: `.url`, `.pid`, `.port`, `.stop()`; also a context manager."""

    def __init__(self, proc: subprocess.Popen, host: str, port: int, log_path: Path, own_log: bool):
        self.proc = proc
        self.host = host
        self.port = port
        self.log_path = log_path
        self._own_log = own_log

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, stop_timeout_s: float = 15.0) -> Optional[int]:
        """SIGTERM the server's PID, wait, SIGKILL if still alive; returns its exit code. Idempotent."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("server pid %d ignored SIGTERM for %.0f s; sending SIGKILL", self.proc.pid, stop_timeout_s)
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        return self.proc.returncode

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ServerHandle(url={self.url!r}, pid={self.pid}, alive={self.alive()})"


def _healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_server(
    model_path: Union[str, Path],
    *,
    host: str = "127.0.0.1",
    port: Optional[int] = None,
    extra_args: Sequence[str] = (),
    log_path: Optional[Union[str, Path]] = None,
    startup_timeout_s: float = 300.0,
    env: Optional[dict] = None,
    python: str = sys.executable,
) -> ServerHandle:
    """Start `python -m megatron_bapo.server` and return once `/health` answers 200.

    `port=None` lets the server pick a free port. `extra_args` are more server flags (e.g.
    `["--context-length", "1024", "--num-threads", "1"]`). Output goes to `log_path` (a temp file
    when None). Raises ServerStartError (with the log tail) if the process exits or is not healthy
    within `startup_timeout_s`; the process is stopped first.
    """
    work = Path(tempfile.mkdtemp(prefix="bapo_server_"))
    port_file = work / "port"
    log = Path(log_path) if log_path is not None else work / "server.log"
    cmd = [python, "-m", "megatron_bapo.server", "--model-path", str(model_path), "--host", host,
           "--port", str(0 if port is None else int(port)), "--port-file", str(port_file), *map(str, extra_args)]
    return launch_process(cmd, host=host, port=port, port_file=port_file, log_path=log, own_log=log_path is None,
                          startup_timeout_s=startup_timeout_s, env=env, name="built-in server")


def launch_process(cmd: Sequence[str], *, host: str, port: Optional[int], log_path: Path,
                   startup_timeout_s: float, env: Optional[dict] = None, port_file: Optional[Path] = None,
                   own_log: bool = False, name: str = "server") -> ServerHandle:
    """Run `cmd` (a server speaking SGLang's HTTP API) and return once its `/health` answers 200.

    The child gets this repository on PYTHONPATH and `MEGATRON_BAPO_PARENT_PID` (it exits when we
    die: `parent_watch`). `port=None`: the server reports the port it bound in `port_file`. Raises
    ServerStartError with the log tail when the process exits or is not healthy in time (it is
    stopped first). Shared by the built-in server and the real SGLang (`rollout.sglang_launch`)."""
    cmd = [str(c) for c in cmd]
    log = Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)
    proc_env = dict(os.environ if env is None else env)
    repo_root = str(Path(__file__).resolve().parents[2])
    proc_env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, proc_env.get("PYTHONPATH", "")) if p)
    proc_env["MEGATRON_BAPO_PARENT_PID"] = str(os.getpid())  # the server exits if we die (parent_watch)
    with open(log, "ab") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=proc_env)
    handle = ServerHandle(proc, host, -1 if port is None else int(port), log, own_log)
    deadline = time.monotonic() + startup_timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise ServerStartError(f"{name} exited with code {proc.returncode} during startup "
                                       f"(cmd: {' '.join(cmd)}); log {log}:\n{handle.log_tail()}")
            if handle.port < 0 and port_file is not None and port_file.exists():
                text = port_file.read_text().strip()
                if text:
                    handle.port = int(text)
            if handle.port >= 0 and _healthy(handle.url):
                logger.info("%s ready at %s (pid %d, log %s)", name, handle.url, proc.pid, log)
                return handle
            if time.monotonic() > deadline:
                raise ServerStartError(f"{name} not healthy after {startup_timeout_s:.0f} s "
                                       f"(cmd: {' '.join(cmd)}); log {log}:\n{handle.log_tail()}")
            time.sleep(0.1)
    except BaseException:
        handle.stop()
        raise
