"""The tiny arithmetic task (seeded, disjoint splits, jsonl) and its exact-answer reward."""

from __future__ import annotations

import pytest

from megatron_bapo.rewards import load_reward_fn
from megatron_bapo.rewards.arithmetic import arithmetic_reward, extract_arithmetic_answer
from megatron_bapo.tiny.task import TaskConfig, generate_splits, read_jsonl, reverse_digits, write_task_data


def test_reverse_digits_and_problem_rows():
    assert [reverse_digits(n) for n in (0, 7, 85, 80, 115, 1000)] == ["0", "7", "58", "08", "511", "0001"]
    with pytest.raises(ValueError):
        reverse_digits(-1)
    train, test = generate_splits(TaskConfig(num_train=300, num_test=50))
    for row in train + test:
        assert row["prompt"] == f"{row['a']}+{row['b']}="
        assert int(row["answer"][::-1]) == row["a"] + row["b"]
        assert 0 <= row["a"] <= 99 and 0 <= row["b"] <= 99


def test_splits_are_seeded_and_disjoint(tmp_path):
    config = TaskConfig(num_train=2000, num_test=300, seed=5)
    paths = write_task_data(tmp_path / "a", config)
    again = write_task_data(tmp_path / "b", TaskConfig(num_train=2000, num_test=300, seed=5))
    for split in ("train", "test"):
        assert paths[split].read_bytes() == again[split].read_bytes()
    train, test = read_jsonl(paths["train"]), read_jsonl(paths["test"])
    assert (len(train), len(test)) == (2000, 300)
    train_pairs = {(r["a"], r["b"]) for r in train}
    test_pairs = {(r["a"], r["b"]) for r in test}
    assert len(train_pairs) == 2000 and len(test_pairs) == 300 and not train_pairs & test_pairs
    other_train, _ = generate_splits(TaskConfig(num_train=2000, num_test=300, seed=6))
    assert other_train != train


@pytest.mark.parametrize(
    "kwargs, field",
    [({"max_operand": 9, "num_train": 90, "num_test": 20}, "num_train + task.num_test"),
     ({"min_operand": -1}, "min_operand"), ({"max_operand": -5}, "max_operand"), ({"num_test": 0}, "num_test")],
)
def test_bad_task_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("+", r"\+")):
        generate_splits(TaskConfig(**kwargs))


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("58", "58", 1.0),
        ("58<|endoftext|>", "58", 1.0),
        ("  58\n", "58", 1.0),
        ("58 and more words", "58", 1.0),
        ("58<|im_end|>garbage", "58", 1.0),
        ("5<|endoftext|>8", "58", 0.0),
        ("580", "58", 0.0),
        ("058", "58", 0.0),
        ("5 8", "58", 0.0),
        ("58.", "58", 0.0),
        ("+58", "58", 0.0),
        ("85", "58", 0.0),
        ("", "58", 0.0),
        ("<|endoftext|>58", "58", 0.0),
        ("", "", 0.0),
        ("   ", "  ", 0.0),
        ("08", " 08 ", 1.0),
    ],
)
def test_arithmetic_reward_tricky_strings(response, answer, reward):
    assert arithmetic_reward(response, answer) == reward
    assert load_reward_fn("arithmetic")(response, answer) == reward


def test_extracted_answer():
    assert extract_arithmetic_answer("\t511\nfoo") == "511"
    assert extract_arithmetic_answer("<|im_end|>") == ""
