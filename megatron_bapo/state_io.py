"""Rank 0's trainer state on disk: JSON for the structure, a binary side file for long numeric lists.

    dump_state(ckpt / "trainer.json", state)     # trainer.json + trainer_arrays.bin
    state = load_state(ckpt / "trainer.json")    # the same dict, lists of Python ints and floats

The partial-rollout buffer is most of the trainer state: every buffered response's token ids,
behavior log-probs and versions. At 32B with 64k-token responses that is ~10^8 numbers, and JSON
writes them at about 1.2M values/s (minutes, gigabytes) while the other ranks wait. Here the
serialization layer, not the rollout module, moves every list of at least `MIN_ARRAY_LEN` plain
ints or floats into `trainer_arrays.bin` (little-endian int32 when the values fit, else int64;
floats as float64, so every value round-trips exactly) and leaves `{"__array__": [dtype, offset,
count]}` in its place; the modules' `state_dict`s stay JSON-safe dicts, as they are.
A state without the side file (written before it existed) loads as plain JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

ARRAYS_FILE = "trainer_arrays.bin"
ARRAYS_KEY = "__arrays__"
"""trainer.json's key naming the side file (absent: no arrays were moved)."""
MARK = "__array__"
MIN_ARRAY_LEN = 64
"""Shorter lists stay in the JSON (readable, and not worth a reference)."""
_I32 = np.iinfo(np.int32)


def _as_array(values: list) -> np.ndarray | None:
    """`values` as a 1-D numeric array when it is a list of numbers (its first element a plain int or
    float), else None. A list mixing ints and floats comes back as floats (equal values)."""
    if type(values[0]) not in (int, float):
        return None
    try:
        arr = np.asarray(values)
    except (ValueError, OverflowError, TypeError):
        return None
    if arr.ndim != 1 or arr.dtype.kind not in "if":
        return None
    if arr.dtype.kind == "i":
        return arr.astype("<i4") if _I32.min <= arr.min() and arr.max() <= _I32.max else arr.astype("<i8")
    return arr.astype("<f8")


def dump_state(path: Path, state: dict[str, Any]) -> None:
    """Write `state` as `path` (JSON) plus `ARRAYS_FILE` beside it, each via a temp file + fsync +
    rename, the side file first (a trainer.json on disk always has its arrays)."""
    path = Path(path)
    chunks: list[bytes] = []
    offset = 0

    def pull(node: Any) -> Any:
        nonlocal offset
        if isinstance(node, dict):
            return {k: pull(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            if len(node) >= MIN_ARRAY_LEN:
                arr = _as_array(list(node))
                if arr is not None:
                    data = arr.tobytes()
                    chunks.append(data)
                    ref = {MARK: [arr.dtype.str, offset, int(arr.size)]}
                    offset += len(data)
                    return ref
            return [pull(v) for v in node]
        return node

    tree = pull(state)
    if chunks:
        tree[ARRAYS_KEY] = ARRAYS_FILE
        _write_atomic(path.with_name(ARRAYS_FILE), chunks)
    _write_atomic(path, [json.dumps(tree, indent=1, sort_keys=True).encode("utf-8")])


def load_state(path: Path, *, arrays: bool = True) -> dict[str, Any]:
    """Read what `dump_state` wrote (or a plain JSON state). `arrays=False` leaves the references in
    place without reading the side file (ranks that need only the step and version)."""
    path = Path(path)
    tree = json.loads(path.read_text(encoding="utf-8"))
    name = tree.pop(ARRAYS_KEY, None)
    if name is None or not arrays:
        return tree
    blob = np.fromfile(path.with_name(name), dtype=np.uint8)

    def push(node: Any) -> Any:
        if isinstance(node, dict):
            if MARK in node and len(node) == 1:
                dtype, offset, count = node[MARK]
                size = np.dtype(dtype).itemsize * int(count)
                if offset + size > blob.size:
                    raise ValueError(f"{path.with_name(name)} is shorter than {path.name} says ({blob.size} bytes)")
                return blob[offset: offset + size].view(dtype).tolist()
            return {k: push(v) for k, v in node.items()}
        if isinstance(node, list):
            return [push(v) for v in node]
        return node

    return push(tree)


def _write_atomic(path: Path, chunks: list[bytes]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
