"""What a checkpoint records about its run, and what a resume compares (`megatron_bapo.run_record`):
changes megatron reshards (TP/PP/VPP/CP/DP) are allowed and described; changes a resume cannot honour
are one `CheckpointError` naming each field, the old and new value, and the ways out."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from megatron_bapo import run_record
from megatron_bapo.config import load_run_config
from megatron_bapo.run_state import CheckpointError


@pytest.fixture
def setup(tmp_path, tiny_hf_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))

    def record(*overrides: str, world_size: int = 1, hf=None):
        cfg = load_run_config(None, [f"model.hf_path={tiny_hf_dir}", f"data.path={data}", "actor.vocab_divisible_by=64",
                                     *overrides])
        return run_record.describe(cfg, hf or AutoConfig.from_pretrained(tiny_hf_dir), world_size=world_size)

    return record, data


def test_record_is_json_and_names_what_resume_depends_on(setup):
    record, data = setup
    rec = record()
    assert json.loads(json.dumps(rec)) == rec
    assert rec["data"]["size"] == data.stat().st_size and len(rec["data"]["sha256_head_tail"]) == 64
    assert rec["rollout"] == {"group_size": 8, "prompts_per_step": 8}
    assert rec["model"]["architecture"] == "Qwen2ForCausalLM" and rec["model"]["num_layers"] == 2
    assert rec["model"]["vocab_size"] % 64 == 0  # the padded vocabulary: the embedding's shape
    assert rec["optimizer"] == {"distributed": True, "name": "adam"}
    assert rec["layout"] == {"tp": 1, "pp": 1, "vpp": None, "cp": 1, "dp": 1}
    assert run_record.check_resume(rec, record(), "ckpt") == []


def test_reshardable_layouts_and_a_moved_file_are_allowed_and_described(setup, tmp_path):
    record, data = setup
    saved = record("actor.parallel.tp=2", world_size=4)
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(data.read_bytes())
    now = record(world_size=2)
    now["data"] = run_record.data_fingerprint(moved) | {k: now["data"][k] for k in run_record.DATA_KEYS}
    notes = run_record.check_resume(saved, now, "ckpt")
    assert notes[0] == f"data file moved: {data} -> {moved} (same size and content)"
    assert notes[1].startswith("layout TP2 PP1 CP1 DP2 -> TP1 PP1 CP1 DP2: megatron reshards")


def test_what_resume_cannot_honour_is_one_error_naming_each_field(setup, tmp_path, tiny_hf_dir):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    record, data = setup
    saved = record()
    data.write_text(data.read_text().replace("+", "-"))  # same size, same rows, other prompts
    wider = AutoConfig.from_pretrained(make_tiny_hf_checkpoint(tmp_path / "wider", hidden_size=128))
    now = record("rollout.group_size=4", "rollout.prompts_per_step=16", "actor.use_distributed_optimizer=false",
                 "actor.optim.name=sgd", "data.max_prompt_tokens=64", hf=wider)
    with pytest.raises(CheckpointError) as err:
        run_record.check_resume(saved, now, "out/checkpoints/step_000004")
    msg = str(err.value)
    assert msg.startswith("cannot resume from out/checkpoints/step_000004: data.path: ")
    for needle in ("is not the file the checkpoint was trained on", "data.max_prompt_tokens None -> 64",
                   "rollout.group_size 8 -> 4", "rollout.prompts_per_step 8 -> 16", "hidden_size 64 -> 128",
                   "actor.use_distributed_optimizer True -> False", "actor.optim.name adam -> sgd",
                   "--no-resume (trainer.resume=false) or a new trainer.output_dir"):
        assert needle in msg, needle
    assert "\n" not in msg


def test_a_checkpoint_without_a_record_resumes_unchecked_with_a_note(setup):
    record, _ = setup
    [note] = run_record.check_resume(None, record(), "out/checkpoints/step_000002")
    assert note.startswith("step_000002 was written before checkpoints recorded their run")


def test_fingerprint_reads_both_ends_of_a_large_file(tmp_path):
    big = tmp_path / "big.jsonl"
    body = bytearray(b"x" * (3 * run_record.DATA_PROBE_BYTES))
    big.write_bytes(bytes(body))
    before = run_record.data_fingerprint(big)
    body[-1:] = b"y"
    big.write_bytes(bytes(body))
    assert run_record.data_fingerprint(big)["sha256_head_tail"] != before["sha256_head_tail"]
    assert run_record.data_fingerprint(big)["size"] == before["size"]


def test_machine_record_names_the_cpu_and_the_kernels_torch_dispatches_to(setup):
    """Two runs' numbers differ across CPU kinds (matmul and reduction kernels differ by instruction
    set), so the record names the CPU and torch's kernels, read from this machine: the model name as
    `lscpu` reports it, and the capability torch picks, which ATEN_CPU_CAPABILITY lowers."""
    import os
    import shutil
    import subprocess
    import sys

    import torch

    record, _ = setup
    machine = record()["machine"]
    assert machine == run_record.machine_record()
    assert machine["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert machine["torch_version"] == torch.__version__ and machine["num_cpus"] == os.cpu_count()
    assert machine["aten_cpu_capability_env"] == os.environ.get("ATEN_CPU_CAPABILITY")
    if shutil.which("lscpu"):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}).stdout
        lscpu = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        if "Model name" in lscpu:
            assert machine["cpu_model"] == lscpu["Model name"].strip()
        if "Vendor ID" in lscpu:
            assert machine["cpu_vendor"] == lscpu["Vendor ID"].strip()
    forced = subprocess.run([sys.executable, "-c", "import json; from megatron_bapo.run_record import machine_record; "
                             "print(json.dumps(machine_record()))"], capture_output=True, text=True, check=True,
                            env={**os.environ, "ATEN_CPU_CAPABILITY": "default"})
    lowered = json.loads(forced.stdout)
    assert (lowered["torch_cpu_capability"], lowered["aten_cpu_capability_env"]) == ("DEFAULT", "default")
    assert lowered["cpu_model"] == machine["cpu_model"]
    line = run_record.describe_machine(lowered)
    assert line.startswith(f"{machine['cpu_model']} ({machine['cpu_vendor']}, {os.cpu_count()} cpus), torch ")
    assert line.endswith("CPU capability DEFAULT (ATEN_CPU_CAPABILITY=default)")
    # config.yaml's header: one comment line, so the file still loads as a config.
    header = run_record.machine_header()
    assert header.startswith("# machine: {") and header.count("\n") == 1
    assert run_record.read_machine_header(header + "trainer:\n  seed: 1\n") == run_record.machine_record()
    assert run_record.read_machine_header("trainer:\n  seed: 1\n") is None


def test_a_resume_on_another_cpu_kind_is_noted(setup):
    record, _ = setup
    saved, now = record(), record()
    saved["machine"] = {**saved["machine"], "cpu_model": "AMD EPYC 9B14", "cpu_vendor": "AuthenticAMD"}
    [note] = run_record.check_resume(saved, now, "ckpt")
    assert note.startswith("machine AMD EPYC 9B14 (AuthenticAMD, ") and "other CPU kernels" in note
    assert run_record.check_resume(record(), now, "ckpt") == []
