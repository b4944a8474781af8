"""The delivery half of the weight sync, on global rank 0: one update of every server to a version.

    delivery = WeightDelivery(sync_config, pool, deterministic_inference=...)
    with delivery.update(version) as session:     # restart dead servers, check flags, pause, begin
        export.run(version, session)              # session.send(bucket) / session.load_from_disk(dir)
    # exit: end the session, continue generation; the version is what the servers serve now

The protocol follows SGLang 0.5.23 exactly (spec sections 9, 10, 12):
- pause: `sync.pause_mode` null = none (every update call takes the server's writer lock and waits
  for the generation in flight); otherwise `/pause_generation {"mode": ...}` first and
  `/continue_generation` last, even when the update fails;
- distributed: `/begin_weight_update` on every server, then per bucket `/update_weights_from_distributed`
  + the broadcast, then `/end_weight_update` (also after a failure: the session must not stay open).
  The weight group is built at the first update and rebuilt after a server restart; it refuses an
  NCCL mismatch between this process and the servers;
- flush: every update says `flush_cache` explicitly (`config.flushes_cache`): true except under the
  "in_place" pause, where SGLang refuses it; only the last bucket of a distributed update flushes;
- disk: `/update_weights_from_disk`; a built-in server that died during it is restarted and every
  server loads the version again (the directory is complete on disk).
Before the first update every server's `/server_info` must show the flags the run relies on
(`rollout.pool.required_server_flags`): a seed SGLang would ignore, or KV an in-place pause could not
flush, is refused here instead of silently changing what is trained.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Optional

from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.errors import RolloutError
from megatron_bapo.rollout.server_layout import weight_group_ranks
from megatron_bapo.sync.config import SyncConfig, flushes_cache
from megatron_bapo.sync.export import NullSink

logger = logging.getLogger(__name__)

SERVER_NCCL_ENV = "SGLANG_NCCL_VERSION"
"""The servers' NCCL version when they do not report one (SGLang's `/server_info` does not): this
variable, or the file `$SGLANG_NCCL_VERSION_FILE` where the image records the SGLang environment's
NCCL at build time (Dockerfile)."""


class UpdateSession:
    """The sink of one update (rank 0): what the export hands over goes to every server."""

    def __init__(self, delivery: "WeightDelivery", version: int) -> None:
        self.delivery, self.version = delivery, version
        self.num_tensors = 0

    def load_from_disk(self, path: Path, version: int) -> None:
        d = self.delivery
        client, flush = d.pool.client, flushes_cache(d.config.pause_mode)
        try:
            client.update_weights_from_disk(str(Path(path).absolute()), version, flush_cache=flush)
        except RolloutError:
            # A built-in server died during the load: restart it (it starts from model.hf_path, or the
            # previous version) and load this complete directory everywhere again.
            if not d.pool.any_dead() or not d.pool.ensure_alive(updating=True):
                raise
            client.update_weights_from_disk(str(Path(path).absolute()), version, flush_cache=flush)
        d.pool.latest_disk_weights = (str(Path(path).absolute()), version)
        d.pool.version = version
        logger.info("weight sync v%s: %s loaded", version, path)

    def send(self, bucket: list, *, last: bool) -> int:
        d = self.delivery
        sent = d.sender.send(bucket, weight_version=str(self.version) if last else None,
                             flush_cache=last and flushes_cache(d.config.pause_mode))
        self.num_tensors += sent
        return sent


class WeightDelivery:
    """Owns every call that brings new weights to the servers (start to end of an update)."""

    def __init__(self, config: SyncConfig, pool: Any, *, deterministic_inference: bool) -> None:
        self.config, self.pool = config, pool
        self.deterministic_inference = deterministic_inference
        self.sender: Any = None
        self._group_restarts = -1
        self._checked = False

    @contextlib.contextmanager
    def update(self, version: int) -> Iterator[UpdateSession]:
        self.pool.ensure_alive(updating=True)
        if not self._checked:
            self._check_servers()
        client, mode = self.pool.client, self.config.pause_mode
        session = UpdateSession(self, version)
        if mode is not None:
            client.pause_generation(mode)
        try:
            if self.config.method == "distributed":
                self._ensure_group()
                client.run(client.abegin_weight_update(), timeout=self.config.group_timeout_s)
                try:
                    yield session
                finally:
                    client.run(client.aend_weight_update(), timeout=self.config.group_timeout_s)
                self.pool.version = version
                logger.info("weight sync v%s: %d tensors over %s", version, session.num_tensors, self.config.backend)
            else:
                yield session
        finally:
            if mode is not None:
                client.continue_generation()

    # ------------------------------------------------------------------ checks, the group
    def _server_infos(self) -> dict[str, dict]:
        """Every server's `/server_info`. A built-in server can die after `ensure_alive` looked (the
        kill lands between the two calls): restart it, as `ensure_alive` would have, and ask again."""
        client = self.pool.client
        try:
            return client.run(client.aget_server_info())
        except RolloutError:
            if not self.pool.any_dead() or not self.pool.ensure_alive(updating=True):
                raise
            return client.run(client.aget_server_info())

    def _check_servers(self) -> None:
        """Every server runs with the flags this run relies on (see the module docstring)."""
        infos = self._server_infos()
        for url, info in infos.items():
            if self.deterministic_inference and not info.get("enable_deterministic_inference"):
                raise ConfigError(f"rollout.deterministic_inference is true but server {url} runs without "
                                  f"--enable-deterministic-inference, so it would ignore every sampling_seed; "
                                  f"launch it with that flag or set rollout.deterministic_inference=false")
            if self.config.pause_mode == "in_place" and not info.get("disable_radix_cache"):
                raise ConfigError(f"sync.pause_mode=in_place but server {url} keeps a radix cache: the update cannot "
                                  f"flush it while requests hold KV, so later requests would reuse KV of older "
                                  f"weights; launch it with --disable-radix-cache or use sync.pause_mode=retract")
        self._checked = True

    def _ensure_group(self) -> None:
        if self.sender is not None and self._group_restarts == self.pool.num_restarted:
            return
        from megatron_bapo.sync.sender import DistributedWeightSender

        if self.sender is not None:  # a restarted server is not in the old group
            self.sender.close()
        client = self.pool.client
        infos = self._server_infos()
        urls = client.worker_urls()
        if self.config.backend == "nccl":
            check_nccl(infos)
        sender = DistributedWeightSender(client, backend=self.config.backend, master_address=self.config.master_address,
                                         master_port=int(self.config.master_port), timeout_s=self.config.group_timeout_s)
        sender.connect(weight_group_ranks(infos, urls))
        self.sender, self._group_restarts = sender, self.pool.num_restarted

    def close(self) -> None:
        """Leave the weight group (best effort)."""
        if self.sender is not None:
            with contextlib.suppress(Exception):
                self.sender.close()
            self.sender = None


def check_nccl(infos: dict[str, dict], *, mine: Optional[str] = None) -> None:
    """Refuse a weight group whose two ends run different NCCL versions (NCCL would refuse the
    communicator at its first collective). A server's version is its `/server_info` `nccl_version`
    (the built-in server reports it), else `$SGLANG_NCCL_VERSION` or the file
    `$SGLANG_NCCL_VERSION_FILE` (the image records SGLang's at build time); when neither is known the
    check is skipped with a warning."""
    from megatron_bapo.weight_update import nccl_version

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


class NullDelivery:
    """Ranks above 0: the export's gathers run; nothing is delivered from here."""

    @contextlib.contextmanager
    def update(self, version: int) -> Iterator[NullSink]:
        yield NullSink()

    def close(self) -> None:
        return None
