"""Weight sync over a torch process group: `/init_weights_update_group` + `/update_weights_from_distributed`.

Protocol (spec section 10), per sync, on trainer rank 0:
  1. (first sync) world = 1 + every server's TP size (`/get_server_info`); server i gets
     `rank_offset = 1 + TP sizes of the servers before it`. The init calls are started on the
     rollout client's loop (each blocks until the rendezvous completes), rank 0 joins as rank 0 and
     hosts the store, then the replies are awaited.
  2. (under `sync.pause_mode`, see sync.pause) for each bucket of HF-named full tensors (`convert.iter_hf_tensors`, <= `bucket_bytes`): post
     `/update_weights_from_distributed` with names/dtypes/shapes to every server, broadcast the tensors
     in the same order, then await the replies. Only the last bucket carries `weight_version` (and
     `flush_cache: true`: the prefix cache holds KV of the old weights), so a server never reports
     the new version while it holds a partial update.
All actor ranks of the first DP/CP replica iterate the buckets (TP all-gathers, PP gathers to stage 0);
other replicas hold identical weights and skip.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Optional

import torch

from megatron_bapo.sync.pause import paused
from megatron_bapo.sync.sender import DistributedWeightSender

logger = logging.getLogger(__name__)


class DistributedWeightSync:
    """Push the actor's weights to SGLang-compatible servers over NCCL (GPU) or gloo (CPU).

    Construct on every actor rank. `config` is the run's `SyncConfig` (backend, master_address,
    master_port, bucket_bytes, pause_mode). `client` is the rollout client, on global rank 0 only.
    """

    def __init__(self, config: Any, actor: Any, hf_config: Any, client: Any = None, *, timeout_s: float = 600.0) -> None:
        self.config = config
        self.actor = actor
        self.hf_config = hf_config
        self.client = client
        self.timeout_s = timeout_s
        self.is_driver = actor.parallel.rank == 0
        if self.is_driver and client is None:
            raise ValueError("DistributedWeightSync: rank 0 needs the rollout client (the servers to update)")
        if config.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("sync.backend='nccl' needs CUDA; use sync.backend=gloo on CPU")
        self._sender: Optional[DistributedWeightSender] = None
        self.num_syncs = 0

    def _first_replica(self) -> bool:
        return self.actor.parallel.dp_rank == 0 and self.actor.parallel.cp_rank == 0

    def _ensure_group(self) -> DistributedWeightSender:
        if self._sender is None:
            infos = self.client.run(self.client.aget_server_info())
            sender = DistributedWeightSender(self.client, backend=self.config.backend,
                                             master_address=self.config.master_address,
                                             master_port=int(self.config.master_port), timeout_s=self.timeout_s)
            sender.connect([int((infos[u] or {}).get("tp_size", 1)) for u in self.client.worker_urls()])
            self._sender = sender
        return self._sender

    def sync(self, version: int) -> int:
        """Send the current weights as `version`; collective over all actor ranks. Returns tensors sent."""
        from megatron_bapo.convert import iter_hf_tensors

        p = self.actor.parallel
        with (paused(self.client, self.config.pause_mode) if self.is_driver else contextlib.nullcontext()):
            if self.is_driver:
                self._ensure_group()
            if not self._first_replica():
                return 0
            buckets = iter_hf_tensors(self.actor.model, self.hf_config, bucket_bytes=int(self.config.bucket_bytes),
                                      gather_to="first", tp_group=p.tp_group, pp_group=p.pp_group)
            sent = 0
            held = None  # one bucket of look-ahead: the last bucket carries the weight version
            for bucket in buckets:
                if held is not None and self.is_driver:
                    sent += self._send(held, None)
                held = bucket
            if self.is_driver and held is not None:
                sent += self._send(held, str(version))
        if self.is_driver:
            self.num_syncs += 1
            logger.info("weight sync v%s: %d tensors over %s", version, sent, self.config.backend)
        return sent

    def _send(self, bucket: list, version: Optional[str]) -> int:
        # NCCL moves GPU memory only; gathered tensors may sit on the CPU.
        device = torch.device("cuda", torch.cuda.current_device()) if self.config.backend == "nccl" else torch.device("cpu")
        return self._sender.send([[(name, t.to(device)) for name, t in bucket]], weight_version=version)

    def reset_servers(self) -> None:
        """Rebuild the weight group at the next sync (rank 0: a server was restarted, so the group
        it belonged to is broken)."""
        self.close()

    def close(self) -> None:
        """Leave the group on every server and here (best effort)."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
