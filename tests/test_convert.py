"""HF <-> live megatron-core model: logits match at TP=1/TP=2, HF -> megatron -> HF is bit-exact."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("megatron.core")

from convert_helpers import CONFIGS, hf_config_dict, hf_logits, make_hf_model, megatron_logits, read_safetensors_dir  # noqa: E402

IDS = torch.tensor([[5, 17, 3, 42, 8, 99, 1, 60, 23, 7, 11, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 50, 51]])
TIED_HEAD_WRITTEN = {"qwen3_moe_no_norm"}
"""Tied Qwen3-MoE: exports add `lm_head.weight`, a copy of the embedding (SGLang's Qwen3-MoE ignores the tie)."""


def assert_exported(src: dict, dst: dict, name: str) -> None:
    """`dst` holds exactly `src`'s tensors, bit-exact, plus the tied head for TIED_HEAD_WRITTEN families."""
    extra = ["lm_head.weight"] if name in TIED_HEAD_WRITTEN else []
    assert "lm_head.weight" not in src or not extra
    assert sorted(dst) == sorted(list(src) + extra)
    for k in src:
        assert src[k].dtype == dst[k].dtype and torch.equal(src[k], dst[k]), k
    for k in extra:
        assert torch.equal(dst[k], src["model.embed_tokens.weight"]), k


def _load_and_export(rank, world_size, hf_dir, out_dir, tp, pp):
    from megatron_bapo.convert import load_hf_into_model, save_model_as_hf
    from megatron_bapo.models.builder import build_gpt_model
    from megatron_bapo.models.parallel import ParallelConfig, initialize_model_parallel

    groups = initialize_model_parallel(ParallelConfig(tp=tp, pp=pp), seed=1)
    cfg = hf_config_dict(hf_dir)
    model = build_gpt_model(cfg)
    n = load_hf_into_model([model], hf_dir)
    logits = None
    if pp == 1:
        logits = megatron_logits(model, IDS, cfg["vocab_size"], groups.tp_group)
    if out_dir is not None:
        save_model_as_hf([model], cfg, out_dir, tokenizer_src=hf_dir, max_shard_bytes=40_000)
    return n, logits


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp1_logits_match_hf_and_round_trip_is_bit_exact(name, tmp_path, run_dist):
    hf_dir = make_hf_model(name, tmp_path / "hf")
    ref = hf_logits(hf_dir, IDS)
    out = tmp_path / "out"
    (n, logits), = run_dist(_load_and_export, 1, hf_dir, out, 1, 1, timeout=120)
    assert n > 0
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    assert_exported(read_safetensors_dir(hf_dir), read_safetensors_dir(out), name)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(hf_logits(out, IDS), ref, atol=0, rtol=0)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_logits_match_hf_and_round_trip_is_bit_exact(name, tmp_path, run_dist):
    hf_dir = make_hf_model(name, tmp_path / "hf", seed=1)
    ref = hf_logits(hf_dir, IDS)
    out = tmp_path / "out"
    results = run_dist(_load_and_export, 2, hf_dir, out, 2, 1, timeout=120)
    for _, logits in results:
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    assert_exported(read_safetensors_dir(hf_dir), read_safetensors_dir(out), name)


def test_tp2_pp2_tied_round_trip_is_bit_exact(tmp_path, run_dist):
    """Tied embeddings under PP: the last stage's output layer is filled, and exported once."""
    hf_dir = make_hf_model("qwen2_tied", tmp_path / "hf", seed=2)
    out = tmp_path / "out"
    run_dist(_load_and_export, 4, hf_dir, out, 2, 2, timeout=180)
    src, dst = read_safetensors_dir(hf_dir), read_safetensors_dir(out)
    assert sorted(src) == sorted(dst) and "lm_head.weight" not in dst
    for k in src:
        assert torch.equal(src[k], dst[k]), k
    assert (out / "tokenizer_config.json").exists() or not (hf_dir / "tokenizer_config.json").exists()


def _iterate(rank, world_size, hf_dir, gather_to, bucket_bytes):
    from megatron_bapo.convert import iter_hf_tensors, load_hf_into_model
    from megatron_bapo.models.builder import build_gpt_model
    from megatron_bapo.models.parallel import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(tp=1, pp=2), seed=1)
    cfg = hf_config_dict(hf_dir)
    model = build_gpt_model(cfg)
    load_hf_into_model([model], hf_dir)
    return [[(n, t.clone()) for n, t in b] for b in iter_hf_tensors([model], cfg, bucket_bytes=bucket_bytes, gather_to=gather_to)]


@pytest.mark.parametrize("gather_to", ["all", "first", "local"])
def test_iter_hf_tensors_pp2_buckets(gather_to, tmp_path, run_dist):
    hf_dir = make_hf_model("qwen2_untied", tmp_path / "hf", seed=3)
    src = read_safetensors_dir(hf_dir)
    bucket = 30_000
    per_rank = run_dist(_iterate, 2, hf_dir, gather_to, bucket, timeout=120)
    seen = []
    for rank, buckets in enumerate(per_rank):
        names = [n for b in buckets for n, _ in b]
        for b in buckets:
            size = sum(t.numel() * t.element_size() for _, t in b)
            assert size <= bucket or len(b) == 1
            for n, t in b:
                assert torch.equal(t, src[n]), n
        if gather_to == "all" or (gather_to == "first" and rank == 0):
            assert names[0] == "model.embed_tokens.weight" and sorted(names) == sorted(src)
        elif gather_to == "first":
            assert names == []
        seen += names
    if gather_to == "local":
        assert sorted(seen) == sorted(src)
        assert all(".layers.1." not in n for n, _ in sum(per_rank[0], []))


def _export_bytes(rank, world_size, hf_dir):
    """TP 2 x PP 2: the bytes each rank sends point-to-point (the pipeline transfers) while the weights
    are gathered to the first stage, as the weight sync does; rank 0's tensors."""
    import torch.distributed as dist

    from megatron_bapo.convert import iter_hf_tensors, load_hf_into_model
    from megatron_bapo.models.builder import build_gpt_model
    from megatron_bapo.models.parallel import ParallelConfig, initialize_model_parallel

    groups = initialize_model_parallel(ParallelConfig(tp=2, pp=2), seed=1)
    cfg = hf_config_dict(hf_dir)
    model = build_gpt_model(cfg)
    load_hf_into_model([model], hf_dir)
    sent = {"bytes": 0}
    send = dist.send

    def counting_send(tensor, *args, **kwargs):
        sent["bytes"] += tensor.numel() * tensor.element_size()
        return send(tensor, *args, **kwargs)

    dist.send = counting_send  # counts the bytes this rank puts on the wire; the send itself is gloo's
    try:
        got = [(n, t.clone()) for b in iter_hf_tensors([model], cfg, gather_to="first", tp_group=groups.tp_group,
                                                        pp_group=groups.pp_group) for n, t in b]
    finally:
        dist.send = send
    return {"sent": sent["bytes"], "tensors": got, "pp_rank": groups.pp_rank, "tp_rank": groups.tp_rank}


def test_one_sender_per_pipeline_stage(tmp_path, run_dist):
    """Gathering the weights to the first stage moves each later stage's weights over the pipeline
    once, from its TP rank 0 (at 1b21a04 every TP rank of stage 1 sent the full tensors: TP times the
    bytes, about 262 GB per sync at 32B with TP 8), and only TP rank 0 of stage 0 yields them."""
    hf_dir = make_hf_model("qwen2_untied", tmp_path / "hf", seed=4)
    src = read_safetensors_dir(hf_dir)
    res = run_dist(_export_bytes, 4, hf_dir, timeout=180)
    by = {(r["pp_rank"], r["tp_rank"]): r for r in res}
    stage1 = sum(t.numel() * t.element_size() for n, t in src.items()
                 if ".layers.1." in n or n in ("model.norm.weight", "lm_head.weight"))
    assert by[(1, 0)]["sent"] == stage1, (by[(1, 0)]["sent"], stage1)  # its stage, exactly once
    assert by[(1, 1)]["sent"] == 0 and by[(0, 0)]["sent"] == 0 and by[(0, 1)]["sent"] == 0
    rank0 = dict(by[(0, 0)]["tensors"])
    assert sorted(rank0) == sorted(src) and all(torch.equal(rank0[n], src[n]) for n in src)
    assert by[(0, 1)]["tensors"] == [] and by[(1, 0)]["tensors"] == [] and by[(1, 1)]["tensors"] == []


def _load_only(rank, world_size, hf_dir, cfg):
    from megatron_bapo.convert import load_hf_into_model
    from megatron_bapo.models.builder import build_gpt_model
    from megatron_bapo.models.parallel import ParallelConfig, initialize_model_parallel

    initialize_model_parallel(ParallelConfig(), seed=1)
    load_hf_into_model([build_gpt_model(cfg)], hf_dir, hf_config=cfg)


def test_load_errors_name_missing_and_unexpected_tensors(tmp_path, run_dist):
    from safetensors.torch import load_file, save_file

    hf_dir = make_hf_model("llama", tmp_path / "hf")
    sd = load_file(str(hf_dir / "model.safetensors"))
    sd["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    del sd["model.layers.1.self_attn.k_proj.weight"]
    save_file(sd, str(hf_dir / "model.safetensors"))
    cfg = hf_config_dict(hf_dir)
    with pytest.raises(AssertionError, match=r"missing tensors \['model.layers.1.self_attn.k_proj.weight'\].*unexpected tensors \['model.layers.0.mlp.extra.weight'\]"):
        run_dist(_load_only, 1, hf_dir, cfg, timeout=120)


def test_unknown_architecture_lists_supported_ones():
    from megatron_bapo.convert import get_mapping

    with pytest.raises(ValueError, match=r"no weight mapping for architecture 'GemmaForCausalLM'; supported: \['LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM'\]"):
        get_mapping({"architectures": ["GemmaForCausalLM"]})


def test_every_model_family_has_a_weight_mapping_and_back():
    """The model registry and the mapping table name the same architectures (one table each, no import order)."""
    from megatron_bapo.convert import MAPPINGS
    from megatron_bapo.models.registry import supported_architectures

    assert sorted(MAPPINGS) == supported_architectures()
    assert all(arch == m.architecture for arch, m in MAPPINGS.items())
