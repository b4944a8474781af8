"""What crosses the driver process's pipe (`megatron_bapo.driver_process`): errors keep their type
where they can, so the CLI's one-line messages and exit codes are the inline driver's; the end-to-end
runs are in test_run_failures.py (the same seeded run as the inline driver, a wrong setting found in
the driver process), test_stop_and_disk.py (SIGTERM) and test_recipe.py (the 8-rank rehearsal)."""

from __future__ import annotations

import pickle

from megatron_bapo.config_io import ConfigError
from megatron_bapo.driver_process import DriverProcessError, _portable
from megatron_bapo.rollout.errors import RolloutError


class _TwoArgs(Exception):
    def __init__(self, url: str, status: int) -> None:
        super().__init__(f"{url} answered {status}")


def test_errors_that_pickle_keep_their_type_and_message():
    for exc in (ConfigError("data.path='x' does not exist"), RolloutError("every server failed")):
        back = pickle.loads(pickle.dumps(_portable(exc)))
        assert type(back) is type(exc) and str(back) == str(exc)


def test_an_error_that_cannot_cross_is_named_by_type_and_message():
    back = pickle.loads(pickle.dumps(_portable(_TwoArgs("http://h:1", 503))))
    assert isinstance(back, DriverProcessError) and str(back) == "_TwoArgs: http://h:1 answered 503"


def test_packed_tensors_cross_as_one_buffer_and_come_back_as_they_were():
    """A CPU weight bucket or a shipment crosses the pipe as one shared-memory buffer; every tensor
    comes back with its dtype, shape and values (aligned views, a non-contiguous one, an empty one)."""
    import torch

    from megatron_bapo.packed_tensors import Packed

    tensors = [torch.randn(3, 5), torch.arange(7), torch.zeros(0, dtype=torch.uint8),
               torch.tensor(3.5, dtype=torch.bfloat16), torch.randn(4, 2).to(torch.bfloat16).t()]
    packed = pickle.loads(pickle.dumps(Packed.of(tensors, ["a", "b", "c", "d", "e"])))
    assert packed.extra == ["a", "b", "c", "d", "e"] and packed.buffer.dim() == 1
    for want, got in zip(tensors, packed.tensors()):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
        assert got.untyped_storage().data_ptr() == packed.buffer.untyped_storage().data_ptr()  # views, no copy


def test_a_child_killed_with_unread_bytes_is_named_in_one_line(tmp_path):
    """A driver process killed while rank 0's last request sat unread in its pipe leaves rank 0 a
    connection reset, not an EOF (CI saw this once): it is the same one-line `DriverProcessError`."""
    import multiprocessing as mp

    import pytest

    from megatron_bapo.driver_process import DriverProcess

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=True)
    sent = ctx.Event()
    proc = ctx.Process(target=sent.wait)  # exits without reading what was sent to it
    proc.start()
    child.close()
    parent.send(("next_batch", (1, 0), {}, []))
    sent.set()
    proc.join(30)
    handle = DriverProcess(config=None, output_dir=tmp_path)
    handle._conn, handle._proc = parent, proc
    with pytest.raises(DriverProcessError, match=r"closed the pipe \(exit code 0\).*rerun with --resume"):
        handle._receive(None)


def _handle_on(tmp_path, target, *args):
    """Rank 0's handle on a forked stand-in child `target(conn, *args)`: (handle, child process)."""
    import multiprocessing as mp
    import queue
    import threading

    from megatron_bapo.driver_process import DriverProcess

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=target, args=(child, *args))
    proc.start()
    child.close()
    handle = DriverProcess(config=None, output_dir=tmp_path)
    handle._conn, handle._proc, handle._logs = parent, proc, queue.Queue()
    handle._log_thread = threading.Thread(target=handle._logs.get)
    handle._log_thread.start()
    return handle, proc


def _stuck_child(conn, stacks_path) -> None:
    """A driver process stuck in its close: it reads the request, then never answers or exits on SIGTERM."""
    import faulthandler
    import signal
    import time

    signal.signal(signal.SIGTERM, lambda *_: None)  # as the child's handler outside a call: no exit
    faulthandler.register(signal.SIGUSR1, file=open(stacks_path, "a"), all_threads=True)
    conn.recv()
    while True:
        time.sleep(1)


def test_a_child_stuck_in_close_says_where_and_is_killed(tmp_path, monkeypatch, caplog):
    """CI saw a driver process that neither answered `close` nor exited on SIGTERM (the run then took
    60 s to stop). `close` now asks it for every thread's stack (the file the warning names) and kills
    it after one wait, not two."""
    import logging

    from megatron_bapo import driver_process
    from megatron_bapo.driver_process import STACKS_FILE

    monkeypatch.setattr(driver_process, "STOP_WAIT_S", 1.0)
    (tmp_path / "logs").mkdir()
    handle, proc = _handle_on(tmp_path, _stuck_child, tmp_path / "logs" / STACKS_FILE)
    with caplog.at_level(logging.WARNING, logger="megatron_bapo.driver_process"):
        handle.close()
    assert not proc.is_alive() and proc.exitcode == -9
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("the driver process did not close cleanly: the driver process gave no answer within 1 s")
    assert warning.endswith(f"where each of its threads was: {tmp_path / 'logs' / STACKS_FILE}")
    assert "in _stuck_child" in (tmp_path / "logs" / STACKS_FILE).read_text()


class _Interrupted(BaseException):
    """What SIGTERM raises in rank 0 (`trainer.Terminated` is a BaseException too)."""


def _interrupt() -> None:
    raise _Interrupted("SIGTERM while the reply was unpickled")


class _InterruptsWhenLoaded:
    def __reduce__(self):
        return _interrupt, ()


def _answering_child(conn) -> None:
    """Answers the call with a reply whose unpickling is interrupted, then answers `close` and exits."""
    conn.recv()
    conn.send(("ok", _InterruptsWhenLoaded(), 0.0))
    method, *_ = conn.recv()
    conn.send(("ok", method, 0.0))


def test_a_reply_interrupted_while_unpickled_is_not_waited_for_again(tmp_path, monkeypatch, caplog):
    """CI: SIGTERM landed while rank 0 unpickled the driver process's reply (fetching a shared tensor's
    handle). The reply was off the pipe but still counted as pending, so `close` waited 30 s for a
    second one and then killed the child. A reply read off the pipe is no longer pending."""
    import logging

    import pytest

    from megatron_bapo import driver_process

    monkeypatch.setattr(driver_process, "STOP_WAIT_S", 5.0)
    handle, proc = _handle_on(tmp_path, _answering_child)
    with pytest.raises(_Interrupted):
        handle.next_batch(1, 0)
    with caplog.at_level(logging.WARNING, logger="megatron_bapo.driver_process"):
        handle.close()
    assert [r.getMessage() for r in caplog.records] == [] and proc.exitcode == 0


def test_sigterm_on_the_pipe_mid_message_is_raised_once_the_message_is_whole(tmp_path):
    """`defer`: the trainer's SIGTERM handler holds its exception while a message is on the pipe."""
    import pytest

    from megatron_bapo.driver_process import DriverProcess

    handle = DriverProcess(config=None, output_dir=tmp_path)
    assert handle.defer(_Interrupted("now")) is False  # between messages: the handler raises at once
    with pytest.raises(_Interrupted, match="held"):
        with handle._shield():
            assert handle.defer(_Interrupted("held")) is True
            reached = True  # the message's read goes on
    assert reached and handle._deferred is None
