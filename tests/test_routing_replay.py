"""Rollout routing replay on a tiny Qwen3-MoE, from the server to the actor's routers.

1. The built-in server returns, per computed position, the experts every layer chose (SGLang's
   `return_routed_experts`, `meta_info.routed_experts`, `routed_experts_start_len`), equal to an
   independent transformers forward; without --enable-return-routed-experts the field is ignored.
2. The partial-rollout buffer keeps the routing across segments and a checkpoint (JSON state) and a
   weight update between the segments: every position keeps the routing of the forward that first
   computed it (the resumed request asks from `routed_experts_start_len`); the actor, holding the
   NEW weights (whose own routing differs on the prefix), replays exactly that routing, token for
   token; without replay it uses its own and `moe/routing_mismatch` says how often that differs.
3. Replay under full activation recompute (the backward recomputes each layer) trains exactly as
   without recompute.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from server_helpers import http  # noqa: E402

LAYERS, TOP_K = 2, 2  # megatron_bapo.tiny's Qwen3-MoE defaults (8 experts)


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("moe_a"), seed=0, architecture="qwen3_moe")


@pytest.fixture(scope="module")
def moe_hf_b(moe_hf, tmp_path_factory):
    """The same model with every router's weights changed: most tokens route differently."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_bapo.tiny.checkpoint import save_quietly

    out = tmp_path_factory.mktemp("moe_b")
    model = AutoModelForCausalLM.from_pretrained(moe_hf, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.copy_(torch.roll(layer.mlp.gate.weight, 3, dims=0))
    save_quietly(model, out)
    AutoTokenizer.from_pretrained(moe_hf).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(moe_hf):
    from megatron_bapo.server.launch import start_server

    with start_server(moe_hf, extra_args=["--num-threads", "1", "--enable-return-routed-experts"]) as handle:
        yield handle


def hf_routing(hf_dir, ids: list) -> np.ndarray:
    """`[len(ids), L, k]` experts of a plain transformers forward over `ids` (the reference)."""
    from transformers import AutoModelForCausalLM

    from megatron_bapo.server.routing import RoutingCapture

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    capture = RoutingCapture(model)
    capture.start()
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    return capture.take().numpy()


def decode(value: str) -> np.ndarray:
    import base64

    return np.frombuffer(base64.b64decode(value), dtype=np.int32).reshape(-1, LAYERS, TOP_K)


def test_server_returns_the_routing_of_every_computed_position(server, moe_hf):
    prompt = [5, 6, 7, 8, 9]
    body = {"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}}
    status, out = http(server.url + "/generate", body)
    assert status == 200
    ids = prompt + out["output_ids"]
    rows = decode(out["meta_info"]["routed_experts"])
    assert rows.shape == (len(ids) - 1, LAYERS, TOP_K)  # the last output token was never fed forward
    np.testing.assert_array_equal(rows, hf_routing(moe_hf, ids)[:-1])
    # a continuation asks only for the positions it computes first
    status, more = http(server.url + "/generate", {**body, "input_ids": ids, "routed_experts_start_len": len(ids) - 1})
    assert status == 200
    ids2 = ids + more["output_ids"]
    np.testing.assert_array_equal(decode(more["meta_info"]["routed_experts"]), hf_routing(moe_hf, ids2)[len(ids) - 1:-1])
    status, err = http(server.url + "/generate", {**body, "routed_experts_start_len": 6})
    assert status == 400 and "routed_experts_start_len=6 is higher than the number of input tokens 5" in err["error"]["message"]
    status, plain = http(server.url + "/generate", {**body, "return_routed_experts": False})
    assert status == 200 and "routed_experts" not in plain["meta_info"]


@pytest.mark.slow
def test_without_the_launch_flag_the_field_is_ignored_as_by_sglang(moe_hf):
    from megatron_bapo.server.launch import start_server

    from megatron_bapo.rollout import PartialRolloutManager
    from megatron_bapo.rollout.client import RolloutClient
    from megatron_bapo.rollout.config import PartialRolloutConfig, RolloutClientConfig
    from megatron_bapo.rollout.errors import RolloutError
    from megatron_bapo.rollout.types import Prompt

    with start_server(moe_hf, extra_args=["--num-threads", "1"]) as plain:
        status, out = http(plain.url + "/generate", {"input_ids": [5, 6], "return_routed_experts": True,
                                                     "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and "routed_experts" not in out["meta_info"]
        # the rollout asking for routing stops there, naming the flag, and keeps its samples
        cfg = PartialRolloutConfig(group_size=2, max_response_tokens=4, return_routed_experts=True)
        with RolloutClient(RolloutClientConfig(urls=[plain.url])) as client:
            manager = PartialRolloutManager(client, cfg)
            with pytest.raises(RolloutError, match="launch the servers with --enable-return-routed-experts"):
                manager.step([Prompt(prompt_ids=[5, 6, 7], index=0)], 0).groups
        assert manager.num_buffered_groups == 1 and all(not s.response_ids for s in manager.buffer[0].samples)


# --------------------------------------------------------------------------- buffer -> batch -> routers
def _rollout_across_a_resume(server, moe_hf, moe_hf_b):
    """Segment 1 on weights A, the buffer through JSON into a new manager, weights B, segment 2."""
    from megatron_bapo.rollout import PartialRolloutManager
    from megatron_bapo.rollout.client import RolloutClient
    from megatron_bapo.rollout.config import PartialRolloutConfig, RolloutClientConfig, SamplingConfig
    from megatron_bapo.rollout.types import Prompt

    cfg = PartialRolloutConfig(group_size=2, max_response_tokens=8, segment_tokens=4, max_staleness=None,
                               return_routed_experts=True, sampling=SamplingConfig(temperature=1.0, ignore_eos=True))
    with RolloutClient(RolloutClientConfig(urls=[server.url])) as client:
        client.update_weights_from_disk(str(moe_hf), 0)
        first = PartialRolloutManager(client, cfg)
        assert first.step([Prompt(prompt_ids=[5, 17, 3, 42], index=0), Prompt(prompt_ids=[9, 8, 7], index=1)], 0).groups == []
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
        resumed = PartialRolloutManager(client, cfg)
        resumed.load_state_dict(state)
        client.update_weights_from_disk(str(moe_hf_b), 1)
        try:
            groups = resumed.step([], 1).groups
        finally:
            client.update_weights_from_disk(str(moe_hf), 0)
    return [s for g in groups for s in g.samples]


def _replayed(rank, world_size, hf_dir, batch, replay):
    """The experts the actor's routers used for each input token of `batch` (-1: no label there)."""
    from transformers import AutoConfig

    from megatron_bapo.actor import ActorConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.actor.layout import POSITION_KEYS
    from megatron_bapo.actor.scatter import local_microbatches, plan
    from megatron_bapo.convert import load_hf_into_model

    hf_config = AutoConfig.from_pretrained(hf_dir)
    actor = Actor(ActorConfig(routing_replay=replay, vocab_divisible_by=64), hf_config)
    load_hf_into_model(actor.model, hf_dir, hf_config=hf_config)
    for tape in actor.routing_tapes:
        tape.log_used = True
    lp = actor.compute_logprobs(batch)
    data = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            **{k: torch.zeros(batch["input_ids"].shape) for k in POSITION_KEYS}}
    used = torch.full((*batch["input_ids"].shape, LAYERS, TOP_K), -1, dtype=torch.long)
    spec = actor.batch_spec  # the micro-batches compute_logprobs ran, in its order
    rows_plan = plan([int(n) for n in data["attention_mask"].sum(-1)], spec)
    for m, mb in enumerate(local_microbatches(data, rows_plan, spec, 0, 0)):
        for tape in actor.routing_tapes:
            layer = int(tape.router.layer_number) - 1
            rows = tape.used[m].view(mb["row"].shape[1], mb["row"].shape[0], TOP_K).transpose(0, 1)
            keep = mb["row"] >= 0
            used[mb["row"][keep], mb["col"][keep] - 1, layer] = rows[keep]
    metrics = actor.train_step({**batch, "advantages": batch["loss_mask"] * 0.5, "behavior_logprobs": lp})
    return used, {k: v for k, v in metrics.items() if k.startswith("moe/")}


@pytest.mark.slow
def test_replayed_routing_equals_the_servers_across_a_resumed_partial_rollout(server, moe_hf, moe_hf_b, run_dist):
    from megatron_bapo.rollout.batch import build_batch

    samples = _rollout_across_a_resume(server, moe_hf, moe_hf_b)
    assert len(samples) == 4 and all(s.num_segments == 2 and s.response_length == 8 for s in samples)
    prefix_differs = 0
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        rows = np.frombuffer(s.routed_experts, dtype="<i2").reshape(-1, LAYERS, TOP_K)
        assert rows.shape[0] == len(ids) - 1
        cut = len(s.prompt_ids) + 4 - 1  # positions segment 1 computed (on A); the rest segment 2 (on B)
        on_a, on_b = hf_routing(moe_hf, ids[:cut + 1]), hf_routing(moe_hf_b, ids)
        np.testing.assert_array_equal(rows[:cut], on_a[:cut])
        np.testing.assert_array_equal(rows[cut:], on_b[cut:-1])
        prefix_differs += int((np.sort(on_a[:cut], -1) != np.sort(on_b[:cut], -1)).any(-1).any(-1).sum())
    assert prefix_differs > 0  # B would route the prefix differently: the kept rows are the ones A chose
    batch = build_batch(samples, routed_experts_shape=(LAYERS, TOP_K))
    recorded = batch["routed_experts"].long()
    for replay in (True, False):
        used, moe = run_dist(_replayed, 1, str(moe_hf_b), batch, replay, timeout=120)[0]
        has = (used >= 0).all(-1).all(-1)
        assert has.sum() == sum(len(s.prompt_ids) + s.response_length - 1 for s in samples)
        same = (used.sort(-1).values == recorded.sort(-1).values).all(-1)[has]
        assert moe["moe/routing_recorded"] == pytest.approx(1.0) and moe["moe/routing_mismatch"] > 0
        if replay:  # token for token, every layer, every labelled position
            assert same.all() and moe["moe/routing_replayed"] == pytest.approx(1.0)
        else:  # B's own routing: not the recorded one on the prefix
            assert not same.all() and moe["moe/routing_replayed"] == 0.0
            assert moe["moe/routing_mismatch"] == pytest.approx(1 - same.double().mean().item())


# --------------------------------------------------------------------------- recompute
def _train_with_replay(rank, world_size, hf_dir, recompute):
    from test_actor_helpers import make_batch
    from test_qwen3_moe import _moe_actor, hf_params

    actor = _moe_actor(hf_dir, routing_replay=True, recompute=recompute, max_tokens_per_microbatch=40)
    b = make_batch(num_seqs=8, max_len=23, seed=3, vocab=actor.hf_vocab_size)
    g = torch.Generator().manual_seed(9)  # a recorded routing unlike the model's own
    b["routed_experts"] = torch.rand((*b["input_ids"].shape, LAYERS, 8), generator=g).argsort(-1)[..., :TOP_K].short()
    b["behavior_logprobs"] = actor.compute_logprobs(b) - 0.1
    before = hf_params(actor)
    metrics = actor.train_step(b)
    return metrics, {k: v - before[k] for k, v in hf_params(actor).items()}


@pytest.mark.slow
def test_replay_under_full_recompute_trains_as_without(run_dist, moe_hf):
    """The backward recomputes every layer with the experts its forward used (several micro-batches)."""
    plain, full = (run_dist(_train_with_replay, 1, str(moe_hf), r, timeout=120)[0] for r in ("none", "full"))
    assert plain[0]["moe/routing_replayed"] == pytest.approx(1.0) and plain[0]["moe/routing_mismatch"] > 0.5
    for k in ("actor/loss", "actor/grad_norm", "actor/kl_k1", "moe/load_balance"):
        assert full[0][k] == pytest.approx(plain[0][k], rel=1e-6), k
    for name, upd in plain[1].items():
        torch.testing.assert_close(full[1][name], upd, atol=1e-7, rtol=1e-5, msg=name)


# --------------------------------------------------------------------------- the trainer CLI
@pytest.mark.slow
def test_trainer_cli_ep2_under_torchrun_replays_on_policy(tmp_path, moe_hf):
    """`torchrun --nproc-per-node 2 -m megatron_bapo.train --config examples/configs/tiny_moe.yaml` (sized
    down) on the tiny Qwen3-MoE with EP=2 (the experts split over the two data-parallel ranks), the
    built-in server returning routed experts and the actor replaying them: 3 steps, every update on
    the weights the server sampled with (disk sync), KL(behavior || current) below 1e-6, every
    recorded token replayed."""
    from test_recipe import REWARD_MODULE, ROOT, _run

    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)[::-1]} for a in range(10, 60) for b in range(10, 14)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "recipe_reward.py").write_text(REWARD_MODULE)
    out = tmp_path / "moe_ep2"
    config = tmp_path / "tiny_moe.yaml"  # the example, pointed at this test's model, data and output
    config.write_text((ROOT / "examples/configs/tiny_moe.yaml").read_text()
                      .replace("runs/tiny_moe_assets/base_model", str(moe_hf))
                      .replace("runs/tiny_moe_assets/data/train.jsonl", str(tmp_path / "train.jsonl"))
                      .replace("output_dir: runs/tiny_moe", f"output_dir: {out}"))
    metrics = _run(config, 2, "actor.parallel.ep=2", "trainer.total_steps=3", "trainer.progress=false",
                   "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_response_tokens=8",
                   "rollout.segment_tokens=null", "rollout.sampling.temperature=0.6", "actor.n_minibatches=1",
                   "reward.fn=recipe_reward:parity_reward", "eval.every_n_steps=0")
    updates = [m for m in metrics if "actor/kl_k1" in m]
    assert [m["step"] for m in updates] == [1, 2, 3], [m["step"] for m in updates]
    for m in updates:
        assert m["actor/num_loss_tokens"] > 50 and m["actor/grad_norm"] > 0
        assert abs(m["actor/kl_k1"]) < 1e-6 and abs(m["actor/ratio_mean"] - 1.0) < 1e-6, m
        assert m["moe/routing_replayed"] == pytest.approx(1.0) and m["moe/routing_recorded"] == pytest.approx(1.0)
        assert m["moe/routing_mismatch"] < 0.01 and m["moe/load_balance"] > 1.0
