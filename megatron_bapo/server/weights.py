"""Loading weights into the served model: from an HF directory, or from named tensors (HF names).

A disk update builds a complete new model and swaps it in only when loading succeeded, so a bad path
or a broken checkpoint leaves the served weights untouched (SGLang's rollback). Named-tensor updates
(distributed sync) are checked against the model's names, shapes and dtypes before anything is
copied, so a bad batch also changes nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

import torch

logger = logging.getLogger(__name__)


def load_model(path: str, dtype: str = "float32") -> torch.nn.Module:
    """An HF causal LM from `path` in eval mode, no grads, on CPU, its parameters in `dtype`
    ("float32" or "bfloat16": the server's `--dtype`, for the first load and every disk update)."""
    from transformers import AutoModelForCausalLM

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model_path {path!r} is not a directory")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"model_path {path!r} has no config.json (not an HF checkpoint directory)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def eos_token_ids(model, tokenizer) -> set:
    """EOS ids from the generation config, the model config and the tokenizer (SGLang stops on all)."""
    ids: set = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def check_named_tensors(model: torch.nn.Module, names: list, shapes: list) -> None:
    """Raise ValueError naming the first HF parameter name or shape the model does not have."""
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))
    for name, shape in zip(names, shapes):
        if name not in params:
            raise ValueError(f"unknown parameter name {name!r} (not in the served {type(model).__name__})")
        if tuple(params[name].shape) != tuple(shape):
            raise ValueError(f"shape mismatch for {name!r}: model has {tuple(params[name].shape)}, got {tuple(shape)}")


def load_named_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy HF-named tensors into the model (dtype cast to the model's); returns the number copied.

    Tied weights (e.g. `lm_head.weight` tied to `model.embed_tokens.weight`) share storage, so
    copying either name updates both.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))
    count = 0
    with torch.no_grad():
        for name, tensor in named:
            params[name].copy_(tensor)  # casts dtype and moves device (e.g. from a CUDA receive buffer)
            count += 1
    return count
