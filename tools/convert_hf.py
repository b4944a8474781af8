#!/usr/bin/env python
"""Convert checkpoints between Hugging Face and megatron-core layouts (thin CLI over megatron_bapo.convert).

  python tools/convert_hf.py --to-megatron --hf-path H --megatron-path M [--dtype bfloat16] [--force]
  python tools/convert_hf.py --to-hf --megatron-path M --hf-path H [--hf-template T] [--dtype ...] [--force]

--to-megatron writes a reshardable `torch_dist` checkpoint (load it at any TP/PP with
`Actor.load_checkpoint(M, load_optimizer=False)`); --to-hf accepts those and Actor checkpoints
(tokenizer and config from --hf-template, default M/hf_template). Both stream one tensor at a time.
An existing output is never overwritten without --force. Exit code 2 on a usage or data error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--to-megatron", action="store_true", help="HF directory -> megatron torch_dist checkpoint")
    mode.add_argument("--to-hf", action="store_true", help="megatron checkpoint -> HF directory")
    p.add_argument("--hf-path", required=True, help="HF directory (input of --to-megatron, output of --to-hf)")
    p.add_argument("--megatron-path", required=True, help="megatron checkpoint directory")
    p.add_argument("--hf-template", default=None, help="--to-hf: HF directory with config.json + tokenizer files")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="output dtype (default: input's)")
    p.add_argument("--vocab-divisible-by", type=int, default=128, help="--to-megatron: vocab padding multiple")
    p.add_argument("--max-shard-size", default="5GB", help="--to-hf: max bytes per safetensors shard, e.g. 5GB, 500MB")
    p.add_argument("--force", action="store_true", help="overwrite an existing output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * mult)
    if t.isdigit():
        return int(t)
    raise ValueError(f"--max-shard-size: cannot parse {text!r} (e.g. 5GB, 500MB, 1000000)")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch

    from megatron_bapo.convert.offline import hf_to_megatron, megatron_to_hf
    from megatron_bapo.models import cpu_compat

    if not torch.cuda.is_available():
        cpu_compat.install()
    try:
        if args.to_megatron:
            out = hf_to_megatron(
                args.hf_path, args.megatron_path, dtype=args.dtype, vocab_divisible_by=args.vocab_divisible_by,
                force=args.force, progress=not args.no_progress,
            )
        else:
            out = megatron_to_hf(
                args.megatron_path, args.hf_path, hf_template=args.hf_template, dtype=args.dtype,
                max_shard_bytes=parse_size(args.max_shard_size), force=args.force, progress=not args.no_progress,
            )
    except (FileExistsError, FileNotFoundError, KeyError, ValueError) as exc:
        print(f"convert_hf: error: {exc}", file=sys.stderr)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from megatron_bapo.process_exit import exit_now

    exit_now(main())  # no module teardown once main has returned (megatron_bapo/process_exit.py)
