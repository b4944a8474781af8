"""Parsing and checking SGLang `/generate` replies into `GenerateResult` (spec section 2)."""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, Optional

from megatron_bapo.rollout.errors import ProtocolError
from megatron_bapo.rollout.types import GenerateResult

FINISH_TYPES = ("stop", "length", "abort")


def parse_version(value: Any) -> Optional[int]:
    """Wire weight versions are strings ("12"); ours are ints. Non-integers ("default") -> None."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        return None


LOGPROB_SLACK = 1e-4
"""A log-probability is <= 0; values up to this above 0 are float noise of a log-softmax, not a bug."""


def parse_generate_reply(body: Any, *, rid: str, url: str, max_new_tokens: Optional[int] = None,
                         vocab_size: Optional[int] = None, max_version: Optional[int] = None) -> GenerateResult:
    """Ids and behavior log-probs from `meta_info.output_token_logprobs` (`[logprob, id, text]`),
    checked before they can become a sample: the one place a reply enters the run.

    A reply is refused (`ProtocolError` naming the server and the field; the client retries it on
    another server, then the run stops) when `output_ids` disagree with the log-prob ids, a log-prob
    is NaN, +inf or above 0 (`LOGPROB_SLACK`), there are more tokens than `max_new_tokens`, an id is
    outside `[0, vocab_size)`, or a token's version is above `max_version` (the newest version the
    trainer published: a later one is from the future). Training on any of these would bias every
    importance ratio or crash the actor's embedding. The version of each token is
    `meta_info.weight_version` at reply time, or the `weight_versions` spans of SGLang 0.5.23+
    (`{"version", "start", "end"}` over output positions) when the server reports them.
    """
    where = f"{url}/generate reply"
    if isinstance(body, list):
        if len(body) != 1:
            raise ProtocolError(f"{url}/generate returned a batch of {len(body)} for one prompt")
        body = body[0]
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ProtocolError(f"{where} has no meta_info: {str(body)[:200]}")
    meta = body["meta_info"]
    finish = meta.get("finish_reason")
    if isinstance(finish, str):
        finish = {"type": finish}
    if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
        raise ProtocolError(f"{where}: unknown meta_info.finish_reason {finish!r}")
    entries = meta.get("output_token_logprobs") or []
    if not isinstance(entries, list):
        raise ProtocolError(f"{where}: meta_info.output_token_logprobs is not a list: {str(entries)[:100]}")
    if max_new_tokens is not None and len(entries) > max_new_tokens:
        raise ProtocolError(f"{where}: meta_info.output_token_logprobs has {len(entries)} tokens, more than the "
                            f"max_new_tokens={max_new_tokens} asked for")
    ids: list[int] = []
    logprobs: list[float] = []
    for i, e in enumerate(entries):
        field = f"meta_info.output_token_logprobs[{i}]"
        if not isinstance(e, (list, tuple)) or len(e) < 2 or e[0] is None:
            raise ProtocolError(f"{where}: malformed {field} {e!r}")
        try:
            lp, token = float(e[0]), e[1]
        except (TypeError, ValueError):
            raise ProtocolError(f"{where}: {field} log-prob {e[0]!r} is not a number") from None
        if not (lp <= LOGPROB_SLACK):  # NaN and +inf fail too; -inf (probability 0) is a log-prob
            raise ProtocolError(f"{where}: {field} log-prob {lp} for token {token}: a log-probability is <= 0")
        if isinstance(token, bool) or not isinstance(token, int):
            raise ProtocolError(f"{where}: {field} token id {token!r} is not an integer")
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise ProtocolError(f"{where}: {field} token id {token} is outside the vocabulary [0, {vocab_size})")
        logprobs.append(lp)
        ids.append(token)
    output_ids = body.get("output_ids")
    if output_ids is not None and [int(x) for x in output_ids] != ids:
        if not ids and output_ids:
            raise ProtocolError(f"{where}: {len(output_ids)} output_ids without meta_info.output_token_logprobs "
                                "(was return_logprob dropped on the way?)")
        raise ProtocolError(f"{where}: output_ids ({len(output_ids)} tokens: {list(output_ids)[:8]}...) disagree with "
                            f"meta_info.output_token_logprobs ({len(ids)} tokens: {ids[:8]}...)")
    versions = _versions(meta, len(ids), where)
    if max_version is not None:
        future = [v for v in versions if v is not None and v > max_version]
        if future:
            raise ProtocolError(f"{where}: meta_info.weight_version {max(future)} is newer than the newest version "
                                f"the trainer published ({max_version})")
    text = body.get("text")
    return GenerateResult(output_ids=ids, logprobs=logprobs, versions=versions,
                          finish_type=finish["type"], finish_reason=dict(finish), rid=rid, url=url,
                          text=text if isinstance(text, str) else "", routed_experts=_routed(meta, url))


def _routed(meta: dict, url: str) -> Optional[bytes]:
    """`meta_info.routed_experts` (base64 of int32 ids, SGLang 0.5.23) as bytes, or None."""
    value = meta.get("routed_experts")
    if value is None:
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError) as exc:
        raise ProtocolError(f"{url}/generate: meta_info.routed_experts is not base64: {exc}") from exc
    if len(raw) % 4:
        raise ProtocolError(f"{url}/generate: meta_info.routed_experts has {len(raw)} bytes, not int32 ids")
    return raw


def _versions(meta: dict, n: int, where: str) -> list[Optional[int]]:
    spans = meta.get("weight_versions")
    out: list[Optional[int]] = [parse_version(meta.get("weight_version"))] * n
    if isinstance(spans, list) and spans:
        for span in spans:
            try:
                start, end, v = int(span["start"]), int(span["end"]), parse_version(span["version"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(f"{where}: malformed meta_info.weight_versions span {span!r}") from exc
            for i in range(max(start, 0), min(end, n)):
                out[i] = v
    return out


def aborted_result(rid: str, url: str) -> GenerateResult:
    """The segment of a request that was never sent because of an abort: no tokens."""
    finish = {"type": "abort", "message": "Aborted by the client before sending"}
    return GenerateResult(output_ids=[], logprobs=[], versions=[], finish_type="abort", finish_reason=finish,
                          rid=rid, url=url)
