"""Trainer side of the distributed weight sync to one or more servers (spec section 10).

    sender = DistributedWeightSender(["http://127.0.0.1:30001", ...], backend="gloo")
    sender.connect()                               # every server joins; trainer is rank 0
    sender.send(buckets, weight_version="12")      # buckets: iterables of (hf_name, tensor)
    sender.close()

Each server is one TP rank here (the built-in server), so server i gets `rank_offset = 1 + i`; for
real SGLang servers with TP > 1 pass `ranks_per_server`. HTTP calls run in threads while this
process takes part in the collective, because every call blocks until the collective completes.
"""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

from megatron_bapo.server.distributed import (
    DEFAULT_GROUP,
    broadcast_weights,
    destroy_weights_update_group,
    init_weights_update_group,
    update_request_body,
)

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A server refused or failed a weight-sync call (message names the server and its reply)."""


def _post(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read() or b"null") or {}
    except urllib.error.HTTPError as err:
        raise WeightSyncError(f"{url} -> HTTP {err.code}: {err.read().decode(errors='replace')}") from err


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DistributedWeightSender:
    """Rank 0 of a weight-update group spanning this process and every server's TP ranks."""

    def __init__(self, urls: Sequence[str], *, backend: str = "gloo", master_address: str = "127.0.0.1",
                 master_port: Optional[int] = None, group_name: str = DEFAULT_GROUP,
                 ranks_per_server: Optional[Sequence[int]] = None, timeout_s: float = 600.0):
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
        self._pool = ThreadPoolExecutor(max(4, len(self.urls)))

    def _all(self, path: str, bodies: Sequence[dict]) -> list:
        return [self._pool.submit(_post, url + path, body, self.timeout_s) for url, body in zip(self.urls, bodies)]

    @staticmethod
    def _check(futures: list, what: str) -> None:
        for fut in futures:
            reply = fut.result()
            if not reply.get("success", False):
                raise WeightSyncError(f"{what} failed: {reply}")

    def connect(self) -> None:
        """Ask every server to join, join as rank 0 ourselves, then check every reply."""
        world = 1 + sum(self.ranks)
        offsets = [1 + sum(self.ranks[:i]) for i in range(len(self.urls))]
        bodies = [{"master_address": self.master_address, "master_port": self.master_port, "rank_offset": off,
                   "world_size": world, "group_name": self.group_name, "backend": self.backend} for off in offsets]
        futures = self._all("/init_weights_update_group", bodies)
        self.pg = init_weights_update_group(self.backend, self.master_address, self.master_port, 0, world,
                                            self.group_name, timeout_s=self.timeout_s)
        self._check(futures, "init_weights_update_group")
        logger.info("weight update group %s: %d server(s), world size %d", self.group_name, len(self.urls), world)

    def send(self, buckets: Iterable[Sequence], *, weight_version: Optional[str] = None,
             flattened: bool = False) -> int:
        """Send every bucket (a list of (hf_name, tensor)); the version is set with the last bucket.
        Returns the number of tensors sent."""
        if self.pg is None:
            raise RuntimeError("DistributedWeightSender.send before connect()")
        buckets = [list(b) for b in buckets]
        count = 0
        for i, bucket in enumerate(buckets):
            version = weight_version if i == len(buckets) - 1 else None
            body = update_request_body(bucket, group_name=self.group_name, weight_version=version, flattened=flattened)
            futures = self._all("/update_weights_from_distributed", [body] * len(self.urls))
            broadcast_weights(self.pg, bucket, flattened=flattened)
            self._check(futures, f"update_weights_from_distributed (bucket {i})")
            count += len(bucket)
        return count

    def close(self) -> None:
        """Destroy the group on every server and here (best effort on the servers)."""
        if self.pg is None:
            return
        for fut in self._all("/destroy_weights_update_group", [{"group_name": self.group_name}] * len(self.urls)):
            try:
                fut.result()
            except Exception as exc:  # noqa: BLE001 - a dead server must not block teardown
                logger.warning("destroy_weights_update_group: %s", exc)
        destroy_weights_update_group(self.pg)
        self.pg = None
        self._pool.shutdown(wait=False)
