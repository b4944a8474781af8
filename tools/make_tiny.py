#!/usr/bin/env python
"""Build the tiny default: char-level tokenizer + small Qwen2 model, reversed-digit addition data and an
SFT warm start, written to OUT/{base_model, data/train.jsonl, data/test.jsonl, info.json}.

    python tools/make_tiny.py --out runs/tiny_assets [--sft-steps N] [--target-accuracy A] [--seed S] [--force]
    python tools/make_tiny.py --out runs/tiny_moe_assets --architecture qwen3_moe   # a tiny Qwen3-MoE
    python tools/make_tiny.py --out runs/tiny_tools_assets --task tools   # multiplication with a calculator tool

A thin CLI over `megatron_bapo.tiny.build.build_tiny_assets`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from tqdm import tqdm

from megatron_bapo.tiny.build import OutputExistsError, TinyAssetsConfig, build_tiny_assets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (must be empty unless --force)")
    parser.add_argument("--sft-steps", type=int, default=None, help="max SFT steps (default: SFTConfig.max_steps)")
    parser.add_argument("--target-accuracy", type=float, default=None,
                        help="stop SFT at this greedy validation accuracy (default: SFTConfig.target_accuracy)")
    parser.add_argument("--loop-fraction", type=float, default=None,
                        help="share of SFT examples that loop instead of stopping (default: SFTConfig.loop_fraction)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--architecture", default=None, choices=["qwen2", "qwen3", "qwen3_moe", "llama"],
                        help="model family (default: qwen2; qwen3_moe: 8 experts, 2 per token)")
    parser.add_argument("--task", default="addition", choices=["addition", "tools"],
                        help="addition (default: reversed-digit addition) or tools (3-digit multiplication, "
                             "a calculator call in 30%% of the SFT examples; examples/configs/tiny_tools.yaml)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    config = TinyAssetsConfig.tools(seed=args.seed) if args.task == "tools" else TinyAssetsConfig(seed=args.seed)
    if args.architecture is not None:
        config.model = dict(config.model, architecture=args.architecture)
    if args.sft_steps is not None:
        config.sft = dataclasses.replace(config.sft, max_steps=args.sft_steps)
    if args.target_accuracy is not None:
        config.sft = dataclasses.replace(config.sft, target_accuracy=args.target_accuracy)

    if args.loop_fraction is not None:
        config.sft = dataclasses.replace(config.sft, loop_fraction=args.loop_fraction)

    bar = tqdm(total=config.sft.max_steps, desc="SFT warm start", unit="step", file=sys.stderr, mininterval=1.0)

    def on_step(step: int, loss: float) -> None:
        bar.update(1)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss:.3f}")

    try:
        info = build_tiny_assets(args.out, config, force=args.force, on_step=on_step)
    except OutputExistsError as exc:
        bar.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bar.close()
    summary = {k: info[k] for k in ("base_accuracy", "num_parameters", "seconds_total")}
    summary["sft_steps"] = info["sft"]["num_steps"]
    summary["sft_stopped_because"] = info["sft"]["stopped_because"]
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
