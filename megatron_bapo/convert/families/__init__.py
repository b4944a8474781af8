"""One weight-mapping file per model family, and the explicit table of them keyed by the HF
`architectures` name (a family is added here, not by registration on import)."""

from __future__ import annotations

from typing import Any

from megatron_bapo.convert.families.llama import LLAMA
from megatron_bapo.convert.families.qwen2 import QWEN2
from megatron_bapo.convert.families.qwen3 import QWEN3
from megatron_bapo.convert.families.qwen3_moe import QWEN3_MOE
from megatron_bapo.convert.mapping import ModelMapping

MAPPINGS: dict[str, ModelMapping] = {m.architecture: m for m in (LLAMA, QWEN2, QWEN3, QWEN3_MOE)}


def supported_architectures() -> list[str]:
    return sorted(MAPPINGS)


def get_mapping(hf_config: Any) -> ModelMapping:
    """The weight mapping for an HF config (PretrainedConfig or dict); errors list the supported ones."""
    from megatron_bapo.models.registry import architecture_of

    arch = architecture_of(hf_config)
    if arch not in MAPPINGS:
        raise ValueError(f"no weight mapping for architecture {arch!r}; supported: {supported_architectures()}")
    return MAPPINGS[arch]
