"""Built-in server generation throughput at 1, 8 and 32 concurrent requests (tokens/s).

Starts the server on the tiny checkpoint (or `--model-path`), sends `--requests-per-level` requests
per concurrency level from an aiohttp client (sampled, temperature 1, `ignore_eos`, fixed
`max_new_tokens`), and prints generated tokens/s and mean latency per level, plus the speedup over
one request at a time. Numbers depend on the machine and its load: compare within one run.

    python benchmarks/bench_server.py [--model-path DIR] [--max-new-tokens 64] [--num-threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

import aiohttp

from megatron_bapo.server.launch import start_server


async def run_level(url: str, concurrency: int, num_requests: int, max_new_tokens: int, prompt_len: int,
                    vocab: int) -> tuple[float, float, int]:
    rng = random.Random(concurrency)
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens = 0

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        body = {"input_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)], "return_logprob": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0, "ignore_eos": True}}
        async with sem:
            t0 = time.perf_counter()
            async with session.post(url + "/generate", json=body) as resp:
                out = await resp.json()
                assert resp.status == 200, out
            latencies.append(time.perf_counter() - t0)
            tokens += len(out["output_ids"])

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(session) for _ in range(num_requests)))
        wall = time.perf_counter() - t0
    return tokens / wall, sum(latencies) / len(latencies), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None, help="HF checkpoint (default: a fresh tiny random one)")
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--requests-per-level", type=int, default=None, help="default: 2 x max(level, 4)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--num-threads", type=int, default=1)
    args = ap.parse_args()

    model_path = args.model_path
    if model_path is None:
        from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

        model_path = str(make_tiny_hf_checkpoint(tempfile.mkdtemp(prefix="bench_server_"), seed=0))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    with start_server(model_path, extra_args=["--num-threads", str(args.num_threads)]) as handle:
        asyncio.run(run_level(handle.url, 4, 4, 8, args.prompt_len, vocab))  # warm-up
        print(f"built-in server on {model_path}: max_new_tokens={args.max_new_tokens}, "
              f"prompt_len={args.prompt_len}, num_threads={args.num_threads}")
        print(f"{'concurrency':>11} {'requests':>8} {'tokens':>7} {'tokens/s':>9} {'mean latency s':>14} {'speedup':>8}")
        base = None
        for level in [int(x) for x in args.levels.split(",")]:
            num = args.requests_per_level or 2 * max(level, 4)
            tps, lat, toks = asyncio.run(run_level(handle.url, level, num, args.max_new_tokens, args.prompt_len, vocab))
            base = base or tps
            print(f"{level:>11} {num:>8} {toks:>7} {tps:>9.1f} {lat:>14.3f} {tps / base:>7.2f}x")


if __name__ == "__main__":
    main()
