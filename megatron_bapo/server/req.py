"""Per-sequence request state and the thread-shared tokenizer."""

from __future__ import annotations

import copy
import dataclasses
import re
import threading
import time
from typing import Callable, Optional

import torch

from megatron_bapo.server.protocol import GenerateItem
from megatron_bapo.server.sampling import top_logprobs


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
    routed_prefill: Optional[torch.Tensor] = None
    """Routed experts of the positions of its last prefill `[positions, L, k]` (return_routed_experts)."""
    routed_decode: list = dataclasses.field(default_factory=list)
    """Then one `[1, L, k]` per decode step: the position it fed."""
    finish_reason: Optional[dict] = None
    cached_tokens: int = 0
    num_retractions: int = 0
    started: bool = False
    running: bool = False
    """In the engine's running batch (False while waiting, retracted, or finished)."""
    t_start: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def rid(self) -> str:
        return self.item.rid


class LockedTokenizer:
    """A tokenizer shared by threads, one call at a time per copy (Rust fast tokenizers raise "Already
    borrowed" if one thread changes truncation/padding while another encodes).

    Encoding (request parsing, in the HTTP pool) and decoding (stop strings in the scheduler, replies
    in the pool) use two copies with a lock each, so tokenizing a long prompt never holds up the
    scheduler or a reply."""

    def __init__(self, tokenizer):
        self._enc = tokenizer
        self._dec = copy.deepcopy(tokenizer)
        self._enc_lock = threading.Lock()
        self._dec_lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._enc_lock:
            return self._enc(*args, **kwargs)

    def decode(self, *args, **kwargs):
        with self._dec_lock:
            return self._dec.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._dec, name)


def abort_reason(message: str) -> dict:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def check_finished(req: Req, tok: int, tokenizer) -> Optional[dict]:
    """The finish reason after `tok` was appended, or None. SGLang 0.5.23's order
    (`Req.update_finish_state`): stop strings and `stop_regex` on the decoded tail, then stop/EOS ids
    (skipped with ignore_eos), then length. So a budget that ends on a stop is a stop, not a length:
    partial rollout continues only a response that did not end."""
    sp = req.item.params
    if (sp.stop or sp.stop_regex) and tokenizer is not None:
        longest = max([len(s) for s in sp.stop] + [64 if sp.stop_regex else 0])
        tail = tokenizer.decode(req.output_ids[-(longest + 8):], skip_special_tokens=sp.skip_special_tokens)
        for s in sp.stop:
            if s in tail:
                return {"type": "stop", "matched": s}
        for pattern in sp.stop_regex:
            if re.search(pattern, tail):
                return {"type": "stop", "matched": pattern}
    if tok in req.stop_ids:
        return {"type": "stop", "matched": tok}
    if len(req.output_ids) >= sp.max_new_tokens:
        return {"type": "length", "length": sp.max_new_tokens}
    return None


def fill_input_logprobs(req: Req, ctx: list, lp_all: torch.Tensor) -> None:
    """`input_token_logprobs` (and top ones) from `lp_all` = log-softmax of the prompt's logits [L-1, vocab]."""
    start = req.item.logprob_start_len
    num_in = len(req.item.input_ids)
    entries, tops = [[None, int(ctx[start]), None]], [None]
    for pos in range(start + 1, num_in):
        entries.append([float(lp_all[pos - 1, ctx[pos]]), int(ctx[pos]), None])
        tops.append(top_logprobs(lp_all[pos - 1], req.item.top_logprobs_num) if req.item.top_logprobs_num else None)
    req.input_logprobs, req.input_top = entries, tops
