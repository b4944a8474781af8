"""A resume checks what the checkpoint means, not only its shapes (`megatron_bapo.run_record`,
`megatron_bapo.resume_policy`), through the CLI as a user resumes: another model of the same shapes
is refused in one `checkpoint error:` line; a changed learning rate, preset or sampling setting is
applied (the metrics show it) with one `resume:` line each, old -> new; a setting the checkpoint
cannot honour is refused; the table of every field in docs/faults.md is complete and current.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_bapo.metrics import read_jsonl_metrics
from run_helpers import finish, last_line, run_config, start_train, write_assets

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    return write_assets(tmp_path_factory.mktemp("resume_assets")), tiny_hf_dir


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    """Two steps at lr 1e-4 with the `bapo` preset, checkpointed at step 2."""
    out = tmp_path_factory.mktemp("trained") / "run"
    config = run_config(assets, out, total_steps=2, save_every=2, eval_at_start=False)
    proc = start_train(config, assets, "eval.every_n_steps=0", "actor.optim.lr=1e-4")
    log = finish(proc)
    assert proc.returncode == 0, log[-3000:]
    return out


def _resume(assets, trained, tmp_path, *overrides: str, total_steps: int = 4):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    config = run_config(assets, out, total_steps=total_steps, save_every=0, eval_at_start=False)
    proc = start_train(config, assets, "--resume", "eval.every_n_steps=0", *overrides)
    return proc, finish(proc), out


@pytest.mark.slow
def test_changed_settings_are_applied_with_one_line_each(assets, trained, tmp_path):
    moved = tmp_path / "same_model_elsewhere"
    shutil.copytree(assets[1], moved)
    proc, log, out = _resume(assets, trained, tmp_path, "actor.optim.lr=1e-3", "bapo_preset=grpo",
                             "rollout.sampling.temperature=0.9", f"model.hf_path={moved}")
    assert proc.returncode == 0, log[-4000:]
    lines = [ln for ln in log.splitlines() if ln.startswith("resume: ")]
    assert sum(ln.startswith("resume: actor.optim.lr 0.0001 -> 0.001 (the LR schedule is rebuilt") for ln in lines) == 1, lines
    assert sum(ln.startswith("resume: bapo_preset 'bapo' -> 'grpo'") for ln in lines) == 1, lines
    assert sum(ln.startswith("resume: actor.bapo.low_start 0.6 -> 0.8") for ln in lines) == 1, lines
    assert sum(ln.startswith("resume: rollout.sampling.temperature 1.0 -> 0.9") for ln in lines) == 1, lines
    assert sum(ln.startswith(f"resume: model moved: {assets[1]} -> {moved} (same weights)") for ln in lines) == 1, lines
    assert not any("trainer.resume" in ln for ln in lines), lines  # changed by every resume: no line
    assert sum(ln.startswith("resume: trainer.total_steps 2 -> 4") for ln in lines) == 1, lines
    updates = [r for r in read_jsonl_metrics(out / "tb") if "actor/lr" in r]
    before = [r for r in updates if r["step"] <= 2]
    after = [r for r in updates if r["step"] > 2]
    assert before and after, updates
    assert all(r["actor/lr"] == pytest.approx(1e-4) for r in before)
    assert all(r["actor/lr"] == pytest.approx(1e-3) for r in after), [r["actor/lr"] for r in after]
    # grpo: fixed bounds 0.8 / 1.2, which the search cannot move
    assert all(r["bapo/c_low"] == pytest.approx(0.8) and r["bapo/c_high"] == pytest.approx(1.2) for r in after)


@pytest.mark.slow
def test_another_model_of_the_same_shapes_and_an_unhonourable_setting_are_refused(assets, trained, tmp_path):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    other = make_tiny_hf_checkpoint(tmp_path / "other_seed", seed=7)  # the same shapes, other weights
    proc, log, out = _resume(assets, trained, tmp_path, f"model.hf_path={other}", "actor.seed=7")
    assert proc.returncode == 2, log[-4000:]
    last = last_line(log)
    assert last.startswith("checkpoint error: cannot resume from ") and "step_000002" in last, last
    assert f"model.hf_path: {other} holds other weights than the model this run started from" in last, last
    assert "actor.seed 1234 -> 7 (the checkpoint restores the RNG streams" in last, last
    assert "Traceback" not in log
    assert "actor built" not in (out / "logs" / "train.log").read_text().split("resuming from")[-1]


def test_every_config_field_has_a_resume_policy_and_docs_show_the_table():
    from megatron_bapo.resume_policy import POLICY, REFUSED, leaf_fields, resume_table

    fields = list(leaf_fields())
    missing = [f for f in fields if f not in POLICY]
    assert not missing, f"add these fields to megatron_bapo/resume_policy.py POLICY: {missing}"
    stale = [f for f in POLICY if f not in fields]
    assert not stale, f"POLICY names fields RunConfig no longer has: {stale}"
    docs = (ROOT / "docs" / "faults.md").read_text()
    assert resume_table() in docs, ("docs/faults.md's resume table is out of date: paste the output of "
                                    "`python -m megatron_bapo.resume_policy`")
    assert {"model.hf_path", "data.path", "rollout.group_size", "actor.optim.name"} <= \
        {f for f, (kind, _) in POLICY.items() if kind == REFUSED}
