"""Prefill log-probs: one `/generate` that scores given tokens instead of sampling new ones.

    logprobs = await client.aprefill_logprobs(prompt_ids, response_ids)   # log p(response[i] | prompt + response[:i])

The request (SGLang 0.5.23's `GenerateReqInput`, spec section 2): `input_ids` = prompt + response,
`sampling_params` `{"max_new_tokens": 0, "temperature": 1.0}`, `return_logprob: true` and
`logprob_start_len` = len(prompt) - 1. Why minus one: SGLang's reply holds one
`meta_info.input_token_logprobs` entry per input position from `logprob_start_len` on, and the first
of them is always `[null, id, text]` (`SchedulerLogprobResultProcessor._process_input_token_logprobs`:
`[None] + input_token_logprobs[:-1]`, whatever the start): position s carries log p(ids[s] | ids[:s])
only for s > logprob_start_len. Starting one before the response makes the entries after that null
one exactly the response's tokens; the prompt's other positions are neither computed nor sent.
SGLang caps its prefix-cache reuse at `logprob_start_len` (`Req._compute_max_prefix_len`), so a
cached prompt does not skip the positions asked for. Temperature 1: the log-probs of the model's own
distribution (the built-in server's input log-probs are unscaled; SGLang's equal them at 1).

The reply is untrusted (`parse_prefill_reply`): one entry per position asked for, each entry's id the
id sent there, every log-prob a finite number <= 0, no generated token. A reply that fails is a
`ProtocolError`, retried on another server like a bad generation (`RolloutClient._attempt_failed`),
with the client's one retry budget (`client.max_retries`) and its dead-server fast path.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any, Optional, Sequence

from megatron_bapo.rollout.errors import ProtocolError, RequestRejected
from megatron_bapo.rollout.protocol import LOGPROB_SLACK

PREFILL_PARAMS = {"max_new_tokens": 0, "temperature": 1.0}
"""The sampling params of a prefill: nothing generated, the model's own (temperature 1) distribution."""


def prefill_request(prompt_ids: Sequence[int], response_ids: Sequence[int]) -> dict[str, Any]:
    """The `/generate` body (without `rid`) whose reply scores every token of `response_ids` after `prompt_ids`."""
    if not prompt_ids or not response_ids:
        raise ValueError(f"prefill_request: needs a prompt and a response, got {len(prompt_ids)} and "
                         f"{len(response_ids)} tokens")
    return {"input_ids": [int(x) for x in (*prompt_ids, *response_ids)], "sampling_params": dict(PREFILL_PARAMS),
            "return_logprob": True, "logprob_start_len": len(prompt_ids) - 1}


def parse_prefill_reply(body: Any, *, input_ids: Sequence[int], start: int, url: str,
                        vocab_size: Optional[int] = None) -> list[float]:
    """log p(input_ids[t] | input_ids[:t]) for t in (start, len(input_ids)) from a prefill reply with
    `logprob_start_len` = `start`, checked before use (module docstring; `ProtocolError` naming the
    server and the entry otherwise).

    SGLang 0.5.23 reports an input id >= vocab_size - 1 of its model config as 0 (it clips image-token
    hashes there: `logprob_result_processor.py`), so with `vocab_size` (the served model's) a reported 0
    is accepted for such an id; everything else must be the id sent.
    """
    where = f"{url}/generate (prefill) reply"
    if isinstance(body, list):
        if len(body) != 1:
            raise ProtocolError(f"{where} is a batch of {len(body)} for one prompt")
        body = body[0]
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ProtocolError(f"{where} has no meta_info: {str(body)[:200]}")
    meta = body["meta_info"]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in ("length", "stop"):
        raise ProtocolError(f"{where}: finish_reason {finish!r} (a prefill ends at once with 'length')")
    if body.get("output_ids"):
        raise ProtocolError(f"{where}: generated {len(body['output_ids'])} token(s) with max_new_tokens 0")
    entries = meta.get("input_token_logprobs")
    expected = len(input_ids) - start
    if not isinstance(entries, list) or len(entries) != expected:
        count = len(entries) if isinstance(entries, list) else entries
        raise ProtocolError(f"{where}: meta_info.input_token_logprobs has {count} entries for logprob_start_len "
                            f"{start} of {len(input_ids)} input tokens (expected {expected}; was return_logprob "
                            f"dropped on the way?)")
    out: list[float] = []
    for i, entry in enumerate(entries):
        field, sent = f"meta_info.input_token_logprobs[{i}]", int(input_ids[start + i])
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise ProtocolError(f"{where}: malformed {field} {entry!r}")
        token = entry[1]
        clipped = token == 0 and vocab_size is not None and sent >= vocab_size - 1
        if isinstance(token, bool) or not isinstance(token, int) or (token != sent and not clipped):
            raise ProtocolError(f"{where}: {field} is for token {token!r}, the request has {sent} there")
        if i == 0:  # position `start` has no log-prob here (SGLang sends null): nothing to check or keep
            continue
        try:
            lp = float(entry[0])
        except (TypeError, ValueError):
            raise ProtocolError(f"{where}: {field} log-prob {entry[0]!r} is not a number") from None
        if not (math.isfinite(lp) and lp <= LOGPROB_SLACK):
            raise ProtocolError(f"{where}: {field} log-prob {lp} for token {sent}: a log-probability is finite "
                                f"and <= 0")
        out.append(lp)
    return out


class PrefillMixin:
    """`aprefill_logprobs` for `RolloutClient`. Needs `config`, `vocab_size`, `stats`, `stopping`,
    `server_caps`, `_fit_lazily`, `_session`, `_backoff`, `_pick_url`, `_post_generate`,
    `_attempt_failed` and `_out_of_retries` (the client's one retry policy)."""

    async def aprefill_logprobs(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> list[float]:
        """log p(response_ids[i] | prompt_ids + response_ids[:i]) under the served model, one float per
        response token, from one prefill request (module docstring), retried and failed over as a
        generation is. Raises RequestRejected on a 4xx, RolloutError when every retry failed."""
        from megatron_bapo.rollout.client import RETRIED

        payload = prefill_request(prompt_ids, response_ids)
        start, ids = payload["logprob_start_len"], payload["input_ids"]

        def parse(body: Any, rid: str, url: str) -> list[float]:
            return parse_prefill_reply(body, input_ids=ids, start=start, url=url, vocab_size=self.vocab_size)

        if self.config.max_concurrency is None and self.server_caps is None:
            await self._fit_lazily()
        session, slots = self._session()
        last_url: Optional[str] = None
        last_error: Optional[BaseException] = None
        async with slots:
            for attempt in range(self.config.max_retries + 1):
                if attempt and self.stopping:
                    break
                if attempt:
                    self.stats["num_retries"] += 1
                    await asyncio.sleep(self._backoff(attempt))
                url = last_url = self._pick_url(avoid=last_url)
                rid = uuid.uuid4().hex
                try:
                    return await self._post_generate(session, url, rid, payload, parse=parse)
                except RequestRejected:
                    self.stats["num_rejected"] += 1
                    raise
                except RETRIED as exc:
                    last_error = exc
                    self._attempt_failed(url, rid, exc, attempt)
        raise self._out_of_retries("/generate (prefill)", last_url, last_error)
