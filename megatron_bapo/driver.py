"""Rank 0's half of the RL loop: servers, the one client, data, rollout, rewards, ledger, eval, metrics.

The actor ranks (`megatron_bapo.trainer`) only train and sync weights; everything that talks to
the rollout servers or the disk on behalf of the whole job lives here, on global rank 0:

    driver = Driver(config, output_dir)
    driver.start(saved_state, step=.., version=.., ...)  # resume checks, servers + client, data, rollout, writers
    driver.start_rollout()                    # once the servers hold the weights to sample from
    batch, metrics = driver.next_batch(step, version)   # a finished round -> rewards -> actor batch
    with driver.weight_update(version) as sink:         # the pool's update: pause, session, flush, version
        export.run(version, sink)                       # every rank gathers; rank 0's sink delivers
    driver.evaluate(step); driver.log(step, metrics)
    driver.state_dict()                       # data position, partial-rollout buffer, rounds ahead
    driver.close()

With `trainer.driver_process: true` this class runs in a process of its own on rank 0's node and
rank 0 holds a `driver_process.DriverProcess`, which answers the same calls by asking it.

The servers, the client and every call that reaches the servers (restarts, pauses, weight updates,
the served version) belong to `rollout.pool.ServerPool`; the pools of other models beside the
policy's (`teacher`, `judge`) are started and closed with it (`rollout.roles`). On actor ranks above 0
a `follower.Follower` holds the driver's place, so the trainer's loop has no rank branches around the sync.

Rollout runs through `rollout.RolloutProducer`: with `trainer.async_steps` = 0 it produces each
round when the trainer asks for it (the synchronous loop); with k > 0 it runs k rounds ahead. A round
is `rollout.dynamic_sampling.DynamicSampler.produce`: it scores the groups that finished
(`experience.score_groups`, the one place rewards are computed; with a teacher also its log-probs,
`rollout.teacher`) and keeps, drops or refills per `rollout.dynamic_sampling`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from megatron_bapo import run_record
from megatron_bapo.config import RunConfig
from megatron_bapo.driver_checks import check_context, preflight, routing_shape
from megatron_bapo.experience import build_experience
from megatron_bapo.follower import Follower  # noqa: F401 (the actor ranks' stand-in; imported from here)
from megatron_bapo.logs import CONSOLE
from megatron_bapo.metrics import MetricsWriter
from megatron_bapo.rewards.judge import log_step as log_judge_step, start_judge
from megatron_bapo.rewards.judge_config import JUDGE
from megatron_bapo.run_state import CheckpointError, checkpoint_dir
from megatron_bapo.rollout.batch import mask_stale_tokens
from megatron_bapo.rollout.pool import ServerPool
from megatron_bapo.rollout.roles import ROLES, close_role_pools, start_role_pools
from megatron_bapo.rollout.state_tokens import TokenFile, TokenWrite, gc_paused, in_background, snapshot
from megatron_bapo.rollout.teacher import TeacherScorer, scoring_with_teacher
from megatron_bapo.rollout.types import live_lists
from megatron_bapo.sample_ledger import SampleLedger

logger = logging.getLogger(__name__)
console = logging.getLogger(CONSOLE)


class Driver:
    """Owns everything rank 0 does besides training; see the module docstring."""

    leads = True
    """Rank 0 (the `Follower` on other ranks says False): it reports, logs and checkpoints the state."""

    def __init__(self, config: RunConfig, output_dir: Path) -> None:
        self.config = config
        self.output_dir = output_dir
        self.pool: Optional[ServerPool] = None
        """The servers (started or external), the one client, the served version; `client` is `pool.client`."""
        self.client: Any = None
        self.roles: dict[str, ServerPool] = {}
        """The pools beside the policy's (`teacher`, `judge`: `rollout.roles`), never weight-synced."""
        self.teacher: Optional[TeacherScorer] = None
        """On-policy distillation's teacher (`rollout.teacher`), with a `teacher` section."""
        self.producer: Any = None
        self.agent: Any = None
        """The agent loop of multi-turn rollouts with tools (`rollout.agent`), None for single-turn."""
        self.writer: Optional[MetricsWriter] = None
        self.judge: Any = None
        """The judge (`rewards.judge.JudgeReward`) when `reward.fn` or `eval.reward` is "judge"."""
        self._thread_cpu = 0.0
        self.record: dict[str, Any] = {}
        """What this run's checkpoints record about it (`run_record`), saved as trainer.json's "run"."""
        self._restoring: Any = None
        """The resumed rollout state being rebuilt in the background (a Future), until start_rollout."""
        self._writing = TokenWrite()
        """The token file `state_dict(wait=False)` writes on a thread, until the next save."""

    # ------------------------------------------------------------------ setup / teardown
    def start(self, state: dict[str, Any], *, step: int, version: int, hf_config: Any, world_size: int,
              checkpoint: Optional[Path] = None) -> None:
        """Start the servers and the client; restore data, rollout buffer and rounds from `state`
        (the trainer state of `checkpoint`), after checking that this config can resume it."""
        from transformers import AutoTokenizer

        from megatron_bapo.data import PromptDataset
        from megatron_bapo.experience import score_groups
        from megatron_bapo.rollout import PartialRolloutManager
        from megatron_bapo.rollout.agent import AgentLoop
        from megatron_bapo.rollout.dynamic_sampling import DynamicSampler, in_flight_of, manager_round, requeue_into
        from megatron_bapo.rollout.producer import RolloutProducer

        cfg, ro = self.config, self.config.rollout
        preflight(self.config)
        # What this run's checkpoints record, and (resuming) what they recorded: refused before the servers start.
        self.record = run_record.describe(cfg, hf_config, world_size=world_size)
        if state:
            for note in run_record.check_resume(state.get("run"), self.record, checkpoint or "the checkpoint"):
                console.info("resume: %s", note)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
        self.dataset = PromptDataset(cfg.data, self.tokenizer)
        self.routed_experts_shape = routing_shape(cfg.model.hf_path) if ro.return_routed_experts else None
        self.pool = ServerPool(ro, cfg.sync, model_path=cfg.model.hf_path, seed=cfg.trainer.seed,
                               log_dir=self.output_dir / "logs", state_path=self.output_dir / "servers.json",
                               weight_version=version, vocab_size=int(hf_config.vocab_size))
        self.client = self.pool.start()
        self.roles = start_role_pools({role: getattr(cfg, role) for role in ROLES}, seed=cfg.trainer.seed,
                                      output_dir=self.output_dir, vocab_size=int(hf_config.vocab_size))
        self.teacher = TeacherScorer(self.roles["teacher"]) if "teacher" in self.roles else None
        judges = self.roles.get("judge")  # a `judge` section's servers, else reward.judge.urls (external ones)
        self.judge = start_judge(cfg.reward, cfg.eval, urls=judges.client.config.urls if judges else cfg.reward.judge.urls,
                                 model_path=cfg.judge.model_path if judges else cfg.model.hf_path,
                                 api_key=judges.client.config.api_key if judges else None)
        check_context(self.config, self.dataset.prompts, self.client,
                      self.teacher.pool.client if self.teacher is not None else None)
        lag = ro.num_segments - 1 + cfg.trainer.async_steps
        if ro.max_staleness is not None and ro.max_staleness < lag:
            logger.info("rollout.max_staleness=%d is below the %d versions a %d-token response spans (%d segments, "
                        "%d step(s) ahead): the oldest tokens of such responses will leave the loss "
                        "(staleness/num_masked_tokens); the rest of each response trains", ro.max_staleness, lag,
                        ro.max_response_tokens, ro.num_segments, cfg.trainer.async_steps)
        # Multi-turn with tools: one agent loop (and its tool workers) for rollout and evaluation.
        self.agent = AgentLoop(ro.agent, self.tokenizer) if ro.agent.enabled else None
        # Per-request seeds only where the servers honour them (SGLang: --enable-deterministic-inference).
        manager = PartialRolloutManager(self.client, ro, seed=cfg.trainer.seed if ro.deterministic_inference else None,
                                        agent=self.agent)
        self._score = functools.partial(score_groups, tokenizer=self.tokenizer, reward_cfg=cfg.reward,
                                        max_response_tokens=ro.max_response_tokens,
                                        judge=self.judge if cfg.reward.fn == JUDGE else None)
        if self.teacher is not None:  # each finished group's teacher log-probs, next to its reward
            self._score = scoring_with_teacher(self._score, self.teacher)
        self.sampler = DynamicSampler(
            mode=ro.dynamic_sampling, prompts_per_step=ro.prompts_per_step, max_refill_rounds=ro.max_refill_rounds,
            draw=lambda n: self.dataset.next_batch(n) if manager.ready_for_prompts() else [],
            advance=manager_round(manager), requeue=requeue_into(manager),
            score=self._score, sample_metrics=self.agent.sample_metrics if self.agent is not None else None,
            in_flight=in_flight_of(manager), headroom=ro.refill_headroom)
        self.producer = RolloutProducer(self.client, manager, self.sampler.produce, ahead=cfg.trainer.async_steps,
                                        served_version=lambda: self.pool.version, interrupt=self.sampler.interrupt)
        if state:
            try:
                self.dataset.load_state_dict(state["data"])
                manager.check_state_dict(state["rollout"])
                tokens = TokenFile.open(state, checkpoint)  # the buffers' token file fits its descriptor
            except (ValueError, KeyError, TypeError, OSError) as exc:  # before run records; a token file unfit
                raise CheckpointError(f"cannot resume from {checkpoint}: {exc}. {run_record.WAY_OUT}") from exc
            # The buffers' lists are rebuilt (~20 ns a value) while the actor loads; start_rollout waits for them.
            self._restoring = in_background(lambda: self._restore(state, tokens, checkpoint))
        # Resumed: drop the steps after the checkpoint (they are redone). Started over in a used
        # directory: drop the earlier run's metrics, as its samples.jsonl is, or curves would mix.
        self.writer = MetricsWriter(self.output_dir / "tb", purge_step=step + 1 if state else 0)
        self.ledger = SampleLedger(self.output_dir / "samples.jsonl", resume_step=step if state else None)

    def _restore(self, state: dict[str, Any], tokens: Optional[TokenFile], checkpoint: Optional[Path]) -> None:
        """The partial-rollout buffer, the rounds produced ahead and the sampler's step, from `state`
        (its token lists in `tokens`' file, or plain lists in a checkpoint from before that file)."""
        try:
            with gc_paused():
                state = tokens.load() if tokens is not None else state
                self.producer.manager.load_state_dict(state["rollout"])
                self.producer.load_state_dict(state.get("rounds", {}))
                self.sampler.load_state_dict(state.get("sampling", {}),
                                             legacy_unrecorded=state.get("rounds", {}).get("unrecorded", []))
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise CheckpointError(f"cannot resume from {checkpoint}: {exc}. {run_record.WAY_OUT}") from exc

    def _restored(self) -> None:
        """Wait for the rollout state `start` restores in the background (its error, if any, raised here)."""
        restoring, self._restoring = self._restoring, None
        if restoring is not None:
            restoring.result()

    def servers_hold_other_weights(self, version: int) -> bool:
        """Whether a server reports a weight version other than `version` (a fresh run's 0) before
        the run synced anything: an external server another run updated. Its weights are not this
        run's, so the trainer syncs them first (else the run would sample another policy, and its
        replies would carry versions this run never published)."""
        from megatron_bapo.rollout.protocol import parse_version

        reported = self.client.run(self.client.aget_weight_versions())
        foreign = {url: v for url, v in reported.items() if parse_version(v) not in (None, version)}
        if foreign:
            logger.info("servers %s report weight versions %s from an earlier run: syncing version %d first",
                        ", ".join(foreign), ", ".join(sorted(set(foreign.values()))), version)
        return bool(foreign)

    def start_rollout(self) -> None:
        """Start producing rounds (after the servers hold the weights to sample from)."""
        self._restored()
        self.producer.start()

    @contextlib.contextmanager
    def weight_update(self, version: int, probe: Any = None) -> Iterator[Any]:
        """Rank 0's half of a weight sync: the pool's update, whose session delivers the export to
        every server; new rounds use `version` once it succeeded (`pool.version`). `probe`: the
        actor's probe log-probs the servers are checked against (`sync.verify=probe`)."""
        with self.pool.update(version, probe) as session:
            yield session

    def begin_stop(self) -> None:
        """The run is ending (called from the SIGTERM handler, before the teardown): every call to the
        servers from now on is one short attempt, never a retry against a dead port."""
        judge = self.judge.client if self.judge is not None else None
        pools = [self.pool, *self.roles.values()] if self.pool is not None else []
        for client in (self.client, *(pool.client for pool in pools), judge):  # a pool's: while starting
            if client is not None:
                client.stopping = True

    def close(self) -> None:
        """Stop producing, leave the weight group, stop the servers (by PID; every role's), close the writer."""
        self.begin_stop()
        self._drop_unfinished_write()
        if self.producer is not None:
            self.producer.stop()
        if self.agent is not None:
            self.agent.close()
        if self.judge is not None:
            self.judge.close()
        if self.pool is not None:
            self.pool.close()
        close_role_pools(self.roles)
        if self.writer is not None:
            self.writer.close()

    # ------------------------------------------------------------------ one step
    def next_batch(self, step: int, version: int) -> tuple[Optional[dict], dict[str, float]]:
        """The next finished round as the actor's batch (None when no group is usable) and its metrics.

        A built-in server that died is restarted first (and a round that failed because of it is
        produced again: its samples stayed buffered); a round whose requests the servers mostly
        rejected stops the run with their message (`rollout.max_failed_group_rate`).
        """
        cfg = self.config
        entered = time.monotonic()
        self.pool.ensure_alive()
        for pool in self.roles.values():  # a teacher or judge server that died since: restarted (counted)
            pool.ensure_alive()
        done, waited = self.pool.retry_after_restart(self.producer.next, before_retry=self.producer.restart)
        self._check_rejections(done)
        t0 = time.monotonic()
        unscored = [g for g in done.groups if any(s.reward is None for s in g.samples)]
        if unscored:  # rounds saved ahead by a checkpoint written before rewards moved to rollout time
            stats = self._score(unscored)
            done.metrics.update(stats.metrics())
            done.dropped += [g for g in done.groups if g.group_id in stats.dropped_group_ids]
            done.groups = [g for g in done.groups if g.group_id not in stats.dropped_group_ids]
        distilled = self.teacher.complete(done) if self.teacher is not None else {}  # may drop groups
        batch, metrics = build_experience(done.groups, self.tokenizer, cfg.advantage,
                                          n_minibatches=cfg.actor.n_minibatches,
                                          temperature=cfg.rollout.sampling.temperature,
                                          routed_experts_shape=self.routed_experts_shape,
                                          distill=cfg.distill if self.teacher is not None else None)
        metrics.update(distilled)
        if batch is not None:  # staleness, per token, against the weights about to train them
            metrics.update(mask_stale_tokens(batch, version, cfg.rollout.max_staleness))
            if not bool((batch["loss_mask"] > 0).any()):
                batch = None
        self.ledger.record(step, done.prompts, done.groups, done.dropped)
        metrics.update(done.metrics)  # rollout/*, reward/* and timing/reward_s: scored when the round ran
        metrics.update(self.dataset.metrics())
        if self.judge is not None:
            log_judge_step(step, metrics, cfg.reward.judge.on_failure)
        metrics.update({"timing/rollout_s": done.metrics.get("rollout/step_s", 0.0), "timing/rollout_wait_s": waited,
                        "timing/experience_s": time.monotonic() - t0})
        # What the driver costs rank 0's step (every rank waits for rank 0 at the scatter): its own
        # time here, not counting the wait for rollout, and the CPU its rollout thread used since the
        # previous step, concurrently with training (HTTP, reply parsing, the buffer).
        cpu = self._rollout_thread_cpu()
        metrics.update({"timing/driver_s": time.monotonic() - entered - waited,
                        "timing/driver_thread_cpu_s": max(cpu - self._thread_cpu, 0.0)})
        self._thread_cpu = cpu
        return batch, metrics

    def _rollout_thread_cpu(self) -> float:
        """CPU seconds (user + system) the rollout client's loop thread has used so far."""
        import psutil

        tid = self.client.loop_thread_id
        return next((t.user_time + t.system_time for t in psutil.Process().threads() if t.id == tid), 0.0)

    def _check_rejections(self, done: Any) -> None:
        """Stop the run when the servers rejected more than `rollout.max_failed_group_rate` of the groups
        that ended in this step's rounds: the failed ones over every group that finished or failed in
        the same rounds (`rollout/num_groups_finished` + `rollout/num_groups_failed`, counted together
        by the partial-rollout manager). Finished groups include those dynamic sampling dropped (zero
        variance) or carried to the next step; dividing by the trained ones alone read a filter run's
        12% as 43%."""
        from megatron_bapo.rollout.errors import RolloutError

        failed = int(done.metrics.get("rollout/num_groups_failed", 0))
        finished = int(done.metrics.get("rollout/num_groups_finished", len(done.groups) + len(done.dropped)))
        total = failed + finished
        if failed and failed > self.config.rollout.max_failed_group_rate * total:
            raise RolloutError(
                f"the servers rejected (4xx) the requests of {failed} of {total} groups that ended this step "
                f"({finished} finished), so they were dropped; "
                f"first rejection: {done.rejections[0] if done.rejections else '?'}. A setting is wrong (e.g. "
                f"rollout.max_response_tokens over the servers' context, or a sampling parameter); raise "
                f"rollout.max_failed_group_rate={self.config.rollout.max_failed_group_rate} to train on regardless")

    def evaluate(self, step: int) -> dict[str, float]:
        """Validation on `eval.datasets` through the same servers and client (and the agent loop,
        with its tools, when rollouts are multi-turn)."""
        from megatron_bapo.eval import run_evaluation

        return self.client.run(run_evaluation(self.client, self.tokenizer, self.config.eval,
                                              output_dir=self.output_dir / "eval", step=step, agent=self.agent,
                                              judge=self.judge))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.writer.log(step, metrics)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, step: int, version: int, ckpt_dir: Optional[Path] = None, *,
                   wait: bool = True) -> dict[str, Any]:
        """Everything rank 0 needs to resume: taken with the producer paused between rounds; the round in
        flight (rollout ahead of training) is aborted with its tokens kept, not drained. Under the pause
        no token value is read: `state_tokens.snapshot` records each live token list and its length, and
        the rollout resumes. The values become the token file in `ckpt_dir` (default: the step's
        checkpoint directory, where the trainer writes trainer.json next) before this returns, or with
        `wait=False` on a thread, and `state_files` waits for it (the trainer asks at the next step
        boundary, `checkpoint_save`). What is returned (and crosses the driver process's pipe) is a
        small JSON-safe tree."""
        self._restored()
        self._drop_unfinished_write()
        self.producer.pause(abort=True)
        try:
            with gc_paused(), live_lists():
                snap = snapshot({"step": step, "version": version, "data": self.dataset.state_dict(),
                                 "rollout": self.producer.manager.state_dict(), "rounds": self.producer.state_dict(),
                                 "sampling": self.sampler.state_dict(), "run": self.record})
        finally:
            self.producer.resume()
        target = ckpt_dir or checkpoint_dir(self.output_dir, step)
        if wait:
            snap.write(target)
        else:
            self._writing.start(snap, target)
        return snap.tree

    def state_files(self) -> dict[str, tuple[int, str]]:
        """The files the last `state_dict(wait=False)` writes, once written, fsync'd and renamed:
        `{path relative to its checkpoint: (size, sha256)}` for the manifest ({} when none was started).
        Raises the write's error (OSError: a full disk). Asked again (a call SIGTERM interrupted, the
        trainer's exit path), the same answer, until the next `state_dict`."""
        return self._writing.files()

    def _drop_unfinished_write(self) -> None:
        self._writing.drop()
