"""Run a function on N real processes joined by a `gloo` process group.

Workers are forked (not spawned): the parent has already imported torch (and megatron-core when a
test needs it), so each worker starts in milliseconds instead of re-importing for ~8 s
(shared/notes/megatron-core-on-cpu.md). The parent never initialises torch.distributed.
Results come back as `torch.save` bytes because tensors sent through a queue die with the worker.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from megatron_bapo.models.parallel import free_port  # noqa: F401 - the tests' one port helper


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, queue) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
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


def run_dist(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` forked gloo ranks; return results by rank.

    A worker exception fails with that worker's traceback; a hang fails after `timeout` seconds.
    """
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout)
            if ok:
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
    except Exception as exc:  # queue.Empty on timeout
        errors.append(f"timed out after {timeout}s waiting for ranks ({exc!r}); got {sorted(results)}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
