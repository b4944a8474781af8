"""Trainer checkpoint bookkeeping: atomic completion marker, `latest` pointer, pruning, RNG."""

import random

import numpy as np

from megatron_bapo import run_state


def _complete(tmp_path, step, **extra):
    d = run_state.checkpoint_dir(tmp_path, step)
    d.mkdir(parents=True)
    run_state.save_trainer_state(d, {"step": step, **extra})
    return d


def test_latest_is_newest_complete_checkpoint(tmp_path):
    assert run_state.latest_checkpoint(tmp_path) is None
    _complete(tmp_path, 2)
    d4 = _complete(tmp_path, 4)
    # A directory without trainer.json (killed mid-save) is never a resume point.
    run_state.checkpoint_dir(tmp_path, 6).mkdir(parents=True)
    assert run_state.latest_checkpoint(tmp_path) == d4
    # A stale pointer (naming a deleted checkpoint) falls back to scanning.
    (tmp_path / "checkpoints" / "latest").write_text("step_000009")
    assert run_state.latest_checkpoint(tmp_path) == d4


def test_state_round_trip_restores_rng(tmp_path):
    random.seed(3)
    np.random.seed(3)
    d = _complete(tmp_path, 1, version=7, buffer={"a": [1, 2]})
    expected = (random.random(), float(np.random.rand()))
    random.seed(99)
    np.random.seed(99)
    state = run_state.load_trainer_state(d)
    assert state["step"] == 1 and state["version"] == 7 and state["buffer"] == {"a": [1, 2]}
    assert (random.random(), float(np.random.rand())) == expected


def test_prune_keeps_newest(tmp_path):
    for s in (1, 2, 3, 4):
        _complete(tmp_path, s)
    run_state.prune_checkpoints(tmp_path, keep=2)
    left = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert left == ["step_000003", "step_000004"]
