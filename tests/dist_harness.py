"""Run a function on N real processes joined by a `gloo` process group.

Workers are forked from a fork server (`multiprocessing`'s "forkserver"), started once per pytest
process, that has imported torch, megatron-core and the actor (`dist_preload`): each worker starts
in milliseconds instead of re-importing for ~8 s (shared/notes/megatron-core-on-cpu.md), and from a
clean, single-threaded process. Forking the pytest process itself handed every rank whatever earlier
tests had left in it (threads, locks held by them, pytest-xdist's I/O thread): one full run on two
xdist workers hung in a rank that never answered. So `fn` and `args` must pickle (a module-level
function, not a lambda), and the test's environment is sent along (the server's is from its start).
Results come back as `torch.save` bytes because tensors sent through a queue die with the worker.

A worker that does not answer in time is not just killed: first every process of it (the rank and
whatever it forked, e.g. dist_checkpointing's writer processes) dumps its Python stacks (faulthandler
on SIGUSR1), and the stacks are the failure message. A hang is then a bug report, not a mystery.
"""

from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from megatron_bapo.models.parallel import free_port  # noqa: F401 - the tests' one port helper

_STACKS = None  # the worker's open stack file: faulthandler writes to its fd, so it must stay open


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, queue, stacks: str,
            env: dict[str, str]) -> None:
    global _STACKS
    import dist_preload  # noqa: F401 - already imported by the fork server; a no-op unless it failed there

    # A forkserver child defaults to "forkserver" itself: what the rank starts (dist_checkpointing's
    # writers, a Manager) would start a second server and re-import everything. Linux's default it is.
    mp.set_start_method("fork", force=True)

    _STACKS = open(stacks, "w")
    # Inherited by every process this rank forks: each dumps its own stacks to the same file.
    faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        store = torch.distributed.TCPStore("127.0.0.1", port, world_size, False, timeout=timedelta(seconds=120))
        torch.distributed.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
        )
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - the traceback is the test's failure message
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except Exception:  # noqa: BLE001 - megatron-core may not be imported by this test
            pass
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _stacks_of(proc: mp.Process, path: Path) -> str:
    """The Python stacks of `proc` and each of its descendants, one process at a time."""
    try:
        root = psutil.Process(proc.pid)
        family = [root, *root.children(recursive=True)]
    except psutil.Error:
        return f"(pid {proc.pid} is gone)"
    parts = []
    for p in family:
        before = path.stat().st_size
        try:
            cmd = " ".join(p.cmdline())[:120]
            os.kill(p.pid, signal.SIGUSR1)
        except (OSError, psutil.Error) as exc:
            parts.append(f"--- pid {p.pid}: no stacks ({exc})")
            continue
        # The dump is a few write() calls from the signal handler: wait until the file stops growing.
        deadline, size = time.monotonic() + 5, before
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = path.stat().st_size
            if now > before and now == size:
                break
            size = now
        with open(path) as f:
            f.seek(before)
            parts.append(f"--- pid {p.pid} ({cmd}):\n{f.read()}")
    return "\n".join(parts)


def _kill_family(pid: int) -> None:
    """SIGKILL a hung rank and whatever it forked (a writer process would outlive it otherwise)."""
    try:
        root = psutil.Process(pid)
        family = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in family:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _context() -> mp.context.BaseContext:
    """The forkserver context, its server started (once per process) with `dist_preload` imported.
    Python 3.11's server ignores the sys.path it is given: PYTHONPATH names this directory for it."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["dist_preload"])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), old]))
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


def run_dist(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks (see above); return results by rank.

    A worker exception fails with that worker's traceback; a hang fails after `timeout` seconds with
    the stacks of every process of every rank that has not answered.
    """
    ctx = _context()
    queue = ctx.Queue()
    # The rendezvous store lives here, on a port the OS picks and this process keeps until every rank
    # is done: a port looked up free and bound later by rank 0 could be taken in between by another
    # xdist worker's processes (EADDRINUSE).
    store = torch.distributed.TCPStore("127.0.0.1", 0, world_size, True, timeout=timedelta(seconds=120),
                                       wait_for_workers=False)
    port = store.port
    with tempfile.TemporaryDirectory(prefix="run_dist_") as tmp:
        stacks = [Path(tmp) / f"rank{r}.txt" for r in range(world_size)]
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue, str(stacks[r]),
                                                          dict(os.environ)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: list[str] = []
        grace = 10.0  # for ranks that answered to exit
        try:
            answered: set[int] = set()
            for _ in range(world_size):
                rank, ok, payload = queue.get(timeout=timeout)
                answered.add(rank)
                if ok:
                    results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors.append(f"rank {rank} failed:\n{payload}")
        except Exception as exc:  # queue.Empty on timeout
            errors.append(f"timed out after {timeout}s waiting for ranks ({exc!r}); got {sorted(results)}")
            grace = 1.0
            for r, p in enumerate(procs):
                if r not in answered and p.is_alive() and stacks[r].exists():
                    errors.append(f"rank {r}'s processes, their Python stacks:\n{_stacks_of(p, stacks[r])}")
        finally:
            for p in procs:
                p.join(timeout=grace)
                if p.is_alive():
                    _kill_family(p.pid)
                    p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
