"""HF <-> live megatron-core model: logits match at TP=1/TP=2, HF -> megatron -> HF is bit-exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from convert_helpers import CONFIGS, hf_config_dict, hf_logits, make_hf_model, megatron_logits, read_safetensors_dir  # noqa: E402

IDS = torch.tensor([[5, 17, 3, 42, 8, 99, 1, 60, 23, 7, 11, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 50, 51]])


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
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    src, dst = read_safetensors_dir(hf_dir), read_safetensors_dir(out)
    assert sorted(src) == sorted(dst)
    for k in src:
        assert src[k].dtype == dst[k].dtype and torch.equal(src[k], dst[k]), k
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(hf_logits(out, IDS), ref, atol=0, rtol=0)
