"""`/generate` request parsing and validation, and SGLang's error shapes.

Parsing is separate from the engine so every malformed request is rejected (400 with a message that
names the field) before anything is queued; the engine only ever sees valid, fully defaulted items.
Semantics follow SGLang 0.5.15 (`io_struct.GenerateReqInput`, `sampling_params.SamplingParams`), see
the shared SGLang native API spec (shared/specs/sglang-native-api.md) section 2.
"""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
import uuid
from typing import Any, Optional

LOGIT_BIAS_MAX = 1e6
"""Largest |logit_bias| value: enough to force or ban any token, small enough that biased fp32
logits, even divided by the smallest non-greedy temperature (1e-6), stay finite."""
SEED_RANGE = (-(1 << 63), 1 << 64)
"""`sampling_seed` values torch.Generator.manual_seed accepts: [-2**63, 2**64)."""
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlevel = 80, 80, 40, 3


def _short(value: Any) -> str:
    """A bounded repr for echoing client values in error messages (a 30 MB string stays short)."""
    return _REPR.repr(value)


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """Per-request caps (`ServerConfig.max_*`, with `max_prompt_tokens` resolved). Each violation is
    a 400 that names the limit and its flag, checked before the expensive part (tokenizing, fan-out)."""

    max_sampling_n: int = 1024
    max_batch_size: int = 4096
    max_prompt_tokens: int = 1 << 62
    max_prompt_chars: int = 1 << 20


class RequestError(Exception):
    """A bad request: becomes HTTP `status` with SGLang's shape 1 (`{"error": {"message"}}`) or,
    with `shape=2`, the OpenAI-style envelope SGLang uses for unparsable bodies / wrong types."""

    def __init__(self, message: str, *, status: int = 400, shape: int = 1):
        super().__init__(message)
        self.message = message
        self.status = status
        self.shape = shape

    def body(self) -> dict:
        if self.shape == 1:
            return {"error": {"message": self.message}}
        kind = "Bad Request" if self.status == 400 else str(self.status)
        return {"object": "error", "message": self.message, "type": kind, "param": None, "code": self.status}


@dataclasses.dataclass
class SamplingParams:
    """Validated sampling parameters of one request (SGLang names and defaults)."""

    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list = dataclasses.field(default_factory=list)
    stop_token_ids: list = dataclasses.field(default_factory=list)
    stop_regex: list = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: Optional[int] = None
    logit_bias: Optional[dict] = None
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    custom_params: Optional[dict] = None
    stream_interval: Optional[int] = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_INT_FIELDS = {"max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed", "stream_interval"}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"}
_BOOL_FIELDS = {"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}


def _finite(value: Any) -> Optional[float]:
    """`value` as a finite float, or None (not a number, a bool, NaN/inf, or an int too big for a float)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None


def _parse_logit_bias(value: Any) -> dict:
    if not isinstance(value, dict):
        raise RequestError("sampling_params.logit_bias must be an object {token_id: bias}", shape=2)
    out = {}
    for key, bias in value.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"sampling_params.logit_bias: key {_short(key)} is not a token id") from None
        num = _finite(bias)
        if num is None or abs(num) > LOGIT_BIAS_MAX:
            raise RequestError(f"sampling_params.logit_bias[{_short(key)}] must be a finite number in "
                               f"[-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {_short(bias)}")
        out[tok] = num
    return out


def parse_sampling_params(raw: Any) -> SamplingParams:
    """A dict from the request -> validated `SamplingParams`; `null` values mean the default."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"sampling_params must be an object, got {type(raw).__name__}", shape=2)
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise RequestError(f"Unknown sampling_params field(s) {unknown}; supported: {sorted(_FIELDS)}")
    sp = SamplingParams()
    for key, value in raw.items():
        if value is None:
            continue
        if key in _INT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    raise RequestError(f"sampling_params.{key} must be an integer, got {_short(value)}", shape=2)
        elif key in _FLOAT_FIELDS:
            num = _finite(value)
            if num is None:
                raise RequestError(f"sampling_params.{key} must be a finite number, got {_short(value)}", shape=2)
            value = num
        elif key in _BOOL_FIELDS:
            if not isinstance(value, bool):
                raise RequestError(f"sampling_params.{key} must be a boolean, got {_short(value)}", shape=2)
        elif key in ("stop", "stop_regex"):
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
                raise RequestError(f"sampling_params.{key} must be a non-empty string or a list of them", shape=2)
            if key == "stop_regex":
                for pattern in value:
                    try:
                        re.compile(pattern)
                    except (re.error, RecursionError, OverflowError) as exc:
                        raise RequestError(f"sampling_params.stop_regex {_short(pattern)} is not a valid regular "
                                           f"expression: {exc}") from None
        elif key == "stop_token_ids":
            if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                raise RequestError("sampling_params.stop_token_ids must be a list of integers", shape=2)
        elif key == "logit_bias":
            value = _parse_logit_bias(value)
        setattr(sp, key, value)
    _check_sampling_rules(sp)
    return sp


def _check_sampling_rules(sp: SamplingParams) -> None:
    """SGLang's `SamplingParams.verify` rules, with its wording where it has one."""
    if sp.temperature < 0.0:
        raise RequestError(f"temperature must be non-negative, got {sp.temperature}.")
    if not 0.0 < sp.top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {sp.top_p}.")
    if not 0.0 <= sp.min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {sp.min_p}.")
    if sp.top_k < 1 and sp.top_k != -1:
        raise RequestError(f"top_k must be -1 (disable), or at least 1, got {sp.top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(sp, name) <= 2.0:
            raise RequestError(f"{name} must be in [-2, 2], got {getattr(sp, name)}.")
    if not 0.0 < sp.repetition_penalty <= 2.0:
        raise RequestError(f"repetition_penalty must be in (0, 2], got {sp.repetition_penalty}.")
    if sp.max_new_tokens is not None and sp.max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {sp.max_new_tokens}.")
    if sp.min_new_tokens < 0:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens], got {sp.min_new_tokens}.")
    if sp.max_new_tokens is not None and sp.min_new_tokens > sp.max_new_tokens:
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens({sp.max_new_tokens})], "
                           f"got {sp.min_new_tokens}.")
    if sp.n < 1:
        raise RequestError(f"n must be at least 1, got {sp.n}.")
    if sp.sampling_seed is not None and not SEED_RANGE[0] <= sp.sampling_seed < SEED_RANGE[1]:
        raise RequestError(f"sampling_params.sampling_seed must be in [-2**63, 2**64), got {sp.sampling_seed}.")
    grammars = [g for g in (sp.json_schema, sp.regex, sp.ebnf) if g is not None]
    if grammars:
        raise RequestError("Constrained decoding (json_schema / regex / ebnf) is not supported by the built-in "
                           "CPU server; use a real SGLang server for grammars.")
    if sp.custom_params is not None:
        raise RequestError("custom_params needs a custom logit processor, which the built-in server does not have.")


@dataclasses.dataclass
class GenerateItem:
    """One sequence to generate: a prompt (token ids) with its options. `n > 1` fans out later."""

    input_ids: list
    params: SamplingParams
    rid: str
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    """Reply with the experts every MoE layer chose per position (`server.routing`; needs the server
    flag --enable-return-routed-experts, otherwise ignored as by SGLang)."""
    routed_experts_start_len: int = 0
    """First position of the returned routing (SGLang: `[start, seqlen - 1)`, 0 = everything)."""


@dataclasses.dataclass
class GenerateRequest:
    """A parsed `/generate` body: `items` in input order; `single` means reply with one object."""

    items: list
    single: bool
    stream: bool = False


def _check_ids(ids: Any, where: str) -> list:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestError(f"{where} must be a list of integers", shape=2)
    if not ids:
        raise RequestError("input_ids cannot be empty.")
    return ids


def _per_item(value: Any, n: int, name: str, default: Any, kinds: tuple) -> list:
    """Scalar -> repeated; list -> must have the batch length."""
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries but the batch has {n} prompts")
        out = value
    else:
        out = [value] * n
    for v in out:
        if v is not None and (not isinstance(v, kinds) or (bool not in kinds and isinstance(v, bool))):
            raise RequestError(f"{name} has a value of the wrong type: {_short(v)}", shape=2)
    return [default if v is None else v for v in out]


def _check_prompt_len(i: int, ids: list, limits: RequestLimits) -> list:
    if len(ids) > limits.max_prompt_tokens:
        raise RequestError(f"prompt {i} has {len(ids)} tokens, above this server's limit max_prompt_tokens="
                           f"{limits.max_prompt_tokens} (--max-prompt-tokens; default: the context length - 1)")
    return ids


def parse_generate(body: Any, tokenize, limits: RequestLimits = RequestLimits()) -> GenerateRequest:
    """Validate a `/generate` JSON body. `tokenize(text) -> list[int]` (None: text prompts rejected).

    Cheap checks come first: the number of prompts, text lengths in characters, the sampling
    parameters and the number of sequences (prompts x n) are all checked against `limits` before
    any text is tokenized or any sample is created. The `n` samples of one prompt share its
    `input_ids` list and its `SamplingParams` (neither is mutated per sample).
    """
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}", shape=2)
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise RequestError("input_embeds is not supported by the built-in server; send input_ids")
    if text is None and input_ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if not isinstance(body.get("stream", False), (bool, type(None))):
        raise RequestError("stream must be a boolean", shape=2)
    for key in ("image_data", "video_data", "audio_data", "lora_path", "session_params"):
        if body.get(key) is not None:
            raise RequestError(f"{key} is not supported by the built-in server")

    texts: Optional[list] = None
    if input_ids is not None:
        if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
            prompts, single = input_ids, False
        else:
            prompts, single = [input_ids], True
    else:
        if tokenize is None:
            raise RequestError("text prompts need the tokenizer (server started with --skip-tokenizer-init)")
        if isinstance(text, str):
            texts, single = [text], True
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            texts, single = text, False
        else:
            raise RequestError("text must be a string or a list of strings", shape=2)
        if not texts:
            raise RequestError("text is an empty list.")
        prompts = texts
    num = len(prompts)
    if num > limits.max_batch_size:
        raise RequestError(f"this request has {num} prompts, above this server's limit "
                           f"max_batch_size={limits.max_batch_size} (--max-batch-size); split it into smaller requests")

    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list):
        if len(raw_sp) != num:
            raise RequestError(f"sampling_params has {len(raw_sp)} entries but the batch has {num} prompts")
        params = [parse_sampling_params(x) for x in raw_sp]
    else:
        sp = parse_sampling_params(raw_sp)
        params = [sp] + [dataclasses.replace(sp) for _ in range(num - 1)]
    for p in params:
        if p.n > limits.max_sampling_n:
            raise RequestError(f"sampling_params.n={p.n} is above this server's limit "
                               f"max_sampling_n={limits.max_sampling_n} (--max-sampling-n)")
    num_seqs = sum(p.n for p in params)
    if num_seqs > limits.max_batch_size:
        raise RequestError(f"this request asks for {num_seqs} sequences ({num} prompt(s) x n), above this server's "
                           f"limit max_batch_size={limits.max_batch_size} (--max-batch-size); split it into smaller requests")

    if texts is not None:
        for i, t in enumerate(texts):
            if len(t) > limits.max_prompt_chars:
                raise RequestError(f"text[{i}] has {len(t)} characters, above this server's limit "
                                   f"max_prompt_chars={limits.max_prompt_chars} (--max-prompt-chars)")
        prompts = []
        for i, t in enumerate(texts):  # each checked as soon as tokenized: a refusal stops the work
            prompts.append(_check_prompt_len(i, tokenize(t), limits))
            if not prompts[-1]:
                raise RequestError(f"text[{i}] tokenizes to zero tokens.")
    else:
        prompts = [_check_prompt_len(i, _check_ids(ids, "input_ids" if single else f"input_ids[{i}]"), limits)
                   for i, ids in enumerate(prompts)]

    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(num)]
    elif isinstance(rid, str):
        rids = [rid] if single else [f"{rid}_{i}" for i in range(num)]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if single:
            raise RequestError("rid must be a string for a single prompt")
        if len(rid) != num:
            raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
        rids = list(rid)
    else:
        raise RequestError("rid must be a string or a list of strings", shape=2)

    ret_lp = _per_item(body.get("return_logprob"), num, "return_logprob", False, (bool,))
    start = _per_item(body.get("logprob_start_len"), num, "logprob_start_len", -1, (int,))
    top = _per_item(body.get("top_logprobs_num"), num, "top_logprobs_num", 0, (int,))
    rtext = _per_item(body.get("return_text_in_logprobs"), num, "return_text_in_logprobs", False, (bool,))
    if any(p.n > 1 for p in params) and any(isinstance(body.get(k), list) for k in
                                             ("return_logprob", "logprob_start_len", "top_logprobs_num")):
        raise RequestError("List-valued return_logprob / logprob_start_len / top_logprobs_num cannot be "
                           "combined with n > 1.")
    routed, routed_start = routed_experts_fields(body, prompts)

    items = []
    for i in range(num):
        if start[i] >= len(prompts[i]):
            raise RequestError(f"logprob_start_len ({start[i]}) is larger than the input length "
                               f"({len(prompts[i])}).")
        if top[i] < 0:
            raise RequestError(f"top_logprobs_num must be >= 0, got {top[i]}")
        n = params[i].n
        for j in range(n):
            # SGLang gives every sample of an n > 1 request a fresh random rid.
            item_rid = rids[i] if n == 1 else uuid.uuid4().hex
            items.append(GenerateItem(input_ids=prompts[i], params=params[i], rid=item_rid,
                                      return_logprob=bool(ret_lp[i]), logprob_start_len=int(start[i]),
                                      top_logprobs_num=int(top[i]), return_text_in_logprobs=bool(rtext[i]),
                                      return_routed_experts=routed, routed_experts_start_len=routed_start))
    single_reply = single and params[0].n == 1
    return GenerateRequest(items=items, single=single_reply, stream=bool(body.get("stream")))


def routed_experts_fields(body: dict, prompts: list) -> tuple[bool, int]:
    """`return_routed_experts` (bool) and `routed_experts_start_len` (int, in [0, len(input_ids)] when
    routing is asked for: SGLang 0.5.23 refuses the request otherwise), one value for every prompt."""
    routed = body.get("return_routed_experts", False)
    start = body.get("routed_experts_start_len", 0)
    if not isinstance(routed, bool):
        raise RequestError(f"return_routed_experts must be a boolean, got {_short(routed)}", shape=2)
    if isinstance(start, bool) or not isinstance(start, int):
        raise RequestError(f"routed_experts_start_len must be an integer, got {_short(start)}", shape=2)
    if routed:
        if start < 0:
            raise RequestError(f"routed_experts_start_len={start} is lower than 0. Please use a non-negative "
                               "routed_experts_start_len.")
        for ids in prompts:
            if start > len(ids):
                raise RequestError(f"routed_experts_start_len={start} is higher than the number of input tokens "
                                   f"{len(ids)}. Please use a smaller routed_experts_start_len.")
    return routed, start


def check_context(item: GenerateItem, context_length: int) -> None:
    """Over-context prompts are rejected (SGLang without --allow-auto-truncate); `max_new_tokens=None`
    becomes "up to the context end"."""
    num_in = len(item.input_ids)
    if num_in >= context_length:
        raise RequestError(f"The input ({num_in} tokens) is longer than the model's context length "
                           f"({context_length} tokens).")
    sp = item.params
    if sp.max_new_tokens is None:
        sp.max_new_tokens = context_length - num_in
        if sp.min_new_tokens > sp.max_new_tokens:
            raise RequestError(f"min_new_tokens must be in [0, max_new_tokens({sp.max_new_tokens})], "
                               f"got {sp.min_new_tokens}.")
    elif num_in + sp.max_new_tokens > context_length:
        raise RequestError(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {num_in + sp.max_new_tokens} tokens: {num_in} tokens from the input "
            f"messages and {sp.max_new_tokens} tokens for the completion. Please reduce the number of tokens "
            "in the input messages or the completion to fit within the limit.")
