"""Rank 0's rollout servers: the built-in ones it starts (and restarts), or external SGLang servers,
and the one client that reaches them.

    pool = ServerPool(rollout_config, model_path=..., seed=..., log_dir=..., state_path=...)
    pool.start()                    # built-in servers on loopback unless rollout.client names servers
    pool.ensure_alive()             # before a round and before a weight update: restart dead ones
    pool.client                     # generation, control, sync and evaluation all go through it
    pool.close()                    # abort in flight, close the client, stop the servers it started

`required_server_flags` lists the launch flags the sync and the client rely on; the built-in
servers get them here, `examples/run_32b_bapo.sh` passes the same to `sglang.launch_server`, and
`sync.delivery` checks them in every server's `/server_info` before the first update.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Optional

from megatron_bapo import run_state
from megatron_bapo.rollout.client import API_KEY_ENV, RolloutClient
from megatron_bapo.rollout.errors import RolloutError

logger = logging.getLogger(__name__)


def required_server_flags(*, deterministic_inference: bool, pause_mode: Optional[str],
                          routed_experts: bool = False) -> list[str]:
    """SGLang launch flags the run relies on: `--enable-deterministic-inference` when requests carry a
    `sampling_seed` (SGLang ignores the seed without it), `--disable-radix-cache` under the "in_place"
    pause (the update cannot flush KV the old weights computed, so no cache may keep it),
    `--enable-return-routed-experts` when requests ask for the MoE routing (ignored without it; the
    client then stops the run naming the flag)."""
    flags = []
    if deterministic_inference:
        flags.append("--enable-deterministic-inference")
    if pause_mode == "in_place":
        flags.append("--disable-radix-cache")
    if routed_experts:
        flags.append("--enable-return-routed-experts")
    return flags


class ServerPool:
    """Owns the rollout servers of a run and its client (global rank 0)."""

    def __init__(self, rollout: Any, *, model_path: str, seed: int, log_dir: Path, state_path: Path,
                 server_flags: tuple[str, ...] = (), vocab_size: Optional[int] = None,
                 weight_version: Optional[int] = None) -> None:
        """`vocab_size` and `weight_version` (the trainer's version at start) bound what the client
        accepts in replies (`protocol.parse_generate_reply`)."""
        self.rollout = rollout
        self.vocab_size, self.weight_version = vocab_size, weight_version
        self.model_path = model_path
        self.seed = seed
        self.log_dir = log_dir
        self.state_path = state_path
        self.server_flags = list(server_flags)
        self.servers: list[Any] = []
        self.restarts: list[int] = []
        """Restarts so far of each built-in server (rollout.max_server_restarts bounds them)."""
        self.num_restarted = 0
        """Servers restarted so far in total: a weight group built before a restart lacks the new one."""
        self.latest_disk_weights: Optional[tuple[str, int]] = None
        """The newest HF directory every server loaded, and its version (a restarted server loads it)."""
        self.version = 0
        """The version every server serves (0: `model_path` as started); set by each delivered update."""
        self.client: Optional[RolloutClient] = None

    # ------------------------------------------------------------------ start / stop
    def start(self) -> RolloutClient:
        client_cfg = self.rollout.client
        if not client_cfg.urls and not client_cfg.router_url:
            self.servers = [self._start_server(i) for i in range(self.rollout.num_builtin_servers)]
            self.restarts = [0] * len(self.servers)
            self._write_servers()
            client_cfg = dataclasses.replace(client_cfg, urls=[s.url for s in self.servers])
            logger.info("built-in rollout servers: %s", ", ".join(client_cfg.urls))
        self.client = RolloutClient(client_cfg, vocab_size=self.vocab_size, weight_version=self.weight_version)
        self.client.wait_healthy()
        return self.client

    def _start_server(self, i: int, port: Optional[int] = None) -> Any:
        from megatron_bapo.server.launch import start_server

        log_path = self.log_dir / f"server_{i}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        args = ["--random-seed", str(self.seed + i), "--weight-version", "0", "--dtype",
                self.rollout.builtin_server_dtype, *self.server_flags]
        key = self.rollout.client.api_key or os.environ.get(API_KEY_ENV)
        if key:
            args += ["--api-key", key]
        return start_server(self.model_path, port=port, log_path=log_path, extra_args=args,
                            startup_timeout_s=self.rollout.client.health_timeout_s)

    def _write_servers(self) -> None:
        # PIDs on disk: operators (and the kill-and-resume test) can see what this run started.
        run_state.write_json_atomic(self.state_path, [{"url": s.url, "pid": s.pid} for s in self.servers])

    def close(self) -> None:
        """Abort what is in flight, close the client, stop the built-in servers (by PID)."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.abort_all()
            with contextlib.suppress(Exception):
                self.client.close()
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop()

    # ------------------------------------------------------------------ restarts
    def any_dead(self) -> bool:
        return any(not s.alive() for s in self.servers)

    def ensure_alive(self, *, updating: bool = False) -> list[str]:
        """Restart (on the same port) every built-in server whose process died, at most
        `rollout.max_server_restarts` times each, and bring it to the version the others serve.
        `updating`: the caller is about to deliver a new version to every server (a distributed sync
        then needs no copy of the current one). Returns the URLs restarted; raises RolloutError naming
        a server out of restarts, or one that cannot be given the current version."""
        restarted = []
        for i, server in enumerate(self.servers):
            if server.alive():
                continue
            if self.restarts[i] >= self.rollout.max_server_restarts:
                raise RolloutError(f"built-in server {server.url} died again (exit code {server.proc.returncode}) after "
                                   f"{self.restarts[i]} restart(s) (rollout.max_server_restarts); its log: "
                                   f"{server.log_path}")
            self.restarts[i] += 1
            logger.warning("built-in server %s (pid %d) died with exit code %s; restarting it (%d of %d)", server.url,
                           server.pid, server.proc.returncode, self.restarts[i], self.rollout.max_server_restarts)
            self.servers[i] = self._start_server(i, port=server.port)
            restarted.append(server.url)
        if restarted:
            self.num_restarted += len(restarted)
            self._write_servers()
            self._give_current_version(restarted, updating=updating)
            self.client.wait_healthy()
        return restarted

    def _give_current_version(self, restarted: list[str], *, updating: bool) -> None:
        """A restarted server starts from `model_path` as version 0; bring it to `self.version` (the
        disk sync's newest directory) or stop: serving the base model as a later version's stand-in
        would label every token with a stale version (regenerated forever) or train on the wrong policy."""
        if self.version == 0:
            return
        if self.latest_disk_weights is None or self.latest_disk_weights[1] != self.version:
            if updating:  # the update about to run gives every server the next version
                return
            raise RolloutError(
                f"built-in server(s) {', '.join(restarted)} restarted, but version {self.version} exists on no disk "
                f"(sync.method=distributed sends weights only during a sync), so they would serve {self.model_path} "
                f"as version 0; rerun with --resume (the resume's first sync gives every server the checkpoint's "
                f"weights) or use sync.method=disk")
        path, version = self.latest_disk_weights
        if not Path(path).is_dir():
            raise RolloutError(f"built-in server(s) {', '.join(restarted)} restarted, but version {version}'s "
                               f"weights {path} are gone, so they would serve {self.model_path} as version 0; "
                               f"rerun with --resume (the resume's first sync rewrites them)")
        try:
            self.client.update_weights_from_disk(path, version, only=restarted)
        except RolloutError as exc:
            raise RolloutError(f"built-in server(s) {', '.join(restarted)} restarted but could not load version "
                               f"{version} from {path}: {exc}") from exc
        logger.info("restarted server(s) %s now serve version %d (%s)", ", ".join(restarted), version, path)
