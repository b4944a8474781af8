"""Peak RSS of offline conversion vs checkpoint size and largest shard (one run, numbers printed).

Writes a random Llama-shaped HF checkpoint (default ~0.66 GB fp32 in ~100 MB shards) tensor by
tensor, then runs `--to-megatron` and `--to-hf` each in a fresh subprocess and reports its peak RSS
(ru_maxrss) minus the RSS of a subprocess that only imports the same modules.

  python benchmarks/bench_convert.py [--hidden 1024 --layers 8 --shard-mb 100]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import resource, sys, time
sys.path.insert(0, {root!r})
import torch
from megatron_bapo.models import cpu_compat
cpu_compat.install()
from megatron_bapo.convert.offline import hf_to_megatron, megatron_to_hf, ensure_single_process_groups
import megatron.core.dist_checkpointing, megatron.core.models.gpt  # noqa: F401  (same imports as a real run)
ensure_single_process_groups()
mode, a, b, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
t = time.time()
if mode == "to-megatron":
    hf_to_megatron(a, b)
elif mode == "to-hf":
    megatron_to_hf(a, b, max_shard_bytes=shard)
print(f"RESULT {{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}} {{time.time() - t:.2f}}")
"""


def make_checkpoint(out: Path, hidden: int, layers: int, vocab: int, shard_bytes: int) -> int:
    import torch

    from megatron_bapo.convert.hf_io import HFShardWriter

    ffn = int(hidden * 2.75) // 64 * 64
    heads, kv = hidden // 64, max(hidden // 256, 1)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, intermediate_size=ffn,
               num_attention_heads=heads, num_key_value_heads=kv, num_hidden_layers=layers, vocab_size=vocab,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=4096,
               hidden_act="silu", torch_dtype="float32")
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    w = HFShardWriter(out, max_shard_bytes=shard_bytes)
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    w.add("model.embed_tokens.weight", r(vocab, hidden))
    hd = hidden // heads
    for i in range(layers):
        p = f"model.layers.{i}."
        w.add(p + "input_layernorm.weight", torch.ones(hidden))
        w.add(p + "self_attn.q_proj.weight", r(heads * hd, hidden))
        w.add(p + "self_attn.k_proj.weight", r(kv * hd, hidden))
        w.add(p + "self_attn.v_proj.weight", r(kv * hd, hidden))
        w.add(p + "self_attn.o_proj.weight", r(hidden, heads * hd))
        w.add(p + "post_attention_layernorm.weight", torch.ones(hidden))
        w.add(p + "mlp.gate_proj.weight", r(ffn, hidden))
        w.add(p + "mlp.up_proj.weight", r(ffn, hidden))
        w.add(p + "mlp.down_proj.weight", r(hidden, ffn))
    w.add("model.norm.weight", torch.ones(hidden))
    w.add("lm_head.weight", r(vocab, hidden))
    w.close()
    return w._total


def run_child(mode: str, a: str, b: str, shard: int) -> tuple[int, float]:
    proc = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), mode, a, b, str(shard)],
                          capture_output=True, text=True, timeout=3600)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if proc.returncode or not line:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-3000:]}")
    rss, secs = line[-1].split()[1:]
    return int(rss), float(secs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=100)
    args = ap.parse_args()
    mb = 2**20
    tmp = Path(tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        hf, mg, back = tmp / "hf", tmp / "mg", tmp / "back"
        t = time.time()
        total = make_checkpoint(hf, args.hidden, args.layers, args.vocab, args.shard_mb * mb)
        shards = sorted(hf.glob("*.safetensors"))
        largest = max(f.stat().st_size for f in shards)
        print(f"checkpoint: {total / mb:.0f} MiB in {len(shards)} shards, largest shard {largest / mb:.0f} MiB "
              f"(written in {time.time() - t:.1f} s)")
        base, _ = run_child("imports-only", "", "", 0)
        print(f"baseline RSS (imports + process group): {base / mb:.0f} MiB")
        for mode, a, b in (("to-megatron", hf, mg), ("to-hf", mg, back)):
            rss, secs = run_child(mode, str(a), str(b), args.shard_mb * mb)
            extra = rss - base
            print(f"{mode:12s}: peak RSS {rss / mb:.0f} MiB = baseline + {extra / mb:.0f} MiB; "
                  f"extra / total size = {extra / total:.2f}, extra / largest shard = {extra / largest:.2f}; {secs:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
