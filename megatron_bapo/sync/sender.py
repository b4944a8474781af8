"""Trainer rank 0's side of the distributed weight-sync protocol (spec section 10), for any tensors.

    sender = DistributedWeightSender(client, backend="gloo")
    sender.connect(ranks_per_server)               # every server joins; the trainer is rank 0
    sender.send(buckets, weight_version="12")      # buckets: lists of (hf_name, tensor)
    sender.close()

Server i gets `rank_offset = 1 + ranks of the servers before it` (`ranks_per_server`: each server's
TP size, 1 for the built-in server). Every HTTP call blocks until the collective it announces is
done, so the calls are started on the rollout client's loop (`client.submit`) while this thread
joins the rendezvous or broadcasts, and awaited afterwards. The group construction and the request
body are `megatron_bapo.weight_update`, which the built-in server uses too, so both sides speak
exactly one protocol. `sync.DistributedWeightSync` feeds this from the Megatron actor.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence

from megatron_bapo.models.parallel import free_port
from megatron_bapo.rollout.errors import RolloutError
from megatron_bapo.weight_update import (
    DEFAULT_GROUP,
    broadcast_weights,
    destroy_weights_update_group,
    init_weights_update_group,
    update_request_body,
)

logger = logging.getLogger(__name__)


class DistributedWeightSender:
    """Rank 0 of a weight-update group spanning this process and every server's TP ranks."""

    def __init__(self, client: Any, *, backend: str = "gloo", master_address: str = "127.0.0.1",
                 master_port: Optional[int] = None, group_name: str = DEFAULT_GROUP, timeout_s: float = 600.0):
        self.client = client
        self.backend, self.group_name, self.timeout_s = backend, group_name, timeout_s
        self.master_address = master_address
        self.master_port = master_port or free_port(master_address)
        self.pg = None
        self.urls: list[str] = []

    def connect(self, ranks_per_server: Optional[Sequence[int]] = None) -> None:
        """Ask every server to join, join as rank 0 ourselves (hosting the store), then await the replies."""
        self.urls = self.client.worker_urls()
        ranks = list(ranks_per_server or [1] * len(self.urls))
        if len(ranks) != len(self.urls) or min(ranks) < 1:
            raise ValueError(f"ranks_per_server must give a positive count per server, got {ranks}")
        world = 1 + sum(ranks)
        bodies = {u: {"master_address": self.master_address, "master_port": self.master_port,
                      "rank_offset": 1 + sum(ranks[:i]), "world_size": world, "group_name": self.group_name,
                      "backend": self.backend} for i, u in enumerate(self.urls)}
        pending = self.client.submit(self.client.ainit_weights_update_group(bodies))
        try:
            self.pg = init_weights_update_group(self.backend, self.master_address, self.master_port, 0, world,
                                                self.group_name, timeout_s=self.timeout_s)
        except Exception as exc:
            pending.cancel()
            raise RolloutError(f"joining the weight update group at {self.master_address}:{self.master_port} "
                               f"failed: {exc}") from exc
        pending.result(self.timeout_s)
        logger.info("weight update group %s: world size %d (trainer + %s server ranks, %s)",
                    self.group_name, world, ranks, self.backend)

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
            pending = self.client.submit(self.client.aupdate_weights_from_distributed(body))
            try:
                broadcast_weights(self.pg, bucket, flattened=flattened)
            finally:
                pending.result(self.timeout_s)
            count += len(bucket)
        return count

    def close(self) -> None:
        """Leave the group on every server (best effort: a dead server must not block teardown) and here."""
        if self.pg is not None:
            try:
                self.client.run(self.client.adestroy_weights_update_group(self.group_name), timeout=90)
            except Exception as exc:  # noqa: BLE001 - teardown
                logger.warning("destroy_weights_update_group: %s", exc)
            destroy_weights_update_group(self.pg)
            self.pg = None
