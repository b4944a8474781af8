"""What `sync.verify` costs and how far apart its probe puts same and other weights.

    python benchmarks/bench_verify.py [--part hash|probe|all] [--mb 512]

`--part hash`: seconds per GB of each step of `sync.verify=checksum` on this machine's CPUs, then
scaled to the 32B recipe (Qwen2.5-32B, 32.8e9 parameters in bf16 = 65.5 GB per sync):
- SGLang's CPU hash (`served_layout.cpu_tensor_hash`: sha256 of the raw bytes), one thread, and one
  tensor per thread over all cores (`ExpectedChecksums` hashes a bucket that way);
- SGLang's GPU hash in its torch port (`served_layout.gpu_tensor_hash`) on the CPU (on a GPU it runs
  on the device: not measured here, the GPU figure printed is an estimate from memory bandwidth);
- the server layout itself (`ServedLayout`: the qkv / gate_up concatenation, a copy of those bytes).
`--part probe`: on the tiny model (megatron actor, TP 1, fp32) against the built-in server: the probe
KL (`sync.verify.probe_kl`, `sync.probe_tokens` tokens) for the same weights served in fp32 and in
bfloat16, for the weights of one optimizer step before (Adam, the tiny recipe's lr 1e-4), and for a
single corrupted tensor of several kinds; and the seconds of one actor probe forward and one server
prefill.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PARAMS_32B, BYTES_32B = 32.8e9, 32.8e9 * 2
HBM_GBS = 4800.0  # H200 HBM3e peak, GB/s (vendor figure): for the labelled GPU estimate only


def _time(fn, *args, repeat: int = 1) -> float:
    fn(*args)  # warm-up
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn(*args)
    return (time.perf_counter() - t0) / repeat


def part_hash(mb: int) -> None:
    from megatron_bapo.convert.served_layout import ServedLayout, cpu_tensor_hash, gpu_tensor_hash
    from megatron_bapo.sync.verify import ExpectedChecksums

    n = mb * 2**20 // 2
    tensors = [torch.randn(n // 8, dtype=torch.float32).to(torch.bfloat16) for _ in range(8)]  # 8 bf16 tensors
    gb = sum(t.numel() * 2 for t in tensors) / 1e9
    one = _time(lambda: [cpu_tensor_hash(t) for t in tensors]) / gb
    cfg = {"architectures": ["Qwen2ForCausalLM"], "tie_word_embeddings": False}
    named = [(f"model.layers.{i}.mlp.down_proj.weight", t) for i, t in enumerate(tensors)]
    threads = _time(lambda: ExpectedChecksums(cfg, torch.bfloat16, "cpu").add(named)) / gb
    small = tensors[0][: 2**22]  # 8 MB: the torch port on a CPU is slow
    port = _time(gpu_tensor_hash, small) / (small.numel() * 2 / 1e9)
    parts = [(f"model.layers.0.mlp.{k}_proj.weight", t) for k, t in (("gate", tensors[0]), ("up", tensors[1]))]
    fuse = _time(lambda: ServedLayout(cfg, torch.bfloat16).add(*parts[0]) + ServedLayout(cfg, torch.bfloat16).add(*parts[1])) \
        / (2 * tensors[0].numel() * 2 / 1e9)
    cores = os.cpu_count()
    print(f"checksum costs on this machine ({cores} cores, {gb:.2f} GB of bf16 tensors):")
    print(f"  sha256 (SGLang's CPU hash), 1 thread:        {one:6.3f} s/GB -> 32B (65.5 GB): {one * 65.5:7.1f} s")
    print(f"  sha256, one tensor per thread ({cores} threads):  {threads:6.3f} s/GB -> 32B: {threads * 65.5:7.1f} s")
    print(f"  GPU hash, torch port, on this CPU:           {port:6.1f} s/GB -> 32B: {port * 65.5:7.0f} s")
    print(f"  server layout (copy of a fused tensor):      {fuse:6.3f} s/GB (qkv + gate_up: ~60% of a dense model)")
    print(f"  ESTIMATE, not measured: SGLang's Triton hash reads each byte once: >= {65.5 / HBM_GBS * 1e3:.0f} ms for "
          f"65.5 GB at {HBM_GBS:.0f} GB/s (H200 HBM); its torch port runs ~30 int64 passes per 4-byte word: "
          f"~{65.5 / 4 * 8 * 30 / HBM_GBS:.1f} s on one H200")


def _probe_setup():
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29593")
    sys.path.insert(0, str(ROOT / "tests"))


def part_probe(tokens: int) -> None:
    _probe_setup()
    from safetensors.torch import load_file, save_file
    from test_actor_helpers import make_batch
    from transformers import AutoConfig

    from megatron_bapo.actor import ActorConfig, OptimConfig
    from megatron_bapo.actor.actor import Actor
    from megatron_bapo.convert import load_hf_into_model
    from megatron_bapo.rollout import RolloutClientConfig
    from megatron_bapo.rollout.client import RolloutClient
    from megatron_bapo.server.launch import start_server
    from megatron_bapo.sync.verify import actor_probe, probe_kl
    from megatron_bapo.tiny.checkpoint import make_tiny_hf_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="bench_verify_"))
    try:
        base = make_tiny_hf_checkpoint(tmp / "base", seed=0)
        hf = AutoConfig.from_pretrained(base)
        actor = Actor(ActorConfig(optim=OptimConfig(lr=1e-4), vocab_divisible_by=64, mismatch={"warn_kl": None}), hf)
        load_hf_into_model(actor.model, str(base), hf_config=hf)
        t0 = time.perf_counter()
        probe = actor_probe(actor, hf.vocab_size, tokens)
        forward_s = time.perf_counter() - t0
        weights = load_file(str(base / "model.safetensors"))
        variants = {}
        for kind in ("noise 1e-2", "zeroed", "rows permuted"):
            name = "model.layers.1.mlp.down_proj.weight" if kind != "rows permuted" else "model.layers.0.self_attn.k_proj.weight"
            bad = dict(weights)
            t = weights[name]
            g = torch.Generator().manual_seed(0)
            bad[name] = {"noise 1e-2": lambda: t + 1e-2 * t.std() * torch.randn(t.shape, generator=g),
                         "zeroed": lambda: torch.zeros_like(t),
                         "rows permuted": lambda: t[torch.randperm(t.shape[0], generator=g)]}[kind]().contiguous()
            d = tmp / kind.replace(" ", "_")
            shutil.copytree(base, d)
            save_file(bad, str(d / "model.safetensors"), metadata={"format": "pt"})
            variants[f"{kind} ({name})"] = d
        rows = []
        for dtype in ("float32", "bfloat16"):
            with start_server(base, log_path=tmp / f"server_{dtype}.log", extra_args=["--dtype", dtype]) as server, \
                    RolloutClient(RolloutClientConfig(urls=[server.url])) as client:
                def score() -> list[float]:
                    return client.run(client.ascore(server.url, list(probe.token_ids)))
                prefill_s = _time(score, repeat=3)
                rows.append((f"same weights, server {dtype}", probe_kl(probe.logprobs, score())))
                if dtype == "float32":
                    for label, path in variants.items():
                        client.update_weights_from_disk(str(path), 1)
                        rows.append((f"one corrupted tensor: {label}", probe_kl(probe.logprobs, score())))
                    client.update_weights_from_disk(str(base), 2)
                    actor.train_step(make_batch(num_seqs=8, max_len=24, vocab=hf.vocab_size, seed=1))
                    stale = actor_probe(actor, hf.vocab_size, tokens)
                    rows.append(("stale: the weights before one Adam step (lr 1e-4)", probe_kl(stale.logprobs, score())))
        print(f"probe KL on the tiny model ({tokens} tokens, actor fp32 TP 1 vs the built-in server):")
        for label, kl in rows:
            print(f"  {label:72s} {kl:.3e}")
        print(f"one actor probe forward: {forward_s * 1e3:.0f} ms (first, incl. warm-up); one server prefill of the "
              f"probe: {prefill_s * 1e3:.1f} ms")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("hash", "probe", "all"), default="all")
    ap.add_argument("--mb", type=int, default=512, help="MB of bf16 tensors hashed per measurement")
    ap.add_argument("--probe-tokens", type=int, default=128)
    args = ap.parse_args()
    if args.part in ("hash", "all"):
        part_hash(args.mb)
    if args.part in ("probe", "all"):
        part_probe(args.probe_tokens)


if __name__ == "__main__":
    main()
