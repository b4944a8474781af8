"""The run's configuration: one YAML file, one nested dataclass per component, validated at start.

    python -m megatron_bapo.train --config examples/configs/tiny_bapo.yaml trainer.total_steps=50

Sections: `trainer` (loop, checkpoints, logging), `model` (the initial HF policy), `data` (prompts,
`megatron_bapo.data.DatasetConfig`),
`rollout` (servers, group sampling, partial rollout), `reward`, `advantage`, `actor` (the Megatron
actor, `megatron_bapo.actor.ActorConfig`), `sync` (weight sync to the servers), `eval` (periodic
validation, `megatron_bapo.eval.EvalConfig`). `bapo_preset` picks a named BAPO configuration
(`bapo`, `bapo-paper`, `bapo-verl`, `grpo`, `clip-higher`); explicit `actor.bapo.*` keys override it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_bapo.actor.config import ActorConfig
from megatron_bapo.algorithms.config import BapoConfig
from megatron_bapo.config_io import ConfigError, apply_overrides, from_dict, to_dict
from megatron_bapo.data.config import DatasetConfig
from megatron_bapo.eval.config import EvalConfig


@dataclass
class TrainerConfig:
    """The loop itself: how long, where outputs go, how often to checkpoint."""

    output_dir: str = "runs/bapo"
    """Checkpoints (`checkpoints/`), TensorBoard (`tb/`), weight-sync HF dirs (`hf_sync/`), eval records."""
    total_steps: int = 100
    """RL steps (one rollout batch -> `ppo_epochs x n_minibatches` optimizer steps -> one weight sync)."""
    save_every: int = 10
    """Checkpoint every this many steps (and at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept on disk (older ones are deleted); 0 keeps all."""
    resume: bool = True
    """Continue from the newest complete checkpoint in `output_dir` if there is one."""
    seed: int = 1
    """Seeds the prompt order and the rollout sampling seeds (the actor has `actor.seed`)."""
    eval_at_start: bool = True
    """Run the `eval` datasets once before the first step (the baseline at step 0), when eval is on."""
    progress: bool = True
    """tqdm progress bar on rank 0's console."""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.total_steps < 1:
            raise ConfigError(f"trainer.total_steps must be >= 1, got {self.total_steps}")
        if self.save_every < 0:
            raise ConfigError(f"trainer.save_every must be >= 0, got {self.save_every}")
        if self.keep_checkpoints < 0:
            raise ConfigError(f"trainer.keep_checkpoints must be >= 0, got {self.keep_checkpoints}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"trainer.log_level must be DEBUG/INFO/WARNING/ERROR, got {self.log_level!r}")


@dataclass
class ModelConfig:
    hf_path: str = ""
    """HF directory of the initial policy (weights, config, tokenizer); also what servers start from."""

    def __post_init__(self) -> None:
        if not self.hf_path:
            raise ConfigError("model.hf_path must be set to an HF checkpoint directory (tools/make_tiny.py makes one)")


@dataclass
class RolloutConfig:
    """Where rollouts come from and how they are sampled (design section 3 steps 2-3)."""

    server_urls: list[str] = field(default_factory=list)
    """SGLang servers (control calls and, without a router, generation). Empty: start built-in servers."""
    router_url: Optional[str] = None
    """sglang-router URL for /generate (control calls still go to each of `server_urls`)."""
    num_builtin_servers: int = 1
    """Built-in servers started on loopback when `server_urls` is empty."""
    group_size: int = 8
    """G: samples per prompt (the GRPO group)."""
    prompts_per_step: int = 8
    """Groups per RL step (the batch is `prompts_per_step x group_size` responses)."""
    max_response_tokens: int = 1024
    segment_tokens: Optional[int] = None
    """Partial rollout: generation budget per request per step; unfinished responses are resumed in
    later steps. None: every response is generated to the end within its step."""
    max_staleness: int = 4
    """A buffered response whose oldest token is more than this many versions old is regenerated."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's log-probs and entropy are those of softmax(logits / T)."""
    top_p: float = 1.0
    """Must stay 1.0 for training rollouts (see __post_init__)."""
    top_k: int = -1
    """Must stay -1 for training rollouts."""
    max_concurrency: int = 256
    request_timeout_s: float = 600.0
    max_retries: int = 3
    startup_timeout_s: float = 300.0
    """How long to wait for servers' /health at start."""

    def __post_init__(self) -> None:
        for name in ("group_size", "prompts_per_step", "max_response_tokens", "num_builtin_servers",
                     "max_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.segment_tokens is not None and self.segment_tokens < 1:
            raise ConfigError(f"rollout.segment_tokens must be >= 1 or null, got {self.segment_tokens}")
        if self.max_staleness < 0:
            raise ConfigError(f"rollout.max_staleness must be >= 0, got {self.max_staleness}")
        if self.temperature <= 0:
            raise ConfigError(f"rollout.temperature must be > 0 for RL sampling, got {self.temperature}")
        # The trainer recomputes the behavior distribution as softmax(logits / temperature); truncated
        # sampling (top-p / top-k) changes the distribution in a way it cannot reproduce, so the
        # importance ratios (and BAPO's bounds) would be wrong. Evaluation may truncate (eval.top_p).
        if self.top_p != 1.0:
            raise ConfigError(f"rollout.top_p={self.top_p}: training rollouts must sample the full distribution "
                              f"(top_p: 1.0), which the trainer's log-probs reproduce; eval.top_p may be below 1")
        if self.top_k != -1:
            raise ConfigError(f"rollout.top_k={self.top_k}: training rollouts must sample the full distribution "
                              f"(top_k: -1), which the trainer's log-probs reproduce")
        if self.segment_tokens is not None:
            segments = -(-self.max_response_tokens // self.segment_tokens)
            if self.max_staleness < segments - 1:
                raise ConfigError(
                    f"rollout.max_staleness={self.max_staleness} < {segments - 1}: a {self.max_response_tokens}-token "
                    f"response takes {segments} segments of {self.segment_tokens} (one per step), so its first "
                    f"tokens are {segments - 1} versions old when it ends and it would be regenerated forever; "
                    f"raise rollout.max_staleness or rollout.segment_tokens")
        if self.router_url and not self.server_urls:
            raise ConfigError("rollout.router_url needs rollout.server_urls too (weight updates go to each server)")


@dataclass
class RewardConfig:
    fn: str = "math"
    """Built-in name ("math", "math_last_number", "arithmetic") or "package.module:function"."""
    num_workers: int = 4
    """Threads scoring in parallel (the math reward checks in worker processes with timeouts)."""


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"
    """"grpo": (r - mean) / (std + eps) per group; "dr_grpo": r - mean (no std division)."""
    eps: float = 1e-6
    filter_uniform_groups: bool = False
    """Drop groups whose rewards are all equal (zero advantage everywhere), counted in metrics."""

    def __post_init__(self) -> None:
        if self.estimator not in ("grpo", "dr_grpo"):
            raise ConfigError(f"advantage.estimator must be 'grpo' or 'dr_grpo', got {self.estimator!r}")
        if self.eps < 0:
            raise ConfigError(f"advantage.eps must be >= 0, got {self.eps}")


@dataclass
class SyncConfig:
    """Weight sync from the actor to the rollout servers after every step (design section 3 step 7)."""

    method: str = "disk"
    """"disk": HF safetensors + /update_weights_from_disk (one machine, shared FS);
    "distributed": a torch process group + /update_weights_from_distributed (NCCL on clusters)."""
    backend: str = "nccl"
    """Process-group backend of the "distributed" method ("gloo" on CPU)."""
    master_address: str = "127.0.0.1"
    master_port: int = 29600
    bucket_bytes: int = 512 * 1024 * 1024
    """Tensors per broadcast bucket ("distributed") / per safetensors shard ("disk")."""
    keep_versions: int = 2
    """HF directories kept under `output_dir/hf_sync/` ("disk"); older ones are deleted."""

    def __post_init__(self) -> None:
        if self.method not in ("disk", "distributed"):
            raise ConfigError(f"sync.method must be 'disk' or 'distributed', got {self.method!r}")
        if self.backend not in ("nccl", "gloo"):
            raise ConfigError(f"sync.backend must be 'nccl' or 'gloo', got {self.backend!r}")
        if self.bucket_bytes < 1024:
            raise ConfigError(f"sync.bucket_bytes must be >= 1024, got {self.bucket_bytes}")
        if self.keep_versions < 1:
            raise ConfigError(f"sync.keep_versions must be >= 1, got {self.keep_versions}")


@dataclass
class RunConfig:
    model: ModelConfig
    data: DatasetConfig
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    bapo_preset: Optional[str] = None
    """Named BAPO configuration; `actor.bapo.*` keys given explicitly override its fields."""

    def __post_init__(self) -> None:
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch % self.actor.n_minibatches:
            raise ConfigError(
                f"actor.n_minibatches={self.actor.n_minibatches} must divide the batch "
                f"rollout.prompts_per_step x rollout.group_size = {batch}"
            )


def load_run_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML + dotted overrides -> validated RunConfig; `bapo_preset` fills `actor.bapo` defaults."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, overrides)
    preset = data.get("bapo_preset")
    if preset is not None:
        try:
            base = dataclasses.asdict(BapoConfig.preset(str(preset)))
        except ValueError as exc:
            raise ConfigError(f"bapo_preset: {exc}") from None
        actor = dict(data.get("actor") or {})
        actor["bapo"] = {**base, **(actor.get("bapo") or {})}
        data["actor"] = actor
    for section, key in (("model", "hf_path"), ("data", "path")):
        if not isinstance(data.get(section), dict) or not data[section].get(key):
            raise ConfigError(f"{section}.{key} must be set (in the YAML or as {section}.{key}=... on the command line)")
    return from_dict(RunConfig, data)


def dump_run_config(config: RunConfig) -> str:
    """The resolved config as YAML (written next to every run so it can be reproduced)."""
    return yaml.safe_dump(to_dict(config), sort_keys=False)
