"""Parsing SGLang `/generate` replies into `GenerateResult` (spec section 2)."""

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


def parse_generate_reply(body: Any, *, rid: str, url: str) -> GenerateResult:
    """Ids and behavior log-probs from `meta_info.output_token_logprobs` (`[logprob, id, text]`).

    `output_ids`, when present, must agree with the log-prob ids. The version of each token is
    `meta_info.weight_version` at reply time, or the `weight_versions` spans of SGLang 0.5.23+
    (`{"version", "start", "end"}` over output positions) when the server reports them.
    """
    if isinstance(body, list):
        if len(body) != 1:
            raise ProtocolError(f"{url}/generate returned a batch of {len(body)} for one prompt")
        body = body[0]
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ProtocolError(f"{url}/generate reply has no meta_info: {str(body)[:200]}")
    meta = body["meta_info"]
    finish = meta.get("finish_reason")
    if isinstance(finish, str):
        finish = {"type": finish}
    if not isinstance(finish, dict) or finish.get("type") not in FINISH_TYPES:
        raise ProtocolError(f"{url}/generate reply has an unknown finish_reason {finish!r}")
    entries = meta.get("output_token_logprobs") or []
    ids: list[int] = []
    logprobs: list[float] = []
    for e in entries:
        if not isinstance(e, (list, tuple)) or len(e) < 2 or e[0] is None:
            raise ProtocolError(f"{url}/generate: malformed output_token_logprobs entry {e!r}")
        lp = float(e[0])
        if math.isnan(lp):
            raise ProtocolError(f"{url}/generate: NaN log-prob for token {e[1]}")
        logprobs.append(lp)
        ids.append(int(e[1]))
    output_ids = body.get("output_ids")
    if output_ids is not None and [int(x) for x in output_ids] != ids:
        if not ids and output_ids:
            raise ProtocolError(f"{url}/generate returned {len(output_ids)} tokens without log-probs "
                                "(was return_logprob dropped on the way?)")
        raise ProtocolError(f"{url}/generate: output_ids {list(output_ids)[:8]}... disagree with "
                            f"output_token_logprobs ids {ids[:8]}...")
    text = body.get("text")
    return GenerateResult(output_ids=ids, logprobs=logprobs, versions=_versions(meta, len(ids)),
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


def _versions(meta: dict, n: int) -> list[Optional[int]]:
    spans = meta.get("weight_versions")
    out: list[Optional[int]] = [parse_version(meta.get("weight_version"))] * n
    if isinstance(spans, list) and spans:
        for span in spans:
            try:
                start, end, v = int(span["start"]), int(span["end"]), parse_version(span["version"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(f"malformed weight_versions span {span!r}") from exc
            for i in range(max(start, 0), min(end, n)):
                out[i] = v
    return out


def aborted_result(rid: str, url: str) -> GenerateResult:
    """The segment of a request that was never sent because of an abort: no tokens."""
    finish = {"type": "abort", "message": "Aborted by the client before sending"}
    return GenerateResult(output_ids=[], logprobs=[], versions=[], finish_type="abort", finish_reason=finish,
                          rid=rid, url=url)
