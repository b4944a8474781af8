"""Prompt datasets for RL: read, validate, tokenize, filter, and hand out in a resumable order.

Why this shape:
- A bad row (unparsable JSON, empty prompt, missing answer, malformed messages) is logged, skipped
  and counted; a 3-day job never dies on one line of data (design section 8).
- Prompts are tokenized once at load, so over-long ones are filtered and counted up front and the
  sampling order only ever holds usable prompts.
- Epoch e visits the prompts in a permutation drawn from (seed, e); `state_dict()` is
  `{epoch, position}`, so a resumed run continues with exactly the prompts it would have drawn.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from megatron_bapo.config_io import ConfigError
from megatron_bapo.data.config import DatasetConfig
from megatron_bapo.rollout.types import Prompt

logger = logging.getLogger(__name__)
STATE_FORMAT = 1


class PromptDataset:
    """Tokenized prompts plus a resumable, seeded per-epoch order. `next_batch(n)` never runs dry."""

    def __init__(self, config: DatasetConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.prompts: list[Prompt] = []
        self.num_rows = 0
        self.num_bad_rows = 0
        self.num_too_long = 0
        self._bad_reasons: list[tuple[int, str]] = []
        for i, row in enumerate(read_rows(config.path, max_rows=config.max_rows)):
            self.num_rows += 1
            prompt = self._to_prompt(i, row)
            if prompt is not None:
                self.prompts.append(prompt)
        if not self.prompts:
            # One line, not a warning per row first: nothing in this file can be trained on.
            first = (f"; the first bad row: row {self._bad_reasons[0][0]}: {self._bad_reasons[0][1]}"
                     if self._bad_reasons else "")
            raise ConfigError(f"data.path={config.path!r} has no usable prompt among {self.num_rows} rows "
                              f"({self.num_bad_rows} bad, {self.num_too_long} over data.max_prompt_tokens="
                              f"{config.max_prompt_tokens}){first}; check data.prompt_key={config.prompt_key!r}, "
                              f"data.answer_key={config.answer_key!r} and the file's format")
        for index, reason in self._bad_reasons:  # a usable file: each bad row is one warning
            logger.warning("%s row %d skipped: %s", config.path, index, reason)
        if self.num_bad_rows or self.num_too_long:
            logger.warning("%s: kept %d of %d rows (%d bad, %d over max_prompt_tokens=%s)", config.path,
                           len(self.prompts), self.num_rows, self.num_bad_rows, self.num_too_long,
                           config.max_prompt_tokens)
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    # ------------------------------------------------------------------ rows -> prompts
    def _to_prompt(self, index: int, row: Any) -> Optional[Prompt]:
        cfg = self.config
        if isinstance(row, BadRow):
            return self._bad(index, row.reason)
        if not isinstance(row, dict):
            return self._bad(index, f"expected a JSON object, got {type(row).__name__}")
        prompt, answer = row.get(cfg.prompt_key), row.get(cfg.answer_key)
        if answer is None or (isinstance(answer, float) and math.isnan(answer)) or str(answer).strip() == "":
            return self._bad(index, f"missing or empty {cfg.answer_key!r}")
        try:
            ids = self.encode(prompt)
        except ValueError as exc:
            return self._bad(index, str(exc))
        if cfg.max_prompt_tokens is not None and len(ids) > cfg.max_prompt_tokens:
            self.num_too_long += 1
            logger.info("%s row %d skipped: %d prompt tokens > max_prompt_tokens=%d", cfg.path, index, len(ids),
                        cfg.max_prompt_tokens)
            return None
        meta = {k: _json_safe(v) for k, v in row.items() if k not in (cfg.prompt_key, cfg.answer_key)}
        return Prompt(prompt_ids=ids, answer=str(answer), index=index, metadata=meta)

    def _bad(self, index: int, reason: str) -> None:
        self.num_bad_rows += 1
        self._bad_reasons.append((index, reason))
        return None

    def encode(self, prompt: Any) -> list[int]:
        """Token ids of one prompt (text or chat messages); ValueError when it is empty or malformed."""
        cfg = self.config
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError(f"empty {cfg.prompt_key!r}")
            if not cfg.apply_chat_template:
                return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, (list, tuple)) and prompt:
            messages = []
            for m in prompt:
                if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                    raise ValueError(f"{cfg.prompt_key!r} messages need string 'role' and 'content', got {m!r}")
                messages.append({"role": m["role"], "content": m["content"]})
            if not any(m["content"].strip() for m in messages):
                raise ValueError(f"empty {cfg.prompt_key!r} messages")
        else:
            raise ValueError(f"{cfg.prompt_key!r} must be a non-empty string or list of messages, got {prompt!r:.80}")
        if cfg.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}] + messages
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; set DatasetConfig.apply_chat_template=false "
                             "and use text prompts")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if not ids:
            raise ValueError(f"{cfg.prompt_key!r} tokenized to no ids")
        return ids

    # ------------------------------------------------------------------ order
    def _permutation(self, epoch: int) -> list[int]:
        n = len(self.prompts)
        if not self.config.shuffle:
            return list(range(n))
        gen = torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch)
        return torch.randperm(n, generator=gen).tolist()

    def __len__(self) -> int:
        return len(self.prompts)

    def next_batch(self, n: int) -> list[Prompt]:
        """The next `n` prompts; wraps into a freshly shuffled epoch (an epoch never repeats a prompt)."""
        if n < 0:
            raise ValueError(f"next_batch: n must be >= 0, got {n}")
        out = []
        for _ in range(n):
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            out.append(self.prompts[self._order[self.position]])
            self.position += 1
        return out

    def __iter__(self) -> Iterator[Prompt]:
        while True:
            yield self.next_batch(1)[0]

    # ------------------------------------------------------------------ checkpoints, metrics
    def state_dict(self) -> dict[str, Any]:
        """JSON-safe position; restoring it on the same file and config continues the same order."""
        return {"format": STATE_FORMAT, "epoch": self.epoch, "position": self.position,
                "num_prompts": len(self.prompts), "seed": self.config.seed, "shuffle": self.config.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"dataset state format {state.get('format')!r} is not {STATE_FORMAT}")
        if int(state["num_prompts"]) != len(self.prompts):
            raise ValueError(f"dataset state was saved with {state['num_prompts']} usable prompts, this dataset has "
                             f"{len(self.prompts)}: the file or DatasetConfig (max_prompt_tokens, keys) changed")
        if (state.get("seed"), state.get("shuffle")) != (self.config.seed, self.config.shuffle):
            logger.warning("dataset state saved with seed=%s shuffle=%s, config has seed=%s shuffle=%s: the order changes",
                           state.get("seed"), state.get("shuffle"), self.config.seed, self.config.shuffle)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)

    def metrics(self) -> dict[str, float]:
        return {"data/num_rows": float(self.num_rows), "data/num_prompts": float(len(self.prompts)),
                "data/num_bad_rows": float(self.num_bad_rows), "data/num_too_long": float(self.num_too_long),
                "data/epoch": float(self.epoch)}


class BadRow:
    """A row that could not be parsed at all (kept as a marker so the row index stays right)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def read_rows(path: str | Path, *, max_rows: Optional[int] = None) -> Iterator[Any]:
    """Rows of a jsonl/json-lines or parquet file; unparsable lines come out as `BadRow`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"DatasetConfig.path {str(path)!r} does not exist")
    count = 0
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            for row in batch.to_pylist():
                if max_rows is not None and count >= max_rows:
                    return
                count += 1
                yield row
        return
    with open(path, "rb") as f:  # bytes: one undecodable line is one bad row, not a dead run
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            if max_rows is not None and count >= max_rows:
                return
            count += 1
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield BadRow(f"line {lineno} is not UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            try:
                yield json.loads(line)
            except ValueError as exc:
                yield BadRow(f"line {lineno} is not JSON ({exc})")


def _json_safe(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)
