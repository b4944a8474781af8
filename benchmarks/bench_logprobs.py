"""Peak extra memory of chunked vs unchunked log-prob + entropy computation (forward + backward).

Each variant runs in its own subprocess; the number is the growth of the process's peak RSS after
the logits and the upstream gradients exist (so both variants pay for the logits' own gradient,
which any method must produce). Unchunked = fp32 log_softmax over all tokens, as a naive actor does.

    python benchmarks/bench_logprobs.py [--tokens 16384] [--vocab 32768] [--chunk 1024]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def naive_logprobs_entropy(logits, targets):
    """The unchunked reference: a full fp32 log-softmax over the vocabulary (what chunking avoids)."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _child(variant: str, tokens: int, vocab: int, chunk: int) -> dict:
    import torch

    torch.manual_seed(0)
    logits = torch.randn(tokens, vocab).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))
    w_lp, w_ent = torch.randn(tokens), torch.randn(tokens)
    grad_buffer = torch.zeros(tokens, vocab)  # the logits' gradient: both variants must produce it
    grad_buffer += 1.0
    del grad_buffer
    base = _peak_mb()
    t0 = time.perf_counter()
    if variant == "chunked":
        from megatron_bapo.actor.logprobs import vocab_parallel_logprobs

        lp, ent = vocab_parallel_logprobs(logits, targets, chunk_size=chunk)
    else:
        lp, ent = naive_logprobs_entropy(logits, targets)
    (lp * w_lp + ent * w_ent).sum().backward()
    elapsed = time.perf_counter() - t0
    return {"variant": variant, "extra_peak_mb": _peak_mb() - base, "seconds": elapsed,
            "logits_mb": tokens * vocab * 4 / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.tokens, args.vocab, args.chunk)))
        return
    results = {}
    for variant in ("chunked", "unchunked"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--vocab", str(args.vocab),
             "--chunk", str(args.chunk)],
            check=True, capture_output=True, text=True,
        )
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    c, u = results["chunked"], results["unchunked"]
    print(f"tokens={args.tokens} vocab={args.vocab} chunk={args.chunk} fp32 logits={c['logits_mb']:.0f} MiB")
    print(f"chunk x vocab fp32 = {args.chunk * args.vocab * 4 / 2**20:.0f} MiB")
    for r in (c, u):
        print(f"{r['variant']:>10}: extra peak {r['extra_peak_mb']:8.0f} MiB   fwd+bwd {r['seconds']:.2f} s")
    print(f"unchunked / chunked extra peak memory: {u['extra_peak_mb'] / max(c['extra_peak_mb'], 1.0):.1f}x")


if __name__ == "__main__":
    main()
