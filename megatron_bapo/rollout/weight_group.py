"""Trainer rank 0's side of the distributed weight-update group (spec section 10), for any tensors.

Owned by the server pool (`rollout.pool.ServerPool`, which builds it at the first distributed
update and rebuilds it after a server restart); usable alone with any client:

    sender = DistributedWeightSender(client, backend="gloo", timeout_s=600)
    sender.connect(ranks_per_server)               # every server joins; the trainer is rank 0
    sender.send(bucket, weight_version="12", flush_cache=True)   # bucket: list of (hf_name, tensor)
    sender.close()

`send` must run inside a `/begin_weight_update` ... `/end_weight_update` session (SGLang 0.5.23
refuses the update otherwise, after this side already started broadcasting); the session, the pause
and the flush policy are the caller's (`rollout.pool`). Server i gets `rank_offset = 1 + ranks of
the servers before it` (`ranks_per_server`: each server's TP size, 1 for the built-in server).
Every HTTP call blocks until the collective it announces is done, so the calls are started on the
rollout client's loop (`client.submit`) while this thread joins the rendezvous or broadcasts, and
awaited afterwards. The group construction and the request body are `megatron_bapo.weight_update`,
which the built-in server uses too, so both sides speak exactly one protocol.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.errors import RolloutError
from megatron_bapo.weight_update import (
    DEFAULT_GROUP,
    broadcast_weights,
    destroy_weights_update_group,
    host_store,
    init_weights_update_group,
    nccl_version,
    update_request_body,
)

logger = logging.getLogger(__name__)

SERVER_NCCL_ENV = "SGLANG_NCCL_VERSION"
"""The servers' NCCL version when they do not report one (SGLang's `/server_info` does not): this
variable, or the file `$SGLANG_NCCL_VERSION_FILE` where the image records the SGLang environment's
NCCL at build time (Dockerfile)."""


class DistributedWeightSender:
    """Rank 0 of a weight-update group spanning this process and every server's TP ranks."""

    def __init__(self, client: Any, *, backend: str = "gloo", master_address: str = "127.0.0.1",
                 master_port: Optional[int] = None, group_name: str = DEFAULT_GROUP, timeout_s: float = 600.0):
        self.client = client
        self.backend, self.group_name, self.timeout_s = backend, group_name, timeout_s
        self.master_address = master_address
        self.master_port = int(master_port or 0)  # 0: the OS picks one when connect() binds the store
        self.pg = None
        self.urls: list[str] = []

    def connect(self, ranks_per_server: Optional[Sequence[int]] = None) -> None:
        """Ask every server to join, join as rank 0 ourselves (hosting the store), then await the replies."""
        self.urls = self.client.worker_urls()
        ranks = list(ranks_per_server or [1] * len(self.urls))
        if len(ranks) != len(self.urls) or min(ranks) < 1:
            raise ValueError(f"ranks_per_server must give a positive count per server, got {ranks}")
        world = 1 + sum(ranks)
        where = f"{self.master_address}:{self.master_port or '(a free port)'}"
        try:  # bound before the servers hear the port, so nothing can take it in between
            store = host_store(self.master_address, self.master_port, world, self.timeout_s)
        except Exception as exc:
            raise RolloutError(f"the weight update group cannot listen on {where}: {exc}; set sync.master_port to "
                               f"a free port the servers can reach, or to 0 to let the trainer pick one") from exc
        self.master_port = int(store.port)
        bodies = {u: {"master_address": self.master_address, "master_port": self.master_port,
                      "rank_offset": 1 + sum(ranks[:i]), "world_size": world, "group_name": self.group_name,
                      "backend": self.backend} for i, u in enumerate(self.urls)}
        pending = self.client.submit(self.client.ainit_weights_update_group(bodies, timeout=self.timeout_s))
        self.pg = self._join(pending, world, store)
        pending.result(self.timeout_s)
        logger.info("weight update group %s: world size %d (trainer + %s server ranks, %s)",
                    self.group_name, world, ranks, self.backend)

    def _join(self, pending: Any, world: int, store: Any) -> Any:
        """Join as rank 0 while the servers' join calls are pending. A server answers its call only once
        the rendezvous completed, so an answer before that is a refusal (e.g. `group ... already exists`
        from a server an earlier trainer left its group on): it stops the wait at once, its reply in the
        error, instead of waiting out `sync.group_timeout_s` for a rank that will never come. The
        rendezvous runs in a daemon thread so this one stays responsive (a SIGTERM lands too)."""
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["pg"] = init_weights_update_group(self.backend, self.master_address, self.master_port, 0, world,
                                                      self.group_name, timeout_s=self.timeout_s, store=store)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the waiting thread
                box["error"] = exc

        thread = threading.Thread(target=join, name="weight-group-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            if thread.is_alive() and pending.done() and pending.exception() is not None:
                raise RolloutError(f"a server refused to join the weight update group {self.group_name!r}: "
                                   f"{pending.exception()}") from pending.exception()
        if "error" in box:
            pending.cancel()
            exc = box["error"]
            refused = pending.exception() if pending.done() else None
            raise RolloutError(f"joining the weight update group at {self.master_address}:{self.master_port} "
                               f"failed within sync.group_timeout_s={self.timeout_s}: {exc}"
                               + (f"; a server answered: {refused}" if refused else "")) from exc
        return box["pg"]

    def send(self, bucket: Sequence, *, weight_version: Optional[str] = None, flush_cache: bool = False,
             flattened: bool = False) -> int:
        """Announce one bucket of (hf_name, tensor) to every server and broadcast it; returns its size.
        Only the bucket that completes an update carries `weight_version` (so no server reports the
        new version while it holds a partial update) and, per the pause mode, `flush_cache`."""
        if self.pg is None:
            raise RuntimeError("DistributedWeightSender.send before connect()")
        bucket = list(bucket)
        body = update_request_body(bucket, group_name=self.group_name, weight_version=weight_version,
                                   flush_cache=flush_cache, flattened=flattened)
        pending = self.client.submit(self.client.aupdate_weights_from_distributed(body, timeout=self.timeout_s))
        try:
            broadcast_weights(self.pg, bucket, flattened=flattened)
        finally:
            pending.result(self.timeout_s)
        return len(bucket)

    def close(self) -> None:
        """Leave the group on every server (best effort: a dead server must not block teardown) and here."""
        if self.pg is not None:
            try:
                self.client.run(self.client.adestroy_weights_update_group(self.group_name), timeout=90)
            except Exception as exc:  # noqa: BLE001 - teardown
                logger.warning("destroy_weights_update_group: %s", exc)
            destroy_weights_update_group(self.pg)
            self.pg = None


def check_nccl(infos: dict[str, dict], *, mine: Optional[str] = None) -> None:
    """Refuse a weight group whose two ends run different NCCL versions (NCCL would refuse the
    communicator at its first collective). A server's version is its `/server_info` `nccl_version`
    (the built-in server reports it), else `$SGLANG_NCCL_VERSION` or the file
    `$SGLANG_NCCL_VERSION_FILE` (the image records SGLang's at build time); when neither is known the
    check is skipped with a warning."""
    mine = mine or nccl_version()
    recorded = os.environ.get(SERVER_NCCL_ENV)
    if recorded is None and os.environ.get(SERVER_NCCL_ENV + "_FILE"):
        path = Path(os.environ[SERVER_NCCL_ENV + "_FILE"])
        recorded = path.read_text().strip() if path.exists() else None
    for url, info in infos.items():
        theirs = (info or {}).get("nccl_version") or recorded
        if theirs is None or mine is None:
            logger.warning("cannot compare NCCL versions with %s (trainer %s, server unknown; set %s)", url, mine,
                           SERVER_NCCL_ENV)
        elif str(theirs) != str(mine):
            raise ConfigError(f"NCCL mismatch in the weight group: the trainer runs NCCL {mine}, server {url} runs "
                              f"NCCL {theirs}; NCCL refuses such a communicator. Run both from one environment "
                              f"(the Dockerfile's) or install the same NCCL on both sides")
