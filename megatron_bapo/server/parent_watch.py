"""Exit when the process that launched us is gone (e.g. a trainer killed with SIGKILL).

`launch.start_server` sets MEGATRON_BAPO_PARENT_PID; a server started by hand (or by SLURM, or as
a drop-in for `sglang.launch_server`) has no such variable and is never affected. Polling the parent
PID works on every POSIX system and needs no cooperation from the (possibly dead) parent.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

ENV_VAR = "MEGATRON_BAPO_PARENT_PID"
logger = logging.getLogger(__name__)


def start_parent_watch(poll_s: float = 1.0) -> bool:
    """Start a daemon thread that SIGTERMs this process once its parent changes; False if not asked to."""
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return False
    parent = int(raw)

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                logger.warning("parent process %d is gone: shutting down", parent)
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(poll_s)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return True
