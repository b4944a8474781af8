"""Checkpoints without Transformer Engine's `_extra_state` load into a TE actor, and the reverse.

Transformer Engine's linear and attention modules carry one `_extra_state` object each (their FP8
scaling state), which megatron saves as sharded objects. megatron's local linears save an empty
(None) `_extra_state` for compatibility, but the local spec's core attention has none, while TE's
`TEDotProductAttention` has one: a checkpoint converted offline (`hf_to_megatron`, local spec) lacks
`decoder.layers.self_attention.core_attention._extra_state`, and megatron's default strict load
refuses it. On CPU, a layer spec whose linears and core attention carry such objects, as TE's do,
stands in for the TE spec: the loader must tolerate exactly the missing `_extra_state` objects (one
log line), nothing else, in both directions.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("megatron.core")

from convert_helpers import hf_config_dict, make_hf_model  # noqa: E402
from test_actor_helpers import full_params, make_batch  # noqa: E402


class ExtraState:
    """TE-like extra state: a uint8 tensor (TE serialises its FP8 metadata so); None is ignored, as TE does."""

    def get_extra_state(self):
        return torch.tensor(list(b"fp8-meta"), dtype=torch.uint8)

    def set_extra_state(self, state):
        if state is not None:
            self.loaded_extra_state = bytes(state.tolist())


def _te_like_layer_spec(local_spec, **options):
    """The local spec with TE-like `_extra_state` on the four linears and the core attention."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_bapo.models import layer_spec

    class TELikeColumn(ExtraState, ColumnParallelLinear):
        pass

    class TELikeRow(ExtraState, RowParallelLinear):
        pass

    class TELikeAttention(ExtraState, layer_spec.sdpa_attention_class()):
        pass

    spec = local_spec(use_te=False, **options)
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    attn.linear_qkv, attn.core_attention, attn.linear_proj = TELikeColumn, TELikeAttention, TELikeRow
    mlp.linear_fc1, mlp.linear_fc2 = TELikeColumn, TELikeRow
    return spec


def _actor(hf_dir, te_like: bool):
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models import layer_spec

    if te_like:  # the builder asks layer_spec.get_layer_spec for the spec: hand it the TE-like one
        local_spec = layer_spec.get_layer_spec
        layer_spec.get_layer_spec = lambda use_te=None, **options: _te_like_layer_spec(local_spec, **options)
    cfg = ActorConfig(optim=OptimConfig(lr=1e-2))
    actor = Actor(cfg, hf_config_dict(hf_dir))
    extra = [m for m in actor.model[0].module.modules() if isinstance(m, ExtraState)]
    assert len(extra) == (5 * 2 if te_like else 0)  # 5 modules x 2 layers
    return actor, extra


def _log_lines():
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("megatron_bapo.actor.checkpoint").addHandler(handler)
    logging.getLogger("megatron_bapo.actor.checkpoint").setLevel(logging.INFO)
    return lines


def _converted_into_te_like(rank, world_size, hf_dir, converted, te_ckpt):
    lines = _log_lines()
    plain, _ = _actor(hf_dir, te_like=False)
    plain.load_checkpoint(converted, load_optimizer=False)
    te, extra = _actor(hf_dir, te_like=True)
    te.load_checkpoint(converted, load_optimizer=False)
    out = {"same_weights": all(torch.equal(full_params(te)[n], p) for n, p in full_params(plain).items()),
           "untouched": all(not hasattr(m, "loaded_extra_state") for m in extra),
           "logs": [m for m in lines if "_extra_state" in m]}
    batch = make_batch(num_seqs=4, vocab=100, seed=2)
    out["lp"] = (te.compute_logprobs(batch), plain.compute_logprobs(batch))
    te.train_step(batch)
    te.save_checkpoint(te_ckpt)  # now WITH _extra_state objects
    out["trained"] = full_params(te)
    return out


def _te_like_into_plain(rank, world_size, hf_dir, te_ckpt):
    lines = _log_lines()
    plain, _ = _actor(hf_dir, te_like=False)
    plain.load_checkpoint(te_ckpt)  # optimizer and all: the checkpoint's extra entries are not read
    te, extra = _actor(hf_dir, te_like=True)
    te.load_checkpoint(te_ckpt)
    return {"plain": full_params(plain), "te": full_params(te), "logs": [m for m in lines if "_extra_state" in m],
            "restored": {m.loaded_extra_state for m in extra}}


def _missing_weight(rank, world_size, hf_dir, converted, broken):
    import json
    import shutil

    from megatron.core import dist_checkpointing

    plain, _ = _actor(hf_dir, te_like=False)
    plain.load_checkpoint(converted, load_optimizer=False)
    sharded = plain.model[0].module.sharded_state_dict()
    del sharded["decoder.final_layernorm.weight"]
    broken.mkdir()
    dist_checkpointing.save({"model": sharded}, str(broken))
    shutil.copy(converted / "actor_meta.json", broken / "actor_meta.json")
    json.loads((broken / "actor_meta.json").read_text())
    te, _ = _actor(hf_dir, te_like=True)
    with pytest.raises(KeyError, match=r"lacks 1 entries this actor needs, e\.g\. \['decoder\.final_layernorm\.weight'\]"):
        te.load_checkpoint(broken, load_optimizer=False)
    return True


def _convert(rank, world_size, hf_dir, converted):
    from megatron_bapo.convert.offline import hf_to_megatron

    hf_to_megatron(hf_dir, converted)


@pytest.mark.slow
def test_checkpoint_without_extra_state_loads_into_a_te_like_actor_and_back(run_dist, tmp_path):
    hf_dir = make_hf_model("qwen2_tied", tmp_path / "hf", seed=5)
    converted, te_ckpt = tmp_path / "converted", tmp_path / "te_ckpt"
    run_dist(_convert, 1, hf_dir, converted, timeout=120)

    res = run_dist(_converted_into_te_like, 1, hf_dir, converted, te_ckpt, timeout=120)[0]
    assert res["same_weights"] and res["untouched"]
    assert len(res["logs"]) == 1
    assert "lacks 1 _extra_state entries (decoder.layers.self_attention.core_attention._extra_state)" in res["logs"][0]
    torch.testing.assert_close(res["lp"][0], res["lp"][1], atol=0, rtol=0)

    back = run_dist(_te_like_into_plain, 1, hf_dir, te_ckpt, timeout=120)[0]
    for name, p in res["trained"].items():
        assert torch.equal(back["plain"][name], p) and torch.equal(back["te"][name], p), name
    assert back["logs"] == []  # nothing was missing either way
    assert back["restored"] == {b"fp8-meta"}  # a TE actor restores its extra state from a TE checkpoint

    assert run_dist(_missing_weight, 1, hf_dir, converted, tmp_path / "broken", timeout=120)[0]
