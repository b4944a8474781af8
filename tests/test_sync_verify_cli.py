"""`sync.verify` through the trainer, as a run configures it: the fields reach the check, the actor's
probe and the trainer's hashes cross the driver process, and a failed check either recovers (the
version sent again) or stops the run in one line. Two runs, side by side (each uses about one core)."""

from __future__ import annotations

import pytest

from run_helpers import finish_later, last_line, run_config, start_train, write_assets
from sglang_proxy import RecordingProxy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_hf_dir):
    """{"probe": (exit code, console, output dir), "checksum": (..., the /weights_checker replies seen)}."""
    from megatron_bapo.server.launch import start_server

    root = tmp_path_factory.mktemp("verify_cli")
    assets = (write_assets(root), tiny_hf_dir)
    # probe: a bfloat16 server (probe KL ~1e-7) and a threshold below it, 9 probe tokens, the driver process.
    probe_out = root / "probe"
    probe = start_train(run_config(assets, probe_out, driver_process=True, eval_at_start=False, sections={
        "rollout": {"builtin_server_dtype": "bfloat16"},
        "sync": {"verify": "probe", "probe_max_kl": 1e-9, "probe_tokens": 9}}), assets, "eval.every_n_steps=0")
    probe_log = finish_later(probe)
    # checksum: the distributed gloo sync to an external server whose first /weights_checker reply is wrong.
    seen = []

    def wrong_once(path, request, reply):
        if path == "/weights_checker":
            seen.append(reply)
            if len(seen) == 1:
                sums = reply["ranks"][0]["checksums"]
                sums["model.norm.weight"] = "0" * 16
        return reply

    server = start_server(tiny_hf_dir, log_path=root / "server.log")
    try:
        with RecordingProxy(server.url, rewrite=wrong_once) as proxy:
            sums_out = root / "checksum"
            sums = start_train(run_config(assets, sums_out, driver_process=True, eval_at_start=False, sections={
                "rollout": {"client": {"urls": [proxy.url], "health_timeout_s": 120}},
                "sync": {"method": "distributed", "backend": "gloo", "verify": "checksum", "group_timeout_s": 120}}),
                assets, "eval.every_n_steps=0")
            sums_log = finish_later(sums).result()
    finally:
        server.stop()
    probe_text = probe_log.result()
    yield {"probe": (probe.returncode, probe_text, probe_out), "checksum": (sums.returncode, sums_log, sums_out, seen,
                                                                            proxy.url)}


def test_the_probe_fields_reach_the_check_and_a_second_failure_stops_the_run(runs):
    """`sync.verify=probe` with `probe_max_kl` 1e-9 against a bfloat16 server: the same weights fail it
    (their rounding alone is above it; the default threshold for bfloat16, 1e-2, would pass), the pool
    restarts its server once with the version's weights, the check fails again, and the run stops in one
    line naming the server, the KL over `probe_tokens - 1` tokens, and the version."""
    code, log, out = runs["probe"]
    assert code == 2, log[-4000:]
    last = last_line(log)
    assert last.startswith("rollout error: built-in server http://127.0.0.1:") and \
        "does not serve weight version 1 after a restart with it: probe KL " in last, last
    assert "over 8 tokens > 1e-09 (sync.probe_max_kl)" in last and "Traceback" not in log, last
    train_log = (out / "logs" / "train.log").read_text()
    assert "failed the weight check of version 1; restarting it (1 of 3)" in train_log


def test_a_failed_checksum_under_the_distributed_sync_sends_the_version_again(runs):
    """`sync.verify=checksum`, distributed gloo sync, driver process: the trainer hashes every bucket as
    it goes out; the first check sees a wrong hash (the proxy), the server is external, so the pool asks
    for the version again (`ResendWeights`), every rank exports it again, the second check passes and
    the run trains to its end. Every later sync is checked once."""
    code, log, out, seen, url = runs["checksum"]
    assert code == 0, log[-4000:]
    assert last_line(log).startswith("done: steps 1-3"), last_line(log)
    train_log = (out / "logs" / "train.log").read_text()
    assert (f"server {url} failed the weight check of version 1: tensor model.norm.weight differs (" in train_log
            and "; 1 of 16 tensors differ (sync.verify=checksum)" in train_log), train_log[-3000:]
    passed = [ln for ln in train_log.splitlines() if "(sync.verify=checksum) passed on 1 server(s): 16 tensors" in ln]
    versions = [int(ln.split("weight check v")[1].split()[0]) for ln in passed]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= 2, passed  # one per sync
    assert len(seen) == len(versions) + 1  # version 1 twice
