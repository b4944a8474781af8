"""One weight-mapping file per model family; importing this package registers them all."""

from megatron_bapo.convert.families import llama, qwen2  # noqa: F401
