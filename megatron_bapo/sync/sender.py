"""Trainer rank 0's side of the distributed weight-sync protocol (spec section 10), for any tensors.

    sender = DistributedWeightSender(["http://127.0.0.1:30001", ...], backend="gloo")
    sender.connect()                               # every server joins; the trainer is rank 0
    sender.send(buckets, weight_version="12")      # buckets: lists of (hf_name, tensor)
    sender.close()

Server i gets `rank_offset = 1 + ranks of the servers before it` (`ranks_per_server`: each server's
TP size, 1 for the built-in server). Every HTTP call blocks until the collective it announces is
done, so calls are posted from `ControlCalls`' background loop while this thread joins the
rendezvous or broadcasts. The group construction and the request body are the server's own
(`megatron_bapo.server.distributed`), so both sides speak exactly one protocol.
`sync.DistributedWeightSync` feeds this from the Megatron actor.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional, Sequence

from megatron_bapo.models.parallel import free_port
from megatron_bapo.server.distributed import (
    DEFAULT_GROUP,
    broadcast_weights,
    destroy_weights_update_group,
    init_weights_update_group,
    update_request_body,
)
from megatron_bapo.sync.http import ControlCalls, WeightSyncError

logger = logging.getLogger(__name__)


class DistributedWeightSender:
    """Rank 0 of a weight-update group spanning this process and every server's TP ranks."""

    def __init__(self, urls: Sequence[str], *, backend: str = "gloo", master_address: str = "127.0.0.1",
                 master_port: Optional[int] = None, group_name: str = DEFAULT_GROUP,
                 ranks_per_server: Optional[Sequence[int]] = None, timeout_s: float = 600.0,
                 calls: Optional[ControlCalls] = None):
        if not urls:
            raise ValueError("DistributedWeightSender: urls is empty")
        self.urls = [u.rstrip("/") for u in urls]
        self.ranks = list(ranks_per_server or [1] * len(self.urls))
        if len(self.ranks) != len(self.urls) or min(self.ranks) < 1:
            raise ValueError(f"ranks_per_server must give a positive count per server, got {self.ranks}")
        self.backend, self.group_name, self.timeout_s = backend, group_name, timeout_s
        self.master_address = master_address
        self.master_port = master_port or free_port(master_address)
        self.pg = None
        self.calls = calls or ControlCalls(timeout_s)
        """HTTP calls to the servers; the sender owns them (also ones passed in) and closes them in `close()`."""

    def _post_all(self, path: str, bodies: Sequence[dict]) -> list:
        return self.calls.post_all(self.urls, path, list(bodies))

    def connect(self) -> None:
        """Ask every server to join, join as rank 0 ourselves (hosting the store), then await the replies."""
        world = 1 + sum(self.ranks)
        offsets = [1 + sum(self.ranks[:i]) for i in range(len(self.urls))]
        bodies = [{"master_address": self.master_address, "master_port": self.master_port, "rank_offset": off,
                   "world_size": world, "group_name": self.group_name, "backend": self.backend} for off in offsets]
        pending = self._post_all("/init_weights_update_group", bodies)
        try:
            self.pg = init_weights_update_group(self.backend, self.master_address, self.master_port, 0, world,
                                                self.group_name, timeout_s=self.timeout_s)
        except Exception as exc:
            for f in pending:
                f.cancel()
            raise WeightSyncError(f"joining the weight update group at {self.master_address}:{self.master_port} "
                                  f"failed: {exc}") from exc
        self.calls.wait_all(pending, self.timeout_s)
        logger.info("weight update group %s: world size %d (trainer + %s server ranks, %s)",
                    self.group_name, world, self.ranks, self.backend)

    def send(self, buckets: Iterable[Sequence], *, weight_version: Optional[str] = None,
             flattened: bool = False) -> int:
        """Send every bucket (a list of (hf_name, tensor)); only the last one carries `weight_version`,
        so no server reports the new version while it holds a partial update. Returns tensors sent."""
        if self.pg is None:
            raise RuntimeError("DistributedWeightSender.send before connect()")
        buckets = [list(b) for b in buckets]
        count = 0
        for i, bucket in enumerate(buckets):
            version = weight_version if i == len(buckets) - 1 else None
            body = update_request_body(bucket, group_name=self.group_name, weight_version=version, flattened=flattened)
            pending = self._post_all("/update_weights_from_distributed", [body] * len(self.urls))
            try:
                broadcast_weights(self.pg, bucket, flattened=flattened)
            finally:
                self.calls.wait_all(pending, self.timeout_s)
            count += len(bucket)
        return count

    def close(self) -> None:
        """Leave the group on every server (best effort: a dead server must not block teardown) and here;
        then stop the HTTP calls."""
        if self.pg is not None:
            try:
                self.calls.wait_all(self._post_all("/destroy_weights_update_group",
                                                   [{"group_name": self.group_name}] * len(self.urls)), 60.0)
            except WeightSyncError as exc:
                logger.warning("destroy_weights_update_group: %s", exc)
            destroy_weights_update_group(self.pg)
            self.pg = None
        self.calls.close()
