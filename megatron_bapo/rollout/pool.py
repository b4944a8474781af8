"""Rank 0's rollout servers and everything that reaches them: the one owner of their life and state.

    pool = ServerPool(rollout_config, sync_config, model_path=..., seed=..., log_dir=..., state_path=...)
    pool.start()                         # rollout.engine servers on loopback unless rollout.client names servers
    pool.client                          # generation, control and evaluation go through it
    pool.version                         # the weight version every server serves (the one place it lives)
    with pool.update(version, probe) as session:     # restart dead servers, check flags, pause, begin
        export.run(version, session)                 # session.load_from_disk(dir) / session.send(bucket)
    # exit: end the session, verify (sync.verify), continue; `pool.version` is `version` once it succeeded
    pool.retry_after_restart(call)       # call(); if it failed because a server it started died: restart, call again
    pool.close()                         # abort in flight, leave the weight group, stop the servers it started

Roles: this class runs every pool (`role`): the policy's, and other models' (`rollout.roles`: teacher,
judge), which are never weight-synced: `update` is refused, no weight group, version 0 throughout.

Which servers? With `rollout.client.urls` (or `router_url`) empty the pool starts
`rollout.num_builtin_servers` of `rollout.engine`: built-in servers, or real SGLang servers
(`rollout.sglang_launch`: CPU, or the GPUs `rollout.sglang.gpu_ids` names), each with the flags
below, and restarts a crashed one on its port with the served weights, the same way for both.

Who talks to the servers? This class (through its `client`, and its weight group for the
distributed sync). `megatron_bapo.sync` is what every actor rank does (gather, bucket, write or
broadcast); rank 0's export hands its result to the session above, the other ranks' to a `NullSink`.

An update follows SGLang 0.5.23 (spec sections 9, 10, 12):
- pause: `sync.pause_mode` null = none (every update call takes the server's writer lock and waits
  for the generation in flight); otherwise `/pause_generation {"mode": ...}` first and
  `/continue_generation` last, even when the update fails;
- distributed: `/begin_weight_update` on every server, then per bucket `/update_weights_from_distributed`
  + the broadcast (`rollout.weight_group`), then `/end_weight_update` (also after a failure). The
  weight group is built at the first update and rebuilt after a server restart; it refuses an NCCL
  mismatch between this process and the servers;
- flush: every update says `flush_cache` explicitly (`weight_update.flushes_cache`): true except
  under the "in_place" pause, where SGLang refuses it; only the last bucket of a distributed update flushes;
- disk: `/update_weights_from_disk`; a server the pool started that died during it is restarted and
  every server loads the version again (the directory is complete on disk).
After an update, and after every restart, the servers' weights are checked (`sync.verify`,
`megatron_bapo.sync.verify`) while rollout requests wait in the client; a failing server is restarted
once with the current weights (the crash path), a second failure stops the run (`rollout/pool_checks.py`).
Before the first update every server's `/server_info` must show the flags the run relies on
(`required_server_flags`): a seed SGLang would ignore, or KV an in-place pause could not flush, is
refused there instead of silently changing what is trained. The servers the pool starts get the
same flags here, and `examples/run_32b_bapo.sh` passes them to `sglang.launch_server`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, TypeVar

from megatron_bapo import run_state
from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.client import API_KEY_ENV, RolloutClient
from megatron_bapo.rollout.errors import RolloutError
from megatron_bapo.rollout.server_layout import weight_group_ranks
from megatron_bapo.rollout.sglang_launch import required_server_flags
from megatron_bapo.rollout.pool_checks import WeightChecks
from megatron_bapo.sync.verify import Probe, ResendWeights, Verifier
from megatron_bapo.weight_update import flushes_cache

if TYPE_CHECKING:
    from megatron_bapo.config import RolloutConfig
    from megatron_bapo.sync.config import SyncConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")
POLICY = "policy"
"""The role of the pool whose servers serve the policy being trained (the only weight-synced one)."""


@dataclasses.dataclass(frozen=True)
class ServedWeights:
    """What every server serves: a weight version and, when one exists, the HF directory holding it
    (the disk sync's newest; None under the distributed sync, which keeps no copy outside a sync)."""

    version: int
    path: Optional[str] = None


class ServerPool(WeightChecks):
    """Owns the rollout servers of a run (global rank 0): start, restart, pause, update, version."""

    def __init__(self, rollout: "RolloutConfig", sync: Optional["SyncConfig"] = None, *, model_path: str, seed: int,
                 log_dir: Path, state_path: Path, vocab_size: Optional[int] = None,
                 weight_version: Optional[int] = None, role: str = POLICY) -> None:
        """`rollout`: the servers, the client and the flags requests rely on (`deterministic_inference`,
        `return_routed_experts`): the `rollout` section or a `rollout.roles.ServerRoleConfig`; `sync`: how
        updates reach the servers (default `SyncConfig()`). `vocab_size` and `weight_version` (the
        trainer's version at start) bound what the client accepts in replies (`protocol.parse_generate_reply`).
        `role`: "policy" (weight-synced) or another model's pool (never: module docstring)."""
        from megatron_bapo.sync.config import SyncConfig

        self.role, self.weight_synced = role, role == POLICY  # only the policy's servers are updated
        self.rollout, self.sync = rollout, sync or SyncConfig()
        self.vocab_size, self.weight_version = vocab_size, weight_version
        self.model_path, self.seed, self.log_dir, self.state_path = model_path, seed, log_dir, state_path
        self.server_flags = required_server_flags(deterministic_inference=rollout.deterministic_inference,
                                                  pause_mode=self.sync.pause_mode,
                                                  routed_experts=rollout.return_routed_experts)
        self.servers: list[Any] = []
        self.restarts: list[int] = []
        """Restarts so far of each server it started (rollout.max_server_restarts bounds them)."""
        self.num_restarted = 0
        """Servers restarted so far in total: a weight group built before a restart lacks the new one."""
        self.served = ServedWeights(0, None)
        """What every server serves (version 0: `model_path` as started); set by each completed update."""
        self.client: Optional[RolloutClient] = None
        self._gpus: Optional[list[list[int]]] = None  # each started SGLang server's GPUs (engine sglang on GPUs)
        self._sender: Any = None  # rollout.weight_group.DistributedWeightSender, built at the first update
        self._group_restarts = -1
        self._checked = False
        self.verifier = Verifier(self.sync, model_path)
        """What the served version must show (`sync.verify`), and the check of a server against it."""
        self._check_restarts: dict[str, int] = {}  # url -> the version a failed check restarted it at

    @property
    def kind(self) -> str:
        """What the servers it starts are, for messages: "built-in server" or "SGLang server" (with the
        role in front for a pool other than the policy's: "teacher SGLang server")."""
        kind = "SGLang server" if self.rollout.engine == "sglang" else "built-in server"
        return kind if self.weight_synced else f"{self.role} {kind}"

    @property
    def version(self) -> int:
        """The weight version every server serves: the version new rollout rounds are labelled with."""
        return self.served.version

    # ------------------------------------------------------------------ start / stop
    def start(self) -> RolloutClient:
        client_cfg = self.rollout.client
        external = bool(client_cfg.urls or client_cfg.router_url)
        if external or self.rollout.engine == "sglang":
            self._refuse_headless_model()
        if not external:
            self._gpus = self._server_gpus()
            self.servers = [self._start_server(i) for i in range(self.rollout.num_builtin_servers)]
            self.restarts = [0] * len(self.servers)
            self._write_servers()
            client_cfg = dataclasses.replace(client_cfg, urls=[s.url for s in self.servers])
            logger.info("%s %s servers: %s", self.rollout.engine, "rollout" if self.weight_synced else self.role,
                        ", ".join(client_cfg.urls))
        self.client = RolloutClient(client_cfg, vocab_size=self.vocab_size, weight_version=self.weight_version)
        self.client.process_exit = self._exit_code_of  # a round fails at once on a dead server: restart it
        self.client.wait_healthy()
        return self.client

    def _exit_code_of(self, url: str) -> Optional[int]:
        """The exit code of the server this pool started at `url` once it died; None while it runs
        (or for a URL it did not start). Called from the client's event-loop thread."""
        for server in list(self.servers):
            if server.url == url and not server.alive():
                return server.proc.returncode
        return None

    def _start_server(self, i: int, port: Optional[int] = None) -> Any:
        """Start server `i` of `rollout.engine` (on `port`: a restart keeps its URL) and wait for its
        health; both engines get the run's flags, seed, version 0 and API key."""
        log_path = self.log_dir / (f"server_{i}.log" if self.weight_synced else f"{self.role}_server_{i}.log")
        log_path.parent.mkdir(parents=True, exist_ok=True)
        key = self.rollout.client.api_key or os.environ.get(API_KEY_ENV)
        timeout = self.rollout.client.health_timeout_s
        if self.rollout.engine == "sglang":
            from megatron_bapo.rollout.sglang_launch import start_sglang_server

            return start_sglang_server(self.rollout.sglang, model_path=self.model_path, log_path=log_path,
                                       random_seed=self.seed + i, flags=self.server_flags, port=port, api_key=key,
                                       gpus=self._gpus[i] if self._gpus else None, startup_timeout_s=timeout)
        from megatron_bapo.server.launch import start_server

        args = ["--random-seed", str(self.seed + i), "--weight-version", "0", "--dtype",
                self.rollout.builtin_server_dtype, *self.server_flags]
        if self.rollout.builtin_server_decode_delay_ms:
            args += ["--decode-delay-ms", str(self.rollout.builtin_server_decode_delay_ms)]
        if key:
            args += ["--api-key", key]
        return start_server(self.model_path, port=port, log_path=log_path, extra_args=args, startup_timeout_s=timeout)

    def _refuse_headless_model(self) -> None:
        """SGLang (the servers it starts, or external ones) would serve `model_path` with a zero output
        head when it is a tied checkpoint of a family whose SGLang model ignores the tie (Qwen3-MoE):
        refuse it, naming the fix (exports, and so every synced version, write the head)."""
        from megatron_bapo.convert.families import headless_for_sglang

        arch = headless_for_sglang(self.model_path)
        if arch:
            field = "model.hf_path" if self.weight_synced else f"{self.role}.model_path"
            raise ConfigError(
                f"{field}={self.model_path} is a {arch} checkpoint with tied embeddings and no lm_head.weight: "
                f"SGLang's model for it ignores tie_word_embeddings and would serve a zero output head (every token "
                f"at -log(vocab)); write the head (tools/convert_hf.py --to-megatron, then --to-hf, writes "
                f"lm_head.weight) or use rollout.engine=builtin")

    def _server_gpus(self) -> Optional[list[list[int]]]:
        """Each SGLang server's GPUs (`rollout.sglang.gpu_ids`: ids of the devices this process sees, which
        `sglang_launch` maps through its CUDA_VISIBLE_DEVICES), None for CPU servers."""
        if self.rollout.engine != "sglang" or self.rollout.sglang.resolved_device() != "cuda":
            return None
        import torch

        from megatron_bapo.rollout.sglang_launch import server_gpus

        return server_gpus(self.rollout.sglang, self.rollout.num_builtin_servers,
                           num_visible=torch.cuda.device_count())

    def _write_servers(self) -> None:
        # PIDs on disk: operators (and the kill-and-resume test) can see what this run started.
        run_state.write_json_atomic(self.state_path, [{"url": s.url, "pid": s.pid} for s in self.servers])

    def close(self) -> None:
        """Abort what is in flight, leave the weight group, close the client, stop the servers it started (by PID)."""
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.abort_all()
        if self._sender is not None:
            with contextlib.suppress(Exception):
                self._sender.close()
            self._sender = None
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop()

    # ------------------------------------------------------------------ restarts
    def any_dead(self) -> bool:
        return any(not s.alive() for s in self.servers)

    def ensure_alive(self, *, updating: bool = False) -> list[str]:
        """Restart (on the same port) every server it started whose process died, at most
        `rollout.max_server_restarts` times each, and bring it to the version the others serve.
        `updating`: the caller is about to deliver a new version to every server (a distributed sync
        then needs no copy of the current one). Returns the URLs restarted; raises RolloutError naming
        a server out of restarts, or one that cannot be given the current version."""
        restarted = [self._restart(i, f"died with exit code {s.proc.returncode}", f"died again (exit code "
                                   f"{s.proc.returncode})") for i, s in enumerate(self.servers) if not s.alive()]
        if restarted:
            self._give_current_version(restarted, updating=updating)
            self.client.wait_healthy()
            if not updating:  # checked before it takes requests (an update checks every server itself)
                self._verify(restarted, self.version)
        return restarted

    def _restart(self, i: int, why: str, why_again: str) -> str:
        """Stop server `i` if it still runs and start it again on its port (counted against
        `rollout.max_server_restarts`); its URL. The caller gives it the current version."""
        server = self.servers[i]
        if self.restarts[i] >= self.rollout.max_server_restarts:
            raise RolloutError(f"{self.kind} {server.url} {why_again} after {self.restarts[i]} restart(s) "
                               f"({'rollout' if self.weight_synced else self.role}.max_server_restarts); its log: "
                               f"{server.log_path}")
        self.restarts[i] += 1
        logger.warning("%s %s (pid %d) %s; restarting it (%d of %d)", self.kind, server.url, server.pid, why,
                       self.restarts[i], self.rollout.max_server_restarts)
        server.stop()
        self.servers[i] = self._start_server(i, port=server.port)
        self.num_restarted += 1
        self._write_servers()
        return server.url

    def retry_after_restart(self, call: Callable[[], T], *, updating: bool = False,
                            before_retry: Optional[Callable[[], None]] = None) -> T:
        """`call()`; when it raises RolloutError because a server it started died, restart the dead ones
        (`ensure_alive`, which brings them to the served version), run `before_retry` and call again.
        The one place a failed call meets a restart: a failure with every server alive (an external
        server, a rejected request), or a server out of restarts, raises."""
        while True:
            try:
                return call()
            except RolloutError:
                if not self.any_dead() or not self.ensure_alive(updating=updating):
                    raise
                if before_retry is not None:
                    before_retry()

    def _give_current_version(self, restarted: list[str], *, updating: bool) -> None:
        """A restarted server starts from `model_path` as version 0; bring it to `self.version` (the
        disk sync's newest directory) or stop: serving the base model as a later version's stand-in
        would label every token with a stale version (regenerated forever) or train on the wrong policy."""
        version, path = self.served.version, self.served.path
        if version == 0:
            return
        if path is None:
            if updating:  # the update about to run gives every server the next version
                return
            raise RolloutError(
                f"{self.kind}(s) {', '.join(restarted)} restarted, but version {version} exists on no disk "
                f"(sync.method=distributed sends weights only during a sync), so they would serve {self.model_path} "
                f"as version 0; rerun with --resume (the resume's first sync gives every server the checkpoint's "
                f"weights) or use sync.method=disk")
        if not Path(path).is_dir():
            raise RolloutError(f"{self.kind}(s) {', '.join(restarted)} restarted, but version {version}'s "
                               f"weights {path} are gone, so they would serve {self.model_path} as version 0; "
                               f"rerun with --resume (the resume's first sync rewrites them)")
        try:
            self.client.update_weights_from_disk(path, version, only=restarted)
        except RolloutError as exc:
            raise RolloutError(f"{self.kind}(s) {', '.join(restarted)} restarted but could not load version "
                               f"{version} from {path}: {exc}") from exc
        logger.info("restarted server(s) %s now serve version %d (%s)", ", ".join(restarted), version, path)

    # ------------------------------------------------------------------ weight updates
    @contextlib.contextmanager
    def update(self, version: int, probe: Optional[Probe] = None) -> Iterator["UpdateSession"]:
        """One update of every server to `version` (see the module docstring); the session is the
        export's sink. `self.version` becomes `version` when the update completed. `probe`: the
        actor's log-probs of the probe sequence (`sync.verify=probe`; without it nothing is checked).
        Refused (RolloutError) on a pool that is not the policy's: nothing reaches its servers."""
        if not self.weight_synced:
            raise RolloutError(f"the {self.role} pool is not weight-synced: its servers serve {self.model_path} as "
                               f"version 0 for the whole run (only the policy's pool is updated)")
        self.ensure_alive(updating=True)
        if not self._checked:
            self._check_servers()
        client, mode = self.client, self.sync.pause_mode
        session = UpdateSession(self, version)
        verifying = self.verifier.begin(probe)
        if mode is not None:
            client.pause_generation(mode)
        elif verifying:  # requests wait in the client until the new weights passed the check
            client.hold_generation()
        held = verifying
        try:
            if self.sync.method == "distributed":
                self._ensure_group()
                client.run(client.abegin_weight_update(), timeout=self.sync.group_timeout_s)
                try:
                    yield session
                finally:
                    client.run(client.aend_weight_update(), timeout=self.sync.group_timeout_s)
                self.served = ServedWeights(version, None)
                logger.info("weight sync v%s: %d tensors over %s", version, session.num_tensors, self.sync.backend)
            else:
                yield session
            self.verifier.delivered()
            if verifying:
                if mode is not None and self.sync.verify == "probe":  # the probe is a generation: servers run
                    client.continue_generation(release=False)
                    mode = None
                self._verify(client.worker_urls(), version)
        except ResendWeights:
            held = False  # requests keep waiting: the version is sent again at once
            raise
        finally:
            if mode is not None:
                client.continue_generation(release=held or not verifying)
            if held:
                client.release_generation()

    def _load_from_disk(self, path: Path, version: int) -> None:
        """Every server loads the complete HF directory `path` as `version`; a started server that
        died during the load is restarted and every server loads it again."""
        where = str(Path(path).absolute())
        flush = flushes_cache(self.sync.pause_mode)
        self.retry_after_restart(lambda: self.client.update_weights_from_disk(where, version, flush_cache=flush),
                                 updating=True)
        self.served = ServedWeights(version, where)
        logger.info("weight sync v%s: %s loaded", version, path)

    def _server_infos(self) -> dict[str, dict]:
        """Every server's `/server_info` (a started server can die after `ensure_alive` looked)."""
        return self.retry_after_restart(lambda: self.client.run(self.client.aget_server_info()), updating=True)

    def _check_servers(self) -> None:
        """Every server runs with the flags this run relies on (see the module docstring)."""
        infos = self._server_infos()
        self.verifier.set_servers(infos)
        for url, info in infos.items():
            if self.rollout.deterministic_inference and not info.get("enable_deterministic_inference"):
                raise ConfigError(f"rollout.deterministic_inference is true but server {url} runs without "
                                  f"--enable-deterministic-inference, so it would ignore every sampling_seed; "
                                  f"launch it with that flag or set rollout.deterministic_inference=false")
            if self.sync.pause_mode == "in_place" and not info.get("disable_radix_cache"):
                raise ConfigError(f"sync.pause_mode=in_place but server {url} keeps a radix cache: the update cannot "
                                  f"flush it while requests hold KV, so later requests would reuse KV of older "
                                  f"weights; launch it with --disable-radix-cache or use sync.pause_mode=retract")
        self._checked = True

    def _ensure_group(self) -> None:
        """The distributed weight group with every server, (re)built when a server restarted since."""
        if self._sender is not None and self._group_restarts == self.num_restarted:
            return
        from megatron_bapo.rollout.weight_group import DistributedWeightSender, check_nccl

        if self._sender is not None:  # a restarted server is not in the old group
            self._sender.close()
            self._sender = None
        infos = self._server_infos()
        urls = self.client.worker_urls()
        if self.sync.backend == "nccl":
            check_nccl(infos)
        self._clear_stale_groups()
        sender = DistributedWeightSender(self.client, backend=self.sync.backend, master_address=self.sync.master_address,
                                         master_port=int(self.sync.master_port), timeout_s=self.sync.group_timeout_s)
        sender.connect(weight_group_ranks(infos, urls))
        self._sender, self._group_restarts = sender, self.num_restarted


    def _clear_stale_groups(self) -> None:
        """Servers outlive trainers: before joining, end any open update session and destroy any group
        of our name on every server (left by a trainer that died; SGLang keeps both, and refuses a new
        join under that name until the group is destroyed). One line names what each server held."""
        from megatron_bapo.weight_update import DEFAULT_GROUP

        held = self.client.run(self.client.aclear_weight_group(DEFAULT_GROUP), timeout=self.sync.group_timeout_s)
        for url, what in held.items():
            if what:
                logger.warning("server %s still held %s of an earlier trainer (one that died): closed before joining "
                               "this run's weight group", url, " and ".join(what))


class UpdateSession:
    """The sink of one update on rank 0 (`sync.export.Sink`): what the export hands over goes to every server."""

    def __init__(self, pool: ServerPool, version: int) -> None:
        self.pool, self.version = pool, version
        self.num_tensors = 0

    def load_from_disk(self, path: Path, version: int) -> None:
        self.pool._load_from_disk(path, version)
        self.pool.verifier.loaded(path)

    def send(self, bucket: list, *, last: bool) -> int:
        """One bucket of (hf_name, tensor) to every server; the last carries the version and the flush."""
        sent = self.pool._sender.send(bucket, weight_version=str(self.version) if last else None,
                                      flush_cache=last and flushes_cache(self.pool.sync.pause_mode))
        self.pool.verifier.sent(bucket)  # sync.verify=checksum: hashed while the tensors are valid
        self.num_tensors += sent
        return sent
