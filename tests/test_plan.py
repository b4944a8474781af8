"""tools/plan.py: true parameter count of Qwen2.5-32B, field-naming layout errors, and the per-GPU
model-state bytes of a small config checked against a real megatron-core actor on CPU ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]
CFG_32B = ROOT / "examples/configs/qwen2.5-32b-bapo-64k.yaml"
HF_32B = ROOT / "examples/configs/qwen2.5-32b-config.json"

TINY = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64, num_attention_heads=4,
    num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2, vocab_size=100, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=256,
)
TINY_QWEN3 = dict(TINY, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32, tie_word_embeddings=False)
"""q/k norms, and head_dim 32 != hidden 64 / 4 heads."""
TINY_MOE = dict(TINY_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
"""4 experts of width 48, 2 per token: split over EP 2."""
SEQ = 64


def hf_num_params(hf_config: dict) -> int:
    """The HF model's own parameter count (built by transformers on the meta device; tied weights once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures", "torch_dtype")}
    config = AutoConfig.for_model(hf_config["model_type"], **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools/plan.py"), *args], capture_output=True, text=True, timeout=240, cwd=ROOT
    )


QWEN3_RECIPES = {  # config, HF config, GPUs, (tp, pp, cp, dp), the HF model's parameter count
    "qwen3-32b": ("qwen3-32b-bapo-64k.yaml", "qwen3-32b-config.json", 64, (8, 2, 2, 2), 32_762_123_264),
    "qwen3-8b": ("qwen3-8b-bapo.yaml", "qwen3-8b-config.json", 8, (4, 1, 2, 1), 8_190_735_360),
    "qwen3-30b-a3b": ("qwen3-30b-a3b-bapo.yaml", "qwen3-30b-a3b-config.json", 16, (2, 1, 2, 4), 30_532_122_624),
}


MODEL_STATE_LAYOUTS = {"qwen2-tp2": (2, 1, TINY, 1), "qwen2-pp2": (1, 2, TINY, 1), "qwen3-tp2": (2, 1, TINY_QWEN3, 1),
                       "qwen3-moe-ep2": (1, 1, TINY_MOE, 2)}
"""tp, pp, HF config, ep of `test_model_state_matches_a_real_cpu_actor`."""


def _model_state_run(directory: Path, tp: int, pp: int, hf_config: dict, ep: int) -> Path:
    """The run YAML (and the HF config.json beside it) of a small layout on 2 CPU ranks."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(hf_config))
    run = {
        "model": {"hf_path": str(directory)}, "data": {"max_prompt_tokens": SEQ // 2},
        "rollout": {"max_response_tokens": SEQ // 2, "prompts_per_step": 2, "group_size": 2},
        "actor": {"parallel": {"tp": tp, "pp": pp, "ep": ep}, "dtype": "float32", "use_distributed_optimizer": False,
                  "max_tokens_per_microbatch": SEQ, "vocab_divisible_by": 64},
    }
    cfg = directory / "run.yaml"
    cfg.write_text(yaml.safe_dump(run))
    return cfg


def _runs_wanted(request) -> set[str]:
    """The runs of `planned` that the selected tests of this module read (`-m "not slow"` leaves
    out the 32B count, whose meta builds alone take about a minute)."""
    wanted: set[str] = set()
    for item in request.session.items:
        if item.module is not request.module:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        name = item.originalname
        if name == "test_32b_true_parameter_count_and_fit":
            wanted |= {"32b", "32b-no-recompute"}
        elif name == "test_cli_exit_status_on_invalid_layout":
            wanted.add("32b-tp3")
        elif "recipe" in params:
            wanted |= {params["recipe"], f"{params['recipe']}-8-gpus"}
        elif "layout" in params:
            wanted.add(params["layout"])
    return wanted


@pytest.fixture(scope="module")
def planned(tmp_path_factory, request):
    """The CLI runs of the selected large-model tests below, started together, two at a time (each
    builds a model on the meta device in one Python thread: one core): {name: (future of the finished
    process, its --json-out path or None)}. Each test reads its own."""
    root = tmp_path_factory.mktemp("plans")
    big = ["--config", str(CFG_32B), "--hf-config", str(HF_32B), "--gpus", "64"]
    runs = {"32b": [*big, "--json-out", str(root / "32b.json")], "32b-no-recompute": [*big, "actor.recompute=none"],
            "32b-tp3": [*big, "actor.parallel.tp=3"]}
    for recipe, (cfg, hf_cfg, gpus, _, _) in QWEN3_RECIPES.items():
        files = ["--config", str(ROOT / "examples/configs" / cfg), "--hf-config", str(ROOT / "examples/configs" / hf_cfg)]
        runs[recipe] = [*files, "--gpus", str(gpus), "--json-out", str(root / f"{recipe}.json")]
        if json.loads((ROOT / "examples/configs" / hf_cfg).read_text()).get("num_experts"):
            runs[f"{recipe}-8-gpus"] = [*files, "--gpus", "8", "--json"]
    for name, (tp, pp, hf_config, ep) in MODEL_STATE_LAYOUTS.items():
        runs[name] = ["--config", str(_model_state_run(root / name, tp, pp, hf_config, ep)), "--gpus", "2", "--json"]
    runs = {name: args for name, args in runs.items() if name in _runs_wanted(request)}
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="plan")
    # The slowest (the 128-expert MoE builds) first, so that they do not run last and alone.
    order = sorted(runs, key=lambda name: "a3b" not in name)
    futures = {name: pool.submit(_plan, *runs[name]) for name in order}
    yield {name: (futures[name], root / f"{name}.json" if "--json-out" in runs[name] else None) for name in runs}
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
def test_32b_true_parameter_count_and_fit(planned):
    text = planned["32b"][0].result()
    assert text.returncode == 0, text.stderr
    plan = json.loads(planned["32b"][1].read_text())
    assert abs(plan["num_parameters"] - 32.76e9) / 32.76e9 < 1e-3
    assert (plan["tp"], plan["pp"], plan["cp"], plan["dp"]) == (8, 2, 2, 2)
    assert plan["fits_recompute"] and not plan["fits"]  # 64k needs recomputation, as design section 5 says
    assert 0 < plan["peak_bytes_recompute"] <= plan["capacity_bytes"]
    assert "32,763,876,352 parameters" in text.stdout and "full recompute FITS" in text.stdout
    no_recompute = planned["32b-no-recompute"][0].result()
    assert no_recompute.returncode == 1, no_recompute.stdout  # the exit status follows actor.recompute


@pytest.mark.slow  # the recipes' meta builds: 31 s in the inner loop even without the 32B one
@pytest.mark.parametrize("recipe", list(QWEN3_RECIPES))
def test_qwen3_recipes_count_the_hf_models_parameters_and_fit_as_configured(planned, recipe):
    """The planner's count (megatron-core meta build: q/k norms, head_dim 128 != hidden/heads) equals the HF
    model's own, and each recipe's layout fits with the recompute it sets (exit status 0)."""
    cfg, hf_cfg, gpus, layout, num_params = QWEN3_RECIPES[recipe]
    hf = json.loads((ROOT / "examples/configs" / hf_cfg).read_text())
    assert hf_num_params(hf) == num_params
    out = planned[recipe][0].result()
    assert out.returncode == 0, out.stdout + out.stderr
    plan = json.loads(planned[recipe][1].read_text())
    assert plan["num_parameters"] == plan["num_parameters_padded"] == num_params  # 151936 = 1187 x 128
    assert (plan["tp"], plan["pp"], plan["cp"], plan["dp"]) == layout
    if hf.get("num_experts"):  # 8 of 128 experts per token: 3.35B active (Qwen's "A3B"), experts over EP 8
        assert plan["num_parameters_active"] == 3_353_032_704 and (plan["ep"], plan["etp"]) == (8, 1)
        assert plan["fits_recompute"] and not plan["fits"]
        eight = planned[f"{recipe}-8-gpus"][0].result()  # the same recipe on 8 GPUs
        assert eight.returncode == 1 and not json.loads(eight.stdout)["fits_recompute"]  # expert-DP 1: no room


@pytest.mark.parametrize(
    "override, gpus, field",
    [("actor.parallel.tp=3", 64, "actor.parallel.tp=3 must divide num_attention_heads=40"),
     ("actor.parallel.pp=3", 64, "actor.parallel.pp=3"),
     ("actor.parallel.tp=10", 80, "num_key_value_heads=8"),
     ("actor.n_minibatches=3", 64, "actor.n_minibatches=3"),
     ("actor.parallel.cp=1", 40, "GPU count 40"),
     ("actor.vocab_divisible_by=100", 64, "padded vocab"),
     ("actor.parallel.ep=2", 64, "actor.parallel.ep=2: Qwen2ForCausalLM is not a mixture-of-experts model"),
     ("moe:actor.parallel.ep=3", 16, "actor.parallel.ep=3 must divide num_experts=128"),
     ("moe:actor.parallel.ep=16", 16, "not divisible by actor.parallel.ep*etp*pp = 16*2*1"),
     ("moe:actor.parallel.sequence_parallel=false", 16, "needs actor.parallel.sequence_parallel=true")],
)
def test_invalid_layout_names_the_field(override, gpus, field):
    from megatron_bapo.planner import PlanError, inputs_from_run_yaml, validate_layout

    cfg, hf = CFG_32B, HF_32B
    if override.startswith("moe:"):
        override = override[4:]
        cfg, hf = ROOT / "examples/configs/qwen3-30b-a3b-bapo.yaml", ROOT / "examples/configs/qwen3-30b-a3b-config.json"
        if "ep=16" in override:
            override = [override, "actor.parallel.etp=2"]
    inputs = inputs_from_run_yaml(cfg, override if isinstance(override, list) else [override], hf_config=hf,
                                  num_gpus=gpus)
    with pytest.raises(PlanError, match=field.replace("*", r"\*")):
        validate_layout(inputs)


def test_cli_exit_status_on_invalid_layout(planned):
    out = planned["32b-tp3"][0].result()
    assert out.returncode == 2 and "actor.parallel.tp=3" in out.stderr


def _measure(rank, world_size, tp, pp, hf_config, ep=1):
    """Bytes a real actor holds on this rank after one Adam step, and the bytes its forward saves."""
    from test_actor_helpers import make_batch

    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.models.parallel import ParallelConfig

    cfg = ActorConfig(
        optim=OptimConfig(name="adam", lr=1e-3), parallel=ParallelConfig(tp=tp, pp=pp, ep=ep),
        max_tokens_per_microbatch=SEQ, use_distributed_optimizer=False, vocab_divisible_by=64,
    )
    actor = Actor(cfg, hf_config)
    actor.train_step(make_batch(num_seqs=4, max_len=SEQ))
    params = [p for chunk in actor.model for p in chunk.parameters()]
    out = {
        "num_params": sum(p.numel() for p in params),
        "params": sum(p.numel() * p.element_size() for p in params),
        "grads": sum(p.main_grad.numel() * p.main_grad.element_size() for p in params),
    }
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    state = 0
    for opt in optimizers:
        for st in opt.optimizer.state.values():
            state += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t) and t.numel() > 1)
    out["optimizer"] = state
    if pp == 1:  # activations saved by one forward of one SEQ-token sequence (parameters excluded)
        model = actor.model[0]
        model.train()
        owned = {p.untyped_storage().data_ptr() for p in params}
        seen: dict[int, int] = {}

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in owned:
                seen.setdefault(s.data_ptr(), s.nbytes())
            return t

        ids = torch.randint(1, 100, (1, SEQ))
        pos = torch.arange(SEQ).unsqueeze(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, pos, None)
        out["saved"] = sum(seen.values())
    return out


# The inner loop keeps PP 2 (Qwen2) and EP 2 (Qwen3-MoE); the TP 2 layouts (8-10 s each) run in the full suite.
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if "tp2" in name else name
                                    for name in MODEL_STATE_LAYOUTS])
def test_model_state_matches_a_real_cpu_actor(run_dist, planned, layout):
    tp, pp, hf_config, ep = MODEL_STATE_LAYOUTS[layout]
    out = planned[layout][0].result()  # tools/plan.py --gpus 2 --json on _model_state_run's YAML
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    # HF count: tied embedding once, vocab padding (100 -> 128) excluded
    if hf_config is TINY:
        assert hf_num_params(TINY) == 100 * 64 + 2 * (64 * 64 + 64 + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    assert plan["num_parameters"] == hf_num_params(hf_config)
    measured = run_dist(_measure, 2, tp, pp, hf_config, ep, timeout=240)
    stages = ["only"] if pp == 1 else ["first", "last"]
    for rank, stage in enumerate(stages if pp > 1 else stages * 2):
        want, got = plan["stages"][stage], measured[rank]
        for key in ("num_params", "params", "grads", "optimizer"):
            assert want[key] == got[key], (stage, key, want[key], got[key])
    if ep > 1:  # each rank holds half the experts: the planner's count is its count
        assert plan["stages"]["only"]["num_params"] < hf_num_params(hf_config) - 4 * 64  # ep halves the experts
    if pp == 1:
        h = hf_config["hidden_size"]
        # decoder layers + the final norm's saved input/output/linear input (3h per token)
        estimate = plan["stages"]["only"]["activations"] + 3 * SEQ * h * 4
        assert measured[0]["saved"] == pytest.approx(estimate, rel=0.1)
