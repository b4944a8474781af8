"""Bytes each rank puts on the wire per weight sync, before and after one sender per pipeline stage.

The weight export gathers the live weights to the first pipeline stage (`convert.iter_hf_tensors`,
`gather_to="first"`), as both syncs do (disk: rank 0 writes; distributed: rank 0 broadcasts to the
servers). At 1b21a04 every TP rank of a later stage sent its stage's full tensors to its stage-0 peer
and only rank 0's copy was used: TP times the bytes. Now TP rank 0 of each stage sends, once.

Measured on gloo, in one run: 4 ranks (TP 2 x PP 2) on a random model of `--layers` x `--hidden`
(megatron-core, fp32), once with the code of `--before` (`git archive` into a temporary directory)
and once with this working tree; each rank counts the bytes it sends point-to-point (the pipeline
transfers) and the bytes its TP all-gathers contribute. Then the same counts for the 32B recipe
(Qwen2.5-32B, TP 8, PP 2, bf16), from its parameter count: a later stage's weights once, or TP times.

    python benchmarks/bench_export_bytes.py [--before 1b21a04] [--layers 8 --hidden 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import json, os, sys
import torch
import torch.distributed as dist
from megatron_bapo.convert import iter_hf_tensors
from megatron_bapo.models.builder import build_gpt_model
from megatron_bapo.models.parallel import ParallelConfig, initialize_model_parallel

out, layers, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
groups = initialize_model_parallel(ParallelConfig(tp=2, pp=2), seed=1)
cfg = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=hidden, num_attention_heads=8,
           num_key_value_heads=4, intermediate_size=hidden * 3, num_hidden_layers=layers, vocab_size=1024,
           rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=256)
model = build_gpt_model(cfg)
sent = {"p2p": 0, "all_gather": 0}
send, gather = dist.send, dist.all_gather

def counting_send(t, *a, **k):
    sent["p2p"] += t.numel() * t.element_size()
    return send(t, *a, **k)

def counting_gather(parts, t, *a, **k):
    sent["all_gather"] += t.numel() * t.element_size()
    return gather(parts, t, *a, **k)

dist.send, dist.all_gather = counting_send, counting_gather
yielded = sum(t.numel() * t.element_size() for b in iter_hf_tensors([model], cfg, gather_to="first",
              tp_group=groups.tp_group, pp_group=groups.pp_group) for _, t in b)
rank = dist.get_rank()
with open(f"{out}.{rank}", "w") as f:
    json.dump({"rank": rank, "pp": groups.pp_rank, "tp": groups.tp_rank, "yielded": yielded, **sent}, f)
'''


def measure(tree: Path, work: Path, args) -> list[dict]:
    script = work / "worker.py"
    script.write_text(WORKER)
    out = work / f"bytes_{tree.name}"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                           "MASTER_PORT")}
    env.update(PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           str(script), str(out), str(args.layers), str(args.hidden)], env=env, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"{tree} failed:\n{proc.stderr[-4000:]}")
    return sorted((json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)), key=lambda d: d["rank"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="1b21a04")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        before = work / "before"
        before.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
        results = {f"before ({args.before})": measure(before, work, args), "after (this tree)": measure(ROOT, work, args)}
    print(f"\n[weight export] TP 2 x PP 2 on gloo, random Qwen2 {args.layers} layers x {args.hidden} hidden (fp32): "
          f"bytes each rank sends per sync")
    print(f"{'rank (pp, tp)':16}" + "".join(f"{lab + ': p2p':>28}{'TP all-gather':>16}" for lab in results))
    for r in range(4):
        row = [results[lab][r] for lab in results]
        where = f"{r} ({row[0]['pp']}, {row[0]['tp']})"
        print(f"{where:16}" + "".join(f"{d['p2p']:>28,}{d['all_gather']:>16,}" for d in row))
    for lab, rows in results.items():
        print(f"{lab}: pipeline bytes per sync {sum(d['p2p'] for d in rows):,} in total; rank 0 yields "
              f"{rows[0]['yielded']:,} bytes (the whole model)")
    # The 32B recipe: Qwen2.5-32B (32,763,876,352 parameters, tools/plan.py), 64 layers over PP 2, TP 8, bf16.
    params, stage1 = 32_763_876_352, 0.5
    once = params * stage1 * 2
    print(f"32B recipe (TP 8, PP 2, bf16): stage 1 holds ~{once / 1e9:.1f} GB of weights; sent over the pipeline per "
          f"sync: before {8 * once / 1e9:.0f} GB (every TP rank, {once / 1e9:.1f} GB each), after {once / 1e9:.1f} GB "
          f"(TP rank 0 only)")


if __name__ == "__main__":
    main()
