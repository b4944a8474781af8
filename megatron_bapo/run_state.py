"""Trainer checkpoints: where they live, how they are written atomically, verified, and resumed.

    <output_dir>/checkpoints/step_000010/actor/          megatron dist checkpoint (Actor.save_checkpoint)
    <output_dir>/checkpoints/step_000010/trainer.json    step, policy version, data position,
                                                         partial-rollout buffer's structure, RNG, config
    <output_dir>/checkpoints/step_000010/rollout_tokens.bin  the buffers' token ids, log-probs and
                                                         versions as flat arrays, written and hashed by
                                                         the driver (in its own process or not) on a
                                                         thread while training goes on (`rollout.state_tokens`)
    <output_dir>/checkpoints/step_000010/trainer_arrays.bin  trainer.json's other long numeric lists,
                                                         binary (`state_io`; older checkpoints: the buffer's)
    <output_dir>/checkpoints/step_000010/manifest.json   path, size and sha256 of every other file in
                                                         the step directory (actor/ included); written last
    <output_dir>/checkpoints/latest                      name of the newest checkpoint written

Writing (after the actor's own atomic save): `trainer.json` (temp file + `os.replace`), every rank
hashes the files it wrote (`manifest.hash_own_files`); at the next step boundary, once the driver's
token file is written, rank 0 writes the merged manifest (same), then `latest`, and only then are old
checkpoints deleted, in the background (`prune_checkpoints`; the trainer's order: `checkpoint_save`).
The manifest is the completion marker: a process killed at any point leaves the previous checkpoint
as the resume point, and samples drawn after it are drawn again on resume (same data order), none
is lost or trained twice.

Resuming (`latest_checkpoint`): step directories are tried newest first and the first one that
verifies is used. Verification (`verify_checkpoint`) compares every file with the manifest -- sizes
first (a truncated or missing file costs a `stat`), then sha256 (bytes changed on disk, which
megatron's loader would read silently) -- and names the first bad file. Each skipped checkpoint is
one WARNING line with the reason. If checkpoints exist but none is usable, `CheckpointError` names
every damaged directory and what to do. A checkpoint written before manifests existed (no manifest,
no `checkpoint_format` in trainer.json) still loads, unverified, with a warning; one whose
trainer.json announces a manifest that is missing was interrupted and is skipped.

Cost: hashing reads the whole checkpoint once at save (just written, so mostly from the page cache)
and once per resume, spread over every rank of the job (`megatron_bapo.manifest`); within a rank
files are hashed in parallel threads (hashlib releases the GIL) in 4 MiB chunks.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from megatron_bapo.manifest import (  # noqa: F401 - the manifest's names, as the tests and tools know them
    FORMAT_KEY,
    HASH_CHUNK_BYTES,
    MANIFEST,
    TRAINER_STATE,
    Hashed,
    hash_file,
    hash_own_files,
    verify_checkpoint,
    write_manifest,
)
from megatron_bapo.state_io import dump_state, load_state

logger = logging.getLogger(__name__)

LATEST = "latest"
FORMAT = 2
"""Written into trainer.json: 2 = a manifest follows (1, or absent: older checkpoints without one)."""
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be resumed from; the message names each damaged directory,
    why, and what to do."""


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a completely written `tmp` directory to `final`, replacing an older `final`.

    The old one is renamed aside first and deleted last, so a crash leaves either the old or the
    new directory under `final` (or the old one as `final.old`), never a partial one.
    """
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def save_trainer_state(ckpt_dir: Path, state: dict[str, Any]) -> None:
    """Complete a checkpoint whose actor files are written, in one process: `write_trainer_state`,
    the manifest of every file hashed here, `latest`. The trainer runs the same steps with the hashing
    spread over its ranks (`Trainer.save_checkpoint`)."""
    write_trainer_state(ckpt_dir, state)
    finish_checkpoint(ckpt_dir, None)


def write_trainer_state(ckpt_dir: Path, state: dict[str, Any]) -> None:
    """Rank 0: `trainer.json` (with its binary side file for the rollout buffer: `state_io`)."""
    dump_state(Path(ckpt_dir) / TRAINER_STATE, {**state, "rng": _rng_state(), FORMAT_KEY: FORMAT})


def finish_checkpoint(ckpt_dir: Path, hashed: Optional[Hashed]) -> None:
    """Rank 0: the manifest from the ranks' merged hashes (None: hash here), then the `latest` pointer."""
    write_manifest(ckpt_dir, hashed)
    latest = Path(ckpt_dir).parent / LATEST
    tmp = latest.with_name(LATEST + ".tmp")
    tmp.write_text(Path(ckpt_dir).name, encoding="utf-8")
    os.replace(tmp, latest)


# ---------------------------------------------------------------------------- resume
def _step_dirs(output_dir: str | Path) -> list[Path]:
    """Step directories, newest (highest step) first."""
    root = Path(output_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(output_dir: str | Path, group: Any = None) -> Optional[Path]:
    """The newest checkpoint that verifies, or None when there is none to resume from; the same on
    every rank of `group` (a CPU/gloo group, collective over it: the ranks hash in parallel,
    `manifest.verify_checkpoint`; None: this process alone).

    Every checkpoint skipped on the way is logged (WARNING, one line, naming the bad file).
    Interrupted saves alone mean a fresh start (None); checkpoints that exist but are damaged, with
    nothing usable older, raise `CheckpointError` naming the directories to remove.
    """
    import torch.distributed as dist

    leads = group is None or dist.get_rank(group) == 0
    candidates: list = [_step_dirs(output_dir) if leads else None]
    if group is not None and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(candidates, group=group, group_src=0)  # one list, whatever each rank sees
    damaged: list[tuple[Path, str]] = []
    for ckpt in candidates[0]:
        start = time.monotonic()
        reason = verify_checkpoint(ckpt, group=group)
        if reason is None:
            if leads and not (ckpt / MANIFEST).exists():
                logger.warning("checkpoint %s has no %s (written before checkpoints were verified): resuming "
                               "from it unverified", ckpt, MANIFEST)
            elif leads:
                logger.info("checkpoint %s verified in %.2f s", ckpt, time.monotonic() - start)
            return ckpt
        if leads:
            logger.warning("skipping checkpoint %s: %s", ckpt, reason)
        if not reason.startswith("incomplete"):
            damaged.append((ckpt, reason))
    if damaged:
        listing = "; ".join(f"{path}: {reason}" for path, reason in damaged)
        paths = " ".join(str(path) for path, _ in damaged)
        raise CheckpointError(
            f"no usable checkpoint in {Path(output_dir) / 'checkpoints'}: {listing}. Remove the damaged "
            f"checkpoint(s) (rm -r {paths}) to start from model.hf_path, or restore them, or rerun with "
            "--no-resume (trainer.resume=false).")
    return None


def resume_checkpoint(output_dir: str | Path, group: Any = None) -> Optional[Path]:
    """`latest_checkpoint` on every rank of `group`: every rank returns the same path or raises the
    same `CheckpointError`."""
    return latest_checkpoint(output_dir, group=group)


def load_trainer_state(ckpt_dir: Path, *, full: bool = True) -> dict[str, Any]:
    """Rank 0's trainer state, its Python/numpy RNG restored. `full=False` (ranks above 0, which need
    only the step and the version): the binary buffer is not read and the RNG is left alone."""
    state = load_state(Path(ckpt_dir) / TRAINER_STATE, arrays=full)
    state.pop(FORMAT_KEY, None)
    rng = state.pop("rng")
    if full:
        _set_rng_state(rng)
    return state


LOW_SPACE_BYTES = 16 << 20
"""A save that fails with less than this free on its filesystem ran out of space (`out_of_space`):
torch's writers report a full disk in their own words ("unexpected pos 704 vs 598", "basic_ios::clear:
iostream error"), without the errno."""


def out_of_space(path: Path, exc: BaseException) -> Optional[OSError]:
    """ENOSPC (an OSError naming `path` and the bytes free) when `exc` happened while writing under
    `path` with less than `LOW_SPACE_BYTES` free there; None otherwise. Measure before removing the
    partial save: afterwards the space is free again."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free >= LOW_SPACE_BYTES or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return None
    said = str(exc).strip().splitlines()[-1][-100:] if str(exc).strip() else ""
    return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free while writing; "
                                 f"{type(exc).__name__}: {said})")


def save_failure(ckpt_dir: Path, exc: BaseException, *, kept: Optional[Path]) -> Optional[CheckpointError]:
    """The one-line error of a save that failed writing files (a full disk, a quota), after removing
    what the save wrote (`ckpt_dir` never became a complete checkpoint); None when `exc` is not such
    a failure (a bug: the caller re-raises it). `kept`: the newest complete checkpoint, which the
    failure did not touch and `--resume` continues from."""
    cause = write_failure_of(exc)
    if cause is None:
        return None
    ckpt_dir = Path(ckpt_dir)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    free = free_bytes(ckpt_dir)
    return CheckpointError(f"saving checkpoint {ckpt_dir} failed: {cause}; {free} bytes ({free / 2**20:.1f} MiB) are "
                           f"free there after removing the partial save; {resume_point(kept, ckpt_dir.parent)}. Free "
                           f"disk space (or lower trainer.keep_checkpoints) and rerun with --resume")


def free_bytes(path: Path) -> int:
    """Bytes free on the filesystem of `path` (or of its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def resume_point(kept: Optional[Path], checkpoints: Path) -> str:
    """Where `--resume` continues after a failure that left `kept` the newest complete checkpoint."""
    if kept is not None:
        return f"the newest complete checkpoint {kept} is kept, and --resume continues from it"
    return (f"this run has no complete checkpoint yet (--resume takes the newest complete one in {checkpoints}, "
            f"or starts from model.hf_path)")


_TORCH_WRITE_FAILURES = ("unexpected pos", "iostream error", "PytorchStreamWriter failed writing",
                         "No space left on device", "Disk quota exceeded", "StorageFull")
"""How torch's and safetensors' file writers word a failed write (a full disk, a quota), without an
OSError (safetensors: `SafetensorError: Error while serializing: IoError(Os { code: 28, kind:
StorageFull, message: "No space left on device" })`)."""


def write_failure_of(exc: BaseException) -> Optional[str]:
    """What failed to be written behind `exc`, or None when it is no write failure. Looks through
    causes, contexts and the per-rank failures torch's distributed checkpoint collects, for an
    OSError (ENOSPC, EDQUOT, ...) or one of torch's own words for a failed write."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return str(e)
        text = str(e).strip()
        marker = next((m for m in _TORCH_WRITE_FAILURES if m in text), None)
        if marker is not None:
            line = text[text.find(marker):].splitlines()[0][:80]
            return f"the file writer failed ({line})"
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):  # rank -> exception, or (exception, traceback)
            for f in failures.values():
                todo += [x for x in (f if isinstance(f, tuple) else (f,)) if isinstance(x, BaseException)]
    return None


DELETING = ".deleting"
"""Under `checkpoints/`: old checkpoints renamed here (instant) and deleted in a background thread."""


def prune_checkpoints(output_dir: str | Path, keep: int) -> Optional[threading.Thread]:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names), off the critical
    path: each is renamed into `checkpoints/.deleting/` (one metadata operation; no longer a step
    directory, so never resumed from) and removed by a daemon thread, returned (None: nothing to do).
    Whatever a killed run left in `.deleting/` goes too. It only looks at completion markers; it never hashes."""
    root = Path(output_dir) / "checkpoints"
    trash = root / DELETING
    doomed = [p for p in trash.iterdir()] if trash.is_dir() else []
    if keep > 0:
        pointer = root / LATEST
        current = root / pointer.read_text(encoding="utf-8").strip() if pointer.exists() else None
        complete = [p for p in reversed(_step_dirs(output_dir))
                    if (p / MANIFEST).exists() or (p / TRAINER_STATE).exists()]
        for old in complete[:-keep]:
            if old != current:
                trash.mkdir(exist_ok=True)
                aside = trash / f"{old.name}.{os.getpid()}.{time.monotonic_ns()}"
                try:
                    old.rename(aside)
                except OSError:
                    continue
                doomed.append(aside)
    if not doomed:
        return None

    def delete() -> None:
        start = time.monotonic()
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)
        logger.info("deleted %d old checkpoint(s) in %.1f s (in the background)", len(doomed), time.monotonic() - start)

    thread = threading.Thread(target=delete, name="checkpoint-prune", daemon=True)
    thread.start()
    return thread


def _rng_state() -> dict[str, Any]:
    # Python and numpy RNG of the trainer process (torch state is saved per rank by the actor).
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
