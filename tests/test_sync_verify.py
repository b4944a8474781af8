"""`sync.verify` against the built-in server: what the trainer hashes equals what the server reports for
every sync path and actor layout, and what a failing server costs (one restart, then a one-line stop).

The same checks against live SGLang are in `tests/test_server_contract.py`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from contract_helpers import Served  # noqa: E402


def _syncs(rank, world_size, weights, url, tmp):
    """Actor (TP = world_size) holding `weights`; the pool on rank 0 syncs it to the server by disk
    (version 1) and by the distributed gloo sync (version 2) with `sync.verify=checksum`, then once more
    (version 3) with `sync.verify=probe`; each update's own check must pass. Rank 0 returns the hashes
    the trainer computed for each method."""
    from transformers import AutoConfig

    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.config import RolloutConfig
    from megatron_bapo.convert import load_hf_into_model
    from megatron_bapo.models.parallel import ParallelConfig
    from megatron_bapo.rollout import RolloutClientConfig
    from megatron_bapo.rollout.pool import ServerPool
    from megatron_bapo.sync import SyncConfig
    from megatron_bapo.sync.export import NullSink, make_export
    from megatron_bapo.sync.verify import actor_probe

    hf_config = AutoConfig.from_pretrained(weights)
    actor = Actor(ActorConfig(parallel=ParallelConfig(tp=world_size), vocab_divisible_by=64), hf_config)
    load_hf_into_model(actor.model, weights, hf_config=hf_config)
    probe = actor_probe(actor, hf_config.vocab_size, 16)
    out = {}
    for version, (method, verify) in enumerate((("disk", "checksum"), ("distributed", "checksum"),
                                                ("distributed", "probe")), start=1):
        cfg = SyncConfig(method=method, backend="gloo", bucket_bytes=64 * 1024, group_timeout_s=120, verify=verify)
        export = make_export(cfg, actor, hf_config, Path(tmp) / f"tp{world_size}", tokenizer_src=weights)
        pool = None
        if rank == 0:
            pool = ServerPool(RolloutConfig(client=RolloutClientConfig(urls=[url])), cfg, model_path=weights, seed=0,
                              log_dir=Path(tmp) / "logs", state_path=Path(tmp) / f"servers{world_size}.json")
            pool.start()
        try:
            if pool is None:
                export.run(version, NullSink())
                continue
            with pool.update(version, probe if verify == "probe" else None) as sink:
                export.run(version, sink)
            assert pool.version == version and pool.verifier.current is not None
            if verify == "checksum":
                (expected,) = pool.verifier.current["sums"].values()
                out[method] = {"sums": dict(expected.checksums), "bytes": expected.num_bytes}
            else:
                out["probe_summary"] = pool.verifier.summary
        finally:
            if pool is not None:
                pool.close()
    return out


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_trainers_hashes_equal_the_servers_for_disk_and_distributed_sync_at_tp1_and_tp2(
        run_dist, tiny_hf_dir, tmp_path, world_size):
    from megatron_bapo.server.launch import start_server
    from megatron_bapo.sync.verify import ExpectedChecksums
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    weights = make_tiny_hf_checkpoint(tmp_path / "weights", seed=3)  # not what the server starts with
    config = json.loads((weights / "config.json").read_text())
    files = ExpectedChecksums.of_directory(weights, config, torch.float32, "cpu").checksums
    with start_server(tiny_hf_dir, log_path=tmp_path / "server.log") as server:
        before = _checksums(server.url)
        out = run_dist(_syncs, world_size, str(weights), server.url, str(tmp_path / "run"), timeout=300)[0]
        served = _checksums(server.url)
    assert before != files  # the check could fail: the server started on other weights
    assert out["disk"]["sums"] == out["distributed"]["sums"] == files == served
    assert out["disk"]["bytes"] == out["distributed"]["bytes"] == sum(t.numel() * 4 for t in _tensors(weights))
    assert out["probe_summary"].startswith("probe KL max ") and out["probe_summary"].endswith("over 15 tokens")
    assert float(out["probe_summary"].split()[3]) < 1e-10


def _checksums(url: str) -> dict:
    import urllib.request

    req = urllib.request.Request(url + "/weights_checker", data=b'{"action": "checksum"}', method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["ranks"][0]["checksums"]


def _tensors(path: Path) -> list:
    from safetensors.torch import load_file

    return list(load_file(str(path / "model.safetensors")).values())


@pytest.fixture
def served(tiny_hf_dir, tmp_path):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    server = Served("builtin", tiny_hf_dir, make_tiny_hf_checkpoint(tmp_path / "b", seed=1), tmp_path / "logs")
    yield server
    server.close()


def _corrupt(src: Path, dst: Path) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj.weight"  # rows permuted: a wrong head order of a bad conversion
    weights[name] = weights[name][torch.randperm(weights[name].shape[0], generator=torch.Generator().manual_seed(0))]
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.slow
def test_a_server_that_fails_the_check_is_restarted_once_with_the_current_weights(served, tmp_path):
    """A corrupted copy on the server (the version's directory is right): the check fails, the pool
    restarts the server with the version's directory, the check passes, generation serves the version."""
    served.verify_with("probe")
    version = served.load(served.model_b, probe=served.probe(served.model_b))
    served.client.update_weights_from_disk(str(_corrupt(served.model_b, tmp_path / "bad")), version)
    served.pool.verify_servers()
    assert served.pool.restarts == [1] and served.client.get_weight_version() == version
    r = served.client.generate([10, 43, 12], {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True})
    torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64),
                               served.ref_logprobs([10, 43, 12], r.output_ids, path=served.model_b), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_wrong_weights_in_the_versions_own_files_stop_the_run_after_one_restart(served, tmp_path):
    """A wrong conversion written to disk: the actor's probe disagrees with the version's own files, so
    the restarted server fails again and the run stops in one line naming it, the KL and the version."""
    from megatron_bapo.sync.verify import WeightCheckError

    served.verify_with("probe")
    bad = _corrupt(served.model_b, tmp_path / "bad")
    with pytest.raises(WeightCheckError) as caught:
        served.load(bad, probe=served.probe(served.model_b))  # the actor holds model_b; its export wrote `bad`
    message = str(caught.value)
    assert served.pool.restarts == [1] and "\n" not in message
    assert message.startswith(f"built-in server {served.url} does not serve weight version 1 after a restart with "
                              f"it: probe KL ") and "> 1e-10 (sync.probe_max_kl)" in message, message


def test_sync_verify_fields_are_checked_where_the_config_is_read():
    from megatron_bapo.config_io import ConfigError
    from megatron_bapo.sync import SyncConfig

    for field, value, says in (("verify", "always", "sync.verify must be 'off', 'probe' or 'checksum'"),
                               ("probe_max_kl", 0.0, "sync.probe_max_kl must be > 0 or null"),
                               ("probe_tokens", 1, "sync.probe_tokens must be >= 2")):
        with pytest.raises(ConfigError, match=says):
            SyncConfig(**{field: value})


@pytest.mark.slow
def test_the_check_requests_conform_to_the_pinned_sglang(tiny_hf_dir, tmp_path):
    """The client's two requests of `sync.verify` (the probe's prefill, `/weights_checker`), recorded on
    their way to a server, pass `tools/sglang_conformance.py` (SGLang 0.5.23's own request classes);
    a body SGLang refuses is named, so the route's body is really checked."""
    from megatron_bapo.rollout import RolloutClientConfig
    from megatron_bapo.rollout.client import RolloutClient
    from megatron_bapo.server.launch import start_server
    from megatron_bapo.sync.verify import probe_token_ids
    from sglang_proxy import RecordingProxy
    from test_sglang_conformance import check_records

    records = tmp_path / "verify.jsonl"
    with start_server(tiny_hf_dir, log_path=tmp_path / "server.log") as server, \
            RecordingProxy(server.url, records) as proxy, RolloutClient(RolloutClientConfig(urls=[proxy.url])) as client:
        assert len(client.run(client.ascore(proxy.url, probe_token_ids(320, 16)))) == 15
        assert client.run(client.aweights_checksum(proxy.url))["ranks"][0]["checksums"]
    assert check_records(records, 320)["violations"] == []
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"method": "POST", "path": "/weights_checker", "body": {"selector": "nope"}}) + "\n")
    assert "CheckWeightsReqInput rejects the body" in check_records(bad, 320)["violations"][0]
