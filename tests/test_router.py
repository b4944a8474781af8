"""The real `sglang-router` (PyPI, a Rust binary) in front of built-in servers.

The rollout client sends `/generate` through the router and every control call to each worker,
which it lists from the router (`GET /workers`) when it has only the router's URL: this checks
that path against the real router, not only a stand-in.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from dist_harness import free_port
from server_helpers import http

pytest.importorskip("sglang_router")


@pytest.fixture(scope="module")
def cluster(tiny_hf_dir, tmp_path_factory):
    from megatron_bapo.server.launch import start_server

    with ThreadPoolExecutor(2) as pool:
        workers = list(pool.map(lambda _: start_server(tiny_hf_dir, extra_args=["--num-threads", "1"]), range(2)))
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                             str(port), "--prometheus-port", str(free_port()),  # not the shared default 29000
                             "--worker-urls", *[w.url for w in workers], "--policy", "round_robin",
                             "--log-level", "warn"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    router = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                urllib.request.urlopen(router + "/health", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.2)
        yield router, workers
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for w in workers:
            w.stop()


@pytest.mark.slow
def test_generation_through_the_router_control_calls_to_each_worker(cluster, tiny_hf_dir, tmp_path):
    from megatron_bapo.rollout import (PartialRolloutConfig, PartialRolloutManager, Prompt, RolloutClient,
                                       RolloutClientConfig, SamplingConfig)
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    router, workers = cluster
    other = make_tiny_hf_checkpoint(tmp_path / "other", seed=3)
    with RolloutClient(RolloutClientConfig(router_url=router)) as client:
        assert sorted(client.worker_urls()) == sorted(w.url for w in workers)  # listed from the router
        client.wait_healthy(timeout_s=60)
        client.update_weights_from_disk(str(other), 7)  # sent to each worker, not through the router
        for w in workers:
            assert http(w.url + "/get_model_info", method="GET")[1]["weight_version"] == "7"
        client.pause_generation("retract")
        client.continue_generation()
        client.flush_cache()
        manager = PartialRolloutManager(client, PartialRolloutConfig(group_size=3, max_response_tokens=6, segment_tokens=3,
                                                                     sampling=SamplingConfig(ignore_eos=True)), seed=1)
        groups = []
        for step in range(3):
            groups += manager.step([Prompt(prompt_ids=[5 + i, 6, 7], index=i) for i in range(4)] if step == 0 else [], 7).groups
        assert sorted(g.prompt.index for g in groups) == [0, 1, 2, 3]
        for s in (s for g in groups for s in g.samples):
            assert len(s.response_ids) == 6 and s.response_versions == [7] * 6 and s.num_segments == 2
        assert client.stats["num_requests"] == 4 * 3 * 2
