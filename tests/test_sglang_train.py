"""The trainer on real SGLang servers it starts itself (`rollout.engine: sglang`), through the CLI.

One run as a user runs it: the server pool launches SGLang 0.5.23 on CPU (`.venv-sglang`), rollout
runs a step ahead with partial rollout, every update is a gloo distributed sync under the retract
pause (requests keep running across it, on the new weights), evaluation samples through the same
servers, and the SGLang server is gone when the run ends. The server behaviours one by one are
`tests/test_server_contract.py`; this is them together, under the trainer.
"""

from __future__ import annotations

import json

import pytest

from contract_helpers import SGLANG_PYTHON
from run_helpers import finish, last_line, pid_alive, run_config, start_train, write_assets

pytestmark = pytest.mark.slow


def test_the_trainer_trains_on_sglang_servers_it_starts(tmp_path, tiny_hf_dir):
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run bash tools/install.sh --with-sglang (tools/run_tests.sh does)")
    assets = (write_assets(tmp_path), tiny_hf_dir)
    out = tmp_path / "run"
    # The driver in its own process, as the recipes run it: the weight buckets go from the trainer through
    # the driver process's pool into SGLang's weight group.
    config = run_config(assets, out, async_steps=1, driver_process=True, sections={
        "rollout": {"engine": "sglang", "deterministic_inference": False, "group_size": 4, "prompts_per_step": 3,
                    "max_response_tokens": 6, "segment_tokens": 3, "max_staleness": 3,
                    "client": {"health_timeout_s": 300}},
        "sync": {"method": "distributed", "backend": "gloo", "pause_mode": "retract", "group_timeout_s": 120}})
    proc = start_train(config, assets)
    log = finish(proc, timeout=600)
    assert proc.returncode == 0, log[-4000:]
    done = last_line(log)
    assert done.startswith("done: steps 1-3") and "0 of 3 steps updated" not in done, done
    servers = json.loads((out / "servers.json").read_text())
    server_log = (out / "logs" / "server_0.log").read_text()
    assert len(servers) == 1 and "sglang" in server_log  # SGLang's own log line for the weight group:
    assert "init custom process group: master_address=127.0.0.1" in server_log and "backend=gloo" in server_log
    assert not pid_alive(servers[0]["pid"])  # stopped with the run
    assert server_log.count("POST /update_weights_from_distributed HTTP/1.1\" 200") >= 1, server_log[-3000:]
    metrics = [json.loads(line) for line in (out / "tb" / "metrics.jsonl").read_text().splitlines()]
    assert any(key.startswith("eval/t/") for record in metrics for key in record)
