"""The tiny default's synthetic verifiable task: addition with the sum written backwards.

A prompt is raw text "47+38=" and the reference answer is the sum's decimal digits least-significant
first ("58" for 85, "511" for 115), followed by EOS in the model's output. Why backwards: the model
then emits the digit it can compute first (the carry flows in writing order), which a ~1M-parameter
model learns in about a minute of CPU SFT, while the normal order stays near 5-10% accuracy for minutes
(the shared notes, tiny-task-calibration.md). That leaves room to stop SFT at a partial accuracy
that RL can visibly improve. Graded by `megatron_bapo.rewards.arithmetic` ("arithmetic").

The tool task (`TaskConfig.tools()`, `megatron_bapo.tiny.tool_task`) is 3-digit multiplication with
the product written normally, "482*375=" -> "180750": far beyond what the tiny model computes, easy
with a calculator call.

Train and test splits are disjoint sets of operand pairs, fixed by the seed.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
from typing import Iterable, Optional


@dataclasses.dataclass
class TaskConfig:
    """Which problems exist and how many go to each split."""

    min_operand: int = 0
    max_operand: int = 99
    """Operands are drawn uniformly from [min_operand, max_operand] (2-digit by default)."""
    num_train: int = 4000
    """Rows in train.jsonl (the RL prompt set; SFT also samples from these pairs)."""
    num_test: int = 500
    """Rows in test.jsonl, disjoint from train (evaluation, base accuracy)."""
    seed: int = 0
    operation: str = "+"
    """"+" (the default task) or "*" (the tool task)."""
    reverse_answer: bool = True
    """Write the answer least-significant digit first (the default task) or normally (the tool task)."""

    @classmethod
    def tools(cls) -> "TaskConfig":
        """The tool task: 3-digit multiplication, the product written normally."""
        return cls(min_operand=100, max_operand=999, operation="*", reverse_answer=False)

    def validate(self) -> None:
        if self.operation not in OPERATIONS:
            raise ValueError(f"task.operation must be one of {sorted(OPERATIONS)}, got {self.operation!r}")
        if self.min_operand < 0:
            raise ValueError(f"task.min_operand must be >= 0, got {self.min_operand}")
        if self.max_operand < self.min_operand:
            raise ValueError(f"task.max_operand ({self.max_operand}) must be >= task.min_operand ({self.min_operand})")
        if self.num_train < 1 or self.num_test < 1:
            raise ValueError(f"task.num_train and task.num_test must be >= 1, got {self.num_train}, {self.num_test}")
        num_pairs = (self.max_operand - self.min_operand + 1) ** 2
        if self.num_train + self.num_test > num_pairs:
            raise ValueError(
                f"task.num_train + task.num_test = {self.num_train + self.num_test} exceeds the {num_pairs} distinct "
                f"operand pairs in [{self.min_operand}, {self.max_operand}]; raise task.max_operand or lower the counts"
            )


OPERATIONS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}


def reverse_digits(n: int) -> str:
    """Decimal digits of a non-negative integer, least-significant first: 85 -> "58", 80 -> "08"."""
    if n < 0:
        raise ValueError(f"reverse_digits expects a non-negative integer, got {n}")
    return str(n)[::-1]


def make_problem(a: int, b: int, operation: str = "+", reverse_answer: bool = True) -> dict:
    """One dataset row: `{"prompt": "a+b=", "answer": reversed digits of a+b, "a": a, "b": b}` (or
    `a*b`, the answer written normally, for the tool task)."""
    value = OPERATIONS[operation](a, b)
    return {"prompt": f"{a}{operation}{b}=", "answer": reverse_digits(value) if reverse_answer else str(value),
            "a": a, "b": b}


def generate_splits(config: Optional[TaskConfig] = None) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows): disjoint operand pairs in a seeded random order."""
    config = config or TaskConfig()
    config.validate()
    rng = random.Random(config.seed)
    span = config.max_operand - config.min_operand + 1
    # Sample distinct pair indices without materialising every pair (cheap even for 4-digit operands).
    chosen = rng.sample(range(span * span), config.num_test + config.num_train)
    pairs = [(config.min_operand + i // span, config.min_operand + i % span) for i in chosen]
    test = [make_problem(a, b, config.operation, config.reverse_answer) for a, b in pairs[: config.num_test]]
    train = [make_problem(a, b, config.operation, config.reverse_answer) for a, b in pairs[config.num_test:]]
    return train, test


def write_jsonl(rows: Iterable[dict], path) -> pathlib.Path:
    """Write rows as UTF-8 jsonl (one object per line) via a temporary file, then rename."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    tmp.replace(path)
    return path


def read_jsonl(path) -> list[dict]:
    """Rows of a jsonl file (blank lines skipped)."""
    with pathlib.Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_task_data(out_dir, config: Optional[TaskConfig] = None) -> dict[str, pathlib.Path]:
    """Write `out_dir/train.jsonl` and `out_dir/test.jsonl`; returns {"train": path, "test": path}."""
    train, test = generate_splits(config)
    out = pathlib.Path(out_dir)
    return {"train": write_jsonl(train, out / "train.jsonl"), "test": write_jsonl(test, out / "test.jsonl")}
