"""The RL loop of design section 3, top to bottom, on every actor rank.

    for step in steps:
        batch   = driver.next_batch()                # rank 0: a finished rollout round -> rewards, advantages
        batch   = scatter(batch)                     # each actor rank gets its own DP/CP slice
        metrics = actor.train_step(batch)            # ppo_epochs x n_minibatches BAPO optimizer steps
        sync_weights(version)                        # export (every rank) -> rank 0's server pool
        maybe evaluate
        complete the previous step's checkpoint      # its manifest, once the driver's token file is written
        log(metrics)
        watchdog.observe(step, metrics)              # no update in trainer.max_steps_without_update steps: stop
        maybe checkpoint                             # completed at the next step boundary (`checkpoint_save`)

Rank 0 also holds the `Driver` (`megatron_bapo.driver`): the server pool and the rollout client,
data, the rollout producer (which with `trainer.async_steps` = k keeps k rounds ahead of training),
rewards, the sample ledger, evaluation, metrics, and the server pool that updates the servers; on the
other ranks a `Follower` holds its place. With `trainer.driver_process` the driver runs in a process of
its own on rank 0's node (`megatron_bapo.driver_process`), which also cuts every rank's slice. All ranks run the actor (TP/PP/CP/DP from
`actor.parallel`) and the export half of the sync (`megatron_bapo.sync`). The loop is resumable at step
boundaries: a checkpoint holds the actor (model, optimizer, scheduler, RNG), the data position,
the partial-rollout buffer, the rounds produced ahead and the policy version
(`megatron_bapo.run_state`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megatron_bapo import run_record, run_state
from megatron_bapo.checkpoint_save import CheckpointSaves
from megatron_bapo.config import RunConfig, dump_run_config
from megatron_bapo.config_io import ConfigError
from megatron_bapo.logs import CONSOLE
from megatron_bapo.models.parallel import init_distributed_env
from megatron_bapo.progress import ProgressWatchdog, why_no_update

logger = logging.getLogger(__name__)
# Rank 0's console lines (megatron_bapo.logs): the compact step line, eval results, resume.
console = logging.getLogger(CONSOLE)


class Terminated(SystemExit):
    """SIGTERM: the process exits with `code` (128 + the signal) after rank 0 prints `message`, one
    line naming the step and where `--resume` continues."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(code)
        self.message = message


class Trainer:
    """The loop: the actor on every rank, the `Driver` on rank 0 (a `Follower` elsewhere)."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.output_dir = Path(config.trainer.output_dir)
        self.step = 0
        self.version = 0
        self.driver: Any = None
        self.export: Any = None
        self._since_line: list[dict[str, float]] = []  # metrics of the steps since the last console line
        self.watchdog = ProgressWatchdog(config.steps_without_update_limit())
        self.saves = CheckpointSaves(self.output_dir, keep=config.trainer.keep_checkpoints)
        """Checkpoints: saved at a step, completed (manifest, `latest`) at the next step boundary."""

    @property
    def checkpoint(self) -> Optional[Path]:
        """The newest complete checkpoint (resumed from or saved): where `--resume` would continue."""
        return self.saves.kept

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[dict[str, float]]:
        """Train to `trainer.total_steps`; returns the per-step metrics (rank 0; empty elsewhere)."""
        cfg = self.config.trainer
        history: list[dict[str, float]] = []
        with self._session():
            progress = self._progress()
            while self.step < cfg.total_steps:
                metrics = self.train_one_step()
                self.saves.complete(self.driver, self.cpu_group)  # the previous step's save: its file written meanwhile
                if self.driver.leads:
                    self._report(metrics, progress)
                    history.append({"step": self.step, **metrics})
                self.watchdog.observe(self.step, metrics)  # same decision on every rank
                if self.step == cfg.total_steps or (cfg.save_every and self.step % cfg.save_every == 0):
                    self.save_checkpoint()
            self.saves.complete(self.driver, self.cpu_group)  # the run ends with its last checkpoint complete
            if progress is not None:
                progress.close()
        return history

    def train_one_step(self) -> dict[str, float]:
        step_start = time.monotonic()
        batch, metrics = self.driver.next_batch(self.step + 1, self.version)
        batch = self._scatter(batch)
        t0 = time.monotonic()
        updated = False  # an optimizer step that was not skipped (progress.ProgressWatchdog)
        if batch is None:
            metrics["actor/skipped_empty_batch"] = 1.0
            if self.driver.leads:  # rank 0 has the rollout metrics and says why
                why = why_no_update(metrics)
                # Partial rollout: no response complete yet is normal early on; anything else is worth a warning.
                (logger.info if why.startswith("no group finished") else logger.warning)(
                    "step %d: no update: %s", self.step + 1, why or "no usable group")
        else:
            skipped = self.actor.num_skipped_steps
            metrics.update(self.actor.train_step(batch, current_version=self.version))
            metrics["throughput/train_tokens_per_s"] = batch.num_tokens / max(time.monotonic() - t0, 1e-9)
            updated = self.actor.num_skipped_steps - skipped < metrics["actor/num_optimizer_steps"]
        metrics["train/updated"] = float(updated)
        t1 = time.monotonic()
        if batch is not None:  # unchanged weights need no new version
            self.version += 1
            self.sync_weights(self.version)
        t2 = time.monotonic()
        self.step += 1
        metrics.update({"timing/train_s": t1 - t0, "timing/sync_s": t2 - t1, "train/version": float(self.version)})
        if self.config.eval.should_run(self.step):
            metrics.update(self.driver.evaluate(self.step))
            metrics["timing/eval_s"] = time.monotonic() - t2
        metrics["timing/step_s"] = time.monotonic() - step_start
        return metrics

    # ------------------------------------------------------------------ setup
    @contextlib.contextmanager
    def _session(self):
        """Actor on every rank, driver on rank 0, resume, the first sync; teardown however the loop
        ends (SIGTERM included): stop producing, leave the weight group, stop built-in servers."""
        from megatron_bapo.driver import Follower

        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):
            self.driver.begin_stop()  # the teardown below makes one short attempt per call
            exc = Terminated(self._stopped(), 128 + signum)
            defer = getattr(self.driver, "defer", None)  # the driver process's pipe, mid-message: raised after
            if defer is None or not defer(exc):
                raise exc

        signal.signal(signal.SIGTERM, on_term)
        self.driver = Follower()
        try:
            self._setup()
            yield
        except BaseException as exc:  # a checkpoint saved before the run ended so is completed (rank 0, alone)
            self.saves.complete_on_exit(self.driver)
            if isinstance(exc, Terminated):
                exc.message = self._stopped()
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.driver.close()

    def _stopped(self) -> str:
        """SIGTERM's line: the step it stopped and where `--resume` continues."""
        total = self.config.trainer.total_steps
        where = (f"the newest checkpoint, {self.checkpoint.name} ({self.checkpoint})" if self.checkpoint is not None
                 else f"the newest complete checkpoint in {self.output_dir / 'checkpoints'} (this run saved none "
                      f"yet), or from model.hf_path if there is none")
        return f"stopped by SIGTERM during step {min(self.step + 1, total)} of {total}; --resume continues from {where}"

    def _setup(self) -> None:
        """Process groups; rank 0 starts the driver (paths, reward, servers, context length checked)
        BEFORE any rank builds the model, so a wrong setting costs seconds, not a model load; then
        the actor, resume, the first sync and the rollout."""
        from transformers import AutoConfig

        from megatron_bapo.actor import Actor
        from megatron_bapo.convert import load_hf_into_model
        from megatron_bapo.driver import Driver
        from megatron_bapo.driver_process import DriverProcess
        from megatron_bapo.models.parallel import initialize_model_parallel
        from megatron_bapo.sync.export import make_export

        cfg = self.config
        init_distributed_env()
        hf_path = cfg.model.hf_path
        if not (Path(hf_path) / "config.json").exists():
            raise ConfigError(f"model.hf_path={hf_path!r} has no config.json; point it at an HF checkpoint directory")
        self.hf_config = AutoConfig.from_pretrained(hf_path)
        groups = initialize_model_parallel(cfg.actor.parallel, seed=cfg.actor.seed)
        # Objects (the batch, decisions) travel over a CPU group of their own, even when the actor uses
        # gloo: its timeout (trainer.cpu_group_timeout_minutes) covers rank 0's rollout, eval and saves.
        self.cpu_group = dist.new_group(backend="gloo",
                                        timeout=timedelta(minutes=cfg.trainer.cpu_group_timeout_minutes))
        resume_from = run_state.resume_checkpoint(self.output_dir, group=self.cpu_group) if cfg.trainer.resume else None
        state: dict[str, Any] = {}
        if resume_from is not None:
            state = run_state.load_trainer_state(resume_from, full=groups.rank == 0)
            self.step, self.version = int(state["step"]), int(state["version"])
            self.saves.kept = resume_from
            console.info("resuming from %s (step %d of %d)", resume_from, self.step, cfg.trainer.total_steps)
        error, foreign = None, False
        if groups.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(run_record.machine_header() + dump_run_config(cfg),
                                                         encoding="utf-8")
            self.driver = (DriverProcess if cfg.trainer.driver_process else Driver)(cfg, self.output_dir)
            try:  # resume checks (run_record) first: a checkpoint this config cannot resume is refused here
                self.driver.start(state, step=self.step, version=self.version, hf_config=self.hf_config,
                                  world_size=groups.world_size, checkpoint=resume_from)
                foreign = resume_from is None and self.driver.servers_hold_other_weights(self.version)
            except Exception as exc:  # every rank must learn of it, or the others wait forever
                error = exc
        failed, foreign = self._broadcast((None if error is None else (type(error).__name__, str(error)), foreign))
        if error is not None:
            raise error
        if failed is not None:
            kind = run_state.CheckpointError if failed[0] == "CheckpointError" else ConfigError
            raise kind(f"rank 0 could not start the run: {failed[0]}: {failed[1]}")
        self.actor = Actor(cfg.actor, self.hf_config, groups=groups)
        self.export = make_export(cfg.sync, self.actor, self.hf_config, self.output_dir, tokenizer_src=hf_path)
        if cfg.trainer.driver_process:  # the driver process cuts every rank's slice: it needs their coordinates
            everyone: list[Any] = [None] * dist.get_world_size(self.cpu_group)
            dist.all_gather_object(everyone, self.actor.coords, group=self.cpu_group)
            if self.driver.leads:
                self.driver.ship_to(self.actor.batch_spec, everyone)
        if resume_from is not None:
            self.actor.load_checkpoint(resume_from / "actor")
            # Servers start from model.hf_path; bring them to the checkpoint's weights and version.
            self.sync_weights(self.version)
        else:
            load_hf_into_model(self.actor.model, hf_path, hf_config=self.hf_config)
            if hasattr(self.actor.optimizer, "reload_model_params"):
                self.actor.optimizer.reload_model_params()  # optimizers with separate fp32 main params
            if foreign:  # external servers still serving another run's weights: give them this run's
                self.sync_weights(self.version)
        if self.driver.leads:
            if cfg.trainer.eval_at_start and self.step == 0 and cfg.eval.every_n_steps and cfg.eval.datasets:
                metrics = self.driver.evaluate(0)
                self.driver.log(0, metrics)
                _report_eval(0, metrics)
            self.driver.start_rollout()
        dist.barrier(group=self.cpu_group)

    # ------------------------------------------------------------------ helpers
    def _broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def _scatter(self, batch: Any):
        """Each rank gets only its DP/CP slice of rank 0's batch (None everywhere when rank 0 has none);
        with `trainer.driver_process`, rank 0 holds the slices the driver process cut (a `Shipment`)."""
        from megatron_bapo.actor.scatter import scatter_batch

        return scatter_batch(batch, self.actor.batch_spec, self.actor.coords, self.cpu_group,
                             current_version=self.version)

    def sync_weights(self, version: int) -> None:
        """Push the actor's weights to every server as `version`: every rank exports (gathers, writes
        or buckets), rank 0's server pool delivers (pause, update session, flush, restarts, version). A
        version the disk export cannot write (a full disk) stops the run in one line, like a save."""
        from megatron_bapo.sync.export import ExportWriteError
        from megatron_bapo.sync.verify import ResendWeights, actor_probe

        verify = self.config.sync.verify
        # sync.verify=probe: the servers' log-probs of the probe are checked against this forward (every rank).
        probe = actor_probe(self.actor, self.hf_config.vocab_size, self.config.sync.probe_tokens) \
            if verify == "probe" else None
        try:
            while True:  # a server that failed the check is restarted and sent the version again (once each)
                resend = False
                try:
                    with self.driver.weight_update(version, probe) as sink:
                        self.export.run(version, sink)
                except ResendWeights:  # rank 0 (the pool): every rank exports again
                    resend = True
                if verify == "off" or not self._broadcast(resend):
                    break
        except ExportWriteError as exc:  # every rank raises it; a full disk during a save is handled alike
            self.saves.complete_on_exit(self.driver)  # the previous step's save first: the line names the resume point
            where = run_state.resume_point(self.checkpoint, self.output_dir / "checkpoints")
            raise ExportWriteError(f"{exc}; {where}. Free disk space (or lower sync.keep_versions) and rerun "
                                   f"with --resume") from exc

    def save_checkpoint(self) -> None:
        """Actor (every rank), rank 0's trainer state, every rank hashes its own files; the driver writes
        the rollout token file on a thread, and the checkpoint is completed (manifest, `latest`, pruning)
        at the next step boundary, once that file is written (`checkpoint_save`). A filesystem error (a
        full disk) removes the partial save and stops the run with one line naming the path, the bytes
        free and the checkpoint that is kept (`run_state.save_failure`), now or at that boundary."""
        self.saves.save(self.step, self.version, self.actor, self.driver, self.cpu_group)

    def _progress(self):
        cfg = self.config.trainer
        if not self.driver.leads or not cfg.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=cfg.total_steps, initial=self.step, desc="bapo", unit="step", dynamic_ncols=True)

    def _report(self, metrics: dict[str, float], progress) -> None:
        """Rank 0, every step: metrics to TensorBoard/jsonl, a full line to the log file, the
        progress bar; every `trainer.console_every` steps (and at the last) the console line."""
        cfg = self.config.trainer
        self.driver.log(self.step, metrics)
        logger.info("step %d: %s", self.step, _summary(metrics))
        if progress is not None:
            progress.set_postfix_str(_summary(metrics, short=True), refresh=False)
            progress.update(1)
        self._since_line.append(metrics)
        if cfg.console_every and (self.step % cfg.console_every == 0 or self.step == cfg.total_steps):
            console.info(_console_line(self.step, cfg.total_steps, self._since_line))
            self._since_line = []
        _report_eval(self.step, metrics)


_SUMMARY_KEYS = (
    ("reward", "rollout/reward_mean"), ("acc", "rollout/accuracy"), ("len", "rollout/response_len_mean"),
    ("c_low", "bapo/c_low"), ("c_high", "bapo/c_high"), ("rho", "bapo/rho_after"), ("s", "timing/step_s"),
)


def _summary(metrics: dict[str, float], short: bool = False) -> str:
    keys = _SUMMARY_KEYS[:4] if short else _SUMMARY_KEYS
    return " ".join(f"{name}={metrics[key]:.3g}" for name, key in keys if key in metrics)


def _console_line(step: int, total: int, window: list[dict[str, float]]) -> str:
    """`step 50/150  reward 0.410  acc 0.400  c_low 0.60 c_high 1.55  rho 0.28->0.40  entropy 0.31
    1.1 s/step`: means over `window` (the steps since the previous line; a value is left out when
    no step in it has it, e.g. no update was made)."""

    def mean(key: str) -> Optional[float]:
        vals = [m[key] for m in window if key in m and m[key] == m[key]]  # NaN: a skipped update
        return sum(vals) / len(vals) if vals else None

    parts = [f"step {step}/{total}"]
    for name, key in (("reward", "rollout/reward_mean"), ("acc", "rollout/accuracy")):
        if (v := mean(key)) is not None:
            parts.append(f"{name} {v:.3f}")
    low, high = mean("bapo/c_low"), mean("bapo/c_high")
    if low is not None and high is not None:
        parts.append(f"c_low {low:.2f} c_high {high:.2f}")
    before, after = mean("bapo/rho_before"), mean("bapo/rho_after")
    if before is not None and after is not None:
        parts.append(f"rho {before:.2f}->{after:.2f}")
    if (v := mean("actor/entropy")) is not None:
        parts.append(f"entropy {v:.2f}")
    if (v := mean("timing/step_s")) is not None:
        parts.append(f"{v:.1f} s/step")
    return "  ".join(parts)


def _report_eval(step: int, metrics: dict[str, float]) -> None:
    """`eval step 50  tiny_test avg@4 0.520` when `metrics` hold evaluation results."""
    results = [f"{key[len('eval/'):].replace('/avg@', ' avg@')} {value:.3f}" for key, value in metrics.items()
               if key.startswith("eval/") and "/avg@" in key]
    if results:
        console.info("eval step %d  %s", step, "  ".join(results))
