"""Weight sync end to end against the built-in server: after a distributed (gloo) or disk sync, the
server's log-probs equal the trainer's; the NCCL path runs the same check on a GPU."""

from __future__ import annotations

import contextlib
import json
import urllib.request

import pytest
import torch

pytest.importorskip("megatron.core")

from dist_harness import free_port  # noqa: E402

IDS = [5, 17, 33, 2, 41, 9, 60, 12, 7, 25, 3, 44]


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _server_logprobs(url: str) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 as the server computes them."""
    out = _post(url, "/generate", {"input_ids": IDS, "return_logprob": True, "logprob_start_len": 0,
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    entries = out["meta_info"]["input_token_logprobs"]
    return torch.tensor([e[0] for e in entries[1:]], dtype=torch.float64)


def _version(url: str) -> str:
    with urllib.request.urlopen(url + "/model_info", timeout=30) as resp:
        return json.loads(resp.read())["weight_version"]


def _train_side(rank, world_size, hf_dir, url, method, sync_port, tmp):
    """Actor (TP = world_size) from the HF checkpoint, weights perturbed, then synced as version 5."""
    from transformers import AutoConfig

    from pathlib import Path

    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.config import RolloutConfig
    from megatron_bapo.convert import load_hf_into_model
    from megatron_bapo.models.parallel import ParallelConfig
    from megatron_bapo.rollout import RolloutClientConfig
    from megatron_bapo.rollout.pool import ServerPool
    from megatron_bapo.sync import SyncConfig
    from megatron_bapo.sync.export import NullSink, make_export

    hf_config = AutoConfig.from_pretrained(hf_dir)
    actor = Actor(ActorConfig(parallel=ParallelConfig(tp=world_size), vocab_divisible_by=64), hf_config)
    load_hf_into_model(actor.model, hf_dir, hf_config=hf_config)
    g = torch.Generator().manual_seed(100)  # same on every TP rank: replicated norms stay identical
    with torch.no_grad():
        for p in actor.model[0].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    ids = torch.tensor([IDS])
    lp = actor.compute_logprobs({"input_ids": ids, "attention_mask": torch.ones_like(ids)})[0, 1:].double()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    cfg = SyncConfig(method=method, backend=backend, master_address="127.0.0.1", master_port=sync_port,
                     bucket_bytes=64 * 1024, group_timeout_s=120)  # small buckets: several update calls per sync
    export = make_export(cfg, actor, hf_config, Path(tmp).parent, tokenizer_src=hf_dir)
    pool = None
    if rank == 0:  # rank 0 delivers to the servers; the others only take part in the gathers
        pool = ServerPool(RolloutConfig(client=RolloutClientConfig(urls=[url])), cfg, model_path=hf_dir, seed=0,
                          log_dir=Path(tmp).parent / "logs", state_path=Path(tmp).parent / "servers.json")
        pool.start()
    sent = 0
    for version in (5, 6):  # a second sync reuses the group
        with (pool.update(version) if pool is not None else contextlib.nullcontext(NullSink())) as sink:
            sent = export.run(version, sink) or 0
    if pool is not None:
        assert pool.version == 6
        pool.close()
    return {"lp": lp, "sent": sent}


@pytest.mark.parametrize("method, world_size", [pytest.param("distributed", 2, marks=pytest.mark.slow),
                                                 pytest.param("disk", 1, marks=pytest.mark.slow)])
def test_sync_makes_server_logprobs_equal_the_trainer(run_dist, tiny_hf_dir, tmp_path, method, world_size):
    from megatron_bapo.server.launch import start_server

    with start_server(tiny_hf_dir, log_path=tmp_path / "server.log") as server:
        before = _server_logprobs(server.url)
        res = run_dist(_train_side, world_size, str(tiny_hf_dir), server.url, method, 0,
                       str(tmp_path / "hf_sync"), timeout=240)
        trainer = res[0]["lp"]
        assert (before - trainer).abs().max() > 1e-3  # the perturbation is visible: the check can fail
        after = _server_logprobs(server.url)
        torch.testing.assert_close(after, trainer, atol=2e-5, rtol=0)
        assert _version(server.url) == "6"
    if method == "distributed":
        assert res[0]["sent"] > 0 and all(r["sent"] == 0 for r in res[1:])  # only rank 0 sends
    else:
        assert sorted(p.name for p in (tmp_path / "hf_sync").iterdir()) == ["v000005", "v000006"]


def _start_sglang(model_dir: str, port: int, log_path):
    """A real SGLang server on GPU 1 (NCCL cannot put two ranks of one group on the same GPU)."""
    import os
    import subprocess
    import sys
    import time

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1")
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--port",
                             str(port), "--host", "127.0.0.1", "--mem-fraction-static", "0.3"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log_path).read()[-3000:]
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            return proc, url
        except OSError:
            time.sleep(2)
    proc.terminate()
    raise TimeoutError(f"SGLang did not become healthy; see {log_path}")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL sync needs 2 GPUs (trainer on GPU 0, SGLang on GPU 1)")
def test_nccl_sync_to_sglang_makes_logprobs_equal(run_dist, tiny_hf_dir, tmp_path):
    """The NCCL path against a real SGLang server (needs sglang installed and two GPUs)."""
    pytest.importorskip("sglang")
    proc, url = _start_sglang(str(tiny_hf_dir), free_port(), tmp_path / "sglang.log")
    try:
        res = run_dist(_train_side, 1, str(tiny_hf_dir), url, "distributed", 0,
                       str(tmp_path / "hf_sync"), timeout=600)
        torch.testing.assert_close(_server_logprobs(url), res[0]["lp"], atol=1e-3, rtol=0)
        assert _version(url) == "6"
    finally:
        proc.terminate()
        proc.wait(timeout=60)
