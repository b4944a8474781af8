"""The measurements `tools/gpu_check.sh` prints, on one GPU (each part also runs on a CPU at `--tiny` sizes).

Parts (`--parts`, comma-separated, default all):
  env       the device, torch / CUDA / megatron-core versions, the layer spec the actor will run (and
            why), and the peak bf16 FLOP/s that MFU is computed against (spec-sheet dense figure for
            the device; `--peak-tflops` overrides it);
  actor     bf16 BAPO steps of random Qwen2.5-0.5B- and 1.5B-shaped models (packed micro-batches,
            `search_scope: minibatch`, distributed optimizer) in a one-rank world over NCCL: tokens/s,
            MFU, peak memory, and the share of a step in the search pass (forward-only + search),
            forward/backward and the optimizer;
  logprobs  chunked vs naive log-probs + entropy (forward and backward) at 32k and 64k tokens x the
            152k Qwen vocabulary: peak memory beyond the logits and their gradient (the naive fp32
            log-softmax may run out of memory: reported as such);
  search    the bound search over 2M tokens: one pass + one collective vs the per-step loop vs one
            evaluation of the loss.

Model FLOPs (for MFU) of one optimizer step: the forward-only search pass plus forward and backward,
4 x (2 x matmul parameters x tokens + 2 x layers x heads x head_dim x sum of squared sequence
lengths) (causal attention, packed sequences attend within themselves; no recompute counted).

    python benchmarks/gpu_bench.py [--parts env,actor,logprobs,search] [--steps 10] [--out DIR] [--tiny]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

QWEN = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6,
            rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True)
MODELS = {
    "qwen2.5-0.5b": dict(QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(QWEN, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096),
}
PEAK_BF16_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0))
"""Dense bf16 tensor-core peaks from NVIDIA's data sheets (SXM unless named), matched by device-name prefix."""


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_memory_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")


def peak_tflops(device_name: str, override: float = 0.0) -> float:
    """The peak bf16 TFLOP/s MFU divides by (0.0 when unknown: MFU is then not computed)."""
    if override:
        return override
    name = device_name.replace("NVIDIA ", "")
    return next((peak for prefix, peak in PEAK_BF16_TFLOPS if name.startswith(prefix)), 0.0)


def env_report(override_tflops: float = 0.0) -> dict[str, Any]:
    import megatron.core

    from megatron_bapo.models.layer_spec import resolve_layer_spec

    cuda = torch.cuda.is_available()
    name = torch.cuda.get_device_name() if cuda else "cpu"
    spec = resolve_layer_spec("auto")
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "megatron_core": megatron.core.__version__,
            "layer_spec": "transformer_engine" if spec.use_te else "local", "layer_spec_reason": spec.reason,
            "peak_bf16_tflops": peak_tflops(name, override_tflops)}


def lengths_mix(num: int, lo: int, hi: int, seed: int) -> list[int]:
    """RL-like lengths: log-normal, clipped to [lo, hi], one at the limit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(torch.log(torch.tensor(float(lo))) + 1.5 + 1.3 * torch.randn(num, generator=g))
    out = [int(n) for n in x.clamp(lo, hi).round().long().tolist()]
    out[0] = hi
    return out


def rl_batch(lengths: list[int], vocab: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    cols = torch.arange(width).unsqueeze(0)
    lens = torch.tensor(lengths).unsqueeze(1)
    attn = (cols < lens).long()
    prompt = torch.clamp(lens // 4, min=1)
    loss_mask = ((cols >= prompt) & (attn > 0)).float()
    return {"input_ids": torch.randint(1, vocab, (len(lengths), width), generator=g) * attn, "attention_mask": attn,
            "loss_mask": loss_mask, "behavior_logprobs": (-torch.rand(len(lengths), width, generator=g) * 2 - 9) * loss_mask,
            "advantages": torch.randn(len(lengths), 1, generator=g).expand(-1, width) * loss_mask, "temperature": 1.0}


def step_flops(hf: dict, lengths: list[int]) -> float:
    """Model FLOPs of one BAPO optimizer step over sequences of `lengths` (see the module docstring)."""
    h, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
    d = h // heads
    kv = hf["num_key_value_heads"] * d
    per_layer = h * (heads * d + 2 * kv) + heads * d * h + 3 * h * hf["intermediate_size"]
    matmul_params = layers * per_layer + h * hf["vocab_size"]
    forward = 2 * matmul_params * sum(lengths) + 2 * layers * heads * d * sum(n * n for n in lengths)
    return 4.0 * forward


def actor_steps(model: str, *, steps: int, seqs: int, min_len: int, max_len: int, budget: int, peak: float,
                dtype: str, old_logprobs: str = "rollout") -> dict[str, Any]:
    """`steps` timed BAPO optimizer steps (after one warm-up) of a randomly initialised model;
    `old_logprobs: recompute` (TIS) adds the recompute pass, reported as its share of the step."""
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor

    hf = MODELS[model]
    cfg = ActorConfig(optim=OptimConfig(lr=1e-6), dtype=dtype, packing=True, max_tokens_per_microbatch=budget,
                      search_scope="minibatch", use_distributed_optimizer=True, old_logprobs=old_logprobs,
                      correction={"mode": "tis" if old_logprobs == "recompute" else "none"},
                      mismatch={"warn_kl": None})  # synthetic behavior log-probs
    actor = Actor(cfg, hf)
    batches = [rl_batch(lengths_mix(seqs, min_len, max_len, seed=s), hf["vocab_size"], seed=s) for s in range(steps + 1)]
    actor.train_step(batches[0])  # warm-up (allocator, kernels, jit fusers)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    seconds, flops, tokens = [], 0.0, 0
    phases = {"recompute": 0.0, "search": 0.0, "forward_backward": 0.0, "optimizer": 0.0}
    for b in batches[1:]:
        _sync()
        t0 = time.perf_counter()
        metrics = actor.train_step(b)
        _sync()
        seconds.append(time.perf_counter() - t0)
        for k in phases:
            phases[k] += actor.phase_times[k]
        lengths = [int(n) for n in b["attention_mask"].sum(-1)]
        flops += step_flops(hf, lengths)
        tokens += sum(lengths)
    total = sum(seconds)
    # the optimizer's kernels end at the sync: its share is the rest of the step
    phases["optimizer"] = max(total - phases["recompute"] - phases["search"] - phases["forward_backward"], 0.0)
    out = {"model": model, "dtype": dtype, "old_logprobs": old_logprobs, "steps": steps, "tokens_per_step": tokens / steps,
           "step_s": statistics.median(seconds), "tokens_per_s": tokens / total,
           "mfu": flops / total / (peak * 1e12) if peak else float("nan"), "peak_memory_gib": _peak_memory_gib(),
           "share": {k: v / total for k, v in phases.items()},
           "params": sum(p.numel() for m in actor.model for p in m.parameters()), "loss": metrics["actor/loss"]}
    del actor
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def logprob_memory(tokens: int, vocab: int, chunk: int, variant: str) -> dict[str, Any]:
    """Peak memory of log-probs + entropy (forward and backward) beyond the logits and their gradient."""
    from bench_logprobs import naive_logprobs_entropy

    from megatron_bapo.actor.logprobs import vocab_parallel_logprobs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=g, device=device, dtype=dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g, device=device)
    w_lp, w_ent = torch.randn(tokens, generator=g, device=device), torch.randn(tokens, generator=g, device=device)
    out: dict[str, Any] = {"variant": variant, "tokens": tokens, "vocab": vocab,
                           "logits_gib": logits.numel() * logits.element_size() / 2**30}
    if device.type == "cuda":
        _sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() + logits.numel() * logits.element_size()  # + the gradient, unavoidable
    t0 = time.perf_counter()
    try:
        if variant == "chunked":
            lp, ent = vocab_parallel_logprobs(logits, targets, chunk_size=chunk)
        else:
            lp, ent = naive_logprobs_entropy(logits, targets)
        (lp * w_lp + ent * w_ent).sum().backward()
        _sync()
        out["seconds"] = time.perf_counter() - t0
        out["extra_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else float("nan")
    except torch.OutOfMemoryError:
        out["oom"] = True
    del logits, targets, w_lp, w_ent
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def search_vs_loss(tokens: int, rounds: int) -> dict[str, Any]:
    """Our search, the per-step loop (both must agree) and one `policy_loss` forward, interleaved."""
    from bench_bound_search import per_step_loop

    from megatron_bapo.algorithms import BapoConfig, policy_loss, search_clip_bounds

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(0)
    behavior = -torch.rand(tokens, generator=g, device=device) * 4
    logp = behavior + torch.randn(tokens, generator=g, device=device) * 0.4
    ratio, adv = torch.exp(logp - behavior), torch.randn(tokens, generator=g, device=device) - 0.3
    mask = (torch.rand(tokens, generator=g, device=device) < 0.95).float()
    cfg = BapoConfig(rho0=0.6)
    ours = search_clip_bounds(ratio, adv, mask, cfg)
    low, high, steps = per_step_loop(ratio, adv, mask, cfg)
    assert abs(low - ours.c_low) < 1e-9 and abs(high - ours.c_high) < 1e-9 and steps == ours.num_steps

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            return time.perf_counter() - t0
        return run

    fns = [timed(lambda: search_clip_bounds(ratio, adv, mask, cfg)), timed(lambda: per_step_loop(ratio, adv, mask, cfg)),
           timed(lambda: policy_loss(logp, behavior, adv, mask, ours.c_low, ours.c_high))]
    for fn in fns:
        fn()
    times = [[fn() for fn in fns] for _ in range(rounds)]
    med = statistics.median
    return {"tokens": tokens, "search_steps": ours.num_steps, "search_ms": med(t[0] for t in times) * 1e3,
            "loop_ms": med(t[1] for t in times) * 1e3, "loss_ms": med(t[2] for t in times) * 1e3,
            "speedup_vs_loop": med(t[1] / t[0] for t in times), "cost_vs_loss": med(t[0] / t[2] for t in times)}


def _print_report(report: dict[str, Any]) -> None:
    env = report.get("env")
    if env:
        print(f"device {env['device']}  torch {env['torch']} (CUDA {env['cuda']})  megatron-core {env['megatron_core']}")
        print(f"layer spec: {env['layer_spec']} ({env['layer_spec_reason']}); MFU against "
              f"{env['peak_bf16_tflops']:.0f} TFLOP/s dense bf16" if env["peak_bf16_tflops"] else
              f"layer spec: {env['layer_spec']} ({env['layer_spec_reason']}); peak FLOP/s unknown: no MFU")
    for r in report.get("actor", []):
        share = "  ".join(f"{k} {v:.0%}" for k, v in r["share"].items())
        print(f"actor {r['model']} ({r['params'] / 1e6:.0f}M params, {r['dtype']}, old_logprobs "
              f"{r['old_logprobs']}): {r['tokens_per_s']:,.0f} tokens/s, "
              f"MFU {r['mfu']:.1%}, peak memory {r['peak_memory_gib']:.1f} GiB, {r['step_s']:.2f} s/step "
              f"({r['tokens_per_step']:,.0f} tokens); share of the step: {share}")
    for r in report.get("logprobs", []):
        result = "out of memory" if r.get("oom") else f"extra peak {r['extra_peak_gib']:.2f} GiB, {r['seconds'] * 1e3:.0f} ms"
        print(f"log-probs+entropy {r['variant']:8} {r['tokens']:>6} tokens x {r['vocab']} vocab "
              f"(logits {r['logits_gib']:.1f} GiB): {result}")
    s = report.get("search")
    if s:
        print(f"bound search over {s['tokens']:,} tokens ({s['search_steps']} steps): {s['search_ms']:.2f} ms; per-step "
              f"loop {s['loop_ms']:.1f} ms ({s['speedup_vs_loop']:.0f}x); one loss evaluation {s['loss_ms']:.2f} ms "
              f"(search = {s['cost_vs_loss']:.2f}x the loss)")


def main(argv: Any = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="env,actor,logprobs,search")
    ap.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seqs", type=int, default=64, help="sequences per step")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=8192, help="max tokens per micro-batch")
    ap.add_argument("--logprob-tokens", default="32768,65536")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--search-tokens", type=int, default=2_000_000)
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="override the device's peak bf16 TFLOP/s")
    ap.add_argument("--old-logprobs", default="rollout", help="rollout, recompute, or both (comma-separated)")
    ap.add_argument("--tiny", action="store_true", help="CPU-sized everything (the tests run this)")
    ap.add_argument("--out", default="", help="directory for gpu_bench.json")
    args = ap.parse_args(argv)
    if args.tiny:
        args.models, args.steps, args.seqs, args.max_len, args.budget = "tiny", 2, 6, 48, 96
        args.logprob_tokens, args.vocab, args.search_tokens = "256", 1000, 20_000
    from megatron_bapo.models.parallel import ParallelConfig, init_distributed_env, initialize_model_parallel

    init_distributed_env()
    initialize_model_parallel(ParallelConfig())  # a one-rank world: NCCL with CUDA (every collective), gloo without
    parts = args.parts.split(",")
    report: dict[str, Any] = {"env": env_report(args.peak_tflops)}
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if "actor" in parts:
        report["actor"] = [actor_steps(m, steps=args.steps, seqs=args.seqs, min_len=max(args.max_len // 64, 8),
                                       max_len=args.max_len, budget=args.budget,
                                       peak=report["env"]["peak_bf16_tflops"], dtype=dtype, old_logprobs=mode)
                           for m in args.models.split(",") for mode in args.old_logprobs.split(",")]
    if "logprobs" in parts:
        report["logprobs"] = [logprob_memory(int(n), args.vocab, 4096 if not args.tiny else 64, variant)
                              for n in args.logprob_tokens.split(",") for variant in ("chunked", "naive")]
    if "search" in parts:
        report["search"] = search_vs_loss(args.search_tokens, rounds=5 if not args.tiny else 2)
    _print_report(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_bench.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
