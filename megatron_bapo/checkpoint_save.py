"""A trainer checkpoint: saved at a step, completed at the next step boundary.

    saves = CheckpointSaves(output_dir, keep=trainer.keep_checkpoints, kept=resumed_from)
    saves.save(step, version, actor, driver, group)   # actor (every rank), trainer.json, every rank hashes
                                                      # its own files; the driver writes its token file on
                                                      # a thread; returns: the next step trains meanwhile
    saves.complete(driver, group)                     # the step boundary: rank 0 takes the token file's entry,
                                                      # writes the manifest and `latest`, prunes; every rank agrees
    saves.complete_on_exit(driver)                    # rank 0 alone, when the run ends otherwise (SIGTERM, an error)

Why deferred: the driver's rollout token file (`rollout.state_tokens`: at 32B ~1.2 GB from ~3x10^8
Python values, ~8 s to read them and ~3 s to write, hash and fsync, extrapolated in docs/cluster.md)
was waited for before the manifest, inside the save, while every rank waited. Its values are read
off the producer's pause now, while the next step trains, so the save returns at once and the file
is written by the next step boundary (a step of the recipe takes minutes). The manifest is the completion marker
(`run_state`): until it is written the checkpoint does not exist for resume (`run_state.latest_checkpoint`
skips it as incomplete and takes the previous one), `latest` still names the previous one, and pruning
(which runs only after the manifest) has deleted nothing. So a process killed in between loses the
steps since the previous checkpoint, as a kill during a save always did, never a checkpoint.

Failures: a filesystem error while writing the token file (a full disk) surfaces at completion, one
step later, as the same one line as any failed save (`run_state.save_failure`: the partial save
removed, the bytes free, the checkpoint that is kept), on every rank (`group`'s broadcast). On the
way out of a run that ends otherwise (SIGTERM's `Terminated`, an error in the next step), rank 0
completes the checkpoint alone: the ranks' hashes were gathered at the save, so no collective is
needed, and a run stopped after a save still leaves that checkpoint complete, as before.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megatron_bapo import run_state
from megatron_bapo.rollout.state_tokens import TOKENS_FILE, TOKENS_KEY

logger = logging.getLogger(__name__)


class CheckpointSaves:
    """The trainer's checkpoints: `save`, then `complete` at the next step boundary (module docstring)."""

    def __init__(self, output_dir: Path, *, keep: int, kept: Optional[Path] = None) -> None:
        self.output_dir = Path(output_dir)
        self.keep = keep
        self.kept = kept
        """The newest complete checkpoint (resumed from or completed): where `--resume` would continue."""
        self.pending: Optional[Path] = None
        """A saved checkpoint without its manifest yet (every rank knows it: completing it is collective)."""
        self._hashed: dict[str, tuple[int, str]] = {}  # rank 0: every rank's files of `pending`, merged
        self._tokens = False  # rank 0: whether `pending`'s trainer.json refers to the driver's token file

    def save(self, step: int, version: int, actor: Any, driver: Any, group: Any) -> None:
        """Actor (every rank), rank 0's trainer state, every rank hashes its own files; rank 0 keeps the
        merged hashes for `complete`. A filesystem error (a full disk) removes the partial save and
        raises `run_state.CheckpointError` on every rank, one line (`run_state.save_failure`)."""
        self.complete(driver, group)  # the previous save's, when no step boundary came between
        ckpt = run_state.checkpoint_dir(self.output_dir, step)
        try:
            actor.save_checkpoint(ckpt / "actor")
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            error = None if isinstance(exc, (KeyboardInterrupt, SystemExit)) else \
                run_state.save_failure(ckpt, exc, kept=self.kept)
            if error is None:
                raise
            raise error from exc
        failed = None
        if driver.leads:  # the driver writes the rollout token file on a thread from here on (state_tokens)
            try:
                tree = driver.state_dict(step, version, wait=False)
                self._tokens = TOKENS_KEY in tree
                run_state.write_trainer_state(ckpt, tree)
            except OSError as exc:
                failed = self._fail(ckpt, driver, exc)
        _agree(failed, group)
        # Every rank hashes the files it wrote (in parallel, from its own page cache); rank 0 merges.
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        try:
            own: Any = run_state.hash_own_files(ckpt, rank, world, skip=frozenset({TOKENS_FILE}))  # the driver's
        except OSError as exc:
            own = f"rank {rank} could not hash its files: {exc}"
        parts: list = [None] * world
        dist.all_gather_object(parts, own, group=group)
        if driver.leads:
            errors = [p for p in parts if isinstance(p, str)]
            if errors:
                failed = self._fail(ckpt, driver, OSError(errors[0]))
            else:
                self._hashed = {rel: h for part in parts for rel, h in part.items()}
        _agree(failed, group)
        self.pending = ckpt

    def complete(self, driver: Any, group: Any) -> None:
        """At a step boundary, on every rank: the pending checkpoint's manifest (rank 0, once the driver's
        token file is written, fsync'd and hashed: `Driver.state_files`), `latest`, pruning. Nothing
        pending: nothing to do, no collective. A failed write raises `run_state.CheckpointError` on every
        rank (the previous checkpoint kept); another error on rank 0 stops the other ranks too."""
        if self.pending is None:
            return
        failed, error = None, None
        if driver.leads:
            try:
                failed = self._finish(driver)
            except Exception as exc:  # noqa: BLE001 - the other ranks must stop too, not wait at a collective
                error, failed = exc, f"completing checkpoint {self.pending} failed: {type(exc).__name__}: {exc}"
            if failed is None:
                self.kept = self.pending
        ckpt, self.pending = self.pending, None
        failed = _verdict(failed, group)
        if error is not None:
            raise error
        if failed is not None:
            raise run_state.CheckpointError(failed)
        self.kept = ckpt

    def complete_on_exit(self, driver: Any) -> None:
        """Rank 0, the run ending otherwise (SIGTERM, an error): complete the pending checkpoint alone (the
        ranks' hashes were gathered at the save); a failure is logged, the run's own error stays the one
        reported. Other ranks: nothing to do."""
        if self.pending is None or not driver.leads:
            return
        try:
            failed = self._finish(driver)
        except Exception as exc:  # noqa: BLE001 - on the way out: say so, keep the run's own error
            failed = f"completing checkpoint {self.pending} failed: {type(exc).__name__}: {exc}"
        if failed is None:
            self.kept = self.pending
        else:
            logger.error("%s", failed)
        self.pending = None

    def _finish(self, driver: Any) -> Optional[str]:
        """Rank 0: wait for the driver's token file, then the manifest, `latest`, pruning; the one-line
        failure of a filesystem error (the partial save removed), or None."""
        ckpt, start = self.pending, time.monotonic()
        try:
            written = driver.state_files()
            waited = time.monotonic() - start
            if self._tokens and TOKENS_FILE not in written:
                raise RuntimeError(f"the driver did not hand over the manifest entry of {ckpt / TOKENS_FILE}")
            run_state.finish_checkpoint(ckpt, {**self._hashed, **written})
        except OSError as exc:
            return self._fail(ckpt, None, exc)
        # Only now, with the new checkpoint complete, may older ones go.
        run_state.prune_checkpoints(self.output_dir, self.keep)
        logger.info("checkpoint %s complete (%.2f s waiting for the rollout token file, %.2f s in all)", ckpt,
                    waited, time.monotonic() - start)
        return None

    def _fail(self, ckpt: Path, driver: Any, exc: OSError) -> str:
        """The one line of a failed save, after the driver's write (if any) ended and the partial save went."""
        if driver is not None:
            try:
                driver.state_files()  # its write ends before the partial save is removed
            except OSError:
                pass
        error = run_state.save_failure(ckpt, exc, kept=self.kept)
        return str(error) if error is not None else f"saving checkpoint {ckpt} failed: {exc}"


def _verdict(failed: Optional[str], group: Any) -> Optional[str]:
    """Rank 0's verdict (a one-line failure, or None) on every rank of `group` (a CPU/gloo group)."""
    box = [failed]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def _agree(failed: Optional[str], group: Any) -> None:
    """Every rank raises rank 0's one-line `run_state.CheckpointError`, or none does."""
    failed = _verdict(failed, group)
    if failed is not None:
        raise run_state.CheckpointError(failed)
