"""SFT warm start, answer decoding and the make_tiny CLI on the real tiny model (small and fast)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_bapo.tiny.checkpoint import build_tiny_model
from megatron_bapo.tiny.decode import answer_accuracy, generate_answers
from megatron_bapo.tiny.sft import IGNORE_INDEX, SFTConfig, make_sft_batch, run_sft
from megatron_bapo.tiny.task import TaskConfig, generate_splits
from megatron_bapo.tiny.tokenizer import build_tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]


def test_sft_batch_labels_only_answer_and_eos():
    tok = build_tiny_tokenizer()
    batch = make_sft_batch(tok, [{"prompt": "7+5=", "answer": "21"}, {"prompt": "47+38=", "answer": "58"}])
    assert batch["input_ids"].shape == (2, 9)
    assert tok.decode(batch["input_ids"][0, :7].tolist()) == "7+5=21<|endoftext|>"
    labels = batch["labels"][0].tolist()
    assert labels[:4] == [IGNORE_INDEX] * 4 and labels[4:7] == tok.encode("21") + [tok.eos_token_id]
    assert labels[7:] == [IGNORE_INDEX] * 2 and batch["attention_mask"][0].tolist() == [1] * 7 + [0] * 2
    assert (batch["labels"][1] != IGNORE_INDEX).sum() == 3


def test_sft_lowers_loss_and_is_deterministic():
    tok = build_tiny_tokenizer()
    train, _ = generate_splits(TaskConfig(num_train=500, num_test=10))
    config = SFTConfig(max_steps=40, batch_size=32, lr=3e-3, eval_every=20, num_eval=20, target_accuracy=None)
    results, params = [], []
    for _ in range(2):
        model = build_tiny_model(tok, seed=1)
        results.append(run_sft(model, tok, train, config))
        params.append(model.model.embed_tokens.weight.detach().clone())
    first, second = results
    assert first.num_steps == 40 and first.stopped_because == "max_steps"
    assert [c["step"] for c in first.curve] == [20, 40]
    assert sum(first.losses[-5:]) / 5 < 0.6 * sum(first.losses[:5]) / 5
    assert first.losses == second.losses and torch.equal(params[0], params[1])


def test_sft_stops_at_the_first_step_over_the_target_not_the_first_check():
    """A check every `eval_every` steps, and when one reaches the target, its steps again from the
    previous check's state with a check after each: the stop lands on the first step over the target.
    Stopping at the check instead overshot by up to `eval_every` steps of a steep curve, so two CPU
    kinds stopped at 0.335 and 0.485 validation accuracy (issue 43). The replay restores everything
    (weights, optimizer, schedule, data order): it ends where a plain run of that many steps ends."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=2)
    prompts = [r["prompt"] for r in generate_splits(TaskConfig(num_train=60, num_test=1))[0]]
    # References = the model's own greedy outputs, so accuracy is ~1 at once and stays (it is trained on them).
    rows = [{"prompt": p, "answer": a} for p, a in zip(prompts, generate_answers(model, tok, prompts))
            if a and not any(c.isspace() for c in a)]
    assert len(rows) >= 10
    start = {k: v.clone() for k, v in model.state_dict().items()}
    config = SFTConfig(max_steps=9, batch_size=8, lr=1e-3, eval_every=5, num_eval=10, loop_fraction=0.0,
                       target_accuracy=None)

    def run(**changes):
        model.load_state_dict(start)
        steps: list[int] = []
        result = run_sft(model, tok, rows, SFTConfig(**{**config.__dict__, **changes}),
                         on_step=lambda step, loss: steps.append(step))
        return result, {k: v.clone() for k, v in model.state_dict().items()}, steps

    plain, _, steps = run()  # no target: every step, however good the model is
    assert (plain.stopped_because, plain.num_steps, steps) == ("max_steps", 9, list(range(1, 10)))
    assert [c["step"] for c in plain.curve] == [5, 9] and min(c["greedy_accuracy"] for c in plain.curve) >= 0.9
    result, _, steps = run(target_accuracy=0.9)  # step 5's check reaches it: steps 1-5 again, step 1 stops
    assert (result.stopped_because, result.num_steps, [c["step"] for c in result.curve]) == ("target_reached", 1, [1])
    assert steps == [1, 2, 3, 4, 5] and result.losses == plain.losses[:1]  # the progress bar counts each step once
    result, weights, _ = run(target_accuracy=0.9, min_steps=3)
    assert (result.stopped_because, result.num_steps, [c["step"] for c in result.curve]) == ("target_reached", 3,
                                                                                             [1, 2, 3])
    assert result.losses == plain.losses[:3]
    _, fixed, _ = run(max_steps=3)
    assert all(torch.equal(weights[k], fixed[k]) for k in fixed) and not torch.equal(fixed["lm_head.weight"],
                                                                                     start["lm_head.weight"])


def test_greedy_decoding_matches_hf_generate():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=2)
    prompts = ["1+2=", "47+38=", "9+10=", "99+99="]
    ours = generate_answers(model, tok, prompts, max_new_tokens=5)
    for prompt, answer in zip(prompts, ours):
        out = model.generate(torch.tensor([tok.encode(prompt)]), max_new_tokens=5, do_sample=False)
        text = tok.decode(out[0, len(tok.encode(prompt)):].tolist(), skip_special_tokens=False)
        assert text.split("<|endoftext|>")[0].replace("<|pad|>", "") == answer
    rows = [{"prompt": p, "answer": a} for p, a in zip(prompts, ours) if a.strip() and " " not in a.strip()]
    assert rows  # the model's own greedy outputs, used as references, score 1.0 greedily
    assert answer_accuracy(model, tok, rows, max_new_tokens=5) == 1.0


# One small build that two tests share: --num-eval keeps each evaluation to 40 problems (the defaults,
# 500 and 200, decode for minutes), --sft-steps 4 still ends SFT with an evaluation (one curve point).
MAKE_TINY_ARGS = ["--sft-steps", "4", "--seed", "3", "--num-eval", "40"]


def _make_tiny(out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tools" / "make_tiny.py"), "--out", str(out), *MAKE_TINY_ARGS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The make_tiny CLI's output directory (read only: tests that write copy it) and its process."""
    out = tmp_path_factory.mktemp("make_tiny") / "tiny"
    proc = _make_tiny(out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out, proc


@pytest.mark.slow
def test_make_tiny_cli_builds_and_refuses_to_overwrite(built):
    out, proc = built
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    info = json.loads((out / "info.json").read_text())
    assert summary["base_accuracy"] == info["base_accuracy"]
    assert info["sft"]["num_steps"] == 4 and info["config"]["seed"] == 3
    assert [c["step"] for c in info["sft"]["curve"]] == [4] and info["config"]["sft"]["num_eval"] == 40
    assert 0.0 <= info["base_accuracy"]["greedy"] <= 1.0 and info["base_accuracy"]["num_problems"] == 40
    assert info["sft"]["stopped_because"] == "max_steps" and info["config"]["sft"]["target_accuracy"] == 0.4
    # The machine that built them (the same seeds give other weights on another CPU kind), read here.
    assert info["machine"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["machine"]["torch_version"] == torch.__version__ and info["machine"]["num_cpus"] == os.cpu_count()
    assert info["machine"]["cpu_model"] and info["machine"]["cpu_vendor"]
    assert f"CPU capability {torch.backends.cpu.get_cpu_capability()}" in summary["machine"]
    train = (out / "data" / "train.jsonl").read_text().splitlines()
    assert len(train) == 4000 and {"prompt", "answer"} <= set(json.loads(train[0]))
    model = AutoModelForCausalLM.from_pretrained(out / "base_model")
    assert model.config.hidden_size == 128 and model.config.num_hidden_layers == 4
    assert len(AutoTokenizer.from_pretrained(out / "base_model")) == model.config.vocab_size

    before = (out / "info.json").read_bytes()
    again = _make_tiny(out)
    assert again.returncode == 2 and "--force" in again.stderr
    assert (out / "info.json").read_bytes() == before


def test_looped_examples_repeat_the_answer_to_the_limit_without_eos():
    """The base's looping habit: a looped example is the answer repeated with "=" to loop_tokens
    tokens, all of them trained, and no EOS (so the policy learns to keep going)."""
    tok = build_tiny_tokenizer()
    rows = [{"prompt": "7+5=", "answer": "21"}, {"prompt": "47+38=", "answer": "58"}]
    batch = make_sft_batch(tok, rows, looped=[True, False], loop_tokens=12)
    assert tok.decode(batch["input_ids"][0, :16].tolist()) == "7+5=21=21=21=21="
    labels = batch["labels"][0].tolist()
    assert labels[4:16] == tok.encode("21=21=21=21=") and tok.eos_token_id not in labels
    assert tok.decode(batch["input_ids"][1, :9].tolist()) == "47+38=58<|endoftext|>"
    # The arithmetic reward scores a looped response 0: the answer must be the whole first word.
    from megatron_bapo.rewards.arithmetic import arithmetic_reward

    assert arithmetic_reward("21=21=21=21=", "21") == 0.0 and arithmetic_reward("21", "21") == 1.0


def _without_timings(value):
    """info.json less its wall-clock fields (seconds), the only part a rebuild may change."""
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if not k.startswith("seconds")}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


@pytest.mark.slow
def test_building_the_tiny_assets_twice_gives_identical_files(built, tmp_path):
    """The quick start builds its own assets on a fresh clone: on one CPU kind the same command must
    give the same model (byte for byte) and data, or README numbers could not be reproduced (another
    CPU kind's kernels give other last bits: info.json names the machine). (The second build of
    the shared one: the same command, SFT curve and base accuracy included.)"""
    first = built[0]
    proc = _make_tiny(tmp_path / "again")
    assert proc.returncode == 0, proc.stderr[-2000:]
    digests = []
    for root in (first, tmp_path / "again"):
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != "info.json")
        digests.append({str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files})
    assert "base_model/model.safetensors" in digests[0] and "data/train.jsonl" in digests[0]
    assert digests[0] == digests[1]
    infos = [json.loads((root / "info.json").read_text()) for root in (first, tmp_path / "again")]
    assert infos[0]["sft"]["curve"] and infos[0]["base_accuracy"]["num_problems"] > 0
    assert _without_timings(infos[0]) == _without_timings(infos[1])


@pytest.mark.slow
def test_make_tiny_adds_a_teacher_with_the_students_tokenizer_to_built_assets(built, tmp_path):
    """`--teacher` on complete assets builds only OUT/teacher_model: the base's SFT continued (here a few
    steps), the base untouched, the student's tokenizer (what a distillation run checks at start), its
    accuracies in info.json; a second build is refused without --force."""
    import shutil

    from megatron_bapo.rollout.teacher import check_same_tokenizer

    out = tmp_path / "tiny"
    shutil.copytree(built[0], out)
    base = (out / "base_model" / "model.safetensors").read_bytes()
    args = ["--out", str(out), "--teacher", "--teacher-sft-steps", "3", "--teacher-target-accuracy", "none",
            "--num-eval", "20"]
    cmd = [sys.executable, str(REPO / "tools" / "make_tiny.py"), *args]
    run = lambda: subprocess.run(cmd, capture_output=True, text=True, timeout=300,  # noqa: E731
                                 env=dict(os.environ, PYTHONPATH=str(REPO)))
    proc = run()
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    teacher = json.loads((out / "info.json").read_text())["teacher"]
    assert summary["teacher_sft_steps"] == teacher["sft"]["num_steps"] == 3
    assert teacher["sft"]["stopped_because"] == "max_steps" and teacher["accuracy"]["num_problems"] == 20
    assert (out / "base_model" / "model.safetensors").read_bytes() == base
    assert (out / "teacher_model" / "model.safetensors").read_bytes() != base
    check_same_tokenizer(str(out / "base_model"), str(out / "teacher_model"))
    again = run()
    assert again.returncode == 2 and "--force" in again.stderr
