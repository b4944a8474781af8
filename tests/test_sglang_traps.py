"""Two things live SGLang does that no double did, handled (each test here fails on 1b21a04).

- SGLang 0.5.23's Qwen3-MoE ignores `tie_word_embeddings`: a tied checkpoint without `lm_head.weight`
  is served with a zero output head (every token at -log(vocab)). Exports of a tied Qwen3-MoE now
  write the head (`ModelMapping.write_tied_head`), checked on real SGLang, and the tiny MoE fixture
  is untied, like every real Qwen3-MoE.
- SGLang numbers weight-group ranks `rank_offset + tp_rank`: a server with pipeline stages, or with
  data-parallel replicas without DP attention, would join with duplicate ranks and hang the sync.
  The first distributed sync refuses it in one line (`rollout.server_layout.weight_group_ranks`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_bapo.config_io import ConfigError
from megatron_bapo.rollout.server_layout import weight_group_ranks

ROOT = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"


# ------------------------------------------------------------------ the tied Qwen3-MoE head
def test_the_tiny_moe_fixture_is_untied_like_real_qwen3_moe(tmp_path):
    from safetensors.torch import load_file

    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    out = make_tiny_hf_checkpoint(tmp_path / "moe", seed=0, architecture="qwen3_moe")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    weights = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" in weights
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def _export_tied_moe(rank, world_size, hf_dir, out_dir):
    """Load a tied tiny Qwen3-MoE into megatron-core and export it both ways the syncs do: the disk
    sync's HF directory and the distributed sync's buckets."""
    from megatron_bapo.convert import iter_hf_tensors, load_hf_into_model, save_model_as_hf
    from megatron_bapo.models.builder import build_gpt_model
    from megatron_bapo.models.parallel import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=1)
    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    model = build_gpt_model(cfg)
    load_hf_into_model([model], hf_dir)
    save_model_as_hf([model], cfg, out_dir, tokenizer_src=hf_dir)
    return [(n, t.clone()) for b in iter_hf_tensors([model], cfg, gather_to="first") for n, t in b]


@pytest.fixture(scope="module")
def tied_moe(tmp_path_factory):
    """A tied tiny Qwen3-MoE (no lm_head.weight in its files) and its export by the live model."""
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint
    from dist_harness import run_dist

    root = tmp_path_factory.mktemp("tied_moe")
    hf_dir = make_tiny_hf_checkpoint(root / "hf", seed=3, architecture="qwen3_moe", tie_word_embeddings=True)
    exported = root / "export"
    (buckets,) = run_dist(_export_tied_moe, 1, str(hf_dir), str(exported), timeout=180)
    return hf_dir, exported, buckets


def test_exports_of_a_tied_qwen3_moe_write_the_head(tied_moe):
    from safetensors.torch import load_file

    hf_dir, exported, buckets = tied_moe
    src = load_file(str(hf_dir / "model.safetensors"))
    assert "lm_head.weight" not in src  # the trap: what transformers saves for a tied model
    disk = {}
    for f in exported.glob("*.safetensors"):
        disk.update(load_file(str(f)))
    sent = dict(buckets)
    for name, got in (("disk sync", disk), ("distributed sync", sent)):
        assert sorted(got) == sorted([*src, "lm_head.weight"]), name
        assert torch.equal(got["lm_head.weight"], src["model.embed_tokens.weight"]), name
    assert [n for n, _ in buckets][-1] == "lm_head.weight"  # HF order: the head last


def test_offline_conversion_of_a_tied_qwen3_moe_writes_the_head(tied_moe, tmp_path):
    from safetensors.torch import load_file
    from test_convert_offline import _to_megatron

    from dist_harness import run_dist

    hf_dir, _, _ = tied_moe
    run_dist(_to_megatron, 1, str(hf_dir), str(tmp_path / "mg"), str(tmp_path / "back"), timeout=180)
    back = {}
    for f in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(str(f)))
    src = load_file(str(hf_dir / "model.safetensors"))
    assert torch.equal(back["lm_head.weight"], src["model.embed_tokens.weight"])


@pytest.mark.slow
def test_real_sglang_serves_the_exported_tied_moe_with_its_head(tied_moe, tmp_path):
    """What the disk sync writes for a tied Qwen3-MoE, served by SGLang 0.5.23: its log-probs are the
    model's (a transformers forward), not the zero head's -log(vocab)."""
    from transformers import AutoModelForCausalLM

    from megatron_bapo.rollout.client import RolloutClient
    from megatron_bapo.rollout.config import RolloutClientConfig
    from megatron_bapo.rollout.sglang_launch import SGLangLaunchConfig, start_sglang_server

    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run bash tools/install.sh --with-sglang (tools/run_tests.sh does)")
    _, exported, _ = tied_moe
    prompt = [5, 17, 3, 42, 8, 99]
    with start_sglang_server(SGLangLaunchConfig(device="cpu"), model_path=str(exported),
                             log_path=tmp_path / "sglang.log", random_seed=0) as server:
        client = RolloutClient(RolloutClientConfig(urls=[server.url]))
        try:
            out = client.run(client.agenerate(prompt, {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}))
        finally:
            client.close()
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
    vocab = model.config.vocab_size
    assert max(abs(lp + torch.log(torch.tensor(float(vocab))).item()) for lp in out.logprobs) > 1e-3, \
        "every token at -log(vocab): SGLang serves a zero head"
    torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("where", ["engine", "external"])
def test_a_run_refuses_to_start_sglang_on_a_tied_qwen3_moe_without_its_head(tied_moe, tmp_path, where):
    """The base checkpoint is served before any export: a run whose servers are SGLang (started by it,
    or external) refuses it before launching anything, naming the fix; the exported one is accepted."""
    from megatron_bapo.config import RolloutConfig
    from megatron_bapo.rollout.config import RolloutClientConfig
    from megatron_bapo.rollout.pool import ServerPool

    hf_dir, exported, _ = tied_moe
    rollout = (RolloutConfig(engine="sglang", deterministic_inference=False) if where == "engine" else
               RolloutConfig(client=RolloutClientConfig(urls=["http://127.0.0.1:9"])))
    pool = ServerPool(rollout, model_path=str(hf_dir), seed=0, log_dir=tmp_path, state_path=tmp_path / "s.json")
    with pytest.raises(ConfigError) as err:
        pool.start()
    msg = str(err.value)
    assert msg.startswith(f"model.hf_path={hf_dir} is a Qwen3MoeForCausalLM checkpoint with tied embeddings and no "
                          f"lm_head.weight") and "tools/convert_hf.py" in msg and "\n" not in msg
    assert pool.servers == [] and pool.client is None  # nothing was started
    from megatron_bapo.convert.families import headless_for_sglang

    assert headless_for_sglang(exported) is None and headless_for_sglang(hf_dir) == "Qwen3MoeForCausalLM"


# ------------------------------------------------------------------ pipeline / data-parallel servers
@pytest.mark.parametrize("info, ranks", [
    ({"tp_size": 4}, 4), ({"tp_size": 2, "pp_size": 1, "dp_size": 1}, 2),
    ({"tp_size": 8, "dp_size": 4, "enable_dp_attention": True}, 8), ({}, 1),
])
def test_servers_whose_ranks_do_not_collide_bring_their_tp_size(info, ranks):
    assert weight_group_ranks({"http://a:1": {"tp_size": 1}, "http://b:2": info}, ["http://a:1", "http://b:2"]) == \
        [1, ranks]


@pytest.mark.parametrize("info, what", [
    ({"tp_size": 2, "pp_size": 2}, "its 2 pipeline stages would join with the same ranks"),
    ({"tp_size": 1, "dp_size": 2}, "its 2 data-parallel replicas without DP attention would join"),
    ({"tp_size": 2, "pp_size": 2, "dp_size": 3, "enable_dp_attention": False},
     "its 2 pipeline stages and 3 data-parallel replicas without DP attention"),
])
def test_servers_whose_ranks_would_collide_are_refused_in_one_line(info, what):
    with pytest.raises(ConfigError) as err:
        weight_group_ranks({"http://a:1": {"tp_size": 1}, "http://b:2": info}, ["http://a:1", "http://b:2"])
    msg = str(err.value)
    assert msg.startswith("server http://b:2 runs tp_size=") and what in msg and "\n" not in msg
    assert "--pp-size 1 and --dp-size 1 (or --enable-dp-attention)" in msg and "sync.method=disk" in msg


@pytest.fixture(scope="module")
def builtin_server(tiny_hf_dir):
    from megatron_bapo.server.launch import start_server

    with start_server(tiny_hf_dir, extra_args=["--num-threads", "1"]) as server:
        yield server


@pytest.mark.parametrize("layout, refused", [
    ({"pp_size": 2}, True), ({"dp_size": 2}, True), ({"dp_size": 2, "enable_dp_attention": True}, False),
])
def test_the_first_distributed_sync_refuses_a_server_whose_ranks_would_collide(builtin_server, tmp_path, layout,
                                                                             refused):
    """A server reporting SGLang's launch arguments (a proxy in front of a built-in server) with
    pipeline stages or replicas without DP attention: refused before the group is built, naming it;
    with DP attention the group is built and the update lands."""
    from sglang_proxy import RecordingProxy

    from megatron_bapo.config import RolloutConfig
    from megatron_bapo.rollout.config import RolloutClientConfig
    from megatron_bapo.rollout.pool import ServerPool
    from megatron_bapo.sync.config import SyncConfig

    def as_launched(path, body, reply):
        return {**reply, **layout} if path in ("/server_info", "/get_server_info") else reply

    records = tmp_path / "requests.jsonl"
    with RecordingProxy(builtin_server.url, records, rewrite=as_launched) as proxy:
        pool = ServerPool(RolloutConfig(client=RolloutClientConfig(urls=[proxy.url], health_timeout_s=60)),
                          SyncConfig(method="distributed", backend="gloo", group_timeout_s=30), model_path="unused",
                          seed=0, log_dir=tmp_path, state_path=tmp_path / "servers.json")
        pool.start()
        norm = ("model.norm.weight", torch.full((64,), 0.5))
        try:
            if refused:
                with pytest.raises(ConfigError, match=f"server {proxy.url} runs tp_size=1 pp_size="):
                    with pool.update(1) as session:
                        session.send([norm], last=True)
            else:
                with pool.update(1) as session:
                    session.send([norm], last=True)
                assert pool.client.get_weight_version() == 1
        finally:
            pool.close()
    paths = [json.loads(line)["path"] for line in records.read_text().splitlines()]
    assert ("/init_weights_update_group" in paths) is not refused
