"""Trainer checkpoints: where they live, how they are written atomically, verified, and resumed.

    <output_dir>/checkpoints/step_000010/actor/          megatron dist checkpoint (Actor.save_checkpoint)
    <output_dir>/checkpoints/step_000010/trainer.json    step, policy version, data position,
                                                         partial-rollout buffer, RNG, config
    <output_dir>/checkpoints/step_000010/manifest.json   path, size and sha256 of every other file in
                                                         the step directory (actor/ included); written last
    <output_dir>/checkpoints/latest                      name of the newest checkpoint written

Writing (`save_trainer_state`, after the actor's own atomic save): `trainer.json` (temp file +
`os.replace`), then the manifest (same), then `latest`. The manifest is the completion marker: a
process killed at any point leaves the previous checkpoint as the resume point, and samples drawn
after it are drawn again on resume (same data order), none is lost or trained twice.

Resuming (`latest_checkpoint`): step directories are tried newest first and the first one that
verifies is used. Verification (`verify_checkpoint`) compares every file with the manifest -- sizes
first (a truncated or missing file costs a `stat`), then sha256 (bytes changed on disk, which
megatron's loader would read silently) -- and names the first bad file. Each skipped checkpoint is
one WARNING line with the reason. If checkpoints exist but none is usable, `CheckpointError` names
every damaged directory and what to do. A checkpoint written before manifests existed (no manifest,
no `checkpoint_format` in trainer.json) still loads, unverified, with a warning; one whose
trainer.json announces a manifest that is missing was interrupted and is skipped.

Cost: hashing reads the whole checkpoint once at save (just written, so mostly from the page cache)
and once per resume; files are hashed in parallel threads (hashlib releases the GIL) in 4 MiB chunks.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer.json"
MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_KEY = "checkpoint_format"
FORMAT = 2
"""Written into trainer.json: 2 = a manifest follows (1, or absent: older checkpoints without one)."""
HASH_CHUNK_BYTES = 4 << 20
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
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
    """Complete a checkpoint whose actor files are written (rank 0 only): `trainer.json`, then the
    manifest of the whole step directory, then the `latest` pointer."""
    state = {**state, "rng": _rng_state(), FORMAT_KEY: FORMAT}
    write_json_atomic(ckpt_dir / TRAINER_STATE, state)
    write_manifest(ckpt_dir)
    latest = ckpt_dir.parent / LATEST
    tmp = latest.with_name(LATEST + ".tmp")
    tmp.write_text(ckpt_dir.name, encoding="utf-8")
    os.replace(tmp, latest)


# ---------------------------------------------------------------------------- manifest
def hash_file(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in `HASH_CHUNK_BYTES` chunks."""
    digest, size = hashlib.sha256(), 0
    buf = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def _hash_all(root: Path, rel_paths: list[str]) -> dict[str, tuple[int, str]]:
    """Hash files in parallel, largest first (hashlib releases the GIL on large updates)."""
    order = sorted(rel_paths, key=lambda r: -(root / r).stat().st_size)
    with ThreadPoolExecutor(min(HASH_THREADS, max(1, len(order)))) as pool:
        return dict(zip(order, pool.map(lambda r: hash_file(root / r), order)))


def _checkpoint_files(ckpt_dir: Path) -> list[str]:
    """Every file under `ckpt_dir` (relative, '/'-separated) except the manifest and temp files."""
    out = []
    for path in ckpt_dir.rglob("*"):
        rel = path.relative_to(ckpt_dir).as_posix()
        if path.is_file() and rel != MANIFEST and not rel.endswith(".tmp"):
            out.append(rel)
    return sorted(out)


def write_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """Hash every file of a written checkpoint and write `manifest.json` atomically; returns it."""
    ckpt_dir = Path(ckpt_dir)
    start = time.monotonic()
    hashed = _hash_all(ckpt_dir, _checkpoint_files(ckpt_dir))
    files = {rel: {"size": size, "sha256": digest} for rel, (size, digest) in sorted(hashed.items())}
    manifest = {"format": 1, "algorithm": "sha256", "files": files}
    write_json_atomic(ckpt_dir / MANIFEST, manifest)
    seconds = time.monotonic() - start
    num_bytes = sum(f["size"] for f in files.values())
    logger.info("checkpoint manifest %s: %d files, %.1f MB hashed in %.2f s (%.0f MB/s)", ckpt_dir / MANIFEST,
                len(files), num_bytes / 1e6, seconds, num_bytes / 1e6 / max(seconds, 1e-9))
    return manifest


def verify_checkpoint(ckpt_dir: str | Path) -> Optional[str]:
    """None when `ckpt_dir` can be resumed from, else why not (naming the file, one line).

    With a manifest: every listed file must exist with its size (checked for all files first) and
    its sha256. Without one: trainer.json must parse and must not announce a manifest (format 2 =
    the save was interrupted before completing); a checkpoint from before manifests is accepted
    unverified (the caller warns). A reason starting with "incomplete" means an interrupted save,
    anything else damage.
    """
    ckpt_dir = Path(ckpt_dir)
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.exists():
        state_path = ckpt_dir / TRAINER_STATE
        if not state_path.exists():
            return f"incomplete: no {TRAINER_STATE} (the save was interrupted)"
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return f"{TRAINER_STATE} is unreadable ({type(exc).__name__}: {exc})"
        if not isinstance(state, dict) or not isinstance(state.get(FORMAT_KEY, 1), int):
            return f"{TRAINER_STATE} is not a trainer state (not an object, or a bad {FORMAT_KEY})"
        if state.get(FORMAT_KEY, 1) >= 2:
            return f"incomplete: no {MANIFEST} (the save was interrupted after {TRAINER_STATE})"
        return None
    try:
        files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
        expected = {str(rel): (int(e["size"]), str(e["sha256"])) for rel, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})"
    try:
        for rel, (size, _) in sorted(expected.items()):
            path = ckpt_dir / rel
            if not path.is_file():
                return f"{rel} is missing"
            actual = path.stat().st_size
            if actual != size:
                return f"{rel} has {actual} bytes, the manifest says {size} (truncated or rewritten)"
        hashed = _hash_all(ckpt_dir, sorted(expected))
    except OSError as exc:
        return f"a file could not be read ({exc})"
    for rel, (_, digest) in sorted(expected.items()):
        if hashed[rel][1] != digest:
            return f"{rel} does not match its sha256 in the manifest (bytes changed on disk)"
    return None


# ---------------------------------------------------------------------------- resume
def _step_dirs(output_dir: str | Path) -> list[Path]:
    """Step directories, newest (highest step) first."""
    root = Path(output_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.glob("step_*") if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The newest checkpoint that verifies, or None when there is none to resume from.

    Every checkpoint skipped on the way is logged (WARNING, one line, naming the bad file).
    Interrupted saves alone mean a fresh start (None); checkpoints that exist but are damaged, with
    nothing usable older, raise `CheckpointError` naming the directories to remove.
    """
    damaged: list[tuple[Path, str]] = []
    for ckpt in _step_dirs(output_dir):
        reason = verify_checkpoint(ckpt)
        if reason is None:
            if not (ckpt / MANIFEST).exists():
                logger.warning("checkpoint %s has no %s (written before checkpoints were verified): resuming "
                               "from it unverified", ckpt, MANIFEST)
            return ckpt
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


def resume_checkpoint(output_dir: str | Path, group=None) -> Optional[Path]:
    """`latest_checkpoint` for every rank of `group`: rank 0 of the group verifies (the checkpoint is
    hashed once, not once per rank) and broadcasts its choice, or its error, over `group` (a CPU/gloo
    group); every rank then returns the same path or raises the same `CheckpointError`."""
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return latest_checkpoint(output_dir)
    message: list = [None]
    if dist.get_rank(group) == 0:
        try:
            found = latest_checkpoint(output_dir)
            message = [("ok", None if found is None else str(found))]
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
            message = [("error", f"{exc}" if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}")]
    dist.broadcast_object_list(message, group=group, group_src=0)
    kind, value = message[0]
    if kind == "error":
        raise CheckpointError(value)
    return None if value is None else Path(value)


def load_trainer_state(ckpt_dir: Path) -> dict[str, Any]:
    state = json.loads((ckpt_dir / TRAINER_STATE).read_text(encoding="utf-8"))
    state.pop(FORMAT_KEY, None)
    _set_rng_state(state.pop("rng"))
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


def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (never the one `latest` names). Runs after every
    save, so it only looks at completion markers; it never hashes."""
    if keep <= 0:
        return
    root = Path(output_dir) / "checkpoints"
    pointer = root / LATEST
    current = root / pointer.read_text(encoding="utf-8").strip() if pointer.exists() else None
    complete = [p for p in reversed(_step_dirs(output_dir)) if (p / MANIFEST).exists() or (p / TRAINER_STATE).exists()]
    for old in complete[:-keep]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)


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
