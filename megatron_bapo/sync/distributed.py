"""Weight sync over a torch process group: `/init_weights_update_group` + `/update_weights_from_distributed`.

Protocol (spec section 10), per sync, on trainer rank 0:
  1. (first sync) world = 1 + every server's TP size; server i gets `rank_offset = 1 + TP sizes of the
     servers before it`. The init calls are fired asynchronously (each blocks until the rendezvous
     completes), rank 0 joins as rank 0 and hosts the store, then the replies are awaited.
  2. `/flush_cache` on every server (the update itself is posted with `flush_cache: false`, as slime does).
  3. For each bucket of HF-named full tensors (`convert.iter_hf_tensors`, <= `bucket_bytes`): post
     `/update_weights_from_distributed` with names/dtypes/shapes to every server, broadcast the tensors
     in the same order, then await the replies. Only the last bucket carries `weight_version`, so a
     server never reports the new version while it holds a partial update.
All actor ranks of the first DP/CP replica iterate the buckets (TP all-gathers, PP gathers to stage 0);
other replicas hold identical weights and skip.
"""

from __future__ import annotations

import atexit
import logging
import time
from typing import Any, Optional, Sequence

import torch

from megatron_bapo.sync.http import ControlCalls, WeightSyncError
from megatron_bapo.sync.sender import DistributedWeightSender

logger = logging.getLogger(__name__)


class DistributedWeightSync:
    """Push the actor's weights to SGLang-compatible servers over NCCL (GPU) or gloo (CPU).

    Construct on every actor rank. `config` is the run's `SyncConfig` (method, backend,
    master_address, master_port, bucket_bytes). Server URLs come from `server_urls`, else from the
    rollout `client` (its `config.urls`); only global rank 0 needs them.
    """

    def __init__(
        self,
        config: Any,
        actor: Any,
        hf_config: Any,
        client: Any = None,
        *,
        server_urls: Optional[Sequence[str]] = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.config = config
        self.actor = actor
        self.hf_config = hf_config
        self.timeout_s = timeout_s
        self.rank = actor.parallel.rank
        self.is_driver = self.rank == 0
        if server_urls is None and client is not None:
            server_urls = list(client.config.urls)
        self.urls = [u.rstrip("/") for u in (server_urls or [])]
        if self.is_driver and not self.urls:
            raise ValueError("DistributedWeightSync: rank 0 needs the server URLs (rollout.server_urls)")
        self.backend = config.backend
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("sync.backend='nccl' needs CUDA; use sync.backend=gloo on CPU")
        self._sender: Optional[DistributedWeightSender] = None
        self.num_syncs = 0

    # ------------------------------------------------------------------ group
    def _first_replica(self) -> bool:
        return self.actor.parallel.dp_rank == 0 and self.actor.parallel.cp_rank == 0

    def _ensure_group(self) -> None:
        if self._sender is not None:
            return
        calls = ControlCalls(self.timeout_s)
        atexit.register(self.close)  # the trainer may exit without calling close()
        infos = calls.wait_all([calls.get(u, "/get_server_info") for u in self.urls], self.timeout_s)
        self._sender = DistributedWeightSender(
            self.urls, backend=self.backend, master_address=self.config.master_address,
            master_port=int(self.config.master_port), ranks_per_server=[int((i or {}).get("tp_size", 1)) for i in infos],
            timeout_s=self.timeout_s, calls=calls,
        )
        try:
            self._sender.connect()
        except Exception:
            self._sender, sender = None, self._sender
            sender.close()
            raise

    # ------------------------------------------------------------------ sync
    def sync(self, version: int) -> int:
        """Send the current weights as `version`; collective over all actor ranks. Returns tensors sent."""
        from megatron_bapo.convert import iter_hf_tensors

        if self.is_driver:
            self._ensure_group()
            self._flush_caches()
        if not self._first_replica():
            return 0
        p = self.actor.parallel
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
            logger.info("weight sync v%s: %d tensors to %d server(s) over %s", version, sent, len(self.urls), self.backend)
        return sent

    def _flush_caches(self, tries: int = 60) -> None:
        """`/flush_cache` on every server, retried while a server is not idle yet (it answers 400)."""
        calls = self._sender.calls
        for attempt in range(tries):
            try:
                calls.wait_all([calls.post(u, "/flush_cache", {}) for u in self.urls], self.timeout_s)
                return
            except WeightSyncError:
                if attempt == tries - 1:
                    raise
                time.sleep(1.0)

    def _send(self, bucket: list, version: Optional[str]) -> int:
        # NCCL moves GPU memory only; gathered tensors may sit on the CPU.
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        return self._sender.send([[(name, t.to(device)) for name, t in bucket]], weight_version=version)

    def close(self) -> None:
        """Leave the group on every server and here (best effort)."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
