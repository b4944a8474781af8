"""Transformer layer spec: Transformer Engine on GPUs, megatron-core local modules + SDPA elsewhere.

megatron-core's local `DotProductAttention` allocates its score buffer on CUDA, so the local spec's
core attention is `SdpaAttention` (`models.cpu_attention`: padded, packed and context-parallel
inputs over `torch.nn.functional.scaled_dot_product_attention`).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from megatron_bapo.models.cpu_attention import sdpa_attention_class

logger = logging.getLogger(__name__)


def have_transformer_engine() -> bool:
    """True when a real Transformer Engine (not the empty PyPI meta-package) is importable."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def get_layer_spec(*, use_te: Optional[bool] = None):
    """The GPT transformer-layer spec for this machine.

    use_te: None picks TE when CUDA and TE are both present; True requires them (error otherwise);
    False forces the local spec with SDPA attention (works everywhere).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    te_ok = torch.cuda.is_available() and have_transformer_engine()
    if use_te is None:
        use_te = te_ok
    if use_te:
        if not te_ok:
            raise ValueError("get_layer_spec(use_te=True) needs CUDA and Transformer Engine installed")
        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    return spec
