"""A trainer checkpoint is completed after the step resumes (`checkpoint_save`): `Trainer.save_checkpoint`
returns while the driver still writes the rollout token file, and the manifest, `latest` and pruning
follow at the next step boundary. Two real gloo ranks, a real `Driver` holding a real rollout (its
token lists notice reads: `rollout_state_helpers.GatedList`, so the test decides when the writer gets
them), real files; the actor's own save is a stand-in that writes one shard file per rank."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_bapo import run_state
from rollout_state_helpers import GatedList, driver_state_now, gated_groups, grow_and_reset, rollout_driver


class _ShardActor:
    """Writes what megatron's save leaves per rank (`__<rank>_0.distcp`; rank 0 also the metadata)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def save_checkpoint(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        (path / f"__{self.rank}_0.distcp").write_bytes(bytes([self.rank]) * 4096)
        if self.rank == 0:
            (path / ".metadata").write_bytes(b"meta" * 64)


def _trainer(rank: int, out: str):
    """A `Trainer` at its loop: a CPU group, the actor, the driver on rank 0 (a `Follower` elsewhere)."""
    import torch.distributed as dist

    from megatron_bapo.config import load_run_config
    from megatron_bapo.driver import Follower
    from megatron_bapo.trainer import Trainer

    config = load_run_config(None, ["model.hf_path=m", "data.path=d.jsonl", f"trainer.output_dir={out}",
                                    "trainer.keep_checkpoints=1"])
    trainer = Trainer(config)
    trainer.cpu_group = dist.new_group(backend="gloo")
    trainer.actor = _ShardActor(rank)
    trainer.driver = rollout_driver(config, Path(out), gated_groups()) if rank == 0 else Follower()
    return trainer


def _save(trainer, step: int) -> None:
    """`save_checkpoint` at `step`, its pause armed: a token value read on this thread fails."""
    trainer.step = trainer.version = step
    GatedList.armed = True
    try:
        trainer.save_checkpoint()
    finally:
        GatedList.armed = False


def _close(trainer) -> None:
    trainer.driver.close()
    if trainer.driver.leads:
        trainer.driver.client.close()


def _completed_at_the_next_boundary(rank: int, world: int, out: str) -> dict:
    from megatron_bapo.rollout.state_tokens import TokenFile
    from megatron_bapo.rollout.types import RolloutGroup

    trainer, out = _trainer(rank, out), Path(out)
    ckpts, seen = out / "checkpoints", {}
    try:
        GatedList.opened.set()
        _save(trainer, 2)
        trainer.saves.complete(trainer.driver, trainer.cpu_group)
        at_pause = driver_state_now(trainer.driver) if rank == 0 else None
        GatedList.opened.clear()  # the writer waits for the values: the file is "still being written"
        _save(trainer, 4)
        seen["manifest_while_writing"] = (ckpts / "step_000004" / run_state.MANIFEST).exists()
        seen["latest_while_writing"] = (ckpts / run_state.LATEST).read_text()
        seen["resume_while_writing"] = run_state.resume_checkpoint(out, group=trainer.cpu_group).name
        seen["previous_kept_while_writing"] = (ckpts / "step_000002" / run_state.MANIFEST).exists()
        seen["checkpoint_while_writing"] = trainer.checkpoint.name
        if rank == 0:
            grow_and_reset(trainer.driver.producer.ready[0].groups + trainer.driver.producer.manager.buffer)
        GatedList.opened.set()
        trainer.saves.complete(trainer.driver, trainer.cpu_group)  # the next step boundary
        seen["latest"] = (ckpts / run_state.LATEST).read_text()
        seen["previous_exists"] = (ckpts / "step_000002").exists()
        seen["resume"] = run_state.resume_checkpoint(out, group=trainer.cpu_group).name
        seen["checkpoint"] = trainer.checkpoint.name
        if rank == 0:
            ckpt = ckpts / "step_000004"
            state = TokenFile.open(run_state.load_trainer_state(ckpt), ckpt).load()
            groups = [RolloutGroup.from_dict(g).to_dict() for g in state["rollout"]["groups"]]
            rounds = [[RolloutGroup.from_dict(g).to_dict() for g in r["groups"]] for r in state["rounds"]["ready"]]
            seen["restored_equals_the_pause"] = (groups == at_pause["rollout"]["groups"]
                                                 and rounds == [r["groups"] for r in at_pause["rounds"]["ready"]])
    finally:
        GatedList.opened.set()
        _close(trainer)
    return seen


def test_save_returns_before_the_token_file_and_the_next_boundary_completes_it(run_dist, tmp_path):
    """While the driver still writes the token file, step 4's checkpoint has no manifest: `latest`, the
    resume (on every rank) and `--resume`'s message name step 2, which is not pruned (keep 1). The
    next step boundary completes it: manifest, `latest`, step 2 pruned; it holds the rollout state at
    the pause though the rollout extended and reset samples since (835d065 read every token value under
    the pause, inside the save)."""
    for seen in run_dist(_completed_at_the_next_boundary, 2, str(tmp_path), timeout=180):
        assert seen["manifest_while_writing"] is False
        assert seen["latest_while_writing"] == seen["resume_while_writing"] == "step_000002"
        assert seen["previous_kept_while_writing"] and seen["checkpoint_while_writing"] == "step_000002"
        assert seen["latest"] == seen["resume"] == seen["checkpoint"] == "step_000004"
        assert seen["previous_exists"] is False
        assert seen.get("restored_equals_the_pause", True)


def _full_disk_at_the_boundary(rank: int, world: int, out: str) -> dict:
    import resource
    import signal

    from megatron_bapo.run_state import CheckpointError

    trainer, out = _trainer(rank, out), Path(out)
    ckpts, seen = out / "checkpoints", {}
    try:
        GatedList.opened.set()
        _save(trainer, 2)
        trainer.saves.complete(trainer.driver, trainer.cpu_group)
        GatedList.opened.clear()
        _save(trainer, 4)
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        if rank == 0:  # from here, rank 0 cannot write a file over 8 KiB: the token file's write fails (EFBIG)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (8192, limits[1]))
        GatedList.opened.set()
        try:
            trainer.saves.complete(trainer.driver, trainer.cpu_group)
        except CheckpointError as exc:
            seen["error"] = str(exc)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        seen["failed_exists"] = (ckpts / "step_000004").exists()
        seen["latest"] = (ckpts / run_state.LATEST).read_text()
        seen["resume"] = run_state.resume_checkpoint(out, group=trainer.cpu_group).name
        seen["checkpoint"] = trainer.checkpoint.name
    finally:
        GatedList.opened.set()
        _close(trainer)
    return seen


def test_a_full_disk_under_the_deferred_write_stops_every_rank_in_one_line_keeping_the_previous(run_dist, tmp_path):
    """The token file's write fails after the save returned (a file-size limit: the OSError a full disk
    or a quota gives): the next boundary stops every rank with `run_state.save_failure`'s one line
    (the partial save removed, the bytes free, the checkpoint kept); step 2 stays the resume point."""
    for seen in run_dist(_full_disk_at_the_boundary, 2, str(tmp_path), timeout=180):
        assert re.fullmatch(r"saving checkpoint \S+/step_000004 failed: \[Errno 27\] File too large; \d+ bytes "
                            r"\([\d.]+ MiB\) are free there after removing the partial save; the newest complete "
                            r"checkpoint \S+/step_000002 is kept, and --resume continues from it\. Free disk space "
                            r"\(or lower trainer.keep_checkpoints\) and rerun with --resume", seen.get("error", "")), \
            seen
        assert seen["failed_exists"] is False
        assert seen["latest"] == seen["resume"] == seen["checkpoint"] == "step_000002"


def _completed_on_the_way_out(rank: int, world: int, out: str) -> dict:
    trainer, out = _trainer(rank, out), Path(out)
    seen = {}
    try:
        GatedList.opened.set()
        _save(trainer, 2)  # saved; the run is stopped (SIGTERM, an error) before the next step boundary
        trainer.saves.complete_on_exit(trainer.driver)  # `Trainer._session`'s exit path: no collective
        seen["manifest"] = (run_state.checkpoint_dir(out, 2) / run_state.MANIFEST).exists()
        seen["message"] = trainer._stopped()
    finally:
        _close(trainer)
    seen["resume"] = str(run_state.resume_checkpoint(out))
    return seen


def test_a_run_stopped_before_the_next_boundary_completes_its_checkpoint_on_the_way_out(run_dist, tmp_path):
    """SIGTERM (or an error) after a save, before the next step boundary: rank 0 completes the checkpoint
    alone on the way out (the ranks' hashes were gathered at the save), and SIGTERM's line names it."""
    out = tmp_path
    rank0, rank1 = run_dist(_completed_on_the_way_out, 2, str(out), timeout=180)
    assert rank0["manifest"] and rank0["resume"] == str(run_state.checkpoint_dir(out, 2))
    assert rank0["message"].endswith(f"--resume continues from the newest checkpoint, step_000002 "
                                     f"({run_state.checkpoint_dir(out, 2)})"), rank0["message"]
