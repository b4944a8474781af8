"""Rank 0's half of the RL loop: servers, the one client, data, rollout, rewards, ledger, eval, metrics.

The actor ranks (`megatron_bapo.trainer`) only train and sync weights; everything that talks to
the rollout servers or the disk on behalf of the whole job lives here, on global rank 0:

    driver = Driver(config, output_dir)
    driver.start(saved_state, step=.., version=..)   # servers, client, dataset, rollout producer, writers
    driver.start_rollout()                    # once the servers hold the weights to sample from
    batch, metrics = driver.next_batch(step, version)   # a finished round -> rewards -> actor batch
    driver.published(version)                 # after the weight sync: new rounds use `version`
    driver.end_step(step, metrics)            # log, eval when due
    driver.state_dict()                       # data position, partial-rollout buffer, rounds ahead
    driver.close()

Rollout runs through `rollout.RolloutProducer`: with `trainer.async_steps` = 0 it produces each
round when the trainer asks for it (the synchronous loop); with k > 0 it runs k rounds ahead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import logging
import time
from pathlib import Path
from typing import Any, Optional

from megatron_bapo import run_state
from megatron_bapo.config import RunConfig
from megatron_bapo.config_io import ConfigError
from megatron_bapo.experience import build_experience
from megatron_bapo.metrics import MetricsWriter
from megatron_bapo.rollout.client import API_KEY_ENV

logger = logging.getLogger(__name__)


class Driver:
    """Owns everything rank 0 does besides training; see the module docstring."""

    def __init__(self, config: RunConfig, output_dir: Path) -> None:
        self.config = config
        self.output_dir = output_dir
        self.servers: list[Any] = []
        self.server_restarts: list[int] = []
        """Restarts so far of each built-in server (rollout.max_server_restarts bounds them)."""
        self._restarted = False
        """A server was restarted since the last `take_restarted()`."""
        self.client: Any = None
        self.producer: Any = None
        self.writer: Optional[MetricsWriter] = None

    # ------------------------------------------------------------------ setup / teardown
    def start(self, state: dict[str, Any], *, step: int, version: int) -> None:
        """Start the servers and the client; restore data, rollout buffer and rounds from `state`."""
        from transformers import AutoTokenizer

        from megatron_bapo.data import PromptDataset
        from megatron_bapo.rollout import PartialRolloutManager, RolloutClient
        from megatron_bapo.rollout.producer import RolloutProducer

        cfg, ro = self.config, self.config.rollout
        self._preflight()
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        self.dataset = PromptDataset(cfg.data, self.tokenizer)
        client_cfg = ro.client
        if not client_cfg.urls and not client_cfg.router_url:
            client_cfg = dataclasses.replace(client_cfg, urls=self._start_builtin_servers())
        self.client = RolloutClient(client_cfg)
        self.client.wait_healthy()
        self._check_context()
        manager = PartialRolloutManager(self.client, ro, seed=cfg.trainer.seed)
        self.producer = RolloutProducer(self.client, manager, lambda: self.dataset.next_batch(ro.prompts_per_step),
                                        ahead=cfg.trainer.async_steps, version=version)
        if state:
            self.dataset.load_state_dict(state["data"])
            manager.load_state_dict(state["rollout"])
            self.producer.load_state_dict(state.get("rounds", {}))
        # Resumed: drop the steps after the checkpoint (they are redone). Started over in a used
        # directory: drop the earlier run's metrics, as its samples.jsonl is, or curves would mix.
        self.writer = MetricsWriter(self.output_dir / "tb", purge_step=step + 1 if state else 0)
        self.ledger = SampleLedger(self.output_dir / "samples.jsonl", resume_step=step if state else None)

    def _preflight(self) -> None:
        """What would otherwise fail only after the model loads (minutes on a cluster): paths and the
        reward functions. Errors name the field and are one line."""
        from megatron_bapo.rewards import load_reward_fn

        cfg = self.config
        if not Path(cfg.data.path).exists():
            raise ConfigError(f"data.path={cfg.data.path!r} does not exist")
        load_reward_fn(cfg.reward.fn)  # RewardSpecError naming reward.fn
        if cfg.eval.every_n_steps and cfg.eval.datasets:
            for i, ds in enumerate(cfg.eval.datasets):
                if not Path(ds.path).exists():
                    raise ConfigError(f"eval.datasets[{i}].path={ds.path!r} does not exist")
            if isinstance(cfg.eval.reward, str):
                load_reward_fn(cfg.eval.reward)

    def _check_context(self) -> None:
        """The longest prompt plus `rollout.max_response_tokens` must fit every server's context;
        otherwise every request would come back 400 and the run would train nothing."""
        ro = self.config.rollout
        longest = max(len(p.prompt_ids) for p in self.dataset.prompts)
        prompt = max(longest, self.config.data.max_prompt_tokens or 0)
        for url, info in self.client.run(self.client.aget_server_info()).items():
            max_input = info.get("max_req_input_len")
            ctx = info.get("context_length") or (max_input + 1 if max_input else None)
            if ctx and prompt + ro.max_response_tokens > ctx:
                raise ConfigError(
                    f"rollout.max_response_tokens={ro.max_response_tokens} + the longest prompt ({prompt} tokens, "
                    f"data.max_prompt_tokens={self.config.data.max_prompt_tokens}) = {prompt + ro.max_response_tokens} "
                    f"exceeds the context length {ctx} of server {url}: every request would be rejected. Lower "
                    f"rollout.max_response_tokens or data.max_prompt_tokens, or serve a longer context")

    def start_rollout(self) -> None:
        """Start producing rounds (after the servers hold the weights to sample from)."""
        self.producer.start()

    def _start_server(self, i: int, port: Optional[int] = None) -> Any:
        from megatron_bapo.server.launch import start_server

        cfg = self.config
        log_path = self.output_dir / "logs" / f"server_{i}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        args = ["--random-seed", str(cfg.trainer.seed + i), "--weight-version", "0"]  # its weights: model.hf_path
        key = cfg.rollout.client.api_key or os.environ.get(API_KEY_ENV)
        if key:
            args += ["--api-key", key]
        return start_server(cfg.model.hf_path, port=port, log_path=log_path, extra_args=args,
                            startup_timeout_s=cfg.rollout.client.health_timeout_s)

    def _write_servers(self) -> None:
        # PIDs on disk: operators (and the kill-and-resume test) can see what this run started.
        run_state.write_json_atomic(self.output_dir / "servers.json", [{"url": s.url, "pid": s.pid} for s in self.servers])

    def _start_builtin_servers(self) -> list[str]:
        self.servers = [self._start_server(i) for i in range(self.config.rollout.num_builtin_servers)]
        self.server_restarts = [0] * len(self.servers)
        self._write_servers()
        urls = [s.url for s in self.servers]
        logger.info("built-in rollout servers: %s", ", ".join(urls))
        return urls

    def restart_dead_servers(self, version: int) -> list[str]:
        """Restart (on the same port) every built-in server whose process died, at most
        `rollout.max_server_restarts` times each, and give it the newest synced weights when they
        are on disk. Returns the URLs restarted; raises RolloutError naming a server out of restarts."""
        from megatron_bapo.rollout.errors import RolloutError

        restarted = []
        for i, server in enumerate(self.servers):
            if server.alive():
                continue
            if self.server_restarts[i] >= self.config.rollout.max_server_restarts:
                raise RolloutError(f"built-in server {server.url} died again (exit code {server.proc.returncode}) after "
                                   f"{self.server_restarts[i]} restart(s) (rollout.max_server_restarts); its log: "
                                   f"{server.log_path}")
            self.server_restarts[i] += 1
            logger.warning("built-in server %s (pid %d) died with exit code %s; restarting it (%d of %d)", server.url,
                           server.pid, server.proc.returncode, self.server_restarts[i],
                           self.config.rollout.max_server_restarts)
            self.servers[i] = self._start_server(i, port=server.port)
            restarted.append(server.url)
        if restarted:
            self._write_servers()
            latest = self.output_dir / "hf_sync" / f"v{version:06d}"
            if version > 0 and (latest / "config.json").exists():  # disk sync: serve the newest weights now
                self.client.update_weights_from_disk(str(latest.absolute()), version, only=restarted)
            self.client.wait_healthy()
        return restarted

    def ensure_servers(self, version: int) -> None:
        """Restart built-in servers that died (before a round and before a weight sync)."""
        if self.servers and self.restart_dead_servers(version):
            self._restarted = True

    def take_restarted(self) -> bool:
        """True once after servers were restarted (a distributed weight group must be rebuilt)."""
        flag, self._restarted = self._restarted, False
        return flag

    def close(self) -> None:
        """Stop producing, close the client, stop the built-in servers (by PID), close the writer."""
        if self.producer is not None:
            self.producer.stop()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.abort_all()
            with contextlib.suppress(Exception):
                self.client.close()
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.stop()
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------------ one step
    def next_batch(self, step: int, version: int) -> tuple[Optional[dict], dict[str, float]]:
        """The next finished round as the actor's batch (None when no group is usable) and its metrics.

        A built-in server that died is restarted first (and a round that failed because of it is
        produced again: its samples stayed buffered); a round whose requests the servers mostly
        rejected stops the run with their message (`rollout.max_failed_group_rate`).
        """
        from megatron_bapo.rollout.errors import RolloutError

        cfg = self.config
        while True:
            self.ensure_servers(version)
            try:
                done, waited = self.producer.next(version)
                break
            except RolloutError:
                if not self.servers or all(s.alive() for s in self.servers):
                    raise  # external servers (named in the error), or no dead built-in server to restart
                self.producer.restart()
        self._check_rejections(done)
        t0 = time.monotonic()
        batch, metrics = build_experience(done.groups, self.tokenizer, cfg.reward, cfg.advantage,
                                          n_minibatches=cfg.actor.n_minibatches,
                                          temperature=cfg.rollout.sampling.temperature)
        self.ledger.record(step, done.prompts, done.groups)
        metrics.update(done.metrics)
        metrics.update(self.dataset.metrics())
        metrics.update({"timing/rollout_s": done.metrics.get("rollout/step_s", 0.0), "timing/rollout_wait_s": waited,
                        "timing/reward_s": time.monotonic() - t0})
        return batch, metrics

    def _check_rejections(self, done: Any) -> None:
        from megatron_bapo.rollout.errors import RolloutError

        failed = int(done.metrics.get("rollout/num_groups_failed", 0))
        total = failed + len(done.groups)
        if failed and failed > self.config.rollout.max_failed_group_rate * total:
            raise RolloutError(
                f"the servers rejected (4xx) the requests of {failed} of {total} groups this step, so they were dropped; "
                f"first rejection: {done.rejections[0] if done.rejections else '?'}. A setting is wrong (e.g. "
                f"rollout.max_response_tokens over the servers' context, or a sampling parameter); raise "
                f"rollout.max_failed_group_rate={self.config.rollout.max_failed_group_rate} to train on regardless")

    def published(self, version: int) -> None:
        """The servers serve `version` now."""
        self.producer.publish(version)

    def evaluate(self, step: int) -> dict[str, float]:
        """Validation on `eval.datasets` through the same servers and client."""
        from megatron_bapo.eval import run_evaluation

        return self.client.run(run_evaluation(self.client, self.tokenizer, self.config.eval,
                                              output_dir=self.output_dir / "eval", step=step))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.writer.log(step, metrics)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, step: int, version: int) -> dict[str, Any]:
        """Everything rank 0 needs to resume: taken with the producer paused between rounds."""
        self.producer.pause()
        try:
            return {"step": step, "version": version, "data": self.dataset.state_dict(),
                    "rollout": self.producer.manager.state_dict(), "rounds": self.producer.state_dict()}
        finally:
            self.producer.resume()


class SampleLedger:
    """`samples.jsonl`: per step, the prompts drawn and the groups trained (rank 0).

    Lets a user (and the kill-and-resume test) check that no prompt is lost or trained twice across
    restarts: a resumed run first drops the killed run's lines after its checkpoint. With rollout
    ahead of training, a round's prompts are recorded when the step that trains it takes it.
    """

    def __init__(self, path: Path, resume_step: Optional[int]) -> None:
        self.path = path
        if resume_step is not None and path.exists():
            kept = [ln for ln in path.read_text(encoding="utf-8").splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= resume_step]
            path.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        elif resume_step is None and path.exists():
            path.unlink()

    def record(self, step: int, prompts: list[Any], groups: list[Any]) -> None:
        line = {"step": step, "drawn": [p.index for p in prompts],
                "trained": [[g.group_id, g.prompt.index] for g in groups]}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
