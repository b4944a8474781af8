"""The inference engine: one scheduler thread doing continuous batching over a transformers model.

Each loop iteration, under `step_lock`: apply pending aborts, admit waiting requests (one prefill per
distinct context, shared by identical prompts such as the G samples of a group), then run ONE decode
step for every running request together. Weight swaps take `step_lock`, so they land between decode
steps and never inside one. The HTTP side talks to the engine only through thread-safe methods and a
per-request `on_done` callback.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

import torch

from megatron_bapo.server.kv import BatchKV
from megatron_bapo.server.prefill import batched_prefill, chunk_by_tokens
from megatron_bapo.server.protocol import GenerateItem
from megatron_bapo.server.req import Req, abort_reason
from megatron_bapo.server.sampling import adjust_logits, choose_plain_batch, choose_token, is_plain, top_logprobs

logger = logging.getLogger(__name__)

PREFILL_MAX_TOKENS = 8192
"""Padded tokens per batched prefill forward (bounds the activation memory of one prefill)."""


def _reserve(req: Req) -> int:
    """KV tokens a request may need: its prompt plus its whole output budget."""
    return len(req.item.input_ids) + int(req.item.params.max_new_tokens)


class Engine:
    """Owns the model and the scheduler thread. All public methods are thread-safe."""

    def __init__(self, model, tokenizer, *, eos_ids, max_running: int, seed: int, original_logprob: bool,
                 max_total_tokens: Optional[int] = None):
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens
        self.original_logprob = original_logprob
        self.generator = torch.Generator().manual_seed(seed)
        self.step_lock = threading.RLock()
        self._cv = threading.Condition()
        self._waiting: list[Req] = []
        self._running: list[Req] = []
        self._kv = BatchKV()
        self._pending_aborts: list[tuple[str, bool]] = []
        self._paused = False
        self._shutdown = False
        self._thread = threading.Thread(target=self._loop, name="bapo-scheduler", daemon=True)
        self.num_generated_tokens = 0
        self.last_error: Optional[BaseException] = None
        self.version_label: Callable[[], str] = lambda: "default"
        """The served weight version, read per generated token (the server state sets it; a swap
        and its version change happen together under `step_lock`)."""

    # ---------------------------------------------------------------- public, thread-safe
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._shutdown = True
            self._cv.notify_all()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._shutdown

    def submit(self, item: GenerateItem, on_done: Callable[[Req], None],
               on_token: Optional[Callable[[Req, int], None]] = None) -> Req:
        sp = item.params
        stop = set() if sp.ignore_eos else set(self.eos_ids) | set(sp.stop_token_ids)
        gen = torch.Generator().manual_seed(sp.sampling_seed) if sp.sampling_seed is not None else None
        req = Req(item=item, on_done=on_done, on_token=on_token, stop_ids=frozenset(stop), generator=gen)
        with self._cv:
            self._waiting.append(req)
            self._cv.notify_all()
        return req

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort every request whose rid starts with `rid` (or all); takes effect before the next step."""
        with self._cv:
            self._pending_aborts.append((rid, abort_all))
            self._cv.notify_all()

    def pause(self, retract: bool) -> None:
        """Stop computing. `retract`: running requests go back to the queue and their KV is dropped
        (re-prefilled on continue); otherwise they stay resident (in place)."""
        with self._cv:
            self._paused = True
        with self.step_lock:
            if retract and self._running:
                for req in self._running:
                    req.num_retractions += 1
                with self._cv:
                    self._waiting[:0] = self._running
                self._running = []
                self._kv.clear()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def loads(self) -> tuple[int, int, int]:
        """(running, waiting, tokens resident in the KV cache)."""
        with self._cv:
            return len(self._running), len(self._waiting), int(self._kv.mask.sum()) if self._kv.mask is not None else 0

    def is_idle(self) -> bool:
        running, waiting, _ = self.loads()
        return running == 0 and waiting == 0

    def swap_model(self, model) -> None:
        """Replace the model between decode steps (resident KV, if any, was computed by the old one)."""
        with self.step_lock:
            self.model = model

    # ---------------------------------------------------------------- scheduler thread
    def _has_work(self) -> bool:
        return bool(self._pending_aborts) or (not self._paused and bool(self._waiting or self._running))

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._shutdown and not self._has_work():
                    self._cv.wait()
                if self._shutdown:
                    break
            try:
                with self.step_lock, torch.inference_mode():
                    self._apply_aborts()
                    if self._paused:
                        continue
                    self._admit()
                    if self._running:
                        self._decode_step()
            except BaseException as exc:  # noqa: BLE001 - keep serving; fail the affected requests
                logger.exception("scheduler step failed; aborting the running requests")
                self.last_error = exc
                with self._cv:
                    failed, self._running = self._running, []
                self._kv.clear()
                for req in failed:
                    self._finish(req, {"type": "abort", "message": f"internal error: {exc}",
                                       "status_code": 500, "err_type": "InternalServerError"})
        with self._cv:
            leftover = self._waiting + self._running
            self._waiting, self._running = [], []
        for req in leftover:
            self._finish(req, abort_reason("Server shutting down"))

    def _finish(self, req: Req, reason: dict) -> None:
        req.finish_reason = reason
        try:
            req.on_done(req)
        except Exception:  # noqa: BLE001
            logger.exception("on_done callback failed for rid %s", req.rid)

    def _apply_aborts(self) -> None:
        with self._cv:
            aborts, self._pending_aborts = self._pending_aborts, []
            if not aborts:
                return

            def hit(req: Req) -> bool:
                return any(a_all or req.rid.startswith(prefix) for prefix, a_all in aborts)

            dropped = [r for r in self._waiting if hit(r)]
            self._waiting = [r for r in self._waiting if not hit(r)]
            keep = [i for i, r in enumerate(self._running) if not hit(r)]
            stopped = [r for r in self._running if hit(r)]
            self._running = [self._running[i] for i in keep]
        if stopped:
            self._kv.keep(keep)
        for req in dropped:
            self._finish(req, abort_reason("Aborted" if req.started else "Abort in waiting queue"))
        for req in stopped:
            self._finish(req, abort_reason("Aborted"))

    def _admit(self) -> None:
        with self._cv:
            room = self.max_running - len(self._running)
            if room <= 0 or not self._waiting:
                return
            count = min(room, len(self._waiting))
            if self.max_total_tokens is not None:
                # Reserve prompt + max_new_tokens per request; FIFO, so a big request is not starved.
                reserved = sum(_reserve(r) for r in self._running)
                count = 0
                for req in self._waiting[:room]:
                    if reserved + _reserve(req) > self.max_total_tokens and (count or self._running):
                        break
                    reserved += _reserve(req)
                    count += 1
                if count == 0:
                    return
            batch, self._waiting = self._waiting[:count], self._waiting[count:]
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
                self._guarded([r for _, rs in entries for r in rs], self._prefill_batch, entries)

    def _guarded(self, reqs: list[Req], fn, *args) -> None:
        """Run a prefill; on error fail only its requests (keep serving the rest)."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001
            logger.exception("prefill failed for %d request(s)", len(reqs))
            self.last_error = exc
            for req in reqs:
                if req.finish_reason is None and req not in self._running:
                    self._finish(req, {"type": "abort", "message": f"internal error in prefill: {exc}",
                                       "status_code": 500, "err_type": "InternalServerError"})

    def _prefill_batch(self, entries: list[tuple]) -> None:
        """One left-padded forward for several distinct contexts, each shared by its requests."""
        logits, layers, mask = batched_prefill(self.model, [ctx for ctx, _ in entries])
        rows, joined = [], []
        for j, (_, reqs) in enumerate(entries):
            for i, req in enumerate(reqs):
                if i > 0 and not req.started:
                    req.cached_tokens = len(req.item.input_ids)
                req.started = True
                if self._sample(req, logits[j]):
                    rows.append(j)
                    joined.append(req)
        if joined:
            idx = torch.tensor(rows, dtype=torch.long)
            self._kv.append([(k.index_select(0, idx), v.index_select(0, idx)) for k, v in layers],
                            mask.index_select(0, idx))
            with self._cv:
                self._running.extend(joined)

    def _prefill(self, ctx: list, reqs: list[Req]) -> None:
        """One forward over `ctx` shared by `reqs`; samples each request's next token."""
        want_input = [r for r in reqs if r.item.return_logprob and r.item.logprob_start_len >= 0 and not r.started]
        todo = [r for r in reqs if r.item.params.max_new_tokens > len(r.output_ids)]
        for r in reqs:
            if r not in todo and r not in want_input:
                self._finish(r, {"type": "length", "length": r.item.params.max_new_tokens})
        if not todo and not want_input:
            return
        ids = torch.tensor([ctx], dtype=torch.long)
        out = self.model(input_ids=ids, use_cache=bool(todo), logits_to_keep=0 if want_input else 1)
        logits = out.logits[0].float()
        if want_input:
            lp_all = torch.log_softmax(logits[:-1], dim=-1)
            for r in want_input:
                self._fill_input_logprobs(r, ctx, lp_all)
        for r in reqs:
            if r not in todo and r.finish_reason is None:
                self._finish(r, {"type": "length", "length": r.item.params.max_new_tokens})
        if not todo:
            return
        last = logits[-1]
        layers = BatchKV.from_cache(out.past_key_values)
        joined: list[Req] = []
        for i, req in enumerate(todo):
            req.cached_tokens = len(req.item.input_ids) if i > 0 and not req.started else req.cached_tokens
            req.started = True
            if self._sample(req, last):
                joined.append(req)
        if joined:
            b = len(joined)
            rep = [(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)) for k, v in layers]
            self._kv.append(rep, torch.ones(b, len(ctx), dtype=torch.long))
            with self._cv:
                self._running.extend(joined)

    def _fill_input_logprobs(self, req: Req, ctx: list, lp_all: torch.Tensor) -> None:
        start = req.item.logprob_start_len
        num_in = len(req.item.input_ids)
        entries, tops = [[None, int(ctx[start]), None]], [None]
        for pos in range(start + 1, num_in):
            entries.append([float(lp_all[pos - 1, ctx[pos]]), int(ctx[pos]), None])
            tops.append(top_logprobs(lp_all[pos - 1], req.item.top_logprobs_num) if req.item.top_logprobs_num else None)
        req.input_logprobs, req.input_top = entries, tops

    def _sample(self, req: Req, logits: torch.Tensor) -> bool:
        """Choose, record and check one token; returns True when the request keeps running."""
        sp = req.item.params
        row = adjust_logits(logits, sp, req.output_ids, sorted(req.stop_ids))
        tok, lp, lp_row = choose_token(row, sp, req.generator or self.generator, original=self.original_logprob)
        return self._record(req, tok, lp, lp_row)

    def _sample_rows(self, reqs: list[Req], logits: torch.Tensor) -> list[int]:
        """`_sample` for every row of a decode step; plain rows are drawn in one batched call.
        Returns the indices of the requests that keep running."""
        plain = [i for i, r in enumerate(reqs) if is_plain(r.item.params, len(r.output_ids), r.stop_ids,
                                                           r.generator is not None, r.item.top_logprobs_num)]
        drawn: dict[int, tuple[int, float]] = {}
        if len(plain) > 1:
            idx = torch.tensor(plain, dtype=torch.long)
            toks, lps = choose_plain_batch(logits.index_select(0, idx), [reqs[i].item.params.temperature for i in plain],
                                           self.generator, original=self.original_logprob)
            drawn = {i: (t, lp) for i, t, lp in zip(plain, toks, lps)}
        keep = []
        for i, req in enumerate(reqs):
            alive = self._record(req, *drawn[i], None) if i in drawn else self._sample(req, logits[i])
            if alive:
                keep.append(i)
        return keep

    def _record(self, req: Req, tok: int, lp: float, lp_row: Optional[torch.Tensor]) -> bool:
        req.output_ids.append(tok)
        req.output_versions.append(self.version_label())
        self.num_generated_tokens += 1
        if req.item.return_logprob:
            req.output_logprobs.append([lp, tok, None])
            if req.item.top_logprobs_num:
                req.output_top.append(top_logprobs(lp_row, req.item.top_logprobs_num))
        reason = self._check_finished(req, tok)
        if reason is not None:
            self._finish(req, reason)
            return False
        if req.on_token is not None:
            req.on_token(req, len(req.output_ids))
        return True

    def _check_finished(self, req: Req, tok: int) -> Optional[dict]:
        """SGLang's order: length first, then stop/EOS ids (skipped with ignore_eos), then stop strings."""
        sp = req.item.params
        if len(req.output_ids) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        if tok in req.stop_ids:
            return {"type": "stop", "matched": tok}
        if (sp.stop or sp.stop_regex) and self.tokenizer is not None:
            longest = max([len(s) for s in sp.stop] + [64 if sp.stop_regex else 0])
            tail = self.tokenizer.decode(req.output_ids[-(longest + 8):], skip_special_tokens=sp.skip_special_tokens)
            for s in sp.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
            if sp.stop_regex:
                import re

                for pattern in sp.stop_regex:
                    m = re.search(pattern, tail)
                    if m:
                        return {"type": "stop", "matched": pattern}
        return None

    def _decode_step(self) -> None:
        reqs = self._running
        ids = torch.tensor([[r.output_ids[-1]] for r in reqs], dtype=torch.long)
        pos = torch.tensor([[len(r.item.input_ids) + len(r.output_ids) - 1] for r in reqs], dtype=torch.long)
        cache = self._kv.to_cache(self.model.config)
        mask = torch.cat([self._kv.mask, self._kv.mask.new_ones(len(reqs), 1)], dim=1)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        self._kv.advance(out.past_key_values)
        logits = out.logits[:, -1].float()
        keep = self._sample_rows(reqs, logits)
        with self._cv:
            self._running = [reqs[i] for i in keep]
        self._kv.keep(keep)
