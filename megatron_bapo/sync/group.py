"""A standalone process group shared by the trainer (rank 0) and the rollout servers.

Built the way SGLang builds it on the server side (and slime on the trainer side): a TCP
rendezvous at `tcp://master_address:master_port` where rank 0 hosts the store, a `PrefixStore`
named after the group, and `_new_process_group_helper`, so it never touches (or needs) the
default process group and interoperates with real SGLang servers.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def new_update_group(
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    timeout_s: float = 600.0,
) -> "dist.ProcessGroup":
    """Join (rank 0: host) the group; blocks until all `world_size` ranks have joined."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_update_group(pg: "dist.ProcessGroup") -> None:
    """Forget and shut down a group made by `new_update_group`."""
    from torch.distributed.distributed_c10d import _world

    _world.pg_group_ranks.pop(pg, None)
    try:
        pg.shutdown()
    except Exception:  # noqa: BLE001 - best effort: the group is unusable either way
        pass
