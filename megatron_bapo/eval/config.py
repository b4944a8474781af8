"""Evaluation config: which datasets, how many samples, which sampling settings.

Used both by `tools/evaluate.py` and by the trainer's periodic validation (`eval.*` in a run's
YAML). Defaults follow the paper's AIME protocol: 16 samples per problem at temperature 0.6.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass
class EvalDatasetConfig:
    """One evaluation set: metrics are reported as `eval/<name>/...`."""

    name: str
    """Metric namespace; letters, digits, `_`, `-`, `.` only (it becomes a TensorBoard tag)."""
    path: str
    """A jsonl or parquet file of `{"prompt": str | [{"role", "content"}], "answer": str}` rows."""

    def __post_init__(self) -> None:
        if not self.name or not all(ch.isalnum() or ch in "_-." for ch in self.name):
            raise ValueError(f"eval.datasets[].name must be non-empty [A-Za-z0-9_.-], got {self.name!r}")
        if not self.path:
            raise ValueError(f"eval.datasets[{self.name}].path must be set")


@dataclasses.dataclass
class EvalConfig:
    """Evaluation settings (standalone tool and in-training validation)."""

    every_n_steps: int = 0
    """Run validation every this many training steps; 0 disables it in training."""
    datasets: list[EvalDatasetConfig] = dataclasses.field(default_factory=list)
    n: int = 16
    """Samples per problem (avg@n, pass@k for k = 1, 2, 4, ... <= n, maj@n)."""
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 1024
    reward: str = "math"
    """Reward spec (`megatron_bapo.rewards.load_reward_fn`): a built-in name or "pkg.mod:fn"."""
    max_prompt_tokens: Optional[int] = None
    """Prompts longer than this are skipped and counted (None: keep all)."""
    max_problems: Optional[int] = None
    """Evaluate only the first this many problems of each dataset (None: all)."""
    concurrency: int = 64
    """Requests in flight at once across all servers."""

    def __post_init__(self) -> None:
        if self.every_n_steps < 0:
            raise ValueError(f"eval.every_n_steps must be >= 0, got {self.every_n_steps}")
        if self.n < 1:
            raise ValueError(f"eval.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"eval.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"eval.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"eval.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.concurrency < 1:
            raise ValueError(f"eval.concurrency must be >= 1, got {self.concurrency}")
        for name, value in (("max_prompt_tokens", self.max_prompt_tokens), ("max_problems", self.max_problems)):
            if value is not None and value < 1:
                raise ValueError(f"eval.{name} must be >= 1 or null, got {value}")
        self.datasets = [d if isinstance(d, EvalDatasetConfig) else EvalDatasetConfig(**d) for d in self.datasets]
        names = [d.name for d in self.datasets]
        dupes = sorted({x for x in names if names.count(x) > 1})
        if dupes:
            raise ValueError(f"eval.datasets: duplicate names {dupes}")

    def sampling_params(self) -> dict:
        """SGLang `sampling_params` for evaluation requests."""
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p}

    def should_run(self, step: int) -> bool:
        """Whether training step `step` (1-based) is a validation step."""
        return self.every_n_steps > 0 and bool(self.datasets) and step % self.every_n_steps == 0
