"""Hugging Face checkpoint files: a lazy tensor reader and a size-bounded sharded safetensors writer.

Both touch one tensor at a time, so converting a model needs RAM for the largest tensor (reader)
or one shard (writer), never the whole model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

logger = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)
"""Files copied from a template/source HF directory next to the weights (when present)."""


class HFCheckpointReader:
    """Read tensors by HF name from `model.safetensors` or a sharded `model.safetensors.index.json`.

    Files are opened lazily (safetensors memory-maps them); `get` materialises one tensor.
    """

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.path = Path(hf_dir)
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(self.path / SINGLE, framework="pt") as f:
                weight_map = {k: SINGLE for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.path}: no {INDEX} or {SINGLE} (only safetensors HF checkpoints are supported)"
            )
        self.weight_map: dict[str, str] = dict(weight_map)
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        from safetensors import safe_open

        if name not in self.weight_map:
            raise KeyError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        fname = self.weight_map[name]
        if fname not in self._handles:
            # One open file at a time: pages of a memory-mapped shard count towards RSS until it is
            # closed, so keeping every shard open would grow RSS to the model size.
            self._handles.clear()
            self._handles[fname] = safe_open(self.path / fname, framework="pt")
        return self._handles[fname]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "HFCheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_hf_config(hf_dir: str | os.PathLike):
    """The `transformers` config of an HF directory (no weights are read)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(hf_dir))


class HFShardWriter:
    """Write named tensors into `model-0000k-of-0000n.safetensors` shards of at most `max_shard_bytes`.

    Tensors are buffered until the shard is full, then written; `close()` renames the shards with the
    final count and writes the index json (one shard is written as plain `model.safetensors`).
    A tensor larger than `max_shard_bytes` gets a shard of its own.
    """

    def __init__(self, out_dir: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
                 dtype: Optional[torch.dtype] = None) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self.dtype = dtype
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._shards: list[list[str]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._buf or any(name in s for s in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach()
        if self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        t = t.cpu().contiguous().clone()  # own storage: safetensors rejects shared/aliased tensors
        nbytes = t.numel() * t.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._buf[name] = t
        self._buf_bytes += nbytes
        self._total += nbytes

    def add_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in items:
            self.add(name, t)

    def _tmp_name(self, k: int) -> str:
        return f"model-{k + 1:05d}.safetensors.partial"

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._buf:
            return
        k = len(self._shards)
        save_file(self._buf, str(self.out / self._tmp_name(k)), metadata={"format": "pt"})
        self._shards.append(list(self._buf))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> dict[str, str]:
        """Flush, name the shards, write the index; returns the weight map (name -> file)."""
        self._flush()
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        for k, names in enumerate(self._shards):
            final = SINGLE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.out / self._tmp_name(k), self.out / final)
            os.chmod(self.out / final, 0o644)  # safetensors creates 0600 files; servers may run as another user
            weight_map.update({name: final for name in names})
        if n > 1:
            index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / INDEX).write_text(json.dumps(index, indent=2))
        return weight_map


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer/generation files that exist in `src` to `dst`; returns the names copied."""
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def write_config(hf_config: Any, out_dir: str | os.PathLike, *, dtype: Optional[torch.dtype] = None) -> None:
    """Write config.json for `hf_config` (a PretrainedConfig or a dict), recording the weights' dtype."""
    out = Path(out_dir)
    if isinstance(hf_config, dict):
        cfg = dict(hf_config)
        if dtype is not None:  # transformers v5 reads "dtype", v4 "torch_dtype"
            cfg["torch_dtype"] = cfg["dtype"] = str(dtype).replace("torch.", "")
        (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        return
    import copy

    cfg = copy.deepcopy(hf_config)
    if dtype is not None:
        # transformers v5 names it `dtype` (setting `torch_dtype` only warns); v4 has `torch_dtype`.
        if "dtype" in cfg.to_dict():
            cfg.dtype = dtype
        else:
            cfg.torch_dtype = dtype
    cfg.save_pretrained(str(out))
