"""SGLang's `/generate` reply for one finished sequence (spec section 2, "Response").

Built when the HTTP reply is assembled, so `weight_version` is the server's version at reply time,
as in SGLang; `weight_versions` (SGLang 0.5.23) gives the version that produced each output token
as `{"version", "start", "end"}` spans (end exclusive), for replies that span a weight update
under a retract/in-place pause.
"""

from __future__ import annotations

import re
import time
from typing import Optional

from megatron_bapo.server.req import Req
from megatron_bapo.server.routing import encode_rows, request_rows


def _decode(tokenizer, ids: list, params) -> str:
    if tokenizer is None or not ids:
        return ""
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


def output_text(req: Req, tokenizer, upto: Optional[int] = None) -> Optional[str]:
    """Decoded output with the matched stop token / string trimmed unless `no_stop_trim`."""
    if tokenizer is None:
        return None
    sp, reason = req.item.params, req.finish_reason or {}
    ids = req.output_ids[:upto]
    matched = reason.get("matched") if reason.get("type") == "stop" else None
    if isinstance(matched, int) and not sp.no_stop_trim:
        ids = ids[:-1]
    text = _decode(tokenizer, ids, sp)
    if isinstance(matched, str) and not sp.no_stop_trim:
        if matched in sp.stop:
            cut = text.find(matched)
            text = text[:cut] if cut >= 0 else text
        else:
            m = re.search(matched, text)
            text = text[: m.start()] if m else text
    return text


def version_spans(versions: list, upto: Optional[int] = None) -> list[dict]:
    """Runs of equal versions over output positions: [{"version", "start", "end"}] (end exclusive)."""
    spans: list[dict] = []
    for i, v in enumerate(versions[:upto]):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def build_output(req: Req, *, weight_version: str, tokenizer, upto: Optional[int] = None) -> dict:
    """One sequence's reply object: `text`, `output_ids`, `meta_info`. `upto` (streaming): only the
    first `upto` output tokens, with `finish_reason` null (the request is still running)."""
    if upto is not None:
        return _partial_output(req, weight_version=weight_version, tokenizer=tokenizer, upto=upto)
    reason = req.finish_reason or {}
    item = req.item
    queued_abort = reason.get("type") == "abort" and not req.started
    meta: dict = {
        "id": req.rid,
        "finish_reason": reason,
        "weight_version": weight_version,
        "completion_tokens": len(req.output_ids),
    }
    if req.output_versions:
        meta["weight_versions"] = version_spans(req.output_versions)
    if not queued_abort:
        meta.update(
            prompt_tokens=len(item.input_ids),
            cached_tokens=req.cached_tokens,
            num_retractions=req.num_retractions,
            reasoning_tokens=0,
            e2e_latency=time.monotonic() - req.t_start,
        )
    if item.return_routed_experts:  # only where the server captures them (--enable-return-routed-experts)
        rows = request_rows(req.routed_prefill, req.routed_decode, item.routed_experts_start_len,
                            len(item.input_ids) + len(req.output_ids))
        if rows is not None:
            meta["routed_experts"] = encode_rows(rows)
    if item.return_logprob:
        meta["input_token_logprobs"] = req.input_logprobs
        meta["output_token_logprobs"] = req.output_logprobs
        meta["output_token_logprobs_length"] = len(req.output_logprobs)
        if item.top_logprobs_num:
            meta["input_top_logprobs"] = req.input_top
            meta["output_top_logprobs"] = req.output_top
        if item.return_text_in_logprobs and tokenizer is not None:
            for lists in (meta["input_token_logprobs"], meta["output_token_logprobs"]):
                for entry in lists:
                    entry[2] = tokenizer.decode([entry[1]])
    out: dict = {"output_ids": list(req.output_ids), "meta_info": meta}
    text = output_text(req, tokenizer)
    if text is not None:
        out = {"text": text, **out}
    return out


def _partial_output(req: Req, *, weight_version: str, tokenizer, upto: int) -> dict:
    item = req.item
    meta: dict = {"id": req.rid, "finish_reason": None, "weight_version": weight_version,
                  "weight_versions": version_spans(req.output_versions, upto),
                  "prompt_tokens": len(item.input_ids), "completion_tokens": upto, "cached_tokens": req.cached_tokens,
                  "num_retractions": req.num_retractions, "reasoning_tokens": 0,
                  "e2e_latency": time.monotonic() - req.t_start}
    if item.return_logprob:
        meta["input_token_logprobs"] = req.input_logprobs
        meta["output_token_logprobs"] = req.output_logprobs[:upto]
        meta["output_token_logprobs_length"] = upto
        if item.top_logprobs_num:
            meta["input_top_logprobs"] = req.input_top
            meta["output_top_logprobs"] = req.output_top[:upto]
    out: dict = {"output_ids": req.output_ids[:upto], "meta_info": meta}
    if tokenizer is not None:
        out = {"text": _decode(tokenizer, req.output_ids[:upto], item.params), **out}
    return out
