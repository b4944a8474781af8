"""Trainer checkpoints: where they live, how they are written atomically, how a run resumes.

    <output_dir>/checkpoints/step_000010/actor/        megatron dist checkpoint (Actor.save_checkpoint)
    <output_dir>/checkpoints/step_000010/trainer.json  step, policy version, data position,
                                                       partial-rollout buffer, RNG, config
    <output_dir>/checkpoints/latest                    name of the newest complete checkpoint

A checkpoint directory is complete once `trainer.json` exists in it (written last, via a temp
file and `os.replace`), and `latest` is only moved after that, so a process killed at any point
leaves the previous checkpoint as the resume point: samples drawn after it are drawn again on
resume (same data order), none is lost or trained twice.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np

TRAINER_STATE = "trainer.json"
LATEST = "latest"


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
    """Write `trainer.json` last and point `latest` at this checkpoint (rank 0 only)."""
    state = {**state, "rng": _rng_state()}
    write_json_atomic(ckpt_dir / TRAINER_STATE, state)
    latest = ckpt_dir.parent / LATEST
    tmp = latest.with_name(LATEST + ".tmp")
    tmp.write_text(ckpt_dir.name, encoding="utf-8")
    os.replace(tmp, latest)


def latest_checkpoint(output_dir: str | Path) -> Optional[Path]:
    """The newest complete checkpoint, or None. Falls back to scanning when `latest` is stale."""
    root = Path(output_dir) / "checkpoints"
    pointer = root / LATEST
    if pointer.exists():
        candidate = root / pointer.read_text(encoding="utf-8").strip()
        if (candidate / TRAINER_STATE).exists():
            return candidate
    complete = sorted(p for p in root.glob("step_*") if (p / TRAINER_STATE).exists())
    return complete[-1] if complete else None


def load_trainer_state(ckpt_dir: Path) -> dict[str, Any]:
    state = json.loads((ckpt_dir / TRAINER_STATE).read_text(encoding="utf-8"))
    _set_rng_state(state.pop("rng"))
    return state


def prune_checkpoints(output_dir: str | Path, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints (never the one `latest` names)."""
    if keep <= 0:
        return
    root = Path(output_dir) / "checkpoints"
    current = latest_checkpoint(output_dir)
    complete = sorted(p for p in root.glob("step_*") if (p / TRAINER_STATE).exists())
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
