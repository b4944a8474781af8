"""DatasetConfig: where prompts come from and how they become token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class DatasetConfig:
    """A jsonl or parquet prompt dataset (rows `{"prompt": str | [{"role","content"}], "answer": str, ...}`)."""

    path: str = ""
    """A `.jsonl`/`.json` (one JSON object per line) or `.parquet` file."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: bool = True
    """Text prompts are wrapped as one user message and go through the tokenizer's chat template
    (with the generation prompt). False: text is tokenized as is. Message lists always use the template."""
    system_prompt: Optional[str] = None
    """Prepended as a system message when the chat template is used."""
    max_prompt_tokens: Optional[int] = None
    """Longer prompts are skipped and counted (`data/num_too_long`). None = no limit."""
    shuffle: bool = True
    seed: int = 0
    """Epoch e is shuffled with seed (seed, e), so the order is reproducible and resumable."""
    max_rows: Optional[int] = None
    """Read at most this many rows (debugging, tiny runs)."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("DatasetConfig.path is empty: give a .jsonl or .parquet file")
        if not str(self.path).lower().endswith((".jsonl", ".json", ".parquet")):
            raise ValueError(f"DatasetConfig.path {self.path!r} must end in .jsonl, .json or .parquet")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"DatasetConfig.max_prompt_tokens must be >= 1 or null, got {self.max_prompt_tokens}")
        if self.max_rows is not None and self.max_rows < 1:
            raise ValueError(f"DatasetConfig.max_rows must be >= 1 or null, got {self.max_rows}")
        if not self.prompt_key or not self.answer_key:
            raise ValueError("DatasetConfig.prompt_key and answer_key must be non-empty")
