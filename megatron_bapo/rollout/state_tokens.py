"""The rollout state's per-token data as flat arrays in a file of the checkpoint, written and read by
the process that holds the rollout (the driver, in its own process with `trainer.driver_process`).

    snap = snapshot(driver_state)                   # lists -> flat arrays in memory + the small tree
    entry = snap.start(ckpt_dir).result()           # -> ckpt_dir/TOKENS_FILE, on a thread; its manifest entry
    state = save_tokens(driver_state, ckpt_dir)     # both at once
    tokens = TokenFile.open(state, ckpt_dir)        # the descriptor checked against the file (a stat)
    state = tokens.load()                           # references -> numpy views (from_dict makes the lists)

Why: the partial-rollout buffer, the rounds produced ahead and the dynamic sampler's step hold every
buffered response's token ids, behavior log-probs and versions: at 32B (64 prompts x 16 samples x
up to 64k tokens, several steps in flight) about 3x10^8 values. As Python lists they crossed the
driver process's pipe pickled, both ways, at ~0.28 us per value: ~100 s per save and per resume
while every rank waited. Here only a small JSON-safe tree crosses; the values go to the file as
one concatenation per field.

Layout. Wherever a `Sample` dict (`Sample.to_dict`) or a `Prompt` dict sits in the state, its
`prompt_ids`, `response_ids`, `response_logprobs`, `response_versions` and `routed_experts` are
appended to the flat array of that field and replaced by `{"__tokens__": [field, start, count]}`.
The state gets `TOKENS_KEY`: `{"format": 1, "file": TOKENS_FILE, "arrays": {field: [dtype,
offset, count]}}`. Ids and versions are int32 when every value fits, else int64; log-probs
float32 when every value survives float64 -> float32 -> float64 bit for bit (SGLang's do), else
float64; the routing is its bytes (uint8). So a restored buffer equals the saved one exactly.

Saving. `snapshot` is the one pass over the Python objects (taken while the producer is paused,
from the live lists: `types.live_lists`); writing the arrays (temp file, sha256 of the bytes as
they are written, fsync, rename) needs no Python object, so the driver does it on a thread while
the rollout resumes and rank 0 writes trainer.json and hashes its files. The trainer asks for the
file's manifest entry (`Driver.state_files`, which waits for the write) right before the manifest:
the manifest is the completion marker, so a process killed while the file is a temp file leaves a
checkpoint without a manifest, skipped at resume; its sha256 covers the file like every other, so a
damaged one is skipped too. A state without `TOKENS_KEY` (written before this file existed) holds
plain lists and loads as it always did.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import hashlib
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

TOKENS_FILE = "rollout_tokens.bin"
TOKENS_KEY = "rollout_tokens"
"""The state's key for the descriptor of `TOKENS_FILE` (absent: an older state with plain lists)."""
REF = "__tokens__"
FORMAT = 1
ALIGN = 64
CHUNK_BYTES = 64 << 20
_SAMPLE_KEYS = frozenset({"prompt_ids", "response_ids", "response_logprobs", "response_versions", "state"})
_PROMPT_KEYS = frozenset({"prompt_ids", "answer", "index"})
_SAMPLE_FIELDS = frozenset({"prompt_ids", "response_ids", "response_logprobs", "response_versions", "routed_experts"})
_FLOATS = frozenset({"response_logprobs"})
_BYTES = frozenset({"routed_experts"})


def _fields_of(node: dict) -> frozenset:
    """The packable fields of a `Sample.to_dict` or `Prompt.to_dict` dict (none of any other dict)."""
    keys = node.keys()
    if _SAMPLE_KEYS <= keys:
        return _SAMPLE_FIELDS
    if _PROMPT_KEYS <= keys:
        return frozenset({"prompt_ids"})
    return frozenset()


def _collect(node: Any, found: dict[str, list[tuple[dict, Any]]]) -> None:
    """Every (dict, value) of a packable field under `node`, per field, in a fixed order. Token
    lists are not iterated here (that is the one O(tokens) pass, `_chunks`)."""
    if isinstance(node, dict):
        fields = _fields_of(node)
        for key, value in node.items():
            if key in fields:
                found.setdefault(key, []).append((node, value))
            elif isinstance(value, (dict, list)):
                _collect(value, found)
    elif isinstance(node, list):
        for value in node:
            if isinstance(value, (dict, list)):
                _collect(value, found)


def _array(field: str, values: list) -> np.ndarray:
    """One field's lists as one flat array: ints as int32 (int64 when one does not fit), log-probs as
    float32 when that is exact bit for bit for every value (else float64), routing bytes as uint8.
    This is the one pass over the Python objects: `struct.pack_into` per list straight into the
    array (~10 ns a value; `array.array` ~17), the float32 check one vectorised compare."""
    if field in _BYTES:
        return np.frombuffer(b"".join(values), dtype=np.uint8)
    count = sum(map(len, values))
    if field in _FLOATS:
        wide = _packed(values, count, "d", "<f8")
        narrow = wide.astype("<f4")
        # Equal values round-trip bit for bit (the cast keeps a zero's sign); a NaN is never equal: float64.
        return narrow if np.array_equal(narrow, wide) else wide
    try:
        return _packed(values, count, "i", "<i4")
    except struct.error:
        pass
    try:
        return _packed(values, count, "q", "<i8")
    except struct.error as exc:
        raise OverflowError(f"a rollout state's {field} holds a value that is not an int64 integer ({exc})") from exc


def _packed(values: list, count: int, code: str, dtype: str) -> np.ndarray:
    out = np.empty(count, dtype=dtype)
    at = 0
    for value in values:
        if value:
            struct.pack_into(f"<{len(value)}{code}", out, at, *value)
            at += len(value) * out.itemsize
    return out


class Snapshot:
    """A driver state's token lists as flat arrays in memory (`snapshot`) and the small tree that
    refers to them; `write` puts the arrays in `TOKENS_FILE`. Taking it is the part that must see
    the buffer still (~10 ns a value); writing (~1.2 GB at 32B: write, sha256, fsync) may run while
    the rollout goes on (`start`)."""

    def __init__(self, tree: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.tree, self.arrays = tree, arrays

    def write(self, ckpt_dir: Path) -> dict[str, tuple[int, str]]:
        """`ckpt_dir/TOKENS_FILE` written (temp file, fsync, rename); returns its manifest entry
        `{TOKENS_FILE: (size, sha256)}`, hashed from memory as it is written (no second read)."""
        path = Path(ckpt_dir) / TOKENS_FILE
        tmp = path.with_name(path.name + ".tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        digest, size, done = hashlib.sha256(), 0, False
        try:
            with open(tmp, "wb") as f:
                for field, arr in self.arrays.items():
                    pad = self.tree[TOKENS_KEY]["arrays"][field][1] - size
                    view = memoryview(arr.view(np.uint8))
                    for chunk in (b"\0" * pad, *(view[i: i + CHUNK_BYTES] for i in range(0, len(view), CHUNK_BYTES))):
                        digest.update(chunk)  # hashlib and the write release the GIL: the rollout goes on
                        f.write(chunk)
                    size += pad + len(view)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            done = True
        finally:
            if not done:  # a failed write (a full disk) leaves no part file behind
                tmp.unlink(missing_ok=True)
        return {TOKENS_FILE: (size, digest.hexdigest())}

    def start(self, ckpt_dir: Path) -> Future:
        """`write` on a thread of its own; the Future's `result()` is its manifest entry (or raises)."""
        return in_background(lambda: self.write(ckpt_dir))


def save_tokens(state: dict[str, Any], ckpt_dir: Path) -> dict[str, Any]:
    """`snapshot(state)` written into `ckpt_dir` at once; returns the tree (`state` is left as it was)."""
    snap = snapshot(state)
    snap.write(ckpt_dir)
    return snap.tree


def snapshot(state: dict[str, Any]) -> Snapshot:
    """`state` (a JSON-safe driver state, `Driver.state_dict`; its token lists may be the live ones,
    `types.live_lists`) with every sample's and prompt's token lists converted to flat arrays;
    `state` is left as it was. Call it where the lists live: only the tree needs to travel."""
    with gc_paused():
        found: dict[str, list[tuple[dict, Any]]] = {}
        _collect(state, found)
        copies: dict[int, dict] = {}  # id(original dict) -> its copy holding references
        arrays: dict[str, np.ndarray] = {}
        layout: dict[str, list] = {}
        offset = 0
        for field, slots in found.items():
            values = [v for _, v in slots]
            if field in _BYTES:  # a Sample's routing travels base64 in its dict ("" when none was recorded)
                values = [base64.b64decode(v) for v in values]
            arrays[field] = arr = _array(field, values)
            offset += -offset % ALIGN
            layout[field] = [arr.dtype.str, offset, len(arr)]
            offset += arr.nbytes
            start = 0
            for (node, _), value in zip(slots, values):
                copies.setdefault(id(node), dict(node))[field] = {REF: [field, start, len(value)]}
                start += len(value)
        tree = _replace(state, copies)
    tree[TOKENS_KEY] = {"format": FORMAT, "file": TOKENS_FILE, "arrays": layout}
    return Snapshot(tree, arrays)


def _replace(node: Any, copies: dict[int, dict]) -> Any:
    """`node` with the dicts in `copies` replaced by their copies (containers above them copied)."""
    if isinstance(node, dict):
        node = copies.get(id(node), node)
        return {k: _replace(v, copies) if isinstance(v, (dict, list)) else v for k, v in node.items()}
    if isinstance(node, list):
        return [_replace(v, copies) if isinstance(v, (dict, list)) else v for v in node]
    return node


class TokenFile:
    """A state's `TOKENS_FILE`, checked against its descriptor; `load` reads it."""

    def __init__(self, state: dict[str, Any], path: Path, layout: dict[str, tuple[np.dtype, int, int]]) -> None:
        self.state, self.path, self.layout = state, path, layout

    @classmethod
    def open(cls, state: dict[str, Any], ckpt_dir: Optional[Path]) -> Optional["TokenFile"]:
        """None for a state without `TOKENS_KEY` (plain lists). Raises ValueError naming the file
        when the descriptor does not fit it (size, format, a reference out of its array)."""
        desc = state.get(TOKENS_KEY)
        if desc is None:
            return None
        if ckpt_dir is None:
            raise ValueError(f"the rollout state refers to {desc.get('file')!r} but no checkpoint directory was given")
        if desc.get("format") != FORMAT:
            raise ValueError(f"{TOKENS_KEY} format {desc.get('format')!r} is not {FORMAT}")
        path = Path(ckpt_dir) / str(desc["file"])
        size = path.stat().st_size if path.is_file() else -1
        layout = {}
        for field, (dtype, offset, count) in desc["arrays"].items():
            dtype, offset, count = np.dtype(dtype), int(offset), int(count)
            if offset % dtype.itemsize or offset + count * dtype.itemsize > size:
                raise ValueError(f"{path} ({size} bytes) does not hold {field} ({count} x {dtype} at {offset})")
            layout[field] = (dtype, offset, count)
        tokens = cls(state, path, layout)
        tokens._walk(state, None)  # every reference inside its array
        return tokens

    def load(self) -> dict[str, Any]:
        """The state with every reference replaced by a numpy view of the file's arrays (one read;
        `from_dict` turns each view into a list: run it under `gc_paused`)."""
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


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while the buffers are copied or rebuilt: each full collection
    walks every element of every list (seconds at 3x10^8 values), and making thousands of new
    lists sets off several (measured: to_dict at 10 ns a value with it, 3.5 without)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def in_background(fn: Callable[[], None]) -> Future:
    """`fn()` on a thread of its own; the Future's `result()` waits for it and raises its error. A
    resumed buffer's lists are rebuilt so (~20 ns a value, seconds at 32B) while the actor loads."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-restore")
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)
