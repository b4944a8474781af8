"""One weight-mapping file per model family, and the explicit table of them keyed by the HF
`architectures` name (a family is added here, not by registration on import)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

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


def headless_for_sglang(hf_dir: str | os.PathLike) -> Optional[str]:
    """The architecture of a checkpoint SGLang would serve with a zero output head, else None: tied
    embeddings, no `lm_head.weight` in its files, and a family whose SGLang model ignores the tie
    (`ModelMapping.write_tied_head`). Not an HF directory (or an unknown family): None."""
    from megatron_bapo.convert.hf_io import HFCheckpointReader

    config_path = Path(hf_dir) / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    arch = (config.get("architectures") or [None])[0]
    mapping = MAPPINGS.get(arch)
    if mapping is None or not (config.get("tie_word_embeddings") and mapping.write_tied_head):
        return None
    with HFCheckpointReader(hf_dir) as reader:
        return None if mapping.tied_hf in reader.names() else arch
