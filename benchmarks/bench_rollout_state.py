"""A checkpoint's rollout state through the driver process (`trainer.driver_process`): bytes and
seconds on rank 0's critical path, save and resume, for a range of buffer sizes, extrapolated to
the 32B recipe's buffer (~3x10^8 token ids, log-probs and versions).

The driver process is a forked peer holding a real `PartialRolloutManager` (the partial-rollout
buffer), `RolloutProducer` (a round produced ahead) and `DynamicSampler`, filled with groups of
`--group-size` responses of `--tokens` tokens (token ids, log-probs as SGLang returns them: float32
values, versions one per segment of `--segments`). What crosses between it and rank 0 crosses as
`DriverProcess._call` sends it (`Connection.send`: `ForkingPickler.dumps` then `send_bytes`; recv:
`recv_bytes` then `loads`), over a real `multiprocessing` pipe:

- save: the peer takes the state as `Driver.state_dict` does (the three `state_dict`s; with
  `rollout.state_tokens`, the token file written into the checkpoint directory), it crosses the
  pipe, rank 0 writes it (`run_state.write_trainer_state`: trainer.json and its side file). Every
  rank waits for all of it. With `state_tokens.snapshot` (835d065) the peer converts the lists to
  arrays before it answers and writes the file on a thread; rank 0 hashes its files and then waits
  for the file right before the manifest ("rank 0: waits for the file"). Here rank 0 has nothing
  to do meanwhile, so that wait is the whole write (in a job rank 0 hashes its share of the
  actor's files first). With the deferred completion (`checkpoint_save`) the snapshot reads no
  value; the peer converts and writes on its thread ("values read", "file written") while the
  next step trains, and rank 0 asks for the file at the next step boundary: the bench waits for
  the write off the clock, then times that ask ("waits, file written") and the manifest. "SAVE, worst
  case": a boundary that comes right when the save returns waits for all of the thread's work.
- resume: rank 0 reads the state (`run_state.load_trainer_state`), it crosses the pipe, the peer
  restores the three objects. With `state_tokens` the peer only checks the token file before it
  answers (`Driver.start`); the lists are rebuilt on a thread while the actor loads (`background`),
  off the critical path. Before it (b74de61), all of it was on the path.

Runs on any tree (it detects `state_tokens` and `checkpoint_save`), so the same file measures the base commits:

    python benchmarks/bench_rollout_state.py [--samples 64 256 1024] [--tokens 16384]

`measure(num_samples, tokens, ...)` returns one size's numbers (for `bench_scale.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Iterator, Optional

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

RECIPE_VALUES = 3e8
"""The 32B recipe's buffer (examples/configs/qwen3-32b-bapo-64k.yaml: 64 prompts x 16 samples x up to
64k tokens, partial rollout and one round ahead): token ids, log-probs and versions."""

try:
    from megatron_bapo.rollout.state_tokens import TokenFile, gc_paused, save_tokens
except ImportError:  # b74de61: the lists cross the pipe
    TokenFile = gc_paused = save_tokens = None
try:  # the snapshot on the path, the file written on the driver's thread (rank 0 waits before the manifest)
    from megatron_bapo.rollout.state_tokens import snapshot
    from megatron_bapo.rollout.types import live_lists
except ImportError:  # 949a309: converted and written before state_dict returns
    snapshot = live_lists = None
try:  # the snapshot reads no value; converted and written on the thread; the manifest at the next step boundary
    from megatron_bapo.checkpoint_save import CheckpointSaves as DEFERRED
except ImportError:  # 835d065: converted under the pause; rank 0 waits for the file inside the save
    DEFERRED = None


def _objects(num_samples: int, tokens: int, group_size: int, prompt_tokens: int, segments: int,
             ready_fraction: float, seed: int = 0) -> tuple[Any, Any, Any]:
    """(manager, producer, sampler) holding the buffer: `ready_fraction` of the groups in a round
    produced ahead, the rest partial in the manager's buffer."""
    from megatron_bapo.rollout.config import PartialRolloutConfig
    from megatron_bapo.rollout.dynamic_sampling import DynamicSampler
    from megatron_bapo.rollout.partial import PartialRolloutManager
    from megatron_bapo.rollout.producer import RolloutProducer
    from megatron_bapo.rollout.types import Prompt, RolloutGroup, RolloutRound, Sample, SampleState

    import numpy as np

    rng = np.random.default_rng(seed)
    cfg = PartialRolloutConfig(group_size=group_size, max_response_tokens=max(tokens, 1), segment_tokens=max(tokens, 1))
    manager = PartialRolloutManager(None, cfg)
    producer = RolloutProducer(None, manager, lambda v: None, ahead=1, served_version=lambda: 0)

    async def never(*_a: Any) -> Any:
        raise AssertionError

    sampler = DynamicSampler(mode="off", prompts_per_step=1, max_refill_rounds=1, draw=lambda n: [],
                             advance=never, score=lambda g: None, requeue=lambda g: None)
    versions = np.repeat(np.arange(segments) + 40, -(-tokens // segments))[:tokens].tolist()
    groups = []
    for g in range(max(1, num_samples // group_size)):
        prompt = Prompt(prompt_ids=rng.integers(0, 151_936, prompt_tokens).tolist(), answer=str(g), index=g)
        samples = [Sample(prompt_ids=list(prompt.prompt_ids), response_ids=rng.integers(0, 151_936, tokens).tolist(),
                          response_logprobs=(-rng.exponential(1.0, tokens)).astype(np.float32).tolist(),
                          response_versions=list(versions), state=SampleState.PARTIAL, num_segments=segments)
                   for _ in range(group_size)]
        groups.append(RolloutGroup(group_id=f"g{g}", prompt=prompt, samples=samples, start_version=40))
    num_ready = int(len(groups) * ready_fraction)
    manager.buffer = groups[num_ready:]
    producer.ready = [RolloutRound(prompts=[g.prompt for g in groups[:num_ready]], groups=groups[:num_ready])]
    return manager, producer, sampler


def _state_dict(manager: Any, producer: Any, sampler: Any, ckpt: Path) -> dict:
    """`Driver.state_dict`'s tree (and, where it exists, its token file)."""
    state = {"step": 10, "version": 10, "data": {"format": 1, "epoch": 0, "position": 64},
             "rollout": manager.state_dict(), "rounds": producer.state_dict(), "sampling": sampler.state_dict(),
             "run": {}}
    return save_tokens(state, ckpt) if save_tokens is not None else state


def _driver_state(manager: Any, producer: Any, sampler: Any, ckpt: Path) -> tuple[dict, Any]:
    """(the tree, the Future of the token file's write or None): as `Driver.state_dict(wait=False)`."""
    if gc_paused is None:  # b74de61
        return _state_dict(manager, producer, sampler, ckpt), None
    if snapshot is None:  # 949a309
        with gc_paused():
            return _state_dict(manager, producer, sampler, ckpt), None
    with gc_paused(), live_lists():
        snap = snapshot({"step": 10, "version": 10, "data": {"format": 1, "epoch": 0, "position": 64},
                         "rollout": manager.state_dict(), "rounds": producer.state_dict(),
                         "sampling": sampler.state_dict(), "run": {}})
    if callable(getattr(snap, "arrays", None)):  # the values are read on the thread: time that part of it
        convert = snap.arrays

        def timed() -> Any:
            start = time.perf_counter()
            arrays = convert()
            THREAD_TIMES["save_convert_s"] = time.perf_counter() - start
            return arrays

        snap.arrays = timed
    return snap.tree, snap.start(ckpt)


THREAD_TIMES: dict[str, float] = {}
"""The driver's writer thread: seconds converting the values (where it reads them off the pause)."""


class _Clock:
    """Wall and CPU seconds (this process) of each phase: the box this runs on may be shared, and a
    phase's CPU seconds are what it costs on a core of its own."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._started: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.process_time()
        self._started[name] = wall
        yield
        self.times[f"{name}_s"] = time.perf_counter() - self._started[name]
        self.times[f"{name}_cpu"] = time.process_time() - cpu

    def elapsed(self, name: str) -> float:
        """Wall seconds of the running phase `name` so far."""
        return time.perf_counter() - self._started[name]

    def restart(self, name: str) -> None:
        """The running phase `name` counts from now (what came before is added back by the caller)."""
        self._started[name] = time.perf_counter()


def _restore(state: dict, ckpt: Path, objects: tuple, clock: _Clock) -> None:
    """`Driver.start`'s restore: what it does before it answers ("answer"), then on its thread."""
    manager, producer, sampler = objects
    tokens = None
    with clock("resume_driver"):
        if TokenFile is not None:
            manager.check_state_dict(state["rollout"])
            tokens = TokenFile.open(state, ckpt)
        else:
            manager.load_state_dict(state["rollout"])
            producer.load_state_dict(state.get("rounds", {}))
            sampler.load_state_dict(state.get("sampling", {}))
    with clock("resume_background"), (gc_paused() if tokens is not None else contextlib.nullcontext()):
        if tokens is not None:
            full = tokens.load()
            manager.load_state_dict(full["rollout"])
            producer.load_state_dict(full.get("rounds", {}))
            sampler.load_state_dict(full.get("sampling", {}))


def _peer(conn: Any, args: tuple, ckpt: str) -> None:
    """The driver process: answers "save" and "restore" as `driver_process._serve` would."""
    manager, producer, sampler = _objects(*args)
    original = [[s.response_ids, s.response_logprobs, s.response_versions] for g in manager.buffer for s in g.samples]
    clock = _Clock()
    conn.send("ready")
    conn.recv()
    with clock("save_driver"):
        state, writing = _driver_state(manager, producer, sampler, Path(ckpt))
        started = time.perf_counter()
    with clock("save_pickle"):
        buf = ForkingPickler.dumps(("ok", state, 0.0))  # Connection.send: dumps, then send_bytes
    conn.send_bytes(buf)
    del state, buf
    if writing is not None and DEFERRED is not None:  # the step boundary comes after the file is written
        writing.result()
        clock.times["save_background_s"] = time.perf_counter() - started
        conn.send("written")
    if writing is not None:  # rank 0 asks for the file's manifest entry (Driver.state_files)
        assert conn.recv() == "files"
        entry = writing.result()
        clock.times.setdefault("save_background_s", time.perf_counter() - started)
        conn.send(entry)
    clock.times.update(THREAD_TIMES)
    fresh = _objects(0, 0, args[2], 1, 1, 0.0)
    data = conn.recv_bytes()  # Connection.recv: recv_bytes, then loads
    with clock("resume_unpickle"):
        _, (state,), _ = ForkingPickler.loads(data)
    del data
    conn.send("answer")  # Driver.start returns here; the background part follows
    _restore(state, Path(ckpt), fresh, clock)
    restored = [[s.response_ids, s.response_logprobs, s.response_versions] for g in fresh[0].buffer for s in g.samples]
    conn.send((clock.times, restored == original))


def measure(num_samples: int, tokens: int, *, group_size: int = 16, prompt_tokens: int = 512, segments: int = 4,
            ready_fraction: float = 0.25, workdir: Optional[Path] = None) -> dict[str, Any]:
    """One save and one resume of a buffer of `num_samples` responses x `tokens` tokens through a real
    pipe to a forked driver process: wall and CPU seconds per phase, bytes through the pipe and on
    disk, and "save_s"/"resume_s" (wall) and "save_cpu"/"resume_cpu" (CPU) on rank 0's critical path."""
    from megatron_bapo import run_state

    root = Path(tempfile.mkdtemp(prefix="bench_rollout_state_", dir=workdir))
    ckpt = run_state.checkpoint_dir(root, 10)
    ckpt.mkdir(parents=True)
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe(duplex=True)
    peer = ctx.Process(target=_peer, args=(there, (num_samples, tokens, group_size, prompt_tokens, segments,
                                                   ready_fraction), str(ckpt)))
    peer.start()
    clock = _Clock()
    try:
        assert here.recv() == "ready"
        out: dict[str, Any] = {"num_samples": num_samples, "tokens": tokens,
                               "values": 3 * num_samples * tokens, "prompt_values": num_samples * prompt_tokens,
                               "format": "state_tokens" if save_tokens is not None else "pickled lists"}
        with clock("save"):
            here.send("save")
            data = here.recv_bytes()
            with clock("save_unpickle"):
                _, state, _ = ForkingPickler.loads(data)
            out["save_pipe_bytes"] = len(data)
            del data
            with clock("save_rank0_write"):
                run_state.write_trainer_state(ckpt, state)
            with clock("save_hash"):  # every rank hashes its own files (rank 0: trainer.json and its side file)
                hashed = run_state.hash_own_files(ckpt, 0, 1, skip=frozenset({"rollout_tokens.bin"}))
            if DEFERRED is not None:  # the next step runs meanwhile (off the path): until the file is written
                clock.times["save_s_so_far"] = clock.elapsed("save")
                assert here.recv() == "written"
                clock.restart("save")
            with clock("save_wait"):  # 835d065: right after the hashes; deferred: at the next step boundary
                if snapshot is not None:
                    here.send("files")
                    out["token_file_entry"] = here.recv()
                    hashed.update(out["token_file_entry"])
            with clock("save_manifest"):  # the completion marker and `latest`
                run_state.finish_checkpoint(ckpt, hashed)
        clock.times["save_s"] += clock.times.pop("save_s_so_far", 0.0)
        out["disk_bytes"] = sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())
        del state
        with clock("resume"):
            with clock("resume_rank0_read"):
                state = run_state.load_trainer_state(ckpt)
            with clock("resume_pickle"):
                data = ForkingPickler.dumps(("start", (state,), {}))
            out["resume_pipe_bytes"] = len(data)
            here.send_bytes(data)
            del data, state
            assert here.recv() == "answer"
        peer_times, out["round_trip_equal"] = here.recv()
    finally:
        peer.join(60)
        if peer.is_alive():
            peer.kill()
        shutil.rmtree(root, ignore_errors=True)
    t = {"save_background_s": 0.0, "save_convert_s": 0.0, **clock.times, **peer_times}  # 0: no such thread
    out.update(t)
    out["save_cpu"] = t["save_driver_cpu"] + t["save_pickle_cpu"] + t["save_unpickle_cpu"] + t["save_rank0_write_cpu"]
    # The worst case: the step boundary comes right after the save returned and waits for all of the thread's work.
    out["save_worst_s"] = (t["save_s"] - t["save_wait_s"] + t["save_background_s"]) if DEFERRED else t["save_s"]
    out["resume_cpu"] = (t["resume_rank0_read_cpu"] + t["resume_pickle_cpu"] + t["resume_unpickle_cpu"]
                         + t["resume_driver_cpu"])
    out["resume_s"] = t["resume_s"] + t["resume_driver_s"]  # rank 0 had its answer when the driver finished that
    return out


def _fit(rows: list[dict], key: str) -> tuple[float, float]:
    """(seconds per value, fixed seconds): least squares over the measured sizes."""
    xs, ys = [r["values"] for r in rows], [r[key] for r in rows]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if n > 1 and var else my / mx
    return slope, my - slope * mx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args()
    rows = [measure(n, args.tokens, group_size=args.group_size, prompt_tokens=args.prompt_tokens) for n in args.samples]
    print(f"rollout state through the driver process ({rows[0]['format']}), {args.tokens}-token responses; MEASURED "
          f"(wall / CPU seconds; values = token ids + log-probs + versions, prompts' ids not counted)")
    phases = [("save", "save_driver", "driver: state_dict"), ("save", "save_pickle", "driver: pickle"),
              ("save", "save_unpickle", "rank 0: unpickle"), ("save", "save_rank0_write", "rank 0: write"),
              ("save", "save_hash", "rank 0: hashes its files"),
              ("save", "save_wait", "rank 0: waits, file written" if DEFERRED else "rank 0: waits for the file"),
              ("save", "save_manifest", "rank 0: manifest + latest"), ("save", "save", "SAVE, critical path"),
              ("resume", "resume_rank0_read", "rank 0: read"), ("resume", "resume_pickle", "rank 0: pickle"),
              ("resume", "resume_unpickle", "driver: unpickle"),
              ("resume", "resume_driver", "driver: until it answers"),
              ("resume", "resume", "RESUME, critical path"), ("resume", "resume_background", "driver: background")]
    print(f"{'values':>34}" + "".join(f"{r['values']:>20.3g}" for r in rows))
    for _, key, label in phases:
        print(f"{label:>34}" + "".join(f"{r.get(key + '_s', 0.0):>9.3f} /{r.get(key + '_cpu', 0.0):>9.3f}"
                                       for r in rows))
    print(f"{'driver: file written (thread)':>34}" + "".join(f"{r['save_background_s']:>9.3f}{'':>11}" for r in rows))
    print(f"{'of which: values read (thread)':>34}" + "".join(f"{r.get('save_convert_s', 0.0):>9.3f}{'':>11}"
                                                             for r in rows))
    print(f"{'SAVE, worst case':>34}" + "".join(f"{r['save_worst_s']:>9.3f}{'':>11}" for r in rows))
    for key in ("save_pipe_bytes", "resume_pipe_bytes", "disk_bytes"):
        print(f"{key:>34}" + "".join(f"{r[key]:>20,}" for r in rows))
    print(f"{'restored == saved':>34}" + "".join(f"{str(r['round_trip_equal']):>20}" for r in rows))
    print(f"EXTRAPOLATED to the recipe's {RECIPE_VALUES:.0e} values (least squares over the sizes above):")
    for key in ("save_s", "save_worst_s", "save_cpu", "save_driver_s", "save_rank0_write_s", "save_wait_s",
                "save_manifest_s", "save_background_s", "save_convert_s", "resume_s", "resume_cpu",
                "resume_background_cpu", "save_pipe_bytes", "resume_pipe_bytes", "disk_bytes"):
        per, fixed = _fit(rows, key)
        if key.endswith("bytes"):
            print(f"  {key:24} {per:8.3f} bytes per value -> {(per * RECIPE_VALUES + fixed) / 1e9:8.3f} GB")
        else:
            print(f"  {key:24} {per * 1e9:8.1f} ns per value    -> {per * RECIPE_VALUES + fixed:8.1f} s")


if __name__ == "__main__":
    main()
