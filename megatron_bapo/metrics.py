"""Per-step metrics to TensorBoard and a JSON-lines log (rank 0 only).

Tags are namespaced (`bapo/c_high`, `rollout/response_len_mean`, `timing/rollout_s`); the jsonl copy
(`metrics.jsonl`) is what plots and tests read back without a TensorBoard dependency.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

logger = logging.getLogger(__name__)


class MetricsWriter:
    """Write scalar dicts (and optional histograms) for a step; no-op when `enabled` is False."""

    def __init__(self, log_dir: str | Path, *, enabled: bool = True, purge_step: Optional[int] = None) -> None:
        self.enabled = enabled
        self.log_dir = Path(log_dir)
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir.mkdir(parents=True, exist_ok=True)
        # purge_step drops events after a resumed step, so curves have no duplicated tail.
        self._tb = SummaryWriter(str(self.log_dir), purge_step=purge_step)
        path = self.log_dir / "metrics.jsonl"
        if purge_step is not None and path.exists():
            # A resumed run re-logs the steps after its checkpoint: drop the killed run's copies.
            kept = [ln for ln in path.read_text(encoding="utf-8").splitlines()
                    if ln.strip() and int(json.loads(ln)["step"]) < purge_step]
            path.write_text("".join(ln + "\n" for ln in kept), encoding="utf-8")
        self._jsonl = open(path, "a", encoding="utf-8")

    def log(self, step: int, scalars: Mapping[str, Any], histograms: Optional[Mapping[str, Any]] = None) -> None:
        if not self.enabled:
            return
        clean: dict[str, float] = {}
        for tag, value in scalars.items():
            if isinstance(value, torch.Tensor):
                value = value.item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            value = float(value)
            clean[tag] = value
            if math.isfinite(value):
                self._tb.add_scalar(tag, value, step)
        for tag, values in (histograms or {}).items():
            tensor = torch.as_tensor(values, dtype=torch.float64)
            if tensor.numel():
                self._tb.add_histogram(tag, tensor, step)
        record = {"step": step, **{k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._tb.flush()

    def log_text(self, tag: str, text: str, step: int) -> None:
        if self.enabled:
            self._tb.add_text(tag, text, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        self._tb = self._jsonl = None


def read_jsonl_metrics(log_dir: str | Path) -> list[dict[str, Any]]:
    """All records of `metrics.jsonl`, last record per step winning (resumed runs rewrite steps)."""
    path = Path(log_dir) / "metrics.jsonl"
    by_step: dict[int, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def read_tensorboard_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Read scalar events back from TensorBoard files: {tag: [(step, value), ...]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags().get("scalars", [])}
