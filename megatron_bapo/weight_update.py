"""The weight-update wire protocol (SGLang native API sections 9-12), shared by both sides.

The trainer side (`megatron_bapo.rollout.pool`, its client and weight group, `megatron_bapo.sync`) and the
built-in server (`megatron_bapo.server.control`, `megatron_bapo.server.distributed`) import this module
and nothing of each other:
- the pause modes of `/pause_generation` and which of them lets an update flush the cache
  (`PAUSE_MODES`, `flushes_cache`);
- the distributed group: its construction (a TCP store hosted by the trainer, prefixed by the group
  name, SGLang's and slime's construction, so real SGLang servers interoperate), the
  `/update_weights_from_distributed` body, and the order tensors are broadcast in.
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

DEFAULT_GROUP = "weight_update_group"

PAUSE_MODES: tuple[Optional[str], ...] = (None, "abort", "retract", "in_place")
"""How an update meets generation in flight (`sync.pause_mode`): None is no pause; the others are
the `mode` of SGLang's `/pause_generation` (0.5.15+), which the built-in server takes too."""


FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are still running or "
                 "queued. Retract or finish them, then call /flush_cache.")
"""SGLang 0.5.23's 400 reply (`success: false`) to an update whose own flush meets requests in its
scheduler: the weights and the version are in, the flush is not. The built-in server gives it where
SGLang would (paused in place); the client completes such an update by flushing again
(`rollout/control.py`), since a request whose reply was just sent can still be in SGLang's scheduler
for a moment (seen once on live SGLang: an update right after a weight check's probes)."""


def flushes_cache(pause_mode: Optional[str]) -> bool:
    """Whether an update under `pause_mode` asks the servers to flush their prefix cache.

    SGLang 0.5.23 flushes after an update only when no request holds KV: true with no pause (the
    writer lock waited for every request), "abort" (none left) and "retract" (requests wait without
    KV); "in_place" keeps the running requests' KV, so the flush is refused (`success: false`, the
    update call fails). Under "in_place" the servers must therefore run without a radix cache
    (`--disable-radix-cache`, checked at the first sync), so no later request reuses KV that older
    weights computed.
    """
    return pause_mode != "in_place"


def host_store(master_address: str, master_port: int, world_size: int, timeout_s: float = 600.0):
    """Rank 0's TCP store of a weight-update group, bound before anyone is told where it is.

    `master_port` 0 lets the OS pick a free port (read it back as `store.port`): a port chosen
    earlier and bound later can be taken in between, by the ephemeral ports of the trainer's own
    gloo/NCCL connections among others, and the group then fails with EADDRINUSE.
    """
    from torch.distributed import TCPStore

    return TCPStore(master_address, int(master_port), world_size, is_master=True,
                    timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def init_weights_update_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int,
    group_name: str = DEFAULT_GROUP, timeout_s: float = 600.0, store=None,
):
    """Create (and rendezvous) a standalone process group; blocks until all `world_size` ranks join.

    Used by both sides: the trainer as rank 0 (it hosts the store: pass the one `host_store`
    made, or let this call bind `master_port`), each server as `rank_offset + tp_rank`. The store
    is built directly, not through `rendezvous("tcp://...")`: under torchrun that handler connects
    to the launcher's agent store instead of hosting one (TORCHELASTIC_USE_AGENT_STORE), and rank 0
    would wait forever for a store nobody serves.
    """
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        if rank == 0:
            store = host_store(master_address, master_port, world_size, timeout_s)
        else:
            store = TCPStore(master_address, int(master_port), world_size, is_master=False, timeout=timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def nccl_version() -> Optional[str]:
    """This process's NCCL as "major.minor.patch" (None without CUDA). NCCL refuses a communicator
    whose ranks run different NCCL versions, so both ends of a weight group compare it first."""
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


def destroy_weights_update_group(pg) -> None:
    """Forget a group made by `init_weights_update_group` (works without a default group).

    Every registry entry goes, the group's name included: a name left behind makes the next group of
    that name fail ("already been created"), on a trainer that rebuilds its group after a server
    restart, on a server asked to join again, and in every process forked from this one."""
    from torch.distributed.distributed_c10d import _world

    if pg in _world.pg_map:
        if pg not in _world.pg_group_ranks:
            _world.pg_group_ranks[pg] = {}
        try:
            dist.destroy_process_group(pg)  # shuts the backend down and unregisters the name
            return
        except Exception:  # noqa: BLE001 - best effort; fall through to a plain shutdown
            pass
    _world.pg_group_ranks.pop(pg, None)
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001 - best effort; the group is unusable either way
        pass


def update_request_body(named: list, *, group_name: str = DEFAULT_GROUP, weight_version: Optional[str] = None,
                        flush_cache: bool = False, flattened: bool = False) -> dict:
    """Trainer side: the `/update_weights_from_distributed` JSON for `named` = [(hf_name, tensor)].

    `flush_cache` is always sent (SGLang's default is true, and SGLang 0.5.23 fails an update whose
    flush it must refuse): the caller sets it on the bucket that completes an update, per pause mode
    (`flushes_cache`)."""
    body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": group_name,
            "flush_cache": bool(flush_cache), "weight_version": weight_version}
    if flattened:
        body["load_format"] = "flattened_bucket"
    return body


def broadcast_weights(pg, named: list, *, flattened: bool = False) -> None:
    """Trainer side (rank 0): broadcast `named` in list order, matching `receive_tensors` on the servers.
    Post the update request first (asynchronously), then call this, then await the replies."""
    if flattened:
        dtypes = {t.dtype for _, t in named}
        if len(dtypes) != 1:
            raise ValueError(f"a flattened bucket needs one dtype, got {sorted(map(str, dtypes))}")
        dist.broadcast(torch.cat([t.detach().reshape(-1) for _, t in named]), src=0, group=pg)
        return
    for _, t in named:
        dist.broadcast(t.detach().contiguous(), src=0, group=pg)


def torch_dtype(name: str) -> torch.dtype:
    """A wire dtype name ("bfloat16") as a torch dtype; ValueError naming it when unknown."""
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (use torch names without 'torch.', e.g. 'bfloat16')")
    return dt


def receive_tensors(pg, names: list, dtypes: list, shapes: list, flattened: bool, device: str = "cpu") -> list:
    """Receive the broadcasts of rank 0 in list order; returns [(name, tensor)] on `device`
    ("cuda" for nccl: NCCL only moves GPU memory; the copy into the CPU model happens at load)."""
    if flattened:
        numels = [int(torch.Size(s).numel()) for s in shapes]
        flat = torch.empty(sum(numels), dtype=dtypes[0], device=device)
        dist.broadcast(flat, src=0, group=pg)
        out, offset = [], 0
        for name, shape, numel in zip(names, shapes, numels):
            out.append((name, flat[offset: offset + numel].view(shape)))
            offset += numel
        return out
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0, group=pg)
        out.append((name, t))
    return out
