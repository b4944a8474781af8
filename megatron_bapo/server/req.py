"""Per-sequence request state and the thread-shared tokenizer."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Optional

import torch

from megatron_bapo.server.protocol import GenerateItem


@dataclasses.dataclass(eq=False)
class Req:
    """One sequence being generated (an `n > 1` request is n of these)."""

    item: GenerateItem
    on_done: Callable[["Req"], None]
    stop_ids: frozenset
    generator: Optional[torch.Generator]
    on_token: Optional[Callable[["Req", int], None]] = None
    """Streaming: called with the number of output tokens after each token that did not finish it."""
    output_ids: list = dataclasses.field(default_factory=list)
    output_logprobs: list = dataclasses.field(default_factory=list)
    output_top: list = dataclasses.field(default_factory=list)
    output_versions: list = dataclasses.field(default_factory=list)
    """The weight version that produced each output token (a request may span a weight update)."""
    input_logprobs: list = dataclasses.field(default_factory=list)
    input_top: list = dataclasses.field(default_factory=list)
    finish_reason: Optional[dict] = None
    cached_tokens: int = 0
    num_retractions: int = 0
    started: bool = False
    t_start: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def rid(self) -> str:
        return self.item.rid


class LockedTokenizer:
    """A tokenizer shared by the HTTP thread and the scheduler thread, one call at a time (Rust fast
    tokenizers raise "Already borrowed" if one thread changes truncation/padding while another encodes)."""

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self._tok(*args, **kwargs)

    def decode(self, *args, **kwargs):
        with self._lock:
            return self._tok.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def abort_reason(message: str) -> dict:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}
