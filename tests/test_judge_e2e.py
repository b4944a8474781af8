"""`reward.fn: judge` through `python -m megatron_bapo.train`, as a user runs it: the built-in server
serves the tiny model as a yes/no judge beside the run's own server, grading training rewards and the
avg@k evaluation. A random tiny model's verdicts are arbitrary (mostly no "yes"/"no" at all), so the
run scores a missing verdict 0 (`on_failure: score_zero`) and lifts the failure limit; what is checked
is that the run completes and that every response it scored is in the judge's counts, by reason.
"""

from __future__ import annotations

import pytest

from megatron_bapo.metrics import read_jsonl_metrics
from run_helpers import finish, run_config, start_train, write_assets

pytestmark = pytest.mark.slow
REASONS = ("scored", "timeout", "unparseable", "error")


@pytest.mark.parametrize("servers", ["urls", "judge_pool"])
def test_a_run_graded_by_a_tiny_yes_no_judge_completes_and_reports_the_judge(tmp_path, tiny_hf_dir, servers):
    """`urls`: a judge server the user runs, named in reward.judge.urls; `judge_pool`: a `judge` section,
    whose built-in server the run starts, watches and closes like the policy's (never weight-synced)."""
    import contextlib
    import json

    from megatron_bapo.server.launch import start_server

    (tmp_path / "assets").mkdir()
    assets = (write_assets(tmp_path / "assets"), tiny_hf_dir)
    out = tmp_path / "run"
    external = start_server(tiny_hf_dir, log_path=tmp_path / "judge.log") if servers == "urls" else None
    with external if external is not None else contextlib.nullcontext():
        judge = {"template": "Question: {prompt}\nAnswer: {response}\nReference: {answer}\n"
                             "Is this answer correct? yes/no",
                 "parse_regex": r"(?i)\b(yes|no)\b", "values": {"yes": 1, "no": 0}, "on_failure": "score_zero",
                 "max_new_tokens": 8, "temperature": 1.0}
        sections = {"eval": {"reward": "judge", "every_n_steps": 3}}
        if external is not None:
            judge["urls"] = [external.url]
        else:
            sections["judge"] = {"model_path": str(tiny_hf_dir), "num_servers": 1}
        sections["reward"] = {"fn": "judge", "num_workers": 0, "max_failure_rate": 1.0, "judge": judge}
        config = run_config(assets, out, total_steps=3, save_every=0, sections=sections)
        proc = start_train(config, assets)
        log = finish(proc)
    if external is None:  # the run started its own judge server, beside the policy's
        urls = json.loads((out / "judge_servers.json").read_text())
        assert urls and urls != json.loads((out / "servers.json").read_text()), urls
    assert proc.returncode == 0, log[-4000:]
    records = read_jsonl_metrics(out / "tb")
    steps = [r for r in records if "timing/step_s" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    judged = [r for r in steps if "judge/num_scored" in r]  # a response takes 2 steps (segments of 3 tokens)
    assert [r["step"] for r in judged] == [2, 3]
    train_log = (out / "logs" / "train.log").read_text()
    for r in judged:
        counts = [r[f"judge/num_{k}"] for k in REASONS]
        assert counts[1] == counts[3] == 0, r  # the judge answered every request
        assert sum(counts) == 4 * r["experience/num_groups"] > 0  # every response of every trained group, once
        assert r["judge/num_groups_dropped"] == 0  # score_zero: counted and trained
        assert f"judge: step {r['step']}: {int(counts[0])} scored, 0 timeout, {int(counts[2])} unparseable" in train_log
    evals = [r for r in records if "eval/t/judge_num_scored" in r]
    assert [r["step"] for r in evals] == [0, 3]
    for r in evals:  # 6 problems x n=2
        assert r["eval/t/judge_num_scored"] + r["eval/t/judge_num_unparseable"] == 12
        assert 0 <= r["eval/t/avg@2"] <= 1
