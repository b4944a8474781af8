"""Evaluation metrics and the pure evaluation core on hand-made cases."""

from __future__ import annotations

import itertools
import json
from math import comb

import pytest

from megatron_bapo.eval import (
    EvalConfig,
    EvalProblem,
    Sample,
    evaluate_records,
    load_problems,
    majority_vote,
    pass_at_k,
    pass_k_values,
    read_records,
    write_records,
)
from megatron_bapo.eval.runner import datasets_from_paths, format_metrics


def _pass_at_k_exact(n: int, c: int, k: int) -> float:
    return 1.0 - comb(n - c, k) / comb(n, k)


def _pass_at_k_enumerated(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (c correct) that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n, c, k", [(4, 1, 1), (4, 1, 2), (4, 2, 2), (5, 0, 3), (5, 5, 1), (6, 3, 4), (8, 1, 8), (7, 2, 3)])
def test_pass_at_k_matches_enumeration(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_enumerated(n, c, k), abs=1e-12)


def test_pass_at_k_hand_values():
    assert pass_at_k(16, 0, 1) == 0.0
    assert pass_at_k(16, 4, 1) == pytest.approx(0.25)  # pass@1 is the fraction correct
    assert pass_at_k(2, 1, 2) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    # C(2000, 1000) is ~1e600: the naive float ratio overflows; the product form does not.
    value = pass_at_k(2000, 3, 1000)
    exact = 1.0 - comb(1997, 1000) / comb(2000, 1000)  # exact integer arithmetic, then one division
    assert value == pytest.approx(exact, rel=1e-12)
    for n, c, k in [(64, 5, 16), (128, 1, 64), (256, 200, 32)]:
        assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_exact(n, c, k), rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, 1, 0), (4, 1, 5), (0, 0, 1), (4, -1, 1)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_pass_k_values_are_powers_of_two_up_to_n():
    assert pass_k_values(1) == [1]
    assert pass_k_values(16) == [1, 2, 4, 8, 16]
    assert pass_k_values(12) == [1, 2, 4, 8]


def test_majority_vote():
    assert majority_vote(["1/2", "3", "1/2", None], [True, False, True, False]) == ("1/2", True)
    assert majority_vote(["3", "1/2", "3", "1/2"], [False, True, False, True]) == ("3", False)  # tie: first seen
    assert majority_vote([None, None], [False, False]) == (None, False)
    assert majority_vote([None, None, "4"], [False, False, True]) == ("4", True)  # no-answers do not vote


def _problems(answers):
    return [EvalProblem(index=i, prompt=f"q{i}", answer=a) for i, a in enumerate(answers)]


def test_evaluate_records_metrics_on_hand_made_case():
    problems = _problems(["\\frac{1}{2}", "70", "5"])
    samples = [
        # 2 of 4 correct, written differently; majority is the correct 1/2
        ["\\boxed{0.5}", "\\boxed{\\dfrac12}", "\\boxed{3}", "no answer"],
        # 0 correct; majority 71
        ["\\boxed{71}", "\\boxed{71}", "\\boxed{69}", "\\boxed{@@}"],
        # 1 correct; majority is the wrong 6 (2 votes) over the right 5 (1 vote)
        ["\\boxed{6}", "\\boxed{5 cm}", "\\boxed{6}", Sample("\\boxed{4", finish_reason="length", num_tokens=10)],
    ]
    records, metrics = evaluate_records(problems, samples, "math", dataset="hand")
    assert [r["num_correct"] for r in records] == [2, 0, 1]
    assert metrics["avg@4"] == pytest.approx((2 / 4 + 0 + 1 / 4) / 3)
    assert metrics["pass@1"] == pytest.approx(metrics["avg@4"])
    assert metrics["pass@2"] == pytest.approx((_pass_at_k_exact(4, 2, 2) + 0 + _pass_at_k_exact(4, 1, 2)) / 3)
    assert metrics["pass@4"] == pytest.approx(2 / 3)
    assert metrics["maj@4"] == pytest.approx(1 / 3)
    assert [r["maj_answer"] for r in records] == ["1/2", "71", "6"]
    assert metrics["num_answer_failures"] == 3  # "no answer", "@@", the cut-off box
    assert metrics["truncated_frac"] == pytest.approx(1 / 12)
    assert metrics["num_problems"] == 3 and metrics["num_samples"] == 12
    # Every dataset metric is the mean of the same key over the per-problem records.
    for key in ("avg@4", "pass@1", "pass@2", "pass@4", "maj@4"):
        assert metrics[key] == pytest.approx(sum(r[key] for r in records) / len(records))
    assert records[0]["responses"][3]["reason"] == "no_answer"
    assert records[2]["responses"][3]["finish_reason"] == "length"


def test_evaluate_records_with_partial_credit_plugin_reward(tmp_path, monkeypatch):
    mod = tmp_path / "partial_reward_mod.py"
    mod.write_text("def reward(response, answer):\n    return 1.0 if response == answer else (0.5 if answer in response else 0.0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    records, metrics = evaluate_records(_problems(["7"]), [["7", "x7", "8", "7"]], "partial_reward_mod:reward")
    assert metrics["avg@4"] == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert metrics["pass@1"] == pytest.approx(0.5)  # only reward >= 1 counts as correct
    assert records[0]["num_correct"] == 2


def test_evaluate_records_rejects_ragged_samples():
    with pytest.raises(ValueError, match="same n"):
        evaluate_records(_problems(["1", "2"]), [["\\boxed{1}"], ["\\boxed{2}", "\\boxed{2}"]])
    with pytest.raises(ValueError, match="2 problems but 1"):
        evaluate_records(_problems(["1", "2"]), [["\\boxed{1}"]])


def test_records_roundtrip_and_problem_loading(tmp_path):
    data = tmp_path / "set.jsonl"
    rows = [
        {"prompt": "What is 1+1?", "answer": "2"},
        {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": 4},  # int answer (AIME)
        {"prompt": "", "answer": "1"},  # empty prompt: skipped
        {"prompt": "no answer"},  # missing answer: skipped
        "not an object",
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken json\n")
    problems, skipped = load_problems(data)
    assert [(p.index, p.answer) for p in problems] == [(0, "2"), (1, "4")]
    assert problems[1].prompt == [{"role": "user", "content": "What is 2+2?"}]
    assert skipped == 4
    assert len(load_problems(data, max_problems=1)[0]) == 1

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "3+4?", "answer": "7"}]), tmp_path / "set.parquet")
    assert [p.answer for p in load_problems(tmp_path / "set.parquet")[0]] == ["7"]

    records, _ = evaluate_records(problems, [["\\boxed{2}"], ["\\boxed{5}"]])
    path = write_records(records, tmp_path / "out" / "set.jsonl")
    assert read_records(path) == json.loads(json.dumps(records))

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_problems(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="jsonl or .parquet"):
        (tmp_path / "x.csv").write_text("a")
        load_problems(tmp_path / "x.csv")


def test_eval_config_validation_names_fields():
    with pytest.raises(ValueError, match="eval.n"):
        EvalConfig(n=0)
    with pytest.raises(ValueError, match="eval.top_p"):
        EvalConfig(top_p=0)
    with pytest.raises(ValueError, match="duplicate names"):
        EvalConfig(datasets=[{"name": "a", "path": "x"}, {"name": "a", "path": "y"}])
    with pytest.raises(ValueError, match="name"):
        EvalConfig(datasets=[{"name": "a/b", "path": "x"}])
    cfg = EvalConfig(every_n_steps=5, datasets=[{"name": "aime", "path": "a.jsonl"}])
    assert [cfg.should_run(s) for s in (1, 5, 10, 11)] == [False, True, True, False]
    assert not EvalConfig(every_n_steps=5).should_run(5)  # no datasets: nothing to run


def test_eval_config_loads_from_yaml_overrides():
    from megatron_bapo.config_io import from_dict

    cfg = from_dict(EvalConfig, {"every_n_steps": 10, "n": 4, "datasets": [{"name": "aime24", "path": "a.jsonl"}]})
    assert cfg.datasets[0].name == "aime24" and cfg.n == 4


def test_dataset_names_from_paths_and_table():
    names = [d.name for d in datasets_from_paths(["x/aime24.jsonl", "y/aime24.parquet", "z/my set.jsonl"])]
    assert names == ["aime24", "aime24_2", "my_set"]
    table = format_metrics({"eval/aime24/avg@4": 0.25, "eval/aime24/pass@1": 0.25, "eval/aime24/num_problems": 3.0,
                            "eval/aime24/num_answer_failures": 1.0})
    assert "aime24" in table and "0.2500" in table


def test_request_errors_score_zero_and_are_counted():
    samples = [[Sample("\\boxed{1}"), Sample("", finish_reason="error", error="400: too long")]]
    records, metrics = evaluate_records(_problems(["1"]), samples)
    assert metrics["avg@2"] == 0.5 and metrics["num_request_errors"] == 1
    assert records[0]["responses"][1]["error"] == "400: too long"
