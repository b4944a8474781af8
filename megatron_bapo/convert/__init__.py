"""HF <-> megatron-core weight conversion: declarative per-family mappings (registered by HF
`architectures` name), live-model load/iterate/save for the trainer and weight sync, and offline
HF <-> `torch_dist` checkpoint conversion for tools/convert_hf.py."""

from megatron_bapo.convert.live import iter_hf_tensors, load_hf_into_model, save_model_as_hf
from megatron_bapo.convert.mapping import ModelMapping, TensorRule, get_mapping, register_mapping, supported_architectures

__all__ = [
    "ModelMapping", "TensorRule", "get_mapping", "register_mapping", "supported_architectures",
    "iter_hf_tensors", "load_hf_into_model", "save_model_as_hf",
]
