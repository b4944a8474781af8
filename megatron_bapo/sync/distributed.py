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
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_bapo.sync.group import destroy_update_group, new_update_group
from megatron_bapo.sync.http import ControlCalls, WeightSyncError

logger = logging.getLogger(__name__)

GROUP_NAME = "weight_update_group"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


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
        self.rank = dist.get_rank()
        self.is_driver = self.rank == 0
        if server_urls is None and client is not None:
            server_urls = list(client.config.urls)
        self.urls = [u.rstrip("/") for u in (server_urls or [])]
        if self.is_driver and not self.urls:
            raise ValueError("DistributedWeightSync: rank 0 needs the server URLs (rollout.server_urls)")
        self.backend = config.backend
        if self.backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("sync.backend='nccl' needs CUDA; use sync.backend=gloo on CPU")
        self._calls: Optional[ControlCalls] = None
        self._group = None
        self.num_syncs = 0

    # ------------------------------------------------------------------ group
    def _first_replica(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0

    def _ensure_group(self) -> None:
        if self._group is not None:
            return
        calls = self._calls = ControlCalls(self.timeout_s)
        atexit.register(self.close)  # the trainer may exit without calling close()
        infos = calls.wait_all([calls.get(u, "/get_server_info") for u in self.urls], self.timeout_s)
        tp_sizes = [int((info or {}).get("tp_size", 1)) for info in infos]
        world = 1 + sum(tp_sizes)
        bodies, offset = [], 1
        for tp in tp_sizes:
            bodies.append({
                "master_address": self.config.master_address, "master_port": int(self.config.master_port),
                "rank_offset": offset, "world_size": world, "group_name": GROUP_NAME, "backend": self.backend,
            })
            offset += tp
        pending = calls.post_all(self.urls, "/init_weights_update_group", bodies)
        try:
            self._group = new_update_group(
                self.backend, self.config.master_address, int(self.config.master_port), 0, world,
                GROUP_NAME, self.timeout_s,
            )
        except Exception as exc:
            for f in pending:
                f.cancel()
            raise WeightSyncError(f"joining the weight update group at {self.config.master_address}:"
                                  f"{self.config.master_port} failed: {exc}") from exc
        calls.wait_all(pending, self.timeout_s)
        logger.info("weight update group: %d ranks (trainer + %s server TP ranks, %s)", world, tp_sizes, self.backend)

    # ------------------------------------------------------------------ sync
    def sync(self, version: int) -> int:
        """Send the current weights as `version`; collective over all actor ranks. Returns tensors sent."""
        from megatron_bapo.convert import iter_hf_tensors

        if self.is_driver:
            self._ensure_group()
            self._flush_caches()
        if not self._first_replica():
            return 0
        buckets = iter_hf_tensors(self.actor.model, self.hf_config, bucket_bytes=int(self.config.bucket_bytes),
                                  gather_to="first")
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
        import time

        for attempt in range(tries):
            try:
                self._calls.wait_all([self._calls.post(u, "/flush_cache", {}) for u in self.urls], self.timeout_s)
                return
            except WeightSyncError:
                if attempt == tries - 1:
                    raise
                time.sleep(1.0)

    def _send(self, bucket: list, version: Optional[str]) -> int:
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        tensors = [t.to(device) for _, t in bucket]
        body = {
            "names": [n for n, _ in bucket], "dtypes": [_dtype_name(t.dtype) for t in tensors],
            "shapes": [list(t.shape) for t in tensors], "group_name": GROUP_NAME, "flush_cache": False,
            "abort_all_requests": False, "weight_version": version,
        }
        pending = self._calls.post_all(self.urls, "/update_weights_from_distributed", [body] * len(self.urls))
        try:
            for t in tensors:
                dist.broadcast(t, src=0, group=self._group)
        finally:
            self._calls.wait_all(pending, self.timeout_s)
        return len(tensors)

    def close(self) -> None:
        """Leave the group on every server and here (best effort)."""
        if self._calls is not None:
            try:
                self._calls.wait_all(
                    [self._calls.post(u, "/destroy_weights_update_group", {"group_name": GROUP_NAME}) for u in self.urls],
                    60.0,
                )
            except WeightSyncError as exc:
                logger.warning("destroy_weights_update_group: %s", exc)
            self._calls.close()
            self._calls = None
        if self._group is not None:
            destroy_update_group(self._group)
            self._group = None
