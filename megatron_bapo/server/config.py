"""Server configuration and its command line (the flag names of `sglang.launch_server`).

Scripts swap `python -m sglang.launch_server` for `python -m megatron_bapo.server` without editing
flags: the flags that matter on one CPU are honoured, common GPU-only SGLang flags are accepted and
ignored with a log line, and anything else is an error (a typo must not be silently ignored).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

SERVER_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class ServerConfig:
    """Everything the built-in server needs; validated by `validate()`."""

    model_path: str = ""
    """HF checkpoint directory (config.json, safetensors, tokenizer)."""
    tokenizer_path: Optional[str] = None
    """Tokenizer directory; defaults to `model_path`."""
    host: str = "127.0.0.1"
    """Listen address. Loopback by default: the server has no authentication unless `api_key` is set."""
    port: int = 30000
    """Listen port; 0 picks a free one (written to `port_file` when given)."""
    port_file: Optional[str] = None
    """Write the bound port here once listening (used by `launch.start_server` to avoid port races)."""
    context_length: Optional[int] = None
    """Max prompt + output tokens; defaults to the model's `max_position_embeddings`."""
    max_running_requests: int = 256
    """Requests decoded together at most; the rest wait in the queue."""
    max_total_tokens: Optional[int] = None
    """KV budget: running requests reserve prompt + max_new_tokens each; None = no limit (tiny models)."""
    random_seed: int = 0
    """Seed of the server-wide sampling generator (requests without a honoured `sampling_seed`)."""
    enable_deterministic_inference: bool = False
    """Honour `sampling_params.sampling_seed` (a per-request generator). Off, a seed is accepted and
    ignored, as SGLang 0.5.23 does without `--enable-deterministic-inference`, so a client that relies
    on seeds without asking the server for them gets what it would get from SGLang."""
    enable_return_routed_experts: bool = False
    """Record the experts every MoE layer chose per token and return them to requests that ask
    (`return_routed_experts`), as SGLang does with this flag; off, the request field is ignored."""
    weight_version: str = "default"
    """Initial weight version string."""
    api_key: Optional[str] = None
    """When set, every request needs `Authorization: Bearer <api_key>`."""
    num_threads: Optional[int] = 1
    """torch intra-op threads (None: torch's default). 1 by default: decoding a small model is a chain of
    tiny ops where OpenMP synchronisation across cores costs more than it gains (measured on the
    2-core CI box: 1 thread ~300 tok/s vs 2 threads ~20-70 tok/s for one tiny-model request under load)."""
    dtype: str = "float32"
    """Parameter and activation dtype of the served model: "float32" (the trainer's CPU dtype: its
    log-probs match the trainer's to ~1e-6) or "bfloat16" (as SGLang serves on GPUs: a real
    training-inference mismatch against an fp32 trainer, with no GPU). Logits are cast to float32
    before sampling and log-probs, as SGLang's sampler does."""
    return_original_logprob: bool = False
    """False (SGLang's default): a returned log-prob is from the temperature-scaled distribution
    (before top-p/top-k/min-p filtering). True: from the raw model distribution (temperature 1)."""
    served_model_name: Optional[str] = None
    """Name reported by /get_model_info (default: the model path)."""
    log_level: str = "info"
    """Python logging level of the server process."""
    skip_tokenizer_init: bool = False
    """No tokenizer: `text` prompts are rejected and replies carry no `text` (ids only)."""
    max_sampling_n: int = 1024
    """Largest `sampling_params.n` one prompt may ask for (SGLang has no cap; RL groups are 4-64).
    Above it: 400 naming this limit."""
    max_batch_size: int = 4096
    """Most sequences one `/generate` call may create (prompts x n). Above it: 400 naming this limit."""
    max_body_bytes: int = 32 << 20
    """Largest request body in bytes (32 MiB: a batch of 4096 prompts of 1k token ids is ~30 MB of
    JSON). A larger declared Content-Length is refused with 413 before the body is read; a chunked
    body is cut off at the limit. The cap also bounds the one step that holds the GIL for long:
    `json.loads` of a 32 MiB body of token ids takes ~0.7 s on the 2-core CI box."""
    max_prompt_tokens: Optional[int] = None
    """Longest prompt in tokens; None = context length - 1 (SGLang's `max_req_input_len`)."""
    decode_delay_ms: float = 0.0
    """Milliseconds added to every scheduler step that generates tokens (each running request's next
    token), so a CPU rehearses what a 32B server's decode speed does to the control plane: syncs that
    meet segments in flight, pauses, long responses spanning syncs (`benchmarks/bench_control_plane.py`).
    Not an SGLang flag; 0 (default) adds nothing."""
    max_prompt_chars: int = 1 << 20
    """Longest `text` prompt in characters, checked before tokenizing (tokenization costs time and
    ~300 bytes of memory per character; 1 Mi characters is far beyond any context this serves)."""

    def validate(self) -> "ServerConfig":
        if not self.model_path:
            raise ValueError("ServerConfig.model_path is required (--model-path DIR)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"ServerConfig.port must be in [0, 65535], got {self.port}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"ServerConfig.context_length must be >= 2, got {self.context_length}")
        if self.max_running_requests < 1:
            raise ValueError(f"ServerConfig.max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"ServerConfig.max_total_tokens must be >= 1, got {self.max_total_tokens}")
        if self.dtype not in SERVER_DTYPES:
            raise ValueError(f"ServerConfig.dtype must be one of {SERVER_DTYPES}, got {self.dtype!r} (--dtype)")
        if not self.decode_delay_ms >= 0:
            raise ValueError(f"ServerConfig.decode_delay_ms must be >= 0, got {self.decode_delay_ms} (--decode-delay-ms)")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"ServerConfig.num_threads must be >= 1, got {self.num_threads}")
        for name in ("max_sampling_n", "max_batch_size", "max_body_bytes", "max_prompt_tokens", "max_prompt_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ServerConfig.{name} must be >= 1, got {value} (--{name.replace('_', '-')})")
        return self


# SGLang flags that have no meaning for a one-process CPU server: accepted, logged, ignored.
# Value is the argparse nargs: 0 = boolean switch, None = one value, "*" = a list.
IGNORED_SGLANG_FLAGS: dict[str, object] = {
    "--tp-size": None, "--tp": None, "--dp-size": None, "--dp": None, "--pp-size": None, "--ep-size": None,
    "--mem-fraction-static": None, "--trust-remote-code": 0, "--kv-cache-dtype": None,
    "--chunked-prefill-size": None, "--max-prefill-tokens": None,
    "--cuda-graph-max-bs": None, "--cuda-graph-bs": "*", "--disable-cuda-graph": 0, "--disable-radix-cache": 0,
    "--attention-backend": None, "--sampling-backend": None, "--schedule-policy": None,
    "--enable-memory-saver": 0, "--enable-metrics": 0, "--log-requests": 0, "--log-requests-level": None,
    "--nccl-port": None, "--dist-init-addr": None, "--nnodes": None, "--node-rank": None,
    "--load-format": None, "--device": None, "--watchdog-timeout": None, "--base-gpu-id": None,
    "--gpu-id-step": None, "--enable-torch-compile": 0, "--disable-custom-all-reduce": 0,
    "--skip-server-warmup": 0, "--allow-auto-truncate": 0, "--quantization": None,
    "--admin-api-key": None, "--show-time-cost": 0,
    "--stream-output": 0, "--incremental-streaming-output": 0, "--disable-overlap-schedule": 0,
    "--enable-dp-attention": 0, "--max-queued-requests": None, "--revision": None,
}


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_bapo.server",
        description="Built-in CPU rollout server speaking SGLang's native HTTP API (transformers backend).",
    )
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--port-file", default=None, help="write the bound port to this file once listening")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="honour sampling_params.sampling_seed (ignored otherwise, as in SGLang)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="return the routed experts of MoE layers to requests with return_routed_experts")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--dtype", default="float32", choices=SERVER_DTYPES,
                   help="dtype of the served model (bfloat16: a real mismatch against an fp32 trainer)")
    p.add_argument("--return-original-logprob", action="store_true",
                   help="return log-probs of the raw (temperature 1) distribution instead of the scaled one")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--max-sampling-n", type=int, default=1024, help="largest sampling_params.n per prompt")
    p.add_argument("--max-batch-size", type=int, default=4096, help="most sequences (prompts x n) per /generate")
    p.add_argument("--max-body-bytes", type=int, default=32 << 20, help="largest request body (413 above)")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: context length - 1)")
    p.add_argument("--max-prompt-chars", type=int, default=1 << 20, help="longest text prompt, checked before tokenizing")
    p.add_argument("--decode-delay-ms", type=float, default=0.0,
                   help="slow generation down: milliseconds added to every step that generates tokens (CPU rehearsals)")
    for flag, nargs in IGNORED_SGLANG_FLAGS.items():
        dest = "ignored_" + flag.lstrip("-").replace("-", "_")
        if nargs == 0:
            p.add_argument(flag, dest=dest, action="store_true", help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, dest=dest, nargs=nargs, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> ServerConfig:
    """Parse the command line into a validated `ServerConfig`; logs every ignored SGLang flag."""
    ns = build_arg_parser().parse_args(argv)
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    kwargs = {}
    for key, value in vars(ns).items():
        if key.startswith("ignored_"):
            if value not in (None, False):
                logger.info("ignoring SGLang flag --%s=%s (no meaning for the built-in CPU server)",
                            key[len("ignored_"):].replace("_", "-"), value)
        elif key in fields:
            kwargs[key] = value
    if kwargs.get("num_threads") == 0:
        kwargs["num_threads"] = None
    return ServerConfig(**kwargs).validate()
