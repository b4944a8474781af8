"""Config dataclasses of the rollout client and the partial-rollout manager.

Each is validated in `__post_init__`, naming the offending field, so a wrong value fails when the
run starts rather than hours later on the first rollout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

ENGINES = ("builtin", "sglang")
"""The servers a run can start itself (`rollout.engine`, and every role's `engine`)."""

# sampling_params keys the client forwards. SGLang 0.5.2-0.5.15 answer an unknown key with a 500
# (an uncaught TypeError) and 0.5.23 with a 400, so unknown keys are rejected here, by name.
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_token_ids",
        "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "sampling_seed",
    }
)


API_KEY_ENV = "ROLLOUT_API_KEY"
"""Environment variable holding the servers' API key when `RolloutClientConfig.api_key` is unset."""

@dataclass
class RolloutClientConfig:
    """How the trainer reaches its SGLang servers (or the built-in CPU server)."""

    urls: list[str] = field(default_factory=list)
    """Worker URLs (`http://host:port`). `/generate` is balanced over them unless `router_url` is
    set; control calls (abort, pause, weight updates) always go to each of them. Empty in a run
    config: the trainer starts built-in servers and fills this in."""
    router_url: Optional[str] = None
    """An sglang-router: `/generate` goes there. With `urls` empty, workers are listed from the
    router (`GET /workers`, or legacy `/list_workers`) for control calls, which it does not forward."""
    max_concurrency: Optional[int] = None
    """Requests in flight at once over the whole pool; more wait their turn in the client (no
    head-of-line block). None: per server, as many as its KV cache holds (`rollout.concurrency`:
    `/server_info`'s `max_total_num_tokens` and context length, over the KV one request of this run
    holds at the end of a segment). A value the servers cannot hold is kept, with one warning naming
    the numbers."""
    request_timeout_s: float = 3600.0
    """Wall-clock limit of one `/generate` call; a timed-out call is aborted and retried elsewhere."""
    connect_timeout_s: float = 10.0
    """Limit on opening a connection; a dead server fails fast instead of after request_timeout_s."""
    control_timeout_s: float = 600.0
    """Limit of one control call (weight update, flush, pause)."""
    max_retries: int = 5
    """Retries of a failed `/generate` (connection error, timeout, 5xx, malformed reply), each on
    another healthy server when there is one; 4xx replies are not retried."""
    backoff_s: float = 0.5
    """First retry delay; doubled each retry up to backoff_max_s."""
    backoff_max_s: float = 10.0
    unhealthy_cooldown_s: float = 30.0
    """A server that failed a request gets no new requests for this long (unless all are down)."""
    health_timeout_s: float = 600.0
    """`wait_healthy` gives up after this long."""
    flush_cache_timeout_s: float = 60.0
    """`flush_cache` polls (1 s apart) until a 200 or this long."""
    api_key: Optional[str] = None
    """Sent as `Authorization: Bearer <key>` on every call (generation, control, weight sync,
    evaluation) when set; unset: the `ROLLOUT_API_KEY` environment variable, if any (keeps the key
    out of config files and run directories)."""

    def __post_init__(self) -> None:
        self.urls = [str(u).rstrip("/") for u in self.urls]
        if self.router_url is not None:
            self.router_url = str(self.router_url).rstrip("/")
        for u in self.urls + ([self.router_url] if self.router_url else []):
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"RolloutClientConfig.urls: {u!r} must start with http:// or https://")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"RolloutClientConfig.urls has duplicates: {self.urls}")
        _positive(self, "request_timeout_s", "connect_timeout_s", "control_timeout_s",
                  "backoff_s", "backoff_max_s", "health_timeout_s", "flush_cache_timeout_s")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"RolloutClientConfig.max_concurrency must be >= 1 or null (follow the servers), got "
                             f"{self.max_concurrency}")
        if self.max_retries < 0:
            raise ValueError(f"RolloutClientConfig.max_retries must be >= 0, got {self.max_retries}")
        if self.unhealthy_cooldown_s < 0:
            raise ValueError(f"RolloutClientConfig.unhealthy_cooldown_s must be >= 0, got {self.unhealthy_cooldown_s}")


@dataclass
class SamplingConfig:
    """Sampling parameters of the rollout requests (SGLang `sampling_params`).

    `max_new_tokens` is not here: the partial-rollout manager sets it per segment.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1 = the whole vocabulary."""
    stop_token_ids: Optional[list[int]] = None
    """Extra stop ids; the model's EOS always stops unless ignore_eos."""
    stop: Optional[list[str]] = None
    ignore_eos: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    """Other SGLang sampling keys (whitelisted: see SAMPLING_KEYS)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingConfig.top_k must be -1 or >= 1, got {self.top_k}")
        bad = sorted(set(self.extra) - SAMPLING_KEYS)
        if bad:
            raise ValueError(f"SamplingConfig.extra has unknown sampling key(s) {bad}; allowed: {sorted(SAMPLING_KEYS)}")
        if "max_new_tokens" in self.extra:
            raise ValueError("SamplingConfig.extra.max_new_tokens: set PartialRolloutConfig.segment_tokens / max_response_tokens instead")

    def to_params(self) -> dict[str, Any]:
        """The `sampling_params` dict (without max_new_tokens)."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                               "ignore_eos": self.ignore_eos, "no_stop_trim": True,
                               "spaces_between_special_tokens": False}
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            out["stop"] = list(self.stop)
        out.update(self.extra)
        return out


@dataclass
class PartialRolloutConfig:
    """Group sampling with partial rollout (design section 3, step 3)."""

    group_size: int = 8
    """G: samples per prompt (the GRPO group); groups are returned whole."""
    max_response_tokens: int = 1024
    """A response that reaches this many tokens is finished as `truncated`."""
    segment_tokens: Optional[int] = None
    """Per-step token budget of one sample (`max_new_tokens` of one request). A sample that uses it
    up before max_response_tokens is kept in the buffer and resumed in a later step. None = no
    partial rollout (a whole response per step)."""
    max_staleness: Optional[int] = 2
    """What is trained, judged per token at training time: a token generated more than this many
    policy versions before the weights that train it is masked out of the loss (and so out of BAPO's
    bound search), counted (`staleness/num_masked_tokens`); the rest of its response trains, each
    token against its own behavior log-prob with the importance correction `actor.old_logprobs` /
    `actor.correction` ask for. Responses are never thrown away for it (that is
    `max_group_staleness`). None = no cap; 0 = only tokens of the training weights."""
    max_group_staleness: Optional[int] = None
    """Hard cap, in versions: a buffered group whose oldest token is more than this many versions
    behind the served weights is reset and regenerated from scratch, all its samples together
    (`rollout/num_regenerated` samples, `rollout/num_regenerated_tokens`). It stops a response whose
    segments keep being cut from growing ever older; a healthy run does not reach it. None: derived,
    `max_staleness + 2 x segments per response` (`group_staleness_cap`), no cap when `max_staleness`
    is None."""
    max_context_tokens: Optional[int] = None
    """The servers' context length. When set, a segment asks for at most
    `max_context_tokens - len(prompt + response so far)` tokens, and a sample with no room left is
    truncated; SGLang would reject the request with a 400 instead. None = do not clip."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    deterministic_inference: bool = False
    """Send every segment its own `sampling_seed` (from `trainer.seed` and the sample's identity), so
    a run samples the same responses whatever order requests reach the servers in. SGLang honours a
    seed only when launched with `--enable-deterministic-inference` (slower kernels) and ignores it
    otherwise, so the servers must run with that flag: the built-in servers get it, the SLURM
    launcher passes it (it reads this field) and the first weight update refuses a server without it.
    False: no seeds (the servers' own generators; responses are not reproducible)."""
    return_routed_experts: bool = False
    """Mixture-of-experts models: ask the servers for the experts every MoE layer chose for each
    token (SGLang's `return_routed_experts`; servers launched with --enable-return-routed-experts,
    which the built-in servers and the SLURM launcher get when this is on) and keep them with the
    sample, across segments and checkpoints. The actor replays them with `actor.routing_replay`, and
    reports how often its own routing differs (`moe/routing_mismatch`) either way."""

    def __post_init__(self) -> None:
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError(f"PartialRolloutConfig.max_context_tokens must be >= 2 or null, got {self.max_context_tokens}")
        if self.group_size < 1:
            raise ValueError(f"PartialRolloutConfig.group_size must be >= 1, got {self.group_size}")
        if self.max_response_tokens < 1:
            raise ValueError(f"PartialRolloutConfig.max_response_tokens must be >= 1, got {self.max_response_tokens}")
        if self.segment_tokens is not None and self.segment_tokens < 1:
            raise ValueError(f"PartialRolloutConfig.segment_tokens must be >= 1 or null, got {self.segment_tokens}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"PartialRolloutConfig.max_staleness must be >= 0 or null, got {self.max_staleness}")
        if self.max_group_staleness is not None and self.max_group_staleness < 0:
            raise ValueError(f"PartialRolloutConfig.max_group_staleness must be >= 0 or null, got "
                             f"{self.max_group_staleness}")

    @property
    def num_segments(self) -> int:
        """Segments (steps) a response of max_response_tokens takes."""
        return -(-self.max_response_tokens // self.segment_budget)

    @property
    def segment_budget(self) -> int:
        """Tokens one request may generate at most."""
        if self.segment_tokens is None:
            return self.max_response_tokens
        return min(self.segment_tokens, self.max_response_tokens)

    @property
    def group_staleness_cap(self) -> Optional[int]:
        """`max_group_staleness`, or its derived default (None: groups are never reset for staleness)."""
        if self.max_group_staleness is not None:
            return self.max_group_staleness
        if self.max_staleness is None:
            return None
        return self.max_staleness + 2 * self.num_segments

    def kv_tokens_per_request(self, prompt_tokens: int) -> int:
        """KV tokens one request holds, on average, when its segment ends: the segments of a
        full-length response end at prompt + seg, ..., prompt + S seg tokens (mean prompt + seg (S + 1) / 2),
        which sizes the client's concurrency per server (`rollout.concurrency`)."""
        seg, num = self.segment_budget, self.num_segments
        return int(prompt_tokens) + min(self.max_response_tokens, -(-seg * (num + 1) // 2))


def _positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not value > 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be > 0, got {value}")
