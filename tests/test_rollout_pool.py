"""The server pool owns its servers' life and what they serve: a restarted server is given the version
the others serve, or the restart is an error naming the version and the path; never the base model
passing for a later version (its tokens would be labelled stale and regenerated forever). Updates
(pause, session, flush, version) go through the pool too."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from megatron_bapo.config import RolloutConfig
from megatron_bapo.rollout.config import RolloutClientConfig
from megatron_bapo.rollout.errors import RolloutError
from megatron_bapo.rollout.pool import ServedWeights, ServerPool
from megatron_bapo.sync.config import SyncConfig


def _kill(pool: ServerPool) -> None:
    os.kill(pool.servers[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while pool.servers[0].alive() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.slow
def test_restarted_server_that_cannot_be_given_the_current_version_is_an_error(tiny_hf_dir, tmp_path):
    rollout = RolloutConfig(client=RolloutClientConfig(health_timeout_s=120))
    pool = ServerPool(rollout, model_path=str(tiny_hf_dir), seed=0, log_dir=tmp_path / "logs",
                      state_path=tmp_path / "servers.json")
    pool.start()
    try:
        url = pool.servers[0].url
        # Disk sync at version 3 whose directory is gone (as pruning by name used to do after a resume).
        pool.served = ServedWeights(3, str(tmp_path / "hf_sync" / "v000003"))
        _kill(pool)
        with pytest.raises(RolloutError) as err:
            pool.ensure_alive()
        assert f"built-in server(s) {url} restarted, but version 3's weights {tmp_path}/hf_sync/v000003 are gone" \
            in str(err.value) and "--resume" in str(err.value)
        # Distributed sync: no copy of version 3 exists outside a sync.
        pool.served = ServedWeights(3, None)
        _kill(pool)
        with pytest.raises(RolloutError, match="version 3 exists on no disk .* sync.method=disk"):
            pool.ensure_alive()
        assert pool.restarts == [2] and pool.client.get_weight_version() == 0  # the restarted one: base model
    finally:
        pool.close()


@pytest.mark.slow
def test_a_server_dying_right_after_the_liveness_check_is_restarted_by_the_update(tiny_hf_dir, tmp_path):
    """The update looks (`ensure_alive`), then asks every server for its flags; a server killed in
    between (seen in CI: the run stopped on `server_info failed`) is restarted there too."""
    rollout = RolloutConfig(client=RolloutClientConfig(health_timeout_s=120, max_retries=1, backoff_s=0.1))
    pool = ServerPool(rollout, SyncConfig(method="disk"), model_path=str(tiny_hf_dir), seed=0, log_dir=tmp_path / "logs",
                      state_path=tmp_path / "servers.json")
    pool.start()
    looked = pool.ensure_alive

    def look_then_die(**kwargs):
        restarted = looked(**kwargs)
        if pool.restarts == [0]:  # the first look only: the server dies just after it
            _kill(pool)
        return restarted

    pool.ensure_alive = look_then_die
    try:
        with pool.update(1):
            pass
        assert pool.restarts == [1] and pool.servers[0].alive()
        assert pool.client.get_weight_version() == 0  # nothing newer existed to give it
    finally:
        pool.close()


def test_sync_fields_reach_the_weight_group(tiny_hf_dir, tmp_path):
    """`sync.master_port` is the port rank 0 binds (a taken one fails naming it) and
    `sync.group_timeout_s` the timeout the group and its HTTP calls run under; both through the
    pool, which builds the group from the config."""
    import socket

    rollout = RolloutConfig(client=RolloutClientConfig(health_timeout_s=120))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        pool = ServerPool(rollout, SyncConfig(method="distributed", backend="gloo", master_port=port, group_timeout_s=45),
                          model_path=str(tiny_hf_dir), seed=0, log_dir=tmp_path / "logs",
                          state_path=tmp_path / "servers.json")
        pool.start()
        try:
            with pytest.raises(RolloutError, match=f"cannot listen on 127.0.0.1:{port}"):
                with pool.update(1):
                    pass
            assert pool.version == 0  # a failed update changes nothing the pool reports
            pool.sync = SyncConfig(method="distributed", backend="gloo", group_timeout_s=45)
            with pool.update(1):
                pass
            assert pool._sender.timeout_s == 45 and pool._sender.master_port > 0 and pool.version == 1
        finally:
            pool.close()


def test_builtin_server_fields_reach_the_servers(tiny_hf_dir, tmp_path):
    """`rollout.builtin_server_decode_delay_ms` (a slow server on a CPU) reaches the built-in servers
    the pool starts, as `--decode-delay-ms`; their `/server_info` reports it."""
    rollout = RolloutConfig(builtin_server_decode_delay_ms=3.5, client=RolloutClientConfig(health_timeout_s=120))
    pool = ServerPool(rollout, model_path=str(tiny_hf_dir), seed=0, log_dir=tmp_path / "logs",
                      state_path=tmp_path / "servers.json")
    pool.start()
    try:
        infos = pool.client.run(pool.client.aget_server_info())
        assert [info["decode_delay_ms"] for info in infos.values()] == [3.5]
    finally:
        pool.close()


@pytest.mark.slow
def test_a_request_on_a_dead_server_fails_at_once_and_the_pool_restarts_it(tiny_hf_dir, tmp_path, caplog):
    """CI: a server SIGKILLed as the next round began stalled the run ~6 minutes: each request retried
    the dead URL with backoff while holding its concurrency slot, so the round failed (and the pool
    could restart the server) only after requests / concurrency x the whole backoff. Now the first
    failure on a dead process, with no other server healthy, ends the request with the exit code."""
    caplog.set_level(logging.DEBUG, logger="megatron_bapo.rollout.concurrency")
    rollout = RolloutConfig(client=RolloutClientConfig(health_timeout_s=120, max_retries=5, backoff_s=0.5))
    pool = ServerPool(rollout, model_path=str(tiny_hf_dir), seed=0, log_dir=tmp_path / "logs",
                      state_path=tmp_path / "servers.json")
    pool.start()
    try:
        url = pool.servers[0].url
        _kill(pool)
        with pytest.raises(RolloutError) as err:
            pool.client.generate([1, 2, 3], {"max_new_tokens": 2})
        assert f"/generate on {url} failed: its server process died (exit code -9)" in str(err.value)
        assert pool.client.stats["num_retries"] == 0
        # Control calls are not retried on a dead process either (each took ~14 s of backoff before).
        with pytest.raises(RolloutError, match=f"{url}/flush_cache failed: its server process died .exit code -9."):
            pool.client.flush_cache()
        # Nor the /server_info the request sized its concurrency by first (a client used alone).
        assert any("cannot size the concurrency" in r.getMessage() and "server process died" in r.getMessage()
                   for r in caplog.records)
        assert pool.retry_after_restart(lambda: pool.client.generate([1, 2, 3], {"max_new_tokens": 2}))
        assert pool.restarts == [1] and pool.servers[0].alive()
    finally:
        pool.close()
