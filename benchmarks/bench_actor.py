"""Training throughput of the actor on this machine: tiny Qwen2 model, one process, CPU (or GPU).

Prints tokens/s of full BAPO optimizer steps (forward-only search pass + forward/backward +
optimizer), counting all real (non-padding) tokens and, separately, loss tokens.

    python benchmarks/bench_actor.py [--hidden 128 --layers 4 --seqs 32 --len 64 --steps 5]
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
    actor = Actor(ActorConfig(optim=OptimConfig(lr=1e-4), max_tokens_per_microbatch=args.budget), hf)
    batches = [make_batch(num_seqs=args.seqs, max_len=args.len, vocab=args.vocab, seed=s) for s in range(args.steps + 1)]
    actor.train_step(batches[0])  # warm-up
    t0 = time.perf_counter()
    for b in batches[1:]:
        actor.train_step(b)
    elapsed = time.perf_counter() - t0
    real = sum(int(b["attention_mask"].sum()) for b in batches[1:])
    loss_tokens = sum(int(b["loss_mask"][:, 1:].sum()) for b in batches[1:])
    params = sum(p.numel() for m in actor.model for p in m.parameters())
    print(f"model: hidden={args.hidden} layers={args.layers} params={params/1e6:.2f}M; batch {args.seqs} x {args.len}; "
          f"threads={torch.get_num_threads()}")
    print(f"{args.steps} steps in {elapsed:.2f} s: {elapsed / args.steps * 1000:.0f} ms/step, "
          f"{real / elapsed:.0f} tokens/s, {loss_tokens / elapsed:.0f} loss tokens/s")


if __name__ == "__main__":
    main()
