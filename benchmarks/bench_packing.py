"""Padded vs packed (THD) micro-batches: padding waste and actor throughput on an RL length mix.

RL responses range from a hundred tokens to the length limit. This draws sequence lengths from a
log-normal distribution clipped to [min, max] (max/min = 500 by default), builds one batch, and
runs the same full BAPO optimizer steps (forward-only search pass + forward/backward + Adam) with
`ActorConfig.packing` off and on, interleaving the two so machine drift hits both alike. It prints
the micro-batch plans (count, tokens processed, padding waste) and the median tokens/s of each,
counting real (non-padding) tokens only, and their ratio.

    python benchmarks/bench_packing.py [--seqs 64 --min-len 16 --max-len 8000 --budget 16384 --rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def lengths_mix(num: int, lo: int, hi: int, seed: int) -> list[int]:
    """Log-normal lengths clipped to [lo, hi], median about 4x lo, a few near hi."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.log(torch.tensor(float(lo))) + 1.5
    x = torch.exp(mu + 1.3 * torch.randn(num, generator=g))
    out = x.clamp(lo, hi).round().long().tolist()
    out[0] = hi  # the length limit is hit in a real RL batch
    return [int(n) for n in out]


def make_rl_batch(lengths: list[int], vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    cols = torch.arange(t).unsqueeze(0)
    lens = torch.tensor(lengths).unsqueeze(1)
    attn = (cols < lens).long()
    ids = torch.randint(1, vocab, (len(lengths), t), generator=g) * attn
    prompt = torch.full_like(lens, 8)
    loss_mask = ((cols >= prompt) & (attn > 0)).float()
    return dict(input_ids=ids, attention_mask=attn, loss_mask=loss_mask,
                behavior_logprobs=(-torch.rand(len(lengths), t, generator=g) * 3 - 4) * loss_mask,
                advantages=torch.randn(len(lengths), 1, generator=g).expand(-1, t) * loss_mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=8000)
    ap.add_argument("--budget", type=int, default=16384, help="max tokens per micro-batch")
    ap.add_argument("--rounds", type=int, default=3, help="timed train steps per layout (interleaved)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29593")
    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.actor.batching import plan_microbatches
    from megatron_bapo.actor.layout import MicroBatchLayout

    lengths = lengths_mix(args.seqs, args.min_len, args.max_len, seed=0)
    real = sum(lengths)
    print(f"lengths: {args.seqs} sequences, min {min(lengths)}, median {int(statistics.median(lengths))}, "
          f"max {max(lengths)} (max/min {max(lengths) / min(lengths):.0f}), {real} tokens; budget {args.budget}")
    for packed in (False, True):
        layout = MicroBatchLayout(packed=packed)
        plan = plan_microbatches(lengths, 1, args.budget, cost=layout.cost)[0]
        processed = sum(layout.cost([lengths[i] for i in mb]) for mb in plan)
        print(f"  {'packed' if packed else 'padded'}: {len(plan)} micro-batches, {processed} tokens processed, "
              f"padding waste {1 - real / processed:.1%}")

    hf = dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=args.hidden, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=args.hidden * 2, num_hidden_layers=args.layers, vocab_size=args.vocab,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=args.max_len * 2,
    )
    actors = {}
    for packed in (False, True):
        cfg = ActorConfig(optim=OptimConfig(lr=1e-5), max_tokens_per_microbatch=args.budget, packing=packed,
                          use_distributed_optimizer=False)
        actors[packed] = Actor(cfg, hf)  # both share one parallel state; weights are not compared
    batch = make_rl_batch(lengths, args.vocab, seed=1)
    times: dict[bool, list[float]] = {False: [], True: []}
    for packed in (False, True):
        actors[packed].train_step(batch)  # warm-up
    for _ in range(args.rounds):
        for packed in (False, True):
            t0 = time.perf_counter()
            actors[packed].train_step(batch)
            times[packed].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for m in actors[True].model for p in m.parameters())
    print(f"model: hidden={args.hidden} layers={args.layers} params={params / 1e6:.2f}M; threads={torch.get_num_threads()}; "
          f"median of {args.rounds} interleaved steps")
    for packed in (False, True):
        print(f"  {'packed' if packed else 'padded'}: {med[packed]:.2f} s/step, {real / med[packed]:.0f} tokens/s")
    print(f"packed / padded throughput: {med[False] / med[True]:.2f}x")


if __name__ == "__main__":
    main()
