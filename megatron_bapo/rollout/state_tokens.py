"""The rollout state's per-token data as flat arrays in a file of the checkpoint, written and read by
the process that holds the rollout (the driver, in its own process with `trainer.driver_process`).

    snap = snapshot(driver_state)                   # under the pause: each list and its length + the small tree
    entry = snap.start(ckpt_dir).result()           # on a thread: the lists' first values -> flat arrays ->
                                                    # ckpt_dir/TOKENS_FILE; its manifest entry
    state = save_tokens(driver_state, ckpt_dir)     # both at once
    tokens = TokenFile.open(state, ckpt_dir)        # the file's header checked against the tree (`token_file`)
    state = tokens.load()                           # references -> numpy views (from_dict makes the lists)

Why: the partial-rollout buffer, the rounds produced ahead and the dynamic sampler's step hold every
buffered response's token ids, behavior log-probs and versions: at 32B (64 prompts x 16 samples x
up to 64k tokens, several steps in flight) about 3x10^8 values. As Python lists they crossed the
driver process's pipe pickled, both ways, at ~0.28 us per value: ~100 s per save and per resume
while every rank waited. Here only a small JSON-safe tree crosses; the values go to the file as
one concatenation per field.

Layout. Wherever a `Sample` dict (`Sample.to_dict`) or a `Prompt` dict sits in the state, its
`prompt_ids`, `response_ids`, `response_logprobs`, `response_versions` and `routed_experts` are
appended to the flat array of that field and replaced by `{"__tokens__": [field, start, count]}`
(in values of that field). The state gets `TOKENS_KEY`: `{"format": 2, "file": TOKENS_FILE,
"counts": {field: count}}`. The file: `MAGIC`, the header's length (uint64 little-endian), the
header (JSON `{"arrays": {field: [dtype, offset, count]}}`), then each array at an `ALIGN`ed offset.
Ids and versions are int32 when every value fits, else int64; log-probs float32 when every value
survives float64 -> float32 -> float64 bit for bit (SGLang's do), else float64; the routing is its
bytes (uint8). So a restored buffer equals the saved one exactly. (Format 1, written before the
values were read off the pause, had the arrays' dtypes and offsets in the tree and no header.)

Saving. Under the producer's pause `snapshot` reads no value: from the live lists (`types.live_lists`)
it records each list object and its length, O(lists). That is the state at the pause because the
token lists are only ever extended, or replaced by new lists (`Sample.reset`), and the routing is
immutable bytes (`tests/test_state_tokens_invariant.py` guards it): `lst[:n]` later (one atomic
slice under the GIL) is what `lst` held at the pause, however much the rollout appended since.
Converting those slices (~15 ns a value: `struct.pack_into` per list, one vectorised float32 check)
and writing the arrays (temp file, sha256 of the bytes as they are written, fsync, rename) run on
the driver's thread (`start`) while the rollout resumes and training goes on. The trainer completes
the checkpoint at the next step boundary: it asks for the file's manifest entry then
(`Driver.state_files`, which waits for the write) and writes the manifest, the completion marker
(`checkpoint_save`). A process killed before that leaves a checkpoint without a manifest, skipped
at resume; the sha256 covers the file like every other, so a damaged one is skipped too. A state
without `TOKENS_KEY` (written before this file existed) holds plain lists and loads as it always did.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import hashlib
import logging
import os
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from megatron_bapo.rollout.token_file import (  # noqa: F401 - the format's names, as callers know them
    ALIGN,
    FORMAT,
    REF,
    TOKENS_FILE,
    TOKENS_KEY,
    TokenFile,
    header_bytes,
    layout_for,
)

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
_SAMPLE_KEYS = frozenset({"prompt_ids", "response_ids", "response_logprobs", "response_versions", "state"})
_PROMPT_KEYS = frozenset({"prompt_ids", "answer", "index"})
_SAMPLE_FIELDS = frozenset({"prompt_ids", "response_ids", "response_logprobs", "response_versions", "routed_experts",
                            "teacher_logprobs"})
_FLOATS = frozenset({"response_logprobs", "teacher_logprobs"})
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
    lists are not iterated here (their values are read on the writer's thread, `_array`)."""
    if isinstance(node, dict):
        fields = _fields_of(node)
        for key, value in node.items():
            if key in fields and value is not None:  # teacher_logprobs: None until the teacher scored it
                found.setdefault(key, []).append((node, value))
            elif isinstance(value, (dict, list)):
                _collect(value, found)
    elif isinstance(node, list):
        for value in node:
            if isinstance(value, (dict, list)):
                _collect(value, found)


Slot = tuple[Any, int]
"""A token list (or the routing's bytes) as the snapshot found it, and its length then."""


def _array(field: str, slots: list[Slot]) -> np.ndarray:
    """One field's values at the snapshot (each list's first `n`) as one flat array: ints as int32
    (int64 when one does not fit), log-probs as float32 when that is exact bit for bit for every
    value (else float64), routing bytes as uint8. This is the one pass over the Python objects:
    `struct.pack_into` per list straight into the array (~15 ns a value with the slice; `array.array`
    ~17), the float32 check one vectorised compare."""
    if field in _BYTES:
        return np.frombuffer(b"".join(value[:n] for value, n in slots), dtype=np.uint8)
    count = sum(n for _, n in slots)
    if field in _FLOATS:
        wide = _packed(slots, count, "d", "<f8")
        narrow = wide.astype("<f4")
        # Equal values round-trip bit for bit (the cast keeps a zero's sign); a NaN is never equal: float64.
        return narrow if np.array_equal(narrow, wide) else wide
    try:
        return _packed(slots, count, "i", "<i4")
    except struct.error:
        pass
    try:
        return _packed(slots, count, "q", "<i8")
    except struct.error as exc:
        raise OverflowError(f"a rollout state's {field} holds a value that is not an int64 integer ({exc})") from exc


def _packed(slots: list[Slot], count: int, code: str, dtype: str) -> np.ndarray:
    out = np.empty(count, dtype=dtype)
    at = 0
    for value, n in slots:
        if n:
            head = value[:n]  # one atomic slice: what the list held at the snapshot, appends since left out
            if len(head) != n:
                raise RuntimeError(f"a rollout token list shrank from {n} to {len(value)} values after the "
                                   f"checkpoint's snapshot: token lists may only be extended or replaced")
            struct.pack_into(f"<{n}{code}", out, at, *head)
            at += n * out.itemsize
    return out


class Snapshot:
    """A driver state's token lists as the producer's pause left them (each list and its length) and
    the small tree that refers to them (`snapshot`); `write` reads the values and puts them in
    `TOKENS_FILE`. Nothing of it needs the buffer still, so it runs while the rollout goes on
    (`start`); it holds the lists a reset sample dropped until then."""

    def __init__(self, tree: dict[str, Any], slots: dict[str, list[Slot]]) -> None:
        self.tree, self.slots = tree, slots

    def arrays(self) -> dict[str, np.ndarray]:
        """Each field's values at the snapshot as one flat array (`_array`)."""
        return {field: _array(field, slots) for field, slots in self.slots.items()}

    def write(self, ckpt_dir: Path) -> dict[str, tuple[int, str]]:
        """`ckpt_dir/TOKENS_FILE` written (temp file, fsync, rename); returns its manifest entry
        `{TOKENS_FILE: (size, sha256)}`, hashed from memory as it is written (no second read)."""
        arrays = self.arrays()
        layout = layout_for(arrays)
        path = Path(ckpt_dir) / TOKENS_FILE
        tmp = path.with_name(path.name + ".tmp")
        path.parent.mkdir(parents=True, exist_ok=True)
        digest, done = hashlib.sha256(), False
        head = header_bytes(layout)
        size = len(head)
        try:
            with open(tmp, "wb") as f:
                digest.update(head)
                f.write(head)
                for field, arr in arrays.items():
                    pad = layout[field][1] - size
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
        self.slots = {}  # the lists a reset sample dropped are no longer held
        return {TOKENS_FILE: (size, digest.hexdigest())}

    def start(self, ckpt_dir: Path) -> Future:
        """`write` on a thread of its own; the Future's `result()` is its manifest entry (or raises)."""
        return in_background(lambda: self.write(ckpt_dir))


class TokenWrite:
    """The token file a checkpoint's `Snapshot` writes on a thread, for the driver: `files` waits for
    it, as often as asked (a call SIGTERM interrupted is asked again), until the next `start`."""

    def __init__(self) -> None:
        self._future: Optional[Future] = None
        self._delivered = False  # whether `files` handed over its outcome (an error is then the caller's)

    def start(self, snap: Snapshot, ckpt_dir: Path) -> None:
        self.drop()
        self._future, self._delivered = snap.start(ckpt_dir), False

    def files(self) -> dict[str, tuple[int, str]]:
        """`{TOKENS_FILE: (size, sha256)}` once written ({} when none was started); raises its error."""
        if self._future is None:
            return {}
        try:
            return self._future.result()
        finally:
            self._delivered = self._future.done()

    def drop(self) -> None:
        """Wait for a write nobody will ask for (the next save, or closing): its error, unless handed
        over already, is logged, not raised (its checkpoint was removed, or the process is ending)."""
        future, self._future = self._future, None
        if future is None:
            return
        try:
            future.result()
        except OSError as exc:
            if not self._delivered:
                logger.warning("the previous checkpoint's rollout token file was not written: %s", exc)


def save_tokens(state: dict[str, Any], ckpt_dir: Path) -> dict[str, Any]:
    """`snapshot(state)` written into `ckpt_dir` at once; returns the tree (`state` is left as it was)."""
    snap = snapshot(state)
    snap.write(ckpt_dir)
    return snap.tree


def snapshot(state: dict[str, Any]) -> Snapshot:
    """`state` (a driver state, `Driver.state_dict`; its token lists may be the live ones,
    `types.live_lists`, its routing raw bytes) with every sample's and prompt's token lists replaced
    by references; `state` is left as it was. O(lists): no value is read (`Snapshot.write` reads
    them). Call it where the lists live: only the tree needs to travel."""
    with gc_paused():
        found: dict[str, list[tuple[dict, Any]]] = {}
        _collect(state, found)
        copies: dict[int, dict] = {}  # id(original dict) -> its copy holding references
        slots: dict[str, list[Slot]] = {}
        counts: dict[str, int] = {}
        for field, pairs in found.items():
            slots[field] = []
            start = 0
            for node, value in pairs:
                if isinstance(value, str):  # routing as a JSON-safe dict holds it (base64; "" when none)
                    value = base64.b64decode(value)
                n = len(value)
                slots[field].append((value, n))
                copies.setdefault(id(node), dict(node))[field] = {REF: [field, start, n]}
                start += n
            counts[field] = start
        tree = _replace(state, copies)
    tree[TOKENS_KEY] = {"format": FORMAT, "file": TOKENS_FILE, "counts": counts}
    return Snapshot(tree, slots)


def _replace(node: Any, copies: dict[int, dict]) -> Any:
    """`node` with the dicts in `copies` replaced by their copies (containers above them copied)."""
    if isinstance(node, dict):
        node = copies.get(id(node), node)
        return {k: _replace(v, copies) if isinstance(v, (dict, list)) else v for k, v in node.items()}
    if isinstance(node, list):
        return [_replace(v, copies) if isinstance(v, (dict, list)) else v for v in node]
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


def in_background(fn: Callable[[], Any]) -> Future:
    """`fn()` on a thread of its own; the Future's `result()` waits for it and raises its error. A
    resumed buffer's lists are rebuilt so (~20 ns a value, seconds at 32B) while the actor loads."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-restore")
    try:
        return pool.submit(fn)
    finally:
        pool.shutdown(wait=False)
