"""Rollout client overhead per request, against an in-process stand-in server (no model).

The server (`tests/fake_server.py`) answers `/generate` in SGLang's response shape at
once, so the time per request is HTTP + JSON + the client's own work. Three ways to send the same
requests, all with up to `--concurrency` in flight:
  raw      bare aiohttp POSTs (the floor: what any HTTP client pays)
  client   RolloutClient.agenerate (whitelist, rid, server choice, retries, reply parsing)
  manager  PartialRolloutManager.step (group sampling + buffer bookkeeping on top)
Prints requests/s and us/request for each and the client's extra us/request over raw.
The server shares this process (and its GIL), so read the ratios, not the absolute numbers.

    python benchmarks/bench_client.py [--requests 4000] [--concurrency 64] [--tokens 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import asyncio
import time
import uuid

import aiohttp

from megatron_bapo.rollout import (PartialRolloutConfig, PartialRolloutManager, Prompt, RolloutClient,
                                   RolloutClientConfig, SamplingConfig)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from fake_server import ThreadedFakeServer  # noqa: E402 - the test double lives with the tests


async def raw(url: str, n: int, concurrency: int, tokens: int) -> float:
    sem = asyncio.Semaphore(concurrency)
    payload = {"input_ids": [5, 6, 7, 8], "return_logprob": True,
               "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            async with sem:
                async with session.post(f"{url}/generate", json={**payload, "rid": uuid.uuid4().hex}) as resp:
                    await resp.json()
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return time.perf_counter() - t0


async def via_client(client: RolloutClient, n: int, tokens: int) -> float:
    params = {"max_new_tokens": tokens, "ignore_eos": True}
    t0 = time.perf_counter()
    await asyncio.gather(*(client.agenerate([5, 6, 7, 8], params) for _ in range(n)))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per way")
    args = ap.parse_args()
    n = args.requests
    with ThreadedFakeServer(weight_version="0") as server:
        results = {"raw": float("inf"), "client": float("inf"), "manager": float("inf")}
        asyncio.run(raw(server.url, 200, args.concurrency, args.tokens))  # warm-up
        with RolloutClient(RolloutClientConfig(urls=[server.url], max_concurrency=args.concurrency)) as client:
            client.run(via_client(client, 200, args.tokens))
            cfg = PartialRolloutConfig(group_size=args.group_size, max_response_tokens=args.tokens,
                                       sampling=SamplingConfig(ignore_eos=True))
            manager = PartialRolloutManager(client, cfg)
            prompts = [Prompt(prompt_ids=[5, 6, 7, i % 50 + 2], index=i) for i in range(n // args.group_size)]
            n_manager = len(prompts) * args.group_size
            for _ in range(args.repeats):  # interleaved, best of each: the machine's load varies
                results["raw"] = min(results["raw"], asyncio.run(raw(server.url, n, args.concurrency, args.tokens)))
                results["client"] = min(results["client"], client.run(via_client(client, n, args.tokens)))
                t0 = time.perf_counter()
                groups = manager.step(prompts, 0).groups
                results["manager"] = min(results["manager"], time.perf_counter() - t0)
                assert len(groups) == len(prompts)
    print(f"{n} requests, concurrency {args.concurrency}, {args.tokens} tokens/reply (in-process stand-in server)")
    for name, secs in results.items():
        count = n_manager if name == "manager" else n
        print(f"  {name:8s} {count / secs:9.0f} req/s  {secs / count * 1e6:8.0f} us/request")
    extra = (results["client"] - results["raw"]) / n * 1e6
    print(f"  client overhead over raw aiohttp: {extra:+.0f} us/request "
          f"({results['client'] / results['raw']:.2f}x the raw time)")


if __name__ == "__main__":
    main()
