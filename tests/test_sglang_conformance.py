"""Every request the trainer sends is one the pinned SGLang accepts, judged by SGLang's own code.

Real trainer runs (`python -m megatron_bapo.train`, as a user runs it) talk to a built-in server
through a recording proxy; `tools/sglang_conformance.py` then checks each recorded request, in
`.venv-sglang` (the `sglang` version `pins.env` names, installed by `tools/install.sh --with-sglang`, which the test command runs), against
SGLang's route table, its `/generate` contract gate, `GenerateReqInput`, `SamplingParams(...)` with
`.normalize()` + `.verify()`, the io_struct request class of every control endpoint, and the
version's protocol rules (updates inside a begin/end session, no flush while paused in place, seeds
only with `--enable-deterministic-inference`).

The runs cover partial rollout (3-token segments of 6-token responses), rollout one step ahead,
every `sync.pause_mode`, abort (the abort pause and the shutdown's abort_all), disk and distributed
(gloo) weight sync with their cache flushes, evaluation, and a Qwen3-MoE run with rollout routing
replay (`return_routed_experts` with `routed_experts_start_len` on every segment, the server launched
with `--enable-return-routed-experts`).
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from run_helpers import ROOT, finish, run_config, start_train, write_assets
from sglang_proxy import RecordingProxy

pytestmark = pytest.mark.slow
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
PINS = dict(line.split("=", 1) for line in (ROOT / "pins.env").read_text().splitlines()
            if line.strip() and not line.startswith("#"))

# (name, sync section, trainer keys, deterministic inference): together every pause mode, both
# sync methods, synchronous and one step ahead; each run is 3 steps with partial rollout and eval.
RUNS = [
    ("disk_abort_ahead", {"method": "disk", "pause_mode": "abort"}, {"async_steps": 1}, True),
    ("disk_inplace", {"method": "disk", "pause_mode": "in_place"}, {"async_steps": 1, "eval_at_start": False}, False),
    ("dist_retract_ahead", {"method": "distributed", "backend": "gloo", "pause_mode": "retract"}, {"async_steps": 1}, True),
    ("dist_nopause", {"method": "distributed", "backend": "gloo", "pause_mode": None},
     {"async_steps": 0, "eval_at_start": False}, False),
    ("moe_replay_dist_abort", {"method": "distributed", "backend": "gloo", "pause_mode": "abort"},
     {"async_steps": 0, "eval_at_start": False}, False),
]
MOE_RUNS = {"moe_replay_dist_abort"}
"""Runs of the tiny Qwen3-MoE with rollout routing replay (the per-expert weights go over the wire too)."""


def check_records(records: Path, vocab_size: int) -> dict:
    out = subprocess.run([str(SGLANG_PYTHON), str(ROOT / "tools" / "sglang_conformance.py"), "--records",
                          str(records), "--vocab-size", str(vocab_size)], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip(), out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


CHECK_EACH = """
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1])
import sglang_conformance
root = sglang_conformance.sglang_root()
sglang_conformance.sglang_root = lambda: root  # after the first check, "sglang" is the bare package it registered
for records, vocab_size in json.loads(sys.argv[2]):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        sglang_conformance.main(["--records", records, "--vocab-size", str(vocab_size)])
    print(printed.getvalue().strip().splitlines()[-1], flush=True)
"""
"""`tools/sglang_conformance.py`'s main on each (records, vocab size) in turn, in one `.venv-sglang`
process (each call checks its file with a new Checker; the sglang files it reads are loaded once)."""


def check_each(files: list[tuple[Path, int]]) -> list[dict]:
    """The reports of `check_records` for each file, in order, from one process."""
    out = subprocess.run([str(SGLANG_PYTHON), "-c", CHECK_EACH, str(ROOT / "tools"),
                          json.dumps([(str(records), vocab) for records, vocab in files])],
                         capture_output=True, text=True, timeout=300)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0 and len(lines) == len(files), out.stdout[-3000:] + out.stderr[-3000:]
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def moe_hf_dir(tmp_path_factory):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("moe"), seed=0, architecture="qwen3_moe")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_hf_dir, moe_hf_dir):
    """Each run's recorded requests (one server per run, behind its own proxy). The runs are
    independent: two go at a time (a run spends most of its time on one core, starting its server and
    importing)."""
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run bash tools/install.sh --with-sglang")
    root = tmp_path_factory.mktemp("conformance")
    write_assets(root)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="conformance") as pool:
        # The MoE run (the longest) first, so that it does not run last and alone.
        futures = {run[0]: pool.submit(_record, root, *run, tiny_hf_dir=tiny_hf_dir, moe_hf_dir=moe_hf_dir)
                   for run in sorted(RUNS, key=lambda run: run[0] not in MOE_RUNS)}
        return {name: futures[name].result() for name, *_ in RUNS}


@pytest.fixture(scope="module")
def reports(recorded, tiny_hf_dir, moe_hf_dir):
    """Each run's conformance report (`check_records`), all from one checker process."""
    from transformers import AutoConfig

    files = [(recorded[name], AutoConfig.from_pretrained(moe_hf_dir if name in MOE_RUNS else tiny_hf_dir).vocab_size)
             for name, *_ in RUNS]
    return dict(zip([r[0] for r in RUNS], check_each(files)))


def _record(root: Path, name: str, sync: dict, trainer: dict, deterministic: bool, *, tiny_hf_dir: Path,
            moe_hf_dir: Path) -> Path:
    """One run behind a recording proxy, on its own built-in server; returns the records' path."""
    from megatron_bapo.server.launch import start_server

    moe = name in MOE_RUNS
    model = moe_hf_dir if moe else tiny_hf_dir
    assets = (root, model)
    records = root / f"{name}.jsonl"
    flags = ["--num-threads", "1", *(["--enable-deterministic-inference"] if deterministic else []),
             *(["--enable-return-routed-experts"] if moe else [])]
    with start_server(model, extra_args=flags) as server, RecordingProxy(server.url, records) as proxy:
        sections = {"sync": {**sync, "group_timeout_s": 120},
                    "rollout": {"group_size": 4, "prompts_per_step": 3, "max_response_tokens": 6,
                                "segment_tokens": 3, "max_staleness": 3, "deterministic_inference": deterministic,
                                "return_routed_experts": moe,
                                "client": {"urls": [proxy.url], "health_timeout_s": 180}}}
        if moe:
            sections["actor"] = {"optim": {"lr": 1e-3}, "n_minibatches": 2, "max_tokens_per_microbatch": 256,
                                 "vocab_divisible_by": 64, "routing_replay": True}
        proc = start_train(run_config(assets, root / name, sections=sections, **trainer), assets)
        log = finish(proc)
        assert proc.returncode == 0, f"{name}: " + log[-4000:]
    return records


def test_pinned_sglang_is_what_the_check_reads():
    version = subprocess.run([str(SGLANG_PYTHON), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                             capture_output=True, text=True, timeout=60).stdout.strip()
    assert version == PINS["SGLANG_VERSION"], f".venv-sglang has sglang {version}, pins.env says {PINS['SGLANG_VERSION']}"


@pytest.mark.parametrize("name", [r[0] for r in RUNS])
def test_every_recorded_request_conforms_to_the_pinned_sglang(recorded, reports, name):
    report = reports[name]
    assert report["checked"] == len(recorded[name].read_text().splitlines())
    assert report["sglang"] == PINS["SGLANG_VERSION"]
    assert report["violations"] == [], "\n".join(report["violations"][:20])
    # The run really exercised what it is meant to cover.
    paths = set(report["paths"])
    _, sync, _, deterministic = next(r for r in RUNS if r[0] == name)
    assert {"/generate", "/server_info", "/health_generate"} <= paths
    if sync["method"] == "distributed":
        assert {"/init_weights_update_group", "/begin_weight_update", "/update_weights_from_distributed",
                "/end_weight_update", "/destroy_weights_update_group"} <= paths
    else:
        assert "/update_weights_from_disk" in paths
    if sync["pause_mode"] is not None:
        assert {"/pause_generation", "/continue_generation"} <= paths
    assert "/abort_request" in paths  # the shutdown aborts what is in flight
    bodies = [json.loads(line) for line in recorded[name].read_text().splitlines()]
    generate = [b["body"] for b in bodies if b["path"] == "/generate"]
    assert any(g["sampling_params"]["max_new_tokens"] < 6 for g in generate)  # partial rollout: segments
    seeded = any("sampling_seed" in g["sampling_params"] for g in generate)
    assert seeded == deterministic
    routed = [g for g in generate if g.get("return_routed_experts")]
    if name in MOE_RUNS:  # every rollout segment asks for the routing of the positions it computes first
        # a first segment from position 0, a resumed one from its last token (the first one not computed yet)
        starts = {g["routed_experts_start_len"] - (len(g["input_ids"]) - 1) if g["routed_experts_start_len"] else 0
                  for g in routed}
        assert starts == {0} and any(g["routed_experts_start_len"] > 0 for g in routed)
    else:
        assert not routed


def test_the_check_catches_what_the_old_client_sent(tmp_path, tiny_hf_dir):
    """What the client sent before this change, replayed to the checker: a seed to a server without
    deterministic inference, a distributed update outside a session with the default flush, and a
    disk update's default flush while paused in place are each named."""
    from transformers import AutoConfig

    records = tmp_path / "old.jsonl"
    rows = [
        {"method": "GET", "path": "/get_server_info", "body": None},
        {"method": "GET", "path": "/get_server_info", "body": None, "reply": {"tp_size": 1}, "replay": True},
        {"method": "POST", "path": "/generate", "body": {"input_ids": [5, 6], "return_logprob": True, "rid": "a" * 32,
         "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "ignore_eos": False, "no_stop_trim": True,
                             "spaces_between_special_tokens": False, "max_new_tokens": 3, "sampling_seed": 7}}},
        {"method": "POST", "path": "/pause_generation", "body": {"mode": "in_place"}},
        {"method": "POST", "path": "/update_weights_from_disk", "body": {"model_path": "/w", "weight_version": "1",
                                                                        "abort_all_requests": False}},
        {"method": "POST", "path": "/continue_generation", "body": {}},
        {"method": "POST", "path": "/update_weights_from_distributed", "body": {
            "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[4, 4]], "group_name": "weight_update_group",
            "flush_cache": True, "weight_version": "2"}},
    ]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = check_records(records, AutoConfig.from_pretrained(tiny_hf_dir).vocab_size)
    text = "\n".join(report["violations"])
    assert "deprecated" in text and "/get_server_info" in text
    assert "sampling_seed sent to a server without --enable-deterministic-inference" in text
    assert "flush_cache (explicit or the default true) while paused in place" in text
    assert "outside a begin/end weight-update session" in text


def test_the_check_catches_routing_a_server_would_drop_or_refuse(tmp_path, tiny_hf_dir):
    """`return_routed_experts` to a server launched without --enable-return-routed-experts (SGLang ignores
    it: replay would get nothing), and a start beyond the input (SGLang aborts the request)."""
    from transformers import AutoConfig

    records = tmp_path / "routed.jsonl"
    body = {"input_ids": [5, 6], "return_logprob": True, "return_routed_experts": True, "routed_experts_start_len": 3,
            "rid": "b" * 32, "sampling_params": {"max_new_tokens": 3}}
    rows = [{"method": "GET", "path": "/server_info", "body": None, "reply": {"enable_return_routed_experts": False}},
            {"method": "POST", "path": "/generate", "body": body}]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = "\n".join(check_records(records, AutoConfig.from_pretrained(tiny_hf_dir).vocab_size)["violations"])
    assert "return_routed_experts sent to a server without --enable-return-routed-experts" in text
    assert "routed_experts_start_len=3 outside [0, 2]" in text


def test_an_end_without_session_is_only_the_clearing_before_a_join(tmp_path, tiny_hf_dir):
    """The pool's clearing of what a dead trainer left (`/end_weight_update`, then
    `/destroy_weights_update_group`, both no-ops on a clean SGLang) passes; an end without an open
    session followed by anything else, or by nothing, is named."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_hf_dir).vocab_size
    end = {"method": "POST", "path": "/end_weight_update", "body": {}}
    destroy = {"method": "POST", "path": "/destroy_weights_update_group", "body": {"group_name": "weight_update_group"}}
    flush = {"method": "POST", "path": "/flush_cache", "body": None}
    cases = (("clearing", [end, destroy, flush], 0), ("stray", [end, flush], 1), ("last", [end], 1))
    for name, rows, _ in cases:
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    reports = check_each([(tmp_path / f"{name}.jsonl", vocab) for name, _, _ in cases])
    for (name, _, bad), report in zip(cases, reports):
        violations = report["violations"]
        assert len(violations) == bad, (name, violations)
        assert all("#0 POST /end_weight_update: no weight-update session is open" in v for v in violations), violations


def test_a_teacher_prefill_conforms_and_a_start_sglang_would_refuse_is_named(tmp_path, tiny_hf_dir):
    """The teacher's prefill (`rollout.prefill.prefill_request`: `max_new_tokens` 0, `return_logprob`,
    `logprob_start_len` one before the response) passes the pinned SGLang's gate, `GenerateReqInput` and
    `SamplingParams`; a start past the input (the scheduler aborts it) or without `return_logprob` (reset
    to -1: no input log-probs) is named. What the reply holds: `teacher_contract.py`, live."""
    from transformers import AutoConfig

    from megatron_bapo.rollout.prefill import prefill_request

    good = {**prefill_request([5, 6, 7], [8, 9]), "rid": "c" * 32}
    rows = [{"method": "POST", "path": "/generate", "body": body}
            for body in (good, {**good, "logprob_start_len": 6}, {**good, "return_logprob": False})]
    records = tmp_path / "prefill.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = check_records(records, AutoConfig.from_pretrained(tiny_hf_dir).vocab_size)
    assert report["checked"] == 3 and len(report["violations"]) == 2, report["violations"]
    first, second = report["violations"]
    assert first.startswith("#1 POST /generate: logprob_start_len=6 outside [0, 5]"), first
    assert second.startswith("#2 POST /generate: logprob_start_len=2 without return_logprob"), second
