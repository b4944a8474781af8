"""HF <-> megatron-core weight conversion: declarative per-family mappings (an explicit table keyed
by the HF `architectures` name, `convert/families/`), live-model load/iterate/save for the trainer
and weight sync, and offline HF <-> `torch_dist` checkpoint conversion for tools/convert_hf.py."""

from megatron_bapo.convert.families import MAPPINGS, get_mapping, supported_architectures
from megatron_bapo.convert.live import iter_hf_tensors, load_hf_into_model, save_model_as_hf
from megatron_bapo.convert.mapping import ModelMapping, TensorRule

__all__ = [
    "MAPPINGS", "ModelMapping", "TensorRule", "get_mapping", "supported_architectures",
    "iter_hf_tensors", "load_hf_into_model", "save_model_as_hf",
]
