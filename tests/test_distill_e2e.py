"""On-policy distillation end to end, through the CLI as a user runs it: the tiny student trains three
steps against a teacher pool (another tiny model with the student's tokenizer) started by the driver in
its own process (`trainer.driver_process: true`), every finished response scored by the teacher; a
teacher with another tokenizer is refused at start in one line naming both paths."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_bapo.metrics import read_jsonl_metrics
from run_helpers import finish, last_line, pid_alive, run_config, start_train, write_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory, tiny_hf_dir):
    return write_assets(tmp_path_factory.mktemp("distill_assets")), tiny_hf_dir


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("teacher"), seed=1)  # other weights, same tokenizer


def _config(assets, out, teacher, **trainer):
    return run_config(assets, out, eval_at_start=False, **trainer, sections={
        "teacher": {"model_path": str(teacher), "client": {"health_timeout_s": 180}},
        "distill": {"coef": 1.0, "reward_coef": 0.5}})


def test_a_short_distillation_run_trains_against_a_teacher_pool(assets, teacher, tmp_path):
    out = tmp_path / "run"
    proc = start_train(_config(assets, out, teacher, driver_process=True), assets)
    log = finish(proc)
    assert proc.returncode == 0, log[-4000:]
    done = last_line(log)
    assert done.startswith("done: steps 1-3") and "0 of 3 steps updated" not in done, done
    steps = [r for r in read_jsonl_metrics(out / "tb") if "distill/reverse_kl_mean" in r]
    assert steps and all(r["distill/num_groups_dropped"] == 0 for r in steps), steps
    assert sum(r["distill/num_teacher_scored"] for r in steps) >= 12  # every finished response, once
    assert all(r["distill/reverse_kl_mean"] == r["distill/reverse_kl_mean"] for r in steps)  # finite, not NaN
    assert any("bapo/rho_before" in r for r in read_jsonl_metrics(out / "tb"))  # BAPO's balance, as for any run
    [server] = json.loads((out / "teacher_servers.json").read_text())
    assert not pid_alive(server["pid"])  # stopped with the run
    assert json.loads((out / "servers.json").read_text())[0]["url"] != server["url"]
    updated = "weights updated from"  # the built-in server's line for every update it applied
    assert (out / "logs" / "server_0.log").read_text().count(updated) >= 1  # the policy's: synced
    assert updated not in (out / "logs" / "teacher_server_0.log").read_text()  # the teacher's: never
    assert "teacher pool: " in (out / "logs" / "train.log").read_text()


def test_a_teacher_with_another_tokenizer_is_refused_at_start(assets, tmp_path):
    from megatron_bapo.tiny.tokenizer import build_tiny_tokenizer

    other = tmp_path / "other_teacher"
    shutil.copytree(assets[1], other)
    build_tiny_tokenizer(pad_to_multiple_of=256).save_pretrained(other)
    out = tmp_path / "run"
    proc = start_train(_config(assets, out, other), assets)
    log = finish(proc)
    assert proc.returncode == 2, log[-4000:]
    line = last_line(log)
    assert line.startswith("config error: ") and f"teacher.model_path='{other}'" in line, line
    assert f"model.hf_path='{assets[1]}'" in line and "another tokenizer" in line, line
    assert not (out / "teacher_servers.json").exists() and not (out / "servers.json").exists()


def test_a_teacher_whose_context_cannot_hold_a_response_is_refused_at_start(assets, tmp_path):
    """The teacher's prefill input is prompt + response: its context must hold the longest prompt
    (data.max_prompt_tokens: 32) + rollout.max_response_tokens (6) as an input, one position more than
    a generation needs: a context of exactly 38 is refused for the teacher (it would do for the policy)."""
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    short = make_tiny_hf_checkpoint(tmp_path / "short_teacher", seed=1, max_position_embeddings=38)
    out = tmp_path / "run"
    proc = start_train(_config(assets, out, short), assets)
    log = finish(proc)
    assert proc.returncode == 2, log[-4000:]
    line = last_line(log)
    assert line.startswith("config error: rollout.max_response_tokens=6 + the longest prompt (32 tokens") and \
        "= 38 exceeds the context length 38 of teacher server http://127.0.0.1:" in line and \
        "(less one: a prefill input)" in line, line
