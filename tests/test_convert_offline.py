"""Offline HF <-> torch_dist conversion: round trip, actor loads converted weights at TP=2, actor
checkpoints export to HF with the actor's logits."""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("megatron.core")

from convert_helpers import hf_config_dict, hf_logits, make_hf_model, megatron_logits, read_safetensors_dir  # noqa: E402
from test_actor_helpers import make_batch  # noqa: E402

IDS = torch.tensor([[5, 17, 3, 42, 8, 99, 1, 60, 23, 7, 11, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 50, 51]])


def _to_megatron(rank, world_size, hf_dir, mdir, back_dir):
    from megatron_bapo.convert.offline import hf_to_megatron, megatron_to_hf

    hf_to_megatron(hf_dir, mdir)
    megatron_to_hf(mdir, back_dir, max_shard_bytes=30_000)


def _actor(tp, hf_dir):
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    cfg = ActorConfig(optim=OptimConfig(name="sgd", lr=0.5), parallel=ParallelConfig(tp=tp), use_distributed_optimizer=False)
    return Actor(cfg, hf_config_dict(hf_dir))


def _actor_loads_converted(rank, world_size, hf_dir, mdir):
    actor = _actor(2, hf_dir)
    actor.load_checkpoint(mdir, load_optimizer=False)
    return megatron_logits(actor.model[0].module, IDS, hf_config_dict(hf_dir)["vocab_size"], actor.parallel.tp_group)


@pytest.mark.parametrize("name", ["qwen2_tied", "llama"])
def test_hf_to_torch_dist_and_back_is_bit_exact_and_loads_into_an_actor_at_tp2(name, tmp_path, run_dist):
    hf_dir = make_hf_model(name, tmp_path / "hf", seed=4)
    mdir, back = tmp_path / "mg", tmp_path / "back"
    run_dist(_to_megatron, 1, hf_dir, mdir, back, timeout=120)
    src, dst = read_safetensors_dir(hf_dir), read_safetensors_dir(back)
    assert sorted(src) == sorted(dst) and len(list(back.glob("model-*-of-*.safetensors"))) > 1
    for k in src:
        assert src[k].dtype == dst[k].dtype and torch.equal(src[k], dst[k]), k
    ref = hf_logits(hf_dir, IDS)
    for logits in run_dist(_actor_loads_converted, 2, hf_dir, mdir, timeout=120):
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def _train_and_save(rank, world_size, hf_dir, ckpt):
    from megatron_bapo.convert import load_hf_into_model

    actor = _actor(2, hf_dir)
    load_hf_into_model(actor.model, hf_dir)
    actor.optimizer.reload_model_params()
    batch = make_batch(num_seqs=4, vocab=100, seed=1)
    batch["advantages"] = batch["advantages"] * 5.0
    actor.train_step(batch)
    actor.save_checkpoint(ckpt)
    return megatron_logits(actor.model[0].module, IDS, hf_config_dict(hf_dir)["vocab_size"], actor.parallel.tp_group)


def _export(rank, world_size, ckpt, out, template):
    from megatron_bapo.convert.offline import megatron_to_hf

    megatron_to_hf(ckpt, out, hf_template=template)


def test_trained_actor_checkpoint_exports_to_hf_with_the_same_logits(tmp_path, run_dist):
    hf_dir = make_hf_model("qwen2_untied", tmp_path / "hf", seed=5)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    logits = run_dist(_train_and_save, 2, hf_dir, ckpt, timeout=180)[0]
    assert (logits - hf_logits(hf_dir, IDS)).abs().max() > 1e-3  # training changed the weights
    run_dist(_export, 1, ckpt, out, hf_dir, timeout=120)
    torch.testing.assert_close(hf_logits(out, IDS), logits, atol=1e-4, rtol=0)
