"""The inference engine: one scheduler thread doing continuous batching over a transformers model.

Each loop iteration, under `step_lock`: take the inbox (new requests and aborts, in arrival order),
admit waiting requests (one prefill per distinct context, shared by identical prompts such as the G
samples of a group), then run ONE decode step for every running request together. Weight swaps take
`step_lock`, so they land between decode steps and never inside one.

Threads: the HTTP side only appends to the inbox (`submit`, `abort`, `abort_rids`) and reads
published counters (`loads`); the condition `_wake` is held for O(1) work only, so the event loop
never waits on the scheduler. Everything else (queues, the rid index, the KV cache) belongs to the
scheduler thread, or to `pause()` under `step_lock`.

Aborts cost O(1) per request: live requests are indexed by rid and an aborted waiting request is
finished in place, never searched for in the queue (`waiting.py`).

Isolation: a request whose sampling raises is failed alone (500 reason) and the others in its
prefill or decode batch go on; a batched prefill whose forward raises is retried one context at a
time, so only the context that fails again is failed. Admission and prefill: `admission.py`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

import torch

from megatron_bapo.server.admission import AdmissionMixin, failure
from megatron_bapo.server.kv import BatchKV
from megatron_bapo.server.protocol import GenerateItem
from megatron_bapo.server.req import Req, abort_reason, check_finished
from megatron_bapo.server.routing import RoutingCapture, keep_routing
from megatron_bapo.server.sampling import adjust_logits, choose_plain_batch, choose_token, is_plain, top_logprobs
from megatron_bapo.server.waiting import WaitingQueue

logger = logging.getLogger(__name__)

_SUBMIT, _ABORT_PREFIX, _ABORT_EXACT = "submit", "abort_prefix", "abort_exact"


class Engine(AdmissionMixin):
    """Owns the model and the scheduler thread. All public methods are thread-safe."""

    def __init__(self, model, tokenizer, *, eos_ids, max_running: int, seed: int, original_logprob: bool,
                 max_total_tokens: Optional[int] = None, capture_routing: bool = False, decode_delay_s: float = 0.0):
        self.model = model
        self.routing: Optional[RoutingCapture] = RoutingCapture(model) if capture_routing else None
        """Records the routed experts of every forward (--enable-return-routed-experts)."""
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self.max_running = max_running
        self.max_total_tokens = max_total_tokens
        self.decode_delay_s = decode_delay_s
        """Added to every step that generates tokens (`--decode-delay-ms`: a slow server on a CPU)."""
        self.original_logprob = original_logprob
        self.generator = torch.Generator().manual_seed(seed)
        self.step_lock = threading.RLock()
        self._wake = threading.Condition()
        self._inbox: collections.deque = collections.deque()  # (kind, payload); deque ops are atomic
        # Scheduler-owned (or pause() under step_lock):
        self._waiting = WaitingQueue()
        self._running: list[Req] = []
        self._kv = BatchKV()
        self._done: list[Req] = []  # finished, on_done not yet called (see _flush)
        # Published for other threads (plain ints, written by the owner, read without a lock):
        self._num_running = 0
        self._num_kv_tokens = 0
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
        with self._wake:
            self._shutdown = True
            self._wake.notify_all()
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
        self._post(_SUBMIT, req)
        return req

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort every request whose rid starts with `rid` (or all); takes effect before the next step.
        SGLang's `/abort_request` semantics: `"s_1"` also aborts `"s_10"`."""
        self._post(_ABORT_PREFIX, (rid, abort_all))

    def abort_rids(self, rids: list) -> None:
        """Abort exactly these rids (a disconnected client's own requests): O(1) each."""
        self._post(_ABORT_EXACT, list(rids))

    def pause(self, retract: bool) -> None:
        """Stop computing. `retract`: running requests go back to the queue and their KV is dropped
        (re-prefilled on continue); otherwise they stay resident (in place)."""
        self._paused = True
        with self.step_lock:
            if retract and self._running:
                for req in self._running:
                    req.num_retractions += 1
                    req.running = False
                self._waiting.requeue_front(self._running)
                self._running = []
                self._kv.clear()
                self._publish()

    def resume(self) -> None:
        with self._wake:
            self._paused = False
            self._wake.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def loads(self) -> tuple[int, int, int]:
        """(running, waiting, tokens resident in the KV cache), as of the last scheduler step."""
        return self._num_running, self._waiting.num_waiting, self._num_kv_tokens

    def is_idle(self) -> bool:
        running, waiting, _ = self.loads()
        return running == 0 and waiting == 0 and not self._inbox

    def swap_model(self, model) -> None:
        """Replace the model between decode steps (resident KV, if any, was computed by the old one)."""
        with self.step_lock:
            if self.routing is not None:
                self.routing.remove()
                self.routing = RoutingCapture(model)
            self.model = model

    def _forward(self, fn, *args, **kwargs):
        """`fn(*args, **kwargs)` (a model forward) and the experts its MoE layers chose per token
        (`[tokens, L, k]`, None unless routing is captured)."""
        if self.routing is None:
            return fn(*args, **kwargs), None
        self.routing.start()
        out = fn(*args, **kwargs)
        return out, self.routing.take()



    # ---------------------------------------------------------------- scheduler thread
    def _post(self, kind: str, payload) -> None:
        self._inbox.append((kind, payload))
        with self._wake:
            self._wake.notify()

    def _has_work(self) -> bool:
        return bool(self._inbox) or (not self._paused and bool(self._waiting.num_waiting or self._running))

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._shutdown and not self._has_work():
                    self._wake.wait()
                if self._shutdown:
                    break
            with self.step_lock, torch.inference_mode():
                try:
                    self._take_inbox()
                    if not self._paused:
                        generated = self.num_generated_tokens
                        self._admit()
                        if self._running:
                            self._decode_step()
                        if self.decode_delay_s and self.num_generated_tokens > generated:
                            time.sleep(self.decode_delay_s)  # as a slower device's step would take
                except BaseException as exc:  # noqa: BLE001 - keep serving; fail the affected requests
                    logger.exception("scheduler step failed; aborting the running requests")
                    self.last_error = exc
                    failed, self._running = self._running, []
                    self._kv.clear()
                    for req in failed:
                        self._finish(req, failure("decode", exc))
                finally:
                    self._flush()
        with self.step_lock:
            self._take_inbox()
            leftover = self._waiting.drain() + self._running
            self._running = []
            for req in leftover:
                self._finish(req, abort_reason("Server shutting down"))
            self._flush()

    def _publish(self) -> None:
        """Update the counters `loads()` reads (under `step_lock`)."""
        mask = self._kv.mask
        self._num_running = len(self._running)
        self._num_kv_tokens = int(mask.sum()) if mask is not None else 0

    def _flush(self) -> None:
        """Publish the counters, then call on_done of the requests finished since the last flush
        (so a client that got its reply never reads a load count that still includes it)."""
        self._publish()
        done, self._done = self._done, []
        for req in done:
            try:
                req.on_done(req)
            except Exception:  # noqa: BLE001
                logger.exception("on_done callback failed for rid %s", req.rid)

    def _finish(self, req: Req, reason: dict) -> None:
        """Record the finish and drop the rid from the index; the callback runs at the next `_flush`."""
        req.finish_reason = reason
        req.running = False
        self._waiting.forget(req)
        self._done.append(req)

    def _take_inbox(self) -> None:
        """New requests join the queue and the rid index; aborts hit live requests by rid (a waiting
        one is finished at once and skipped later; running ones leave the batch together)."""
        stopped: set = set()
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == _SUBMIT:
                if not self._waiting.add(payload):  # the HTTP layer refuses in-flight rids; in-process use
                    self._finish(payload, {"type": "abort", "message": "Duplicate request ID detected.",
                                           "status_code": 400, "err_type": "BadRequest"})
                continue
            for req in self._matches(kind, payload):
                if req.finish_reason is not None or id(req) in stopped:
                    continue
                if req.running:
                    stopped.add(id(req))
                else:
                    self._waiting.left_queue()
                    self._finish(req, abort_reason("Aborted" if req.started else "Abort in waiting queue"))
        if stopped:
            keep = [i for i, r in enumerate(self._running) if id(r) not in stopped]
            gone = [r for r in self._running if id(r) in stopped]
            self._running = [self._running[i] for i in keep]
            self._kv.keep(keep)
            for req in gone:
                self._finish(req, abort_reason("Aborted"))

    def _matches(self, kind: str, payload) -> list:
        if kind == _ABORT_EXACT:
            return self._waiting.exact(payload)
        prefix, abort_all = payload
        if abort_all:
            return self._waiting.all_live()
        return self._waiting.with_prefix(prefix) if prefix else []

    def _sample_guarded(self, req: Req, logits: torch.Tensor) -> bool:
        """`_sample` for one request; an error fails this request only (returns False)."""
        try:
            return self._sample(req, logits)
        except Exception as exc:  # noqa: BLE001
            logger.exception("sampling failed for rid %s; failing that request only", req.rid)
            self.last_error = exc
            if req.finish_reason is None:
                self._finish(req, failure("sampling", exc))
            return False

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
            try:
                toks, lps = choose_plain_batch(logits.index_select(0, idx),
                                               [reqs[i].item.params.temperature for i in plain],
                                               self.generator, original=self.original_logprob)
                drawn = {i: (t, lp) for i, t, lp in zip(plain, toks, lps)}
            except Exception as exc:  # noqa: BLE001 - e.g. one non-finite row: sample row by row instead
                logger.warning("batched sampling of %d rows failed (%s); sampling them one by one", len(plain), exc)
        keep = []
        for i, req in enumerate(reqs):
            alive = self._record(req, *drawn[i], None) if i in drawn else self._sample_guarded(req, logits[i])
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
        reason = check_finished(req, tok, self.tokenizer)
        if reason is not None:
            self._finish(req, reason)
            return False
        if req.on_token is not None:
            try:
                req.on_token(req, len(req.output_ids))
            except Exception:  # noqa: BLE001 - a streaming client's callback must not stop the batch
                logger.exception("on_token callback failed for rid %s", req.rid)
        return True

    def _decode_step(self) -> None:
        reqs = self._running
        ids = torch.tensor([[r.output_ids[-1]] for r in reqs], dtype=torch.long)
        pos = torch.tensor([[len(r.item.input_ids) + len(r.output_ids) - 1] for r in reqs], dtype=torch.long)
        cache = self._kv.to_cache(self.model.config)
        mask = torch.cat([self._kv.mask, self._kv.mask.new_ones(len(reqs), 1)], dim=1)
        out, routed = self._forward(self.model, input_ids=ids, attention_mask=mask, position_ids=pos,
                                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        if routed is not None:  # one fed token per request
            for i, req in enumerate(reqs):
                keep_routing(req, routed[i:i + 1], prefill=False)
        self._kv.advance(out.past_key_values)
        logits = out.logits[:, -1].float()
        keep = self._sample_rows(reqs, logits)
        self._running = [reqs[i] for i in keep]
        self._kv.keep(keep)
