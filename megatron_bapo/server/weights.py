"""Loading weights into the served model: from an HF directory, or from named tensors (HF names).

A disk update builds a complete new model and swaps it in only when loading succeeded, so a bad path
or a broken checkpoint leaves the served weights untouched (SGLang's rollback). Named-tensor updates
(distributed sync) are checked against the model's names, shapes and dtypes before anything is
copied, so a bad batch also changes nothing.

Names are the checkpoint's (HF on-disk) names, as SGLang takes them. transformers 5 keeps a mixture
of experts fused in memory (`mlp.experts.gate_up_proj` `[E, 2F, H]`, `mlp.experts.down_proj`
`[E, H, F]`) and converts the per-expert checkpoint tensors when loading, so an update of
`model.layers.{i}.mlp.experts.{e}.gate_proj.weight` (`up_proj`, `down_proj`) lands in expert e's
slice of the fused tensor (gate rows first, as transformers fuses them).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Callable, Iterable, Optional

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


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _targets(model: torch.nn.Module) -> Callable[[str], Optional[torch.Tensor]]:
    """name -> the tensor (or fused-expert slice) an update of that checkpoint name writes, or None."""
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(dict(model.named_buffers()))

    def target(name: str) -> Optional[torch.Tensor]:
        if name in params:
            return params[name]
        m = _EXPERT.match(name)
        if m is None:
            return None
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        fused = params.get(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
        if fused is None or fused.dim() != 3 or expert >= fused.shape[0]:
            return None
        if proj == "down_proj":
            return fused[expert]
        half = fused.shape[1] // 2
        return fused[expert, :half] if proj == "gate_proj" else fused[expert, half:]

    return target


def check_named_tensors(model: torch.nn.Module, names: list, shapes: list) -> None:
    """Raise ValueError naming the first HF parameter name or shape the model does not have."""
    target = _targets(model)
    for name, shape in zip(names, shapes):
        t = target(name)
        if t is None:
            raise ValueError(f"unknown parameter name {name!r} (not in the served {type(model).__name__})")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"shape mismatch for {name!r}: model has {tuple(t.shape)}, got {tuple(shape)}")


def load_named_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy HF-named tensors into the model (dtype cast to the model's); returns the number copied.

    Tied weights (e.g. `lm_head.weight` tied to `model.embed_tokens.weight`) share storage, so
    copying either name updates both; a per-expert name writes its slice of the fused experts.
    """
    target = _targets(model)
    count = 0
    with torch.no_grad():
        for name, tensor in named:
            target(name).copy_(tensor)  # casts dtype and moves device (e.g. from a CUDA receive buffer)
            count += 1
    return count
