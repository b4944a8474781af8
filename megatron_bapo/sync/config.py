"""The weight sync's config (`sync` section of the run config); the pause modes it names are the wire
protocol's (`megatron_bapo.weight_update.PAUSE_MODES`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_bapo.config_io import ConfigError
from megatron_bapo.weight_update import PAUSE_MODES

VERIFY_MODES = ("off", "probe", "checksum")


@dataclass
class SyncConfig:
    """Weight sync from the actor to the rollout servers after every step (design section 3 step 7)."""

    method: str = "disk"
    """"disk": HF safetensors + /update_weights_from_disk (one machine, shared FS);
    "distributed": a torch process group + /update_weights_from_distributed inside a
    /begin_weight_update ... /end_weight_update session (NCCL on clusters)."""
    backend: str = "nccl"
    """Process-group backend of the "distributed" method ("gloo" on CPU)."""
    master_address: str = "127.0.0.1"
    master_port: int = 0
    """Port of the weight group's store on trainer rank 0's node ("distributed"); 0 lets the OS pick
    a free one when the group is made (the servers are told it). Set one when a firewall must allow it."""
    bucket_bytes: int = 512 * 1024 * 1024
    """Tensors per broadcast bucket ("distributed") / per safetensors shard ("disk")."""
    keep_versions: int = 2
    """HF directories kept under `output_dir/hf_sync/` ("disk"); older ones are deleted."""
    pause_mode: Optional[str] = None
    """How an update meets generation in flight (`megatron_bapo.rollout.pool.ServerPool.update`): null waits for the
    in-flight requests (SGLang's writer lock; between segments with partial rollout); "abort"
    returns them with their partial tokens (resumed under the new weights); "retract" / "in_place"
    keep them running on the new weights, with per-token versions ("in_place" needs servers without
    a radix cache). With "distributed" and `trainer.async_steps` > 0 a pause is required."""
    group_timeout_s: float = 600.0
    """Timeout of the distributed weight group: its rendezvous, every broadcast and the HTTP calls
    that announce them. A server that does not join or receive within it fails the sync naming it."""
    verify: str = "probe"
    """What checks, after every sync and after every server restart, that the servers hold the weights
    the trainer sent (`megatron_bapo.sync.verify`; docs/cluster.md, "Served weights verified"): "probe"
    scores `probe_tokens` fixed tokens on every server and compares them with the actor's own log-probs
    (any engine; catches wrong or stale weights through what they compute); "checksum" compares every
    server's `/weights_checker` hashes with the hashes of what was sent, in the server's layout (exact;
    SGLang 0.5.23 or the built-in server, dense Qwen2/Qwen3/Llama served at TP 1); "off". A failing
    server is restarted once with the current weights; a second failure stops the run."""
    probe_max_kl: Optional[float] = None
    """Largest probe KL (mean over the probe's tokens of exp(d) - 1 - d, d = actor log-prob - server
    log-prob) a server may show. null: by dtype, 1e-10 when the actor and the server both compute in
    float32, else 1e-2 (`sync.verify.PROBE_MAX_KL`). Measured on the tiny model (benchmarks/bench_verify.py):
    same weights 4e-14 (fp32) and 3e-7 (a bfloat16 server); one Adam step stale 3e-6; one corrupted tensor
    2e-8 to 2e-4. With 16-bit weights on either side only gross errors (a wrong conversion, garbage, weights
    many steps old) stand above the rounding; docs/cluster.md."""
    probe_tokens: int = 128
    """Length of the probe sequence (fixed pseudo-random token ids, the same every sync)."""

    def __post_init__(self) -> None:
        if self.method not in ("disk", "distributed"):
            raise ConfigError(f"sync.method must be 'disk' or 'distributed', got {self.method!r}")
        if self.backend not in ("nccl", "gloo"):
            raise ConfigError(f"sync.backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if not 0 <= int(self.master_port) <= 65535:
            raise ConfigError(f"sync.master_port must be a port (1-65535) or 0 to pick a free one, got {self.master_port}")
        if self.bucket_bytes < 1024:
            raise ConfigError(f"sync.bucket_bytes must be >= 1024, got {self.bucket_bytes}")
        if self.keep_versions < 1:
            raise ConfigError(f"sync.keep_versions must be >= 1, got {self.keep_versions}")
        if self.pause_mode not in PAUSE_MODES:
            raise ConfigError(f"sync.pause_mode must be null, 'abort', 'retract' or 'in_place', got {self.pause_mode!r}")
        if not self.group_timeout_s > 0:
            raise ConfigError(f"sync.group_timeout_s must be > 0, got {self.group_timeout_s}")
        if self.verify not in VERIFY_MODES:
            raise ConfigError(f"sync.verify must be 'off', 'probe' or 'checksum', got {self.verify!r}")
        if self.probe_max_kl is not None and not self.probe_max_kl > 0:
            raise ConfigError(f"sync.probe_max_kl must be > 0 or null (by dtype), got {self.probe_max_kl}")
        if self.probe_tokens < 2:
            raise ConfigError(f"sync.probe_tokens must be >= 2 (the first token has no log-prob), got {self.probe_tokens}")
