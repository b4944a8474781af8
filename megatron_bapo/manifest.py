"""A checkpoint's sha256 manifest: written by every rank in parallel, verified by every rank in parallel.

    own = hash_own_files(ckpt, rank, world)        # each rank: the files it wrote
    write_manifest(ckpt, hashed=merged parts)      # rank 0: manifest.json, the completion marker
    verify_checkpoint(ckpt, group=cpu_group)       # at resume, on every rank: None or why not

At 32B a checkpoint is ~460 GB with the optimizer state, spread over every rank's shard files.
Hashed from rank 0 alone it took the time to read all of it through one node, twice (at the save
and at the resume), while 127 ranks waited. Here a file belongs to the rank that wrote it
(`owner_of`: megatron's `__<rank>_<i>.distcp`, the actor's `rng/rank<rank>.pt`; rank 0 the rest),
so each rank hashes only its own (from its page cache, on its own node); rank 0 merges the parts
into one manifest. At resume the files are shared out the same way among the ranks of the
resuming job (any layout), each hashes its share, and the ranks agree on the first bad file.
Hashes use threads within a rank (hashlib releases the GIL on large updates).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

TRAINER_STATE = "trainer.json"
MANIFEST = "manifest.json"
FORMAT_KEY = "checkpoint_format"
HASH_CHUNK_BYTES = 4 << 20
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
_RANK_FILE = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|rank(\d+)\.pt)$")

Hashed = dict[str, tuple[int, str]]
"""{path relative to the checkpoint, '/'-separated: (size in bytes, sha256 hex)}."""


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


def hash_files(root: Path, rel_paths: list[str]) -> Hashed:
    """Hash files in parallel threads, largest first."""
    order = sorted(rel_paths, key=lambda r: -(root / r).stat().st_size)
    if not order:
        return {}
    with ThreadPoolExecutor(min(HASH_THREADS, len(order))) as pool:
        return dict(zip(order, pool.map(lambda r: hash_file(root / r), order)))


def checkpoint_files(ckpt_dir: Path) -> list[str]:
    """Every file under `ckpt_dir` (relative, '/'-separated) except the manifest and temp files."""
    out = []
    for path in Path(ckpt_dir).rglob("*"):
        rel = path.relative_to(ckpt_dir).as_posix()
        if path.is_file() and rel != MANIFEST and not rel.endswith(".tmp"):
            out.append(rel)
    return sorted(out)


def owner_of(rel: str, world: int) -> int:
    """The rank that hashes `rel` in a job of `world` ranks: the rank in its name (megatron's shard
    files, the per-rank RNG files), modulo `world` when the job has fewer ranks than wrote the
    checkpoint; rank 0 for every other file (metadata, common state, the trainer state)."""
    m = _RANK_FILE.search(rel)
    if m is None:
        return 0
    return int(m.group(1) or m.group(2)) % max(world, 1)


def hash_own_files(ckpt_dir: Path, rank: int, world: int, skip: frozenset = frozenset()) -> Hashed:
    """The files of `ckpt_dir` that `rank` owns (`owner_of`), hashed; not those in `skip` (hashed by
    their writer as it wrote them: the driver's rollout token file)."""
    mine = [rel for rel in checkpoint_files(ckpt_dir) if owner_of(rel, world) == rank and rel not in skip]
    return hash_files(Path(ckpt_dir), mine)


def write_manifest(ckpt_dir: Path, hashed: Optional[Hashed] = None) -> dict[str, Any]:
    """Write `manifest.json` atomically from `hashed` (the ranks' merged parts; None: hash every file
    here, in this process); returns it."""
    from megatron_bapo.run_state import write_json_atomic

    ckpt_dir = Path(ckpt_dir)
    start = time.monotonic()
    if hashed is None:
        hashed = hash_files(ckpt_dir, checkpoint_files(ckpt_dir))
    files = {rel: {"size": size, "sha256": digest} for rel, (size, digest) in sorted(hashed.items())}
    manifest = {"format": 1, "algorithm": "sha256", "files": files}
    write_json_atomic(ckpt_dir / MANIFEST, manifest)
    num_bytes = sum(f["size"] for f in files.values())
    logger.info("checkpoint manifest %s: %d files, %.1f MB (merged in %.2f s)", ckpt_dir / MANIFEST, len(files),
                num_bytes / 1e6, time.monotonic() - start)
    return manifest


def check_listing(ckpt_dir: Path) -> tuple[Optional[str], Optional[dict[str, tuple[int, str]]]]:
    """The cheap half of verification (no hashing): (why not, None), or (None, the manifest's files),
    or (None, None) for a checkpoint from before manifests. Every listed file must exist with its size.
    A reason starting with "incomplete" means an interrupted save, anything else damage."""
    ckpt_dir = Path(ckpt_dir)
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.exists():
        state_path = ckpt_dir / TRAINER_STATE
        if not state_path.exists():
            return f"incomplete: no {TRAINER_STATE} (the save was interrupted)", None
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return f"{TRAINER_STATE} is unreadable ({type(exc).__name__}: {exc})", None
        if not isinstance(state, dict) or not isinstance(state.get(FORMAT_KEY, 1), int):
            return f"{TRAINER_STATE} is not a trainer state (not an object, or a bad {FORMAT_KEY})", None
        if state.get(FORMAT_KEY, 1) >= 2:
            return f"incomplete: no {MANIFEST} (the save was interrupted after {TRAINER_STATE})", None
        return None, None
    try:
        files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
        expected = {str(rel): (int(e["size"]), str(e["sha256"])) for rel, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__}: {exc})", None
    try:
        for rel, (size, _) in sorted(expected.items()):
            path = ckpt_dir / rel
            if not path.is_file():
                return f"{rel} is missing", None
            actual = path.stat().st_size
            if actual != size:
                return f"{rel} has {actual} bytes, the manifest says {size} (truncated or rewritten)", None
    except OSError as exc:
        return f"a file could not be read ({exc})", None
    return None, expected


def check_share(ckpt_dir: Path, expected: dict[str, tuple[int, str]], rank: int, world: int) -> Optional[str]:
    """Hash this rank's share of `expected` (`owner_of` in this job) and name the first mismatch."""
    mine = sorted(rel for rel in expected if owner_of(rel, world) == rank)
    try:
        hashed = hash_files(Path(ckpt_dir), mine)
    except OSError as exc:
        return f"a file could not be read ({exc})"
    for rel in mine:
        if hashed[rel][1] != expected[rel][1]:
            return f"{rel} does not match its sha256 in the manifest (bytes changed on disk)"
    return None


def verify_checkpoint(ckpt_dir: str | Path, group: Any = None) -> Optional[str]:
    """None when `ckpt_dir` can be resumed from, else why not (naming the file, one line), the same
    on every rank of `group` (a CPU/gloo group; collective over it). Rank 0 checks the listing and
    sizes, every rank hashes its share, the first bad file in path order is the answer. A checkpoint
    from before manifests is accepted unverified (the caller warns)."""
    import torch.distributed as dist

    ckpt_dir = Path(ckpt_dir)
    world = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    box: list = [check_listing(ckpt_dir) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(box, group=group, group_src=0)
    reason, expected = box[0]
    if reason is not None or expected is None:
        return reason
    mine = check_share(ckpt_dir, expected, rank, world)
    if world == 1:
        return mine
    shares: list = [None] * world
    dist.all_gather_object(shares, mine, group=group)
    bad = [s for s in shares if s is not None]
    return min(bad) if bad else None
