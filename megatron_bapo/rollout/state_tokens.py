"""The rollout state's per-token data as flat arrays in a file of the checkpoint, written and read by
the process that holds the rollout (the driver, in its own process with `trainer.driver_process`).

    state = save_tokens(driver_state, ckpt_dir)     # lists -> flat arrays -> ckpt_dir/TOKENS_FILE
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

The file is written (temp file, fsync, rename) before trainer.json, in the checkpoint directory,
so the checkpoint's sha256 manifest covers it like every other file: a damaged one is skipped at
resume. A state without `TOKENS_KEY` (written before this file existed) holds plain lists and
loads as it always did.
"""

from __future__ import annotations

import array
import base64
import contextlib
import gc
import os
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


def _chunks(field: str, values: list) -> list:
    """One field's values, one buffer per list: ints as int32 (int64 when one does not fit),
    log-probs as float32 when that is exact bit for bit for every value (else float64), routing
    bytes as they are. The conversion is the one pass over the Python objects (~15 ns a value)."""
    if field in _BYTES:
        return values
    if field in _FLOATS:
        wide = [np.frombuffer(array.array("d", v), dtype=np.float64) for v in values]
        narrow = [w.astype(np.float32) for w in wide]
        # Equal values round-trip bit for bit (the cast keeps a zero's sign); a NaN is never equal: float64.
        exact = all(np.array_equal(n, w) for n, w in zip(narrow, wide))
        return narrow if exact else wide
    for code in ("i", "q"):  # array's "i" is C int: 32 bits on every target
        try:
            return [array.array(code, v) for v in values]
        except OverflowError:
            continue
    raise OverflowError(f"a rollout state's {field} holds a value outside int64")


def _dtype(chunks: list) -> np.dtype:
    first = chunks[0]
    if isinstance(first, np.ndarray):
        return first.dtype
    return np.dtype(np.uint8) if isinstance(first, bytes) else np.dtype({"i": np.int32, "q": np.int64}[first.typecode])


def save_tokens(state: dict[str, Any], ckpt_dir: Path) -> dict[str, Any]:
    """`state` (a JSON-safe driver state: `Driver.state_dict`) with every sample's and prompt's token
    lists moved into `ckpt_dir/TOKENS_FILE`; returns the new (small, JSON-safe) state, `state` is
    left as it was. Call it where the lists live: only the returned tree needs to travel."""
    with gc_paused():
        return _save(state, Path(ckpt_dir))


def _save(state: dict[str, Any], ckpt_dir: Path) -> dict[str, Any]:
    found: dict[str, list[tuple[dict, Any]]] = {}
    _collect(state, found)
    copies: dict[int, dict] = {}  # id(original dict) -> its copy holding references
    with _Writer(ckpt_dir / TOKENS_FILE) as out:
        for field, slots in found.items():
            values = [v for _, v in slots]
            if field in _BYTES:  # a Sample's routing travels base64 in its dict ("" when none was recorded)
                values = [base64.b64decode(v) for v in values]
            out.append(field, _chunks(field, values))
            start = 0
            for (node, _), value in zip(slots, values):
                copies.setdefault(id(node), dict(node))[field] = {REF: [field, start, len(value)]}
                start += len(value)
    tree = _replace(state, copies)
    tree[TOKENS_KEY] = {"format": FORMAT, "file": TOKENS_FILE, "arrays": out.layout}
    return tree


def _replace(node: Any, copies: dict[int, dict]) -> Any:
    """`node` with the dicts in `copies` replaced by their copies (containers above them copied)."""
    if isinstance(node, dict):
        node = copies.get(id(node), node)
        return {k: _replace(v, copies) if isinstance(v, (dict, list)) else v for k, v in node.items()}
    if isinstance(node, list):
        return [_replace(v, copies) if isinstance(v, (dict, list)) else v for v in node]
    return node


class _Writer:
    """`path` written as a temp file, fsync'd and renamed on a clean exit. Each field's buffers go
    one after another from a multiple of ALIGN. Every `SYNC_BYTES` a thread starts an fdatasync, so
    the disk writes while the next values are converted and the final fsync finds little left
    (a full 1.2 GB at the end would wait ~3 s for a 400 MB/s disk)."""

    SYNC_BYTES = 128 << 20

    def __init__(self, path: Path) -> None:
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        self.layout: dict[str, list] = {}
        self.offset, self.unsynced = 0, 0
        self._sync: Optional[Future] = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-tokens-sync")

    def __enter__(self) -> "_Writer":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.tmp, "wb")
        return self

    def append(self, field: str, chunks: list) -> None:
        pad = -self.offset % ALIGN
        self.file.write(b"\0" * pad)
        self.offset += pad
        dtype = _dtype(chunks)
        count = 0
        for chunk in chunks:
            self.file.write(chunk)
            nbytes = len(chunk) * dtype.itemsize
            count += len(chunk)
            self.offset += nbytes
            self.unsynced += nbytes
            if self.unsynced >= self.SYNC_BYTES and (self._sync is None or self._sync.done()):
                self.file.flush()
                self._sync, self.unsynced = self._pool.submit(os.fdatasync, self.file.fileno()), 0
        self.layout[field] = [dtype.str, self.offset - count * dtype.itemsize, count]

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        done = False
        try:
            if self._sync is not None:
                self._sync.result()
            if kind is None:
                self.file.flush()
                os.fsync(self.file.fileno())
                done = True
        finally:
            self._pool.shutdown()
            self.file.close()
            if done:
                os.replace(self.tmp, self.path)
            else:  # a failed write (a full disk) leaves no part file behind
                self.tmp.unlink(missing_ok=True)


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
