"""Admission and prefill of the built-in server's scheduler (`engine.Engine` runs them each step).

Waiting requests are admitted FIFO while there is room (`max_running`, and the KV budget when set:
prompt + max_new_tokens reserved per request); admitted contexts are prefilled, one forward per
distinct context (the G samples of a group share one), batched left-padded up to
`PREFILL_MAX_TOKENS`, and each request samples its first token. A batched prefill whose forward
raises is retried one context at a time, so only a context that fails again is failed. Runs on the
scheduler thread under the engine's `step_lock`, on the engine's state (a mixin of `Engine`).
"""

from __future__ import annotations

import logging

import torch

from megatron_bapo.server.kv import BatchKV
from megatron_bapo.server.prefill import batched_prefill, chunk_by_tokens
from megatron_bapo.server.req import Req, fill_input_logprobs
from megatron_bapo.server.routing import keep_routing

logger = logging.getLogger(__name__)

PREFILL_MAX_TOKENS = 8192
"""Padded tokens per batched prefill forward (bounds the activation memory of one prefill)."""


def _reserve(req: Req) -> int:
    """KV tokens a request may need: its prompt plus its whole output budget."""
    return len(req.item.input_ids) + int(req.item.params.max_new_tokens)


def failure(where: str, exc: BaseException) -> dict:
    return {"type": "abort", "message": f"internal error in {where}: {exc}", "status_code": 500,
            "err_type": "InternalServerError"}


class AdmissionMixin:
    """Needs the engine's `_waiting`, `_running`, `_kv`, `max_running`, `max_total_tokens`, `model`,
    `_forward`, `_finish`, `_sample_guarded`, `last_error`."""

    def _pop_admissible(self) -> list:
        """Waiting requests (FIFO) while there is room: `max_running`, and the KV budget when set
        (prompt + max_new_tokens reserved per request; one is always admitted when none runs)."""
        budget = self.max_total_tokens
        reserved = sum(_reserve(r) for r in self._running) if budget is not None else 0

        def fits(req: Req, num_taken: int) -> bool:
            nonlocal reserved
            if budget is None:
                return True
            if reserved + _reserve(req) > budget and (num_taken or self._running):
                return False
            reserved += _reserve(req)
            return True

        return self._waiting.pop_admissible(self.max_running - len(self._running), fits)

    def _admit(self) -> None:
        batch = self._pop_admissible()
        if not batch:
            return
        groups: dict[tuple, list[Req]] = {}
        for req in batch:
            groups.setdefault(tuple(req.item.input_ids + req.output_ids), []).append(req)
        plain: list[tuple] = []
        for ctx, reqs in groups.items():
            needs_input = any(r.item.return_logprob and r.item.logprob_start_len >= 0 and not r.started for r in reqs)
            if needs_input:  # full-sequence logits: one forward for this context alone
                self._guarded(reqs, self._prefill, list(ctx), reqs)
                continue
            for r in reqs:
                if r.item.params.max_new_tokens <= len(r.output_ids):
                    self._finish(r, {"type": "length", "length": r.item.params.max_new_tokens})
            reqs = [r for r in reqs if r.finish_reason is None]
            if reqs:
                plain.append((ctx, reqs))
        if plain:
            for chunk in chunk_by_tokens([ctx for ctx, _ in plain], PREFILL_MAX_TOKENS):
                entries = [plain[i] for i in chunk]
                if not self._guarded([r for _, rs in entries for r in rs], self._prefill_batch, entries,
                                     fail=len(entries) == 1):
                    for entry in entries:  # isolate: one context at a time, so only a failing one fails
                        self._guarded(entry[1], self._prefill_batch, [entry])

    def _guarded(self, reqs: list[Req], fn, *args, fail: bool = True) -> bool:
        """Run a prefill; on error fail only its unfinished requests (when `fail`), keep serving the
        rest. Returns False on error."""
        try:
            fn(*args)
            return True
        except Exception as exc:  # noqa: BLE001
            self.last_error = exc
            if not fail:
                logger.warning("batched prefill of %d request(s) failed (%s); retrying one context at a time",
                               len(reqs), exc)
                return False
            logger.exception("prefill failed for %d request(s)", len(reqs))
            for req in reqs:
                if req.finish_reason is None and not req.running:
                    self._finish(req, failure("prefill", exc))
            return False

    def _join(self, reqs: list[Req]) -> None:
        for req in reqs:
            req.running = True
        self._running.extend(reqs)

    def _prefill_batch(self, entries: list[tuple]) -> None:
        """One left-padded forward for several distinct contexts, each shared by its requests.
        Only the forward may raise (the caller may then retry); later errors fail the requests here."""
        (logits, layers, mask), routed = self._forward(batched_prefill, self.model, [ctx for ctx, _ in entries])
        if routed is not None:  # [b * width, L, k] of the left-padded batch
            routed = routed.view(mask.shape[0], mask.shape[1], *routed.shape[1:])
        rows, joined = [], []
        try:
            for j, (ctx, reqs) in enumerate(entries):
                for i, req in enumerate(reqs):
                    if i > 0 and not req.started:
                        req.cached_tokens = len(req.item.input_ids)
                    req.started = True
                    if routed is not None:
                        keep_routing(req, routed[j, routed.shape[1] - len(ctx):], prefill=True)
                    if self._sample_guarded(req, logits[j]):
                        rows.append(j)
                        joined.append(req)
            if joined:
                idx = torch.tensor(rows, dtype=torch.long)
                self._kv.append([(k.index_select(0, idx), v.index_select(0, idx)) for k, v in layers],
                                mask.index_select(0, idx))
                self._join(joined)
        except Exception as exc:  # noqa: BLE001 - tokens were drawn: no retry, fail these requests
            logger.exception("prefill bookkeeping failed for %d context(s)", len(entries))
            for _, reqs in entries:
                for req in reqs:
                    if req.finish_reason is None and not req.running:
                        self._finish(req, failure("prefill", exc))

    def _prefill(self, ctx: list, reqs: list[Req]) -> None:
        """One forward over `ctx` shared by `reqs`; samples each request's next token."""
        want_input = [r for r in reqs if r.item.return_logprob and r.item.logprob_start_len >= 0 and not r.started]
        todo = [r for r in reqs if r.item.params.max_new_tokens > len(r.output_ids)]
        todo_ids, want_ids = {id(r) for r in todo}, {id(r) for r in want_input}
        for r in reqs:
            if id(r) not in todo_ids and id(r) not in want_ids:
                self._finish(r, {"type": "length", "length": r.item.params.max_new_tokens})
        if not todo and not want_input:
            return
        ids = torch.tensor([ctx], dtype=torch.long)
        out, routed = self._forward(self.model, input_ids=ids, use_cache=bool(todo), logits_to_keep=0 if want_input else 1)
        for r in reqs:
            keep_routing(r, routed, prefill=True)
        logits = out.logits[0].float()
        if want_input:
            lp_all = torch.log_softmax(logits[:-1], dim=-1)
            for r in want_input:
                fill_input_logprobs(r, ctx, lp_all)
        for r in reqs:
            if id(r) not in todo_ids and r.finish_reason is None:
                self._finish(r, {"type": "length", "length": r.item.params.max_new_tokens})
        if not todo:
            return
        last = logits[-1]
        layers = BatchKV.from_cache(out.past_key_values)
        joined: list[Req] = []
        for i, req in enumerate(todo):
            req.cached_tokens = len(req.item.input_ids) if i > 0 and not req.started else req.cached_tokens
            req.started = True
            if self._sample_guarded(req, last):
                joined.append(req)
        if joined:
            b = len(joined)
            rep = [(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)) for k, v in layers]
            self._kv.append(rep, torch.ones(b, len(ctx), dtype=torch.long))
            self._join(joined)
