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
import logging
import time
from pathlib import Path
from typing import Any, Optional

from megatron_bapo import run_state
from megatron_bapo.config import RunConfig
from megatron_bapo.experience import build_experience
from megatron_bapo.metrics import MetricsWriter

logger = logging.getLogger(__name__)


class Driver:
    """Owns everything rank 0 does besides training; see the module docstring."""

    def __init__(self, config: RunConfig, output_dir: Path) -> None:
        self.config = config
        self.output_dir = output_dir
        self.servers: list[Any] = []
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
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        self.dataset = PromptDataset(cfg.data, self.tokenizer)
        client_cfg = ro.client
        if not client_cfg.urls and not client_cfg.router_url:
            client_cfg = dataclasses.replace(client_cfg, urls=self._start_builtin_servers())
        self.client = RolloutClient(client_cfg)
        self.client.wait_healthy()
        manager = PartialRolloutManager(self.client, ro, seed=cfg.trainer.seed)
        self.producer = RolloutProducer(self.client, manager, lambda: self.dataset.next_batch(ro.prompts_per_step),
                                        ahead=cfg.trainer.async_steps, version=version)
        if state:
            self.dataset.load_state_dict(state["data"])
            manager.load_state_dict(state["rollout"])
            self.producer.load_state_dict(state.get("rounds", {}))
        self.writer = MetricsWriter(self.output_dir / "tb", purge_step=step + 1 if state else None)
        self.ledger = SampleLedger(self.output_dir / "samples.jsonl", resume_step=step if state else None)

    def start_rollout(self) -> None:
        """Start producing rounds (after the servers hold the weights to sample from)."""
        self.producer.start()

    def _start_builtin_servers(self) -> list[str]:
        from megatron_bapo.server.launch import start_server

        cfg = self.config
        for i in range(cfg.rollout.num_builtin_servers):
            log_path = self.output_dir / "logs" / f"server_{i}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self.servers.append(
                start_server(cfg.model.hf_path, log_path=log_path, startup_timeout_s=cfg.rollout.client.health_timeout_s,
                             extra_args=["--random-seed", str(cfg.trainer.seed + i),
                                         "--weight-version", "0"])  # its weights: model.hf_path
            )
        urls = [s.url for s in self.servers]
        # PIDs on disk: operators (and the kill-and-resume test) can see what this run started.
        run_state.write_json_atomic(self.output_dir / "servers.json", [{"url": s.url, "pid": s.pid} for s in self.servers])
        logger.info("built-in rollout servers: %s", ", ".join(urls))
        return urls

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
        """The next finished round as the actor's batch (None when no group is usable) and its metrics."""
        cfg = self.config
        done, waited = self.producer.next(version)
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
