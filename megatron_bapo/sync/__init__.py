"""Weight sync from the actor to the rollout servers (design section 3 step 7), in two halves.

- Export (`sync.export`, every actor rank): gather the weights over TP/PP and either write an HF
  safetensors directory (`DiskExport`) or cut HF-named buckets (`DistributedExport`), handing the
  result to a sink. Collective over all actor ranks; it never talks HTTP.
- Delivery (`sync.delivery.WeightDelivery`, global rank 0 only, owned by the driver next to the
  server pool): everything that reaches the servers: restart dead built-in servers, pause
  (`sync.pause_mode`), the `/begin_weight_update` ... `/end_weight_update` session and the
  `/update_weights_from_distributed` broadcasts (`sync.sender`), `/update_weights_from_disk`, the
  explicit `flush_cache` of each update (`config.flushes_cache`), continue, and the new version.
  Ranks above 0 hold `NullDelivery`, whose sink drops what the export hands it.

    with driver.weight_update(version) as sink:    # rank 0: a real session; others: a null sink
        export.run(version, sink)                   # every rank: gather; rank 0's sink delivers

This package's `__init__` imports only the config (the built-in server and the client read the pause
modes without importing the Megatron side).
"""

from megatron_bapo.sync.config import PAUSE_MODES, SyncConfig, flushes_cache

__all__ = ["PAUSE_MODES", "SyncConfig", "flushes_cache"]
