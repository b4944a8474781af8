"""The RL loop of design section 3, top to bottom.

    for step in steps:
        groups  = rollout.step(prompts, version)     # rank 0: SGLang / built-in servers, partial rollout
        batch   = build_experience(groups)           # rank 0: rewards, GRPO advantages, padded tensors
        batch   = broadcast(batch)                   # every actor rank holds the global batch
        metrics = actor.train_step(batch)            # ppo_epochs x n_minibatches BAPO optimizer steps
        version = sync_weights(actor, servers)       # HF dir + /update_weights_from_disk (or NCCL)
        log(metrics); maybe checkpoint; maybe evaluate

Rank 0 drives the rollout servers with an asyncio client; all ranks run the actor (TP/PP/DP from
`actor.parallel`) and take part in weight gathers for the sync. The loop is resumable at step
boundaries: a checkpoint holds the actor (model, optimizer, scheduler, RNG), the data position,
the partial-rollout buffer and the policy version (see `megatron_bapo.run_state`).
"""

from __future__ import annotations

import json
import contextlib
import logging
import signal
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megatron_bapo import run_state
from megatron_bapo.config import RunConfig, dump_run_config
from megatron_bapo.experience import build_experience
from megatron_bapo.metrics import MetricsWriter
from megatron_bapo.models.parallel import init_distributed_env

logger = logging.getLogger(__name__)


class Trainer:
    """Owns the actor (all ranks) and, on rank 0, the servers, rollout state, data and metrics."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.output_dir = Path(config.trainer.output_dir)
        self.step = 0
        self.version = 0
        self._servers: list[Any] = []
        self.rollout = None
        self.dataset = None
        self.client = None
        self._weight_sync: Any = None
        self.writer: Optional[MetricsWriter] = None

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from transformers import AutoConfig

        from megatron_bapo.actor import Actor
        from megatron_bapo.convert import load_hf_into_model

        cfg = self.config
        init_distributed_env()
        hf_path = cfg.model.hf_path
        if not (Path(hf_path) / "config.json").exists():
            raise FileNotFoundError(f"model.hf_path={hf_path!r} has no config.json; point it at an HF checkpoint directory")
        self.hf_config = AutoConfig.from_pretrained(hf_path)
        self.actor = Actor(cfg.actor, self.hf_config)
        self.rank = self.actor.parallel.rank
        self.is_driver = self.rank == 0
        # Objects (the batch, decisions) travel over a CPU group even when the actor uses NCCL.
        world = self.actor.parallel.world_group
        self.cpu_group = world if dist.get_backend(world) == "gloo" else dist.new_group(backend="gloo")
        if self.is_driver:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(dump_run_config(cfg), encoding="utf-8")
        resume_from = run_state.latest_checkpoint(self.output_dir) if cfg.trainer.resume else None
        state: dict[str, Any] = {}
        if resume_from is not None:
            logger.info("resuming from %s", resume_from)
            self.actor.load_checkpoint(resume_from / "actor")
            state = run_state.load_trainer_state(resume_from)
            self.step, self.version = int(state["step"]), int(state["version"])
        else:
            load_hf_into_model(self.actor.model, hf_path, hf_config=self.hf_config)
            if hasattr(self.actor.optimizer, "reload_model_params"):
                self.actor.optimizer.reload_model_params()  # optimizers with separate fp32 main params
        if self.is_driver:
            self._setup_driver(state)
        if resume_from is not None:
            # Servers start from model.hf_path; bring them to the checkpoint's weights and version.
            self.sync_weights(self.version)
        self._barrier()

    def _setup_driver(self, state: dict[str, Any]) -> None:
        from transformers import AutoTokenizer

        from megatron_bapo.data import PromptDataset
        from megatron_bapo.rollout import PartialRolloutConfig, PartialRolloutManager, RolloutClient, RolloutClientConfig
        from megatron_bapo.rollout import SamplingConfig

        cfg, rc = self.config, self.config.rollout
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        self.dataset = PromptDataset(cfg.data, self.tokenizer)
        self.urls = list(rc.server_urls) or self._start_builtin_servers()
        self.client = RolloutClient(RolloutClientConfig(
            urls=self.urls, router_url=rc.router_url, max_concurrency=rc.max_concurrency,
            request_timeout_s=rc.request_timeout_s, max_retries=rc.max_retries, health_timeout_s=rc.startup_timeout_s,
        ))
        self.client.wait_healthy()
        self.rollout = PartialRolloutManager(self.client, PartialRolloutConfig(
            group_size=rc.group_size, max_response_tokens=rc.max_response_tokens, segment_tokens=rc.segment_tokens,
            max_staleness=rc.max_staleness, seed=cfg.trainer.seed,
            sampling=SamplingConfig(temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k),
        ))
        if state:
            self.dataset.load_state_dict(state["data"])
            self.rollout.load_state_dict(state["rollout"])
        self.writer = MetricsWriter(self.output_dir / "tb", purge_step=self.step + 1 if state else None)
        self.ledger = SampleLedger(self.output_dir / "samples.jsonl", resume_step=self.step if state else None)

    def _start_builtin_servers(self) -> list[str]:
        from megatron_bapo.server.launch import start_server

        cfg = self.config.rollout
        for i in range(cfg.num_builtin_servers):
            log_path = self.output_dir / "logs" / f"server_{i}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._servers.append(
                start_server(self.config.model.hf_path, log_path=log_path, startup_timeout_s=cfg.startup_timeout_s,
                             extra_args=["--random-seed", str(self.config.trainer.seed + i),
                                         "--weight-version", "0"])  # its weights: model.hf_path
            )
        urls = [s.url for s in self._servers]
        # PIDs on disk: operators (and the kill-and-resume test) can see what this run started.
        run_state.write_json_atomic(self.output_dir / "servers.json",
                                    [{"url": s.url, "pid": s.pid} for s in self._servers])
        logger.info("built-in rollout servers: %s", ", ".join(urls))
        return urls

    # ------------------------------------------------------------------ helpers
    def _barrier(self) -> None:
        dist.barrier(group=self.cpu_group)

    def _broadcast(self, obj: Any) -> Any:
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    # ------------------------------------------------------------------ one step
    def rollout_step(self) -> tuple[Optional[dict], dict[str, float]]:
        """Rank 0: new prompts + buffered partial rollouts -> finished groups -> the actor batch."""
        cfg = self.config
        t0 = time.monotonic()
        prompts = self.dataset.next_batch(cfg.rollout.prompts_per_step)
        groups = self.rollout.step(prompts, self.version)
        t1 = time.monotonic()
        batch, metrics = build_experience(groups, self.tokenizer, cfg.reward, cfg.advantage,
                                          n_minibatches=cfg.actor.n_minibatches, temperature=cfg.rollout.temperature)
        t2 = time.monotonic()
        self.ledger.record(self.step + 1, prompts, groups)
        metrics.update(self.rollout.last_metrics)
        metrics.update(self.dataset.metrics())
        metrics.update({"timing/rollout_s": t1 - t0, "timing/reward_s": t2 - t1})
        return batch, metrics

    def train_one_step(self) -> dict[str, float]:
        step_start = time.monotonic()
        batch, metrics = self.rollout_step() if self.is_driver else (None, {})
        batch = self._broadcast(batch)
        t0 = time.monotonic()
        if batch is None:
            logger.warning("step %d: no usable groups (all filtered); skipping the update", self.step + 1)
            train_metrics: dict[str, float] = {"actor/skipped_empty_batch": 1.0}
        else:
            train_metrics = self.actor.train_step(batch, current_version=self.version)
            tokens = float(batch["attention_mask"].sum())
            train_metrics["throughput/train_tokens_per_s"] = tokens / max(time.monotonic() - t0, 1e-9)
        t1 = time.monotonic()
        if batch is not None:  # unchanged weights need no new version
            self.version += 1
            self.sync_weights(self.version)
        t2 = time.monotonic()
        self.step += 1
        metrics.update(train_metrics)
        metrics.update({"timing/train_s": t1 - t0, "timing/sync_s": t2 - t1, "train/version": float(self.version)})
        if self.is_driver and self.config.eval.should_run(self.step):
            t3 = time.monotonic()
            metrics.update(self.evaluate())
            metrics["timing/eval_s"] = time.monotonic() - t3
        metrics["timing/step_s"] = time.monotonic() - step_start
        return metrics

    # ------------------------------------------------------------------ weight sync
    def sync_weights(self, version: int) -> None:
        """Push the actor's weights to every server as `version` (all ranks take part in the gathers)."""
        if self._weight_sync is None:
            from megatron_bapo.sync import DiskWeightSync, DistributedWeightSync

            cfg = self.config
            urls = self.urls if self.is_driver else None
            if cfg.sync.method == "distributed":
                self._weight_sync = DistributedWeightSync(cfg.sync, self.actor, self.hf_config, server_urls=urls)
            else:
                self._weight_sync = DiskWeightSync(cfg.sync, self.actor, self.hf_config, self.output_dir / "hf_sync",
                                                   server_urls=urls, tokenizer_src=cfg.model.hf_path)
        self._weight_sync.sync(version)

    # ------------------------------------------------------------------ eval / checkpoints
    def evaluate(self) -> dict[str, float]:
        """Validation on `eval.datasets` through the same servers (rank 0)."""
        from megatron_bapo.eval import run_evaluation
        from megatron_bapo.eval.sampling import HttpSampler

        async def go() -> dict[str, float]:
            async with HttpSampler(self.urls) as sampler:
                return await run_evaluation(sampler, self.tokenizer, self.config.eval,
                                            output_dir=self.output_dir / "eval", step=self.step)

        return self.client.run(go())

    def save_checkpoint(self) -> None:
        ckpt = run_state.checkpoint_dir(self.output_dir, self.step)
        self.actor.save_checkpoint(ckpt / "actor")
        if self.is_driver:
            run_state.save_trainer_state(ckpt, {
                "step": self.step,
                "version": self.version,
                "data": self.dataset.state_dict(),
                "rollout": self.rollout.state_dict(),
            })
            run_state.prune_checkpoints(self.output_dir, self.config.trainer.keep_checkpoints)
            logger.info("checkpoint %s", ckpt)
        self._barrier()

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[dict[str, float]]:
        """Train to `trainer.total_steps`; returns the per-step metrics (rank 0; empty elsewhere)."""
        cfg = self.config.trainer
        history: list[dict[str, float]] = []
        progress = None
        with self._cleanup():
            self.setup()
            if self.is_driver and cfg.progress:
                from tqdm import tqdm

                progress = tqdm(total=cfg.total_steps, initial=self.step, desc="bapo", unit="step", dynamic_ncols=True)
            ev = self.config.eval
            if self.is_driver and cfg.eval_at_start and self.step == 0 and ev.every_n_steps and ev.datasets:
                self.writer.log(0, self.evaluate())
            while self.step < cfg.total_steps:
                metrics = self.train_one_step()
                if self.is_driver:
                    self.writer.log(self.step, metrics)
                    history.append({"step": self.step, **metrics})
                    logger.info("step %d: %s", self.step, _summary(metrics))
                    if progress is not None:
                        progress.update(1)
                        progress.set_postfix_str(_summary(metrics, short=True))
                last = self.step == cfg.total_steps
                if last or (cfg.save_every and self.step % cfg.save_every == 0):
                    self.save_checkpoint()
            if progress is not None:
                progress.close()
        return history

    @contextlib.contextmanager
    def _cleanup(self):
        """Stop built-in servers (by PID) and close writers however the loop ends; SIGTERM included."""
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self._weight_sync is not None:
                with contextlib.suppress(Exception):
                    self._weight_sync.close()
            if self.client is not None:
                with contextlib.suppress(Exception):
                    self.client.close()
            for server in self._servers:
                with contextlib.suppress(Exception):
                    server.stop()
            if self.writer is not None:
                self.writer.close()


class SampleLedger:
    """`samples.jsonl`: per step, the prompts drawn and the groups trained (rank 0).

    Lets a user (and the kill-and-resume test) check that no prompt is lost or trained twice across
    restarts: a resumed run first drops the killed run's lines after its checkpoint.
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


_SUMMARY_KEYS = (
    ("reward", "rollout/reward_mean"), ("acc", "rollout/accuracy"), ("len", "rollout/response_len_mean"),
    ("c_low", "bapo/c_low"), ("c_high", "bapo/c_high"), ("rho", "bapo/rho_after"), ("s", "timing/step_s"),
)


def _summary(metrics: dict[str, float], short: bool = False) -> str:
    keys = _SUMMARY_KEYS[:4] if short else _SUMMARY_KEYS
    return " ".join(f"{name}={metrics[key]:.3g}" for name, key in keys if key in metrics)
