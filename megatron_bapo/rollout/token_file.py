"""The rollout token file's format, and its reader: a checkpoint's rollout state refers to it, the
driver writes it (`state_tokens`, where the layout is described) and reads it back at resume.

    tokens = TokenFile.open(state, ckpt_dir)   # None for a state with plain lists; else checked (a stat,
                                               # the header) against the state's references
    state = tokens.load()                      # references -> numpy views of the file's arrays
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Optional

import numpy as np

TOKENS_FILE = "rollout_tokens.bin"
TOKENS_KEY = "rollout_tokens"
"""The state's key for the descriptor of `TOKENS_FILE` (absent: an older state with plain lists)."""
REF = "__tokens__"
FORMAT = 2
"""2: the arrays' dtypes and offsets in the file's header (their dtypes are known only once the
values are read, after the pause). 1 (still read): in the state's descriptor, no header."""
MAGIC = b"BAPOTOK2"
HEADER = struct.Struct("<8sQ")
"""`MAGIC`, then the length of the JSON header that follows it."""
ALIGN = 64
MAX_HEADER_BYTES = 1 << 20


def header_bytes(layout: dict[str, list]) -> bytes:
    """The file's first bytes for `layout` ({field: [dtype, offset, count]}), padded to `ALIGN`."""
    text = json.dumps({"arrays": layout}, sort_keys=True).encode("ascii")
    head = HEADER.pack(MAGIC, len(text)) + text
    return head + b"\0" * (-len(head) % ALIGN)


def layout_for(arrays: dict[str, np.ndarray]) -> dict[str, list]:
    """{field: [dtype, offset, count]}: each array at an `ALIGN`ed offset after the header. The
    header's own length depends on the offsets' digits, so it is sized until it stops growing."""
    start = 0
    while True:
        layout, offset = {}, start
        for field, arr in arrays.items():
            offset += -offset % ALIGN
            layout[field] = [arr.dtype.str, offset, len(arr)]
            offset += arr.nbytes
        size = len(header_bytes(layout))
        if size == start:
            return layout
        start = size


class TokenFile:
    """A state's `TOKENS_FILE`, checked against the state's references; `load` reads it."""

    def __init__(self, state: dict[str, Any], path: Path, layout: dict[str, tuple[np.dtype, int, int]]) -> None:
        self.state, self.path, self.layout = state, path, layout

    @classmethod
    def open(cls, state: dict[str, Any], ckpt_dir: Optional[Path]) -> Optional["TokenFile"]:
        """None for a state without `TOKENS_KEY` (plain lists). Raises ValueError naming the file when
        it does not fit the state (size, format, header, counts, a reference out of its array)."""
        desc = state.get(TOKENS_KEY)
        if desc is None:
            return None
        if ckpt_dir is None:
            raise ValueError(f"the rollout state refers to {desc.get('file')!r} but no checkpoint directory was given")
        path = Path(ckpt_dir) / str(desc["file"])
        size = path.stat().st_size if path.is_file() else -1
        if desc.get("format") == 1:
            arrays = desc["arrays"]
        elif desc.get("format") == FORMAT:
            arrays = _read_header(path, size)
            counts = {field: int(entry[2]) for field, entry in arrays.items()}
            if counts != {field: int(n) for field, n in desc["counts"].items()}:
                raise ValueError(f"{path} holds {counts} values per field, the rollout state refers to "
                                 f"{desc['counts']}")
        else:
            raise ValueError(f"{TOKENS_KEY} format {desc.get('format')!r} is not {FORMAT} (or 1)")
        layout = {}
        for field, (dtype, offset, count) in arrays.items():
            dtype, offset, count = np.dtype(dtype), int(offset), int(count)
            if offset % dtype.itemsize or offset + count * dtype.itemsize > size:
                raise ValueError(f"{path} ({size} bytes) does not hold {field} ({count} x {dtype} at {offset})")
            layout[field] = (dtype, offset, count)
        tokens = cls(state, path, layout)
        tokens._walk(state, None)  # every reference inside its array
        return tokens

    def load(self) -> dict[str, Any]:
        """The state with every reference replaced by a numpy view of the file's arrays (one read;
        `from_dict` turns each view into a list: run it under `state_tokens.gc_paused`)."""
        blob = np.fromfile(self.path, dtype=np.uint8)
        views = {field: blob[offset: offset + count * dtype.itemsize].view(dtype)
                 for field, (dtype, offset, count) in self.layout.items()}
        out = self._walk(self.state, views)
        out.pop(TOKENS_KEY)
        return out

    def _walk(self, node: Any, views: Optional[dict[str, np.ndarray]]) -> Any:
        if isinstance(node, dict):
            ref = node.get(REF) if len(node) == 1 else None
            if ref is not None:
                field, start, count = ref[0], int(ref[1]), int(ref[2])
                if field not in self.layout or start < 0 or count < 0 or start + count > self.layout[field][2]:
                    raise ValueError(f"{self.path}: reference {ref} is outside its array")
                return None if views is None else views[field][start: start + count]
            return {k: self._walk(v, views) if isinstance(v, (dict, list)) else v for k, v in node.items()}
        if isinstance(node, list):
            return [self._walk(v, views) if isinstance(v, (dict, list)) else v for v in node]
        return node


def _read_header(path: Path, size: int) -> dict[str, list]:
    """The arrays of a format-2 file's header ({field: [dtype, offset, count]})."""
    if size < HEADER.size:
        raise ValueError(f"{path} ({size} bytes) is too short for its header")
    with open(path, "rb") as f:
        magic, length = HEADER.unpack(f.read(HEADER.size))
        if magic != MAGIC or length > min(MAX_HEADER_BYTES, size - HEADER.size):
            raise ValueError(f"{path} does not start with a rollout token file header ({magic!r}, {length} bytes)")
        try:
            arrays = json.loads(f.read(length))["arrays"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} has an unreadable header ({exc})") from None
    if not isinstance(arrays, dict):
        raise ValueError(f"{path} has an unreadable header (arrays is not an object)")
    return arrays
