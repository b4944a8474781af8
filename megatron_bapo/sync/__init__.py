"""Weight sync from the actor to the rollout servers (design section 3 step 7): what every actor rank does.

Export (`sync.export`, every actor rank): gather the weights over TP/PP and either write an HF
safetensors directory (`DiskExport`) or cut HF-named buckets (`DistributedExport`), handing the
result to a sink. Collective over all actor ranks; it never talks HTTP. Rank 0's sink is the server
pool's update session (`rollout.pool.ServerPool.update`: pause, update session, flush, restarts,
version); every other rank's is `NullSink`.

    with driver.weight_update(version) as sink:    # rank 0: pool.update(version); others: NullSink
        export.run(version, sink)                   # every rank: gather; rank 0's sink delivers

The pause modes and the flush rule are the wire protocol's (`megatron_bapo.weight_update`).
"""

from megatron_bapo.sync.config import SyncConfig

__all__ = ["SyncConfig"]
