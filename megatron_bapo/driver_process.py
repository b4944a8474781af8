"""The rollout driver in a process of its own on rank 0's node (`trainer.driver_process: true`).

Why: with the driver inside rank 0's training process, its rollout client thread (HTTP, the reply
JSON of every round: 1-2 GB of log-probs at 32B and 64k tokens, the partial-rollout buffer) competes
with rank 0's kernel launches, and every collective waits for rank 0. Here the whole `Driver` (the
server pool, the client, data, rewards, the ledger, evaluation, TensorBoard) runs in a spawned child
process; rank 0 keeps only a `DriverProcess`, which answers the trainer's calls by asking the child:

    driver = DriverProcess(config, output_dir)
    driver.start(state, ...)                  # spawns the child, which builds and starts the Driver
    driver.ship_to(spec, everyone)            # once the actor exists: the batch spec, every rank's coordinates
    shipment, metrics = driver.next_batch(step, version)   # each rank's slice, cut in the child
    with driver.weight_update(version) as sink:            # the child's pool pauses, opens the session ...
        export.run(version, sink)                          # ... and sends what rank 0 hands over
    driver.close()

The child also prepares the batch (`actor.scatter.ship`: loss mask, aggregation weights, the
micro-batch plan, every rank's slice serialised), so rank 0 only sends each rank its bytes.

The wire: one duplex `torch.multiprocessing` pipe, one call at a time, `(method, args, kwargs,
logged)` -> `("ok", result, seconds)` or `("error", exception, seconds)`; `logged` carries the
metrics `log` was given since the previous call (no round trip of their own). Tensors cross it in shared memory
(CUDA tensors as IPC handles), so a weight bucket is not copied: the child's weight sender
broadcasts rank 0's gathered tensors to the servers itself; the pool stays the one owner of the
servers. A checkpoint's rollout state does not cross it either: the child writes the buffers' token
ids, log-probs and versions into the checkpoint directory as flat arrays and reads them back at
resume (`rollout.state_tokens`); the pipe carries the small tree that refers to them. The child's
log records come back over a queue and go through rank 0's own loggers (the log file, the console
lines, above the progress bar). `begin_stop` (the SIGTERM handler) signals
the child instead of writing to the pipe, which a call may be using: the child's call in progress
is interrupted as rank 0's own would be, and each later call to a server is one short attempt.
The child dies with rank 0 (PR_SET_PDEATHSIG), and its built-in servers with it (`parent_watch`).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import logging
import logging.handlers
import os
import pickle
import signal
import threading
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Iterator, Optional

from megatron_bapo.logs import CONSOLE
from megatron_bapo.packed_tensors import Packed

logger = logging.getLogger(__name__)

STOP_WAIT_S = 30.0
"""How long `close` waits for the child's call in progress, then for the child to close the servers."""
STACKS_FILE = "driver_stacks.txt"
"""Under the run's logs/: where a driver process that stopped answering writes its threads' stacks
(empty otherwise)."""


class DriverProcessError(RuntimeError):
    """The driver process died, or raised something that cannot cross the pipe (named by type and message)."""


class DriverStopped(BaseException):
    """Raised in the child by SIGTERM inside a call, as `Terminated` is in the trainer's process."""


class DriverProcess:
    """Rank 0's handle on the `Driver` in its own process: the `Driver`'s calls, answered by the child."""

    leads = True

    def __init__(self, config: Any, output_dir: Path) -> None:
        self.config, self.output_dir = config, Path(output_dir)
        self._proc: Any = None
        self._conn: Any = None
        self._logs: Any = None
        self._log_thread: Optional[threading.Thread] = None
        self._pending = False  # a request whose reply was not read (a call interrupted by SIGTERM)
        self._overhead = 0.0  # rank 0's seconds in calls beyond the child's own time, since the last next_batch
        self._outbox: list[tuple[int, dict[str, float]]] = []  # metrics `log` leaves for the next call to carry
        self._lock = threading.Lock()
        self._closed = False
        self._shielded = 0  # > 0 while a message is being written to or read off the pipe
        self._deferred: Optional[BaseException] = None  # SIGTERM's exception, raised when that ends

    # ------------------------------------------------------------------ the process
    def _spawn(self) -> None:
        import torch
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")  # fork after CUDA or gloo threads exist is unsafe
        self._logs = ctx.Queue()
        self._log_thread = threading.Thread(target=_forward_logs, args=(self._logs,), name="driver-logs", daemon=True)
        self._log_thread.start()
        self._conn, child = ctx.Pipe(duplex=True)
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        level = logging.getLogger().getEffectiveLevel()
        self._proc = ctx.Process(target=_serve, name="bapo-driver", daemon=False,
                                 args=(child, self._logs, level, self.config, self.output_dir, device))
        self._proc.start()
        child.close()
        logger.info("driver process %d started (servers, client, rewards, eval, metrics)", self._proc.pid)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The child's result; the seconds rank 0 spent beyond the child's own time (transfer and
        pickling) add up in `_overhead`."""
        with self._lock:
            self._drain()
            started = time.monotonic()
            self._pending = True  # before sending: a SIGTERM right after the send must not lose its reply
            try:
                with self._shield():
                    self._conn.send((method, args, kwargs, self._outbox))
                self._outbox = []
            except OSError as exc:  # a broken pipe: the child is gone
                self._proc.join(5)
                raise DriverProcessError(self._gone(f"could not be asked to {method} ({exc})")) from None
            kind, value, seconds = self._receive(None)
        self._overhead += max(time.monotonic() - started - seconds, 0.0)
        if isinstance(value, DriverStopped):  # the child alone got SIGTERM (rank 0's own would have ended the call)
            raise DriverProcessError(f"the driver process was stopped by a signal during {method}; rerun with --resume")
        if kind == "error":
            raise value
        return value

    def _receive(self, timeout: Optional[float]) -> tuple[str, Any, float]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(1.0):  # wake every second to notice a dead child
            if not self._proc.is_alive():
                raise DriverProcessError(self._gone("died"))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the driver process gave no answer within {timeout:.0f} s")
        with self._shield():  # a reply is read whole and marked read, or not at all
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):  # EOF, or ECONNRESET when the child died with bytes unread on its side
                self._proc.join(5)
                raise DriverProcessError(self._gone("closed the pipe")) from None
            self._pending = False
        return ForkingPickler.loads(data)  # shared tensors' handles are fetched here: may be interrupted

    @contextlib.contextmanager
    def _shield(self) -> Iterator[None]:
        """SIGTERM's exception waits until a message is whole on the pipe (or off it). CI saw the
        exception land while rank 0 unpickled a reply: the reply was consumed but still counted as
        pending, so `close` waited 30 s for one that never came."""
        self._shielded += 1
        try:
            yield
        finally:
            self._shielded -= 1
            if not self._shielded and self._deferred is not None:
                exc, self._deferred = self._deferred, None
                raise exc

    def defer(self, exc: BaseException) -> bool:
        """From the SIGTERM handler: True if `exc` is held until the pipe is between messages (the
        handler then returns), False if the handler should raise it now."""
        if self._shielded:
            self._deferred = exc
            return True
        return False

    def _dump_stacks(self) -> str:
        """Ask a child that stopped answering for every thread's stack (faulthandler, which answers
        from its C signal handler even while Python code is stuck), to say where it hung."""
        path = self.output_dir / "logs" / STACKS_FILE
        if not self._proc.is_alive():
            return ""
        before = path.stat().st_size if path.exists() else 0
        with contextlib.suppress(ProcessLookupError):
            os.kill(self._proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and (path.stat().st_size if path.exists() else 0) == before:
            time.sleep(0.05)
        time.sleep(0.2)  # the rest of the threads
        return f"; where each of its threads was: {path}" if path.exists() and path.stat().st_size > before else ""

    def _gone(self, what: str) -> str:
        return (f"the driver process {self._proc.pid} {what} (exit code {self._proc.exitcode}); its servers exit with "
                f"it; its last lines are in {self.output_dir / 'logs' / 'train.log'}; rerun with --resume")

    def _drain(self) -> None:
        """Read the reply of a call SIGTERM interrupted (the child was told to stop it)."""
        if self._pending:
            self._receive(STOP_WAIT_S)

    # ------------------------------------------------------------------ the Driver's calls
    def start(self, state: dict[str, Any], **kwargs: Any) -> None:
        self._spawn()
        self._call("start", state, **kwargs)

    def servers_hold_other_weights(self, version: int) -> bool:
        return self._call("servers_hold_other_weights", version)

    def ship_to(self, spec: Any, everyone: list[Any]) -> None:
        """The actor's batch spec and every rank's coordinates: the child cuts each step's slices for them."""
        self._call("ship_to", spec, everyone)

    def start_rollout(self) -> None:
        self._call("start_rollout")

    def next_batch(self, step: int, version: int) -> tuple[Any, dict[str, float]]:
        """(`actor.scatter.Shipment` or None, metrics). `timing/driver_rank0_s`: what the driver cost rank
        0's process since the previous step's batch, beyond the child's own time: the pipe, pickling,
        the shipment and the weight buckets handed over (the work itself runs in the child)."""
        packed, metrics = self._call("next_batch", step, version)
        metrics["timing/driver_rank0_s"], self._overhead = self._overhead, 0.0
        if packed is None:
            return None, metrics
        from megatron_bapo.actor.scatter import Shipment

        own, *payloads = packed.tensors()
        return Shipment(coords=packed.extra, own=own, payloads=payloads), metrics

    @contextlib.contextmanager
    def weight_update(self, version: int, probe: Any = None) -> Iterator["RemoteSink"]:
        self._call("update_begin", version, probe)
        try:
            yield RemoteSink(self)
        except BaseException as exc:
            with contextlib.suppress(Exception):  # the export's error is the one to report
                self._call("update_end", f"{type(exc).__name__}: {exc}")
            raise
        self._call("update_end", None)

    def evaluate(self, step: int) -> dict[str, float]:
        return self._call("evaluate", step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Carried by the next call (the child writes them before it), not a round trip of its own."""
        self._outbox.append((step, metrics))

    def state_dict(self, step: int, version: int, ckpt_dir: Optional[Path] = None, *,
                   wait: bool = True) -> dict[str, Any]:
        """The child writes the buffers' token lists into the checkpoint itself (`rollout.state_tokens`):
        only the small tree crosses the pipe, as at `start` when resuming. `wait=False`: on its thread
        (`Driver.state_dict`); `state_files` waits for it."""
        return self._call("state_dict", step, version, ckpt_dir, wait=wait)

    def state_files(self) -> dict[str, tuple[int, str]]:
        """`Driver.state_files`, answered by the child (the same answer when asked again); a SIGTERM
        to the child does not interrupt it."""
        return self._call("state_files")

    def begin_stop(self) -> None:
        """From the SIGTERM handler: the child stops its call in progress and makes each later call short."""
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._proc.pid, signal.SIGTERM)

    def close(self) -> None:
        """The child stops producing, leaves the weight group, stops the servers and exits."""
        if self._closed or self._proc is None:
            return
        self._closed = True
        try:
            if self._proc.is_alive():
                self._drain()
                with self._lock:
                    self._conn.send(("close", (), {}, self._outbox))
                    self._receive(STOP_WAIT_S)
        except Exception as exc:  # noqa: BLE001 - the teardown goes on: the child is stopped below
            logger.warning("the driver process did not close cleanly: %s%s", exc, self._dump_stacks())
            self._proc.kill()  # its SIGTERM handler only interrupts calls: a child stuck in close needs SIGKILL
        finally:
            self._proc.join(STOP_WAIT_S)
            if self._proc.is_alive():
                logger.warning("the driver process %d did not exit: killing it (its servers exit with it)",
                               self._proc.pid)
                self._proc.kill()
                self._proc.join()
            self._conn.close()
            self._logs.put(None)
            self._log_thread.join(5)


class RemoteSink:
    """The export's sink on rank 0 (`sync.export.Sink`): hands each bucket to the child's update session."""

    def __init__(self, driver: DriverProcess) -> None:
        self.driver = driver

    def load_from_disk(self, path: Path, version: int) -> None:
        self.driver._call("sink_load", path, version)

    def send(self, bucket: list, *, last: bool) -> int:
        names, tensors = [n for n, _ in bucket], [t for _, t in bucket]
        if all(t.device.type == "cpu" for t in tensors):  # one shared-memory buffer, not one per tensor
            return self.driver._call("sink_send", Packed.of(tensors, names), last)
        return self.driver._call("sink_send", bucket, last)  # CUDA: one IPC handle per tensor, no copy


# ---------------------------------------------------------------------- rank 0's log side
def _forward_logs(queue: Any) -> None:
    """Each record the child logged goes through rank 0's logger of the same name (file, console, bar)."""
    while True:
        record = queue.get()
        if record is None:
            return
        logging.getLogger(record.name).handle(record)


# ---------------------------------------------------------------------- the child
class _Child:
    """The `Driver` and the calls the pipe carries to it (one at a time, on the main thread)."""

    def __init__(self, config: Any, output_dir: Path) -> None:
        from megatron_bapo.driver import Driver

        self.driver = Driver(config, output_dir)
        self.spec: Any = None
        self.everyone: list[Any] = []
        self._update: Any = None
        self._session: Any = None
        self.busy = False
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.driver.close()

    def ship_to(self, spec: Any, everyone: list[Any]) -> None:
        self.spec, self.everyone = spec, list(everyone)

    def next_batch(self, step: int, version: int) -> tuple[Any, dict[str, float]]:
        from megatron_bapo.actor.scatter import ship

        batch, metrics = self.driver.next_batch(step, version)
        if batch is None:
            return None, metrics
        if self.spec is None:
            raise RuntimeError("next_batch before ship_to: the driver process does not know the ranks' coordinates")
        t0 = time.monotonic()
        shipment = ship(batch, self.spec, self.everyone, current_version=version)
        metrics["timing/batch_prepare_s"] = time.monotonic() - t0
        return Packed.of([shipment.own, *shipment.payloads], shipment.coords), metrics

    def update_begin(self, version: int, probe: Any = None) -> None:
        self._update = self.driver.weight_update(version, probe)
        self._session = self._update.__enter__()

    def sink_send(self, bucket: Any, last: bool) -> int:
        if isinstance(bucket, Packed):
            bucket = list(zip(bucket.extra, bucket.tensors()))
        return self._session.send(bucket, last=last)

    def sink_load(self, path: Path, version: int) -> None:
        self._session.load_from_disk(path, version)

    def update_end(self, error: Optional[str]) -> None:
        update, self._update, self._session = self._update, None, None
        if error is None:
            update.__exit__(None, None, None)
        else:  # rank 0's export failed: the pool's update ends as it would around a failing export
            exc = RuntimeError(f"the export on rank 0 failed: {error}")
            update.__exit__(RuntimeError, exc, None)

    def on_term(self, signum: int, frame: Any) -> None:
        self.driver.begin_stop()
        if self.busy:
            raise DriverStopped(f"signal {signum}")

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        target = getattr(self, method, None) if method in _OWN_CALLS else getattr(self.driver, method)
        # SIGTERM stops a call in progress, but not the wait for a checkpoint's token file: the
        # trainer's exit path asks for it to complete that checkpoint before the job ends.
        self.busy = method not in _UNINTERRUPTED
        try:
            return target(*args, **kwargs)
        finally:
            self.busy = False


_OWN_CALLS = frozenset({"ship_to", "next_batch", "update_begin", "sink_send", "sink_load", "update_end"})
_DRIVER_CALLS = frozenset({"start", "servers_hold_other_weights", "start_rollout", "evaluate", "state_dict",
                           "state_files"})
_UNINTERRUPTED = frozenset({"state_files"})


def _serve(conn: Any, logs: Any, level: int, config: Any, output_dir: Path, device: Optional[int]) -> None:
    """The child's main: answer rank 0's calls until it says close (or is gone), then close the Driver."""
    _die_with_parent()
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(logs)]
    root.setLevel(level)
    logging.getLogger(CONSOLE).setLevel(logging.INFO)  # the console lines' own level, as `logs.configure` sets it
    logging.captureWarnings(True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    (Path(output_dir) / "logs").mkdir(parents=True, exist_ok=True)
    stacks_path = Path(output_dir) / "logs" / STACKS_FILE
    stacks = stacks_path.open("a")  # written only if rank 0 asks (`_dump_stacks`)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if device is not None:
        import torch

        torch.cuda.set_device(device)  # the weight sender's NCCL group and CUDA IPC handles of rank 0's device
    child = _Child(config, output_dir)
    signal.signal(signal.SIGTERM, child.on_term)
    try:
        while True:
            try:
                method, args, kwargs, logged = conn.recv()
            except (EOFError, OSError):
                logger.warning("rank 0 is gone: the driver process closes the servers and exits")
                return
            if method == "close":
                for step, metrics in logged:
                    child.driver.log(step, metrics)
                child.close()
                conn.send(("ok", None, 0.0))
                return
            started = time.monotonic()
            try:
                if method not in _OWN_CALLS | _DRIVER_CALLS:
                    raise DriverProcessError(f"the driver process has no call {method!r}")
                for step, metrics in logged:  # the metrics rank 0 logged since its last call
                    child.driver.log(step, metrics)
                reply = ("ok", child.call(method, args, kwargs), time.monotonic() - started)
            except BaseException as exc:  # noqa: BLE001 - every error goes back to rank 0, which raises it
                logger.info("driver process: %s raised", method, exc_info=True)  # the traceback: train.log
                reply = ("error", _portable(exc), time.monotonic() - started)
            conn.send(reply)
    finally:
        try:
            child.close()
        finally:
            faulthandler.unregister(signal.SIGUSR1)
            stacks.close()
            with contextlib.suppress(OSError):  # an output directory removed under a closing child
                if stacks_path.stat().st_size == 0:  # nobody asked: no empty file left in every run's logs/
                    stacks_path.unlink()


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling (ConfigError, RolloutError ... keep their type: the CLI's exit
    codes and one-line messages depend on it), else a DriverProcessError naming it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - an exception class with a custom __init__
        return DriverProcessError(f"{type(exc).__name__}: {exc}")


def _die_with_parent() -> None:
    """SIGTERM when rank 0's process dies (Linux), so a killed trainer leaves no driver behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed pipe ends the child instead
        pass
