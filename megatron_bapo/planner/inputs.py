"""What the planner needs, read from a run YAML (the trainer's config file) plus the GPU count.

The run YAML is read as plain data (sections `model`, `data`, `rollout`, `actor`), so the planner
works on a config whose model and data paths exist only on the cluster; the `actor` section is
validated by the actor's own `ActorConfig`, exactly as the trainer will.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megatron_bapo.actor.config import ActorConfig
from megatron_bapo.config_io import ConfigError, apply_overrides, from_dict


class PlanError(ValueError):
    """The layout or the inputs are wrong; the message names the config field to change."""


@dataclass
class PlanInputs:
    """One actor layout at one sequence length on one kind of GPU."""

    hf_config: dict[str, Any]
    """Parsed HF config.json of the policy (only shapes are used)."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Parallel layout, dtype, optimizer, micro-batch token budget, log-prob chunk size."""
    num_gpus: Optional[int] = None
    """Actor GPUs (ranks); None = tp * pp * cp (DP 1, the largest optimizer shards)."""
    seq_len: int = 2048
    """Longest training sequence: prompt + full response (partial-rollout segments are joined)."""
    gpu_memory_gib: float = 79.0
    """Usable memory per GPU (an H100-80GB reports 79.6 GiB; the default keeps a little margin)."""
    reserved_gib: float = 4.0
    """CUDA context, NCCL buffers and allocator fragmentation (an assumption, not measured here)."""
    batch_size: Optional[int] = None
    """Responses per RL step (prompts_per_step x group_size), checked against n_minibatches and DP."""

    @property
    def world_size(self) -> int:
        return self.num_gpus if self.num_gpus is not None else self.actor.parallel.model_parallel_size


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Parsed config.json from a file or an HF checkpoint directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise PlanError(f"no HF config at {p}: pass --hf-config FILE (e.g. examples/configs/qwen2.5-32b-config.json)")
    return json.loads(p.read_text(encoding="utf-8"))


def inputs_from_run_yaml(
    path: str | Path,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    hf_config: Optional[str | Path] = None,
    num_gpus: Optional[int] = None,
    gpu_memory_gib: float = 79.0,
    reserved_gib: float = 4.0,
) -> PlanInputs:
    """PlanInputs from a run YAML (+ `a.b=c` overrides).

    The HF config comes from `hf_config` when given, else from `model.hf_path` in the YAML.
    Sequence length = `data.max_prompt_tokens` + `rollout.max_response_tokens` (defaults 1024 each,
    as in the trainer's config).
    """
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise PlanError(f"{path}: the top level must be a mapping")
    data = apply_overrides(data, overrides)
    try:
        actor = from_dict(ActorConfig, data.get("actor") or {}, "actor")
    except ConfigError as exc:
        raise PlanError(str(exc)) from None
    if hf_config is None:
        hf_path = (data.get("model") or {}).get("hf_path")
        if not hf_path:
            raise PlanError("model.hf_path is not set in the config: pass --hf-config FILE")
        hf_config = hf_path
    rollout = data.get("rollout") or {}
    prompt = int((data.get("data") or {}).get("max_prompt_tokens", 1024))
    response = int(rollout.get("max_response_tokens", 1024))
    batch = int(rollout.get("prompts_per_step", 8)) * int(rollout.get("group_size", 8))
    return PlanInputs(
        hf_config=load_hf_config(hf_config),
        actor=actor,
        num_gpus=num_gpus,
        seq_len=prompt + response,
        gpu_memory_gib=gpu_memory_gib,
        reserved_gib=reserved_gib,
        batch_size=batch,
    )
