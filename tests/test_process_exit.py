"""`exit_now` skips only module teardown: a child process that leaves through it still joins its
non-daemon threads (a checkpoint writer), runs its `atexit` handlers (reward workers reaped, log
handlers flushed) and delivers what it printed, with the exit code it was given."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import atexit, logging, pathlib, sys, threading, time
    from megatron_bapo.process_exit import exit_now

    out = pathlib.Path(sys.argv[1])
    logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
    logging.getLogger("child").info("logged before the exit")

    def writer():
        time.sleep(0.3)  # still running when exit_now is called
        (out / "thread.txt").write_text("joined")

    threading.Thread(target=writer).start()
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
    print("printed before the exit", end="")  # no newline: sits in stdout's buffer
    exit_now(3)
    (out / "after.txt").write_text("exit_now returned")
""")


def test_exit_now_joins_threads_runs_atexit_flushes_and_keeps_the_code(tmp_path):
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "printed before the exit"
    assert (tmp_path / "thread.txt").read_text() == "joined"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert "logged before the exit" in (tmp_path / "log.txt").read_text()
    assert not (tmp_path / "after.txt").exists()
