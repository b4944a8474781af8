"""Training throughput of the actor on this machine: tiny Qwen2 model, one process, CPU (or GPU).

Prints tokens/s of full BAPO optimizer steps (forward-only search pass + forward/backward +
optimizer), counting all real (non-padding) tokens and, separately, loss tokens; once with
`old_logprobs: rollout` and once with `recompute` (+ TIS), with each phase's share of the step
(`Actor.phase_times`): the recompute pass is one forward-only pass over the batch, of which the
first mini-batch's forward is reused as its search pass.

    python benchmarks/bench_actor.py [--hidden 128 --layers 4 --seqs 32 --len 64 --steps 5 --minibatches 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=100)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget", type=int, default=1024, help="max tokens per micro-batch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--minibatches", type=int, default=4, help="optimizer steps per train_step (n_minibatches)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29591")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from test_actor_helpers import make_batch

    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor

    hf = dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=args.hidden, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=args.hidden * 2, num_hidden_layers=args.layers, vocab_size=args.vocab,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=args.len * 2,
    )
    batches = [make_batch(num_seqs=args.seqs, max_len=args.len, vocab=args.vocab, seed=s) for s in range(args.steps + 1)]
    real = sum(int(b["attention_mask"].sum()) for b in batches[1:])
    loss_tokens = sum(int(b["loss_mask"][:, 1:].sum()) for b in batches[1:])
    print(f"batch {args.seqs} x {args.len}, {args.minibatches} mini-batches; threads={torch.get_num_threads()}")
    for mode, correction in (("rollout", "none"), ("recompute", "tis")):
        cfg = ActorConfig(optim=OptimConfig(lr=1e-4), max_tokens_per_microbatch=args.budget,
                          n_minibatches=args.minibatches, old_logprobs=mode, correction={"mode": correction},
                          mismatch={"warn_kl": None})  # synthetic behavior log-probs: no warning
        actor = Actor(cfg, hf)
        actor.train_step(batches[0])  # warm-up
        phases = dict.fromkeys(actor.phase_times, 0.0)
        t0 = time.perf_counter()
        for b in batches[1:]:
            actor.train_step(b)
            for k, v in actor.phase_times.items():
                phases[k] += v
        elapsed = time.perf_counter() - t0
        params = sum(p.numel() for m in actor.model for p in m.parameters())
        shares = ", ".join(f"{k} {v / elapsed:.0%}" for k, v in phases.items())
        print(f"old_logprobs {mode:9s} ({params/1e6:.2f}M params): {elapsed / args.steps * 1000:.0f} ms/step, "
              f"{real / elapsed:.0f} tokens/s, {loss_tokens / elapsed:.0f} loss tokens/s; share of the step: {shares}")


if __name__ == "__main__":
    main()
