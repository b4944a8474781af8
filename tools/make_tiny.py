#!/usr/bin/env python
"""Build the tiny default: char-level tokenizer + small Qwen2 model, reversed-digit addition data and an
SFT warm start that stops at a target accuracy, written to OUT/{base_model, data/train.jsonl, data/test.jsonl,
info.json} (info.json also names the machine: the same seeds give other weights on another CPU kind).

    python tools/make_tiny.py --out runs/tiny_assets [--sft-steps N] [--target-accuracy A|none] [--seed S]
                              [--num-eval N] [--force]
    python tools/make_tiny.py --out runs/tiny_moe_assets --architecture qwen3_moe   # a tiny Qwen3-MoE
    python tools/make_tiny.py --out runs/tiny_tools_assets --task tools   # multiplication with a calculator tool
    python tools/make_tiny.py --out runs/tiny_assets --teacher   # + OUT/teacher_model: a longer SFT to distill from

With --teacher and complete assets in OUT (info.json), only the teacher is built (`tiny.teacher`:
the base's SFT continued without looped examples to --teacher-target-accuracy); otherwise the assets
first, then the teacher.

A thin CLI over `megatron_bapo.tiny.build.build_tiny_assets` and `megatron_bapo.tiny.teacher.build_tiny_teacher`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from tqdm import tqdm

from megatron_bapo.run_record import describe_machine
from megatron_bapo.tiny.build import OutputExistsError, TinyAssetsConfig, build_tiny_assets


def _target(value: str) -> float | str | None:
    """--target-accuracy: a float, or "none" (no target: a fixed step count)."""
    if value in ("default", "none"):
        return None if value == "none" else value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'none', got {value!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (must be empty unless --force)")
    parser.add_argument("--sft-steps", type=int, default=None,
                        help="most SFT steps (default: SFTConfig.max_steps; --task tools: 300, all of them)")
    parser.add_argument("--target-accuracy", type=_target, default="default",
                        help="stop SFT at the first step with this greedy validation accuracy, or 'none' to run "
                             "all --sft-steps (default: SFTConfig.target_accuracy; --task tools: none)")
    parser.add_argument("--loop-fraction", type=float, default=None,
                        help="share of SFT examples that loop instead of stopping (default: SFTConfig.loop_fraction)")
    parser.add_argument("--num-eval", type=int, default=None,
                        help="problems each evaluation decodes: the base accuracy in info.json and SFT's "
                             "validation curve (default: 500 and SFTConfig.num_eval; fewer for a quick smoke build)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--architecture", default=None, choices=["qwen2", "qwen3", "qwen3_moe", "llama"],
                        help="model family (default: qwen2; qwen3_moe: 8 experts, 2 per token)")
    parser.add_argument("--task", default="addition", choices=["addition", "tools"],
                        help="addition (default: reversed-digit addition) or tools (3-digit multiplication, "
                             "a calculator call in 30%% of the SFT examples; examples/configs/tiny_tools.yaml)")
    parser.add_argument("--force", action="store_true",
                        help="replace a non-empty --out (with --teacher and complete assets: the teacher only)")
    parser.add_argument("--teacher", action="store_true",
                        help="also build OUT/teacher_model, a stronger model to distill from (the base's SFT "
                             "continued without looped examples; examples/configs/tiny_distill.yaml)")
    parser.add_argument("--teacher-target-accuracy", type=_target, default="default",
                        help="the teacher's SFT stops at this greedy validation accuracy, or 'none' "
                             "(default: TeacherConfig.target_accuracy, 0.8)")
    parser.add_argument("--teacher-sft-steps", type=int, default=None,
                        help="most SFT steps of the teacher on top of the base's (default: TeacherConfig.max_steps)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.teacher and (Path(args.out) / "info.json").is_file():
        return _teacher(args)

    config = TinyAssetsConfig.tools(seed=args.seed) if args.task == "tools" else TinyAssetsConfig(seed=args.seed)
    if args.architecture is not None:
        config.model = dict(config.model, architecture=args.architecture)
    if args.sft_steps is not None:
        config.sft = dataclasses.replace(config.sft, max_steps=args.sft_steps)
    if args.target_accuracy != "default":
        config.sft = dataclasses.replace(config.sft, target_accuracy=args.target_accuracy)

    if args.num_eval is not None:
        if args.num_eval < 1:
            parser.error(f"--num-eval must be >= 1, got {args.num_eval}")
        config.num_base_eval = args.num_eval
        config.sft = dataclasses.replace(config.sft, num_eval=args.num_eval)
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
    summary["machine"] = describe_machine(info["machine"])
    print(json.dumps(summary))
    return _teacher(args) if args.teacher else 0


def _teacher(args: argparse.Namespace) -> int:
    """Build OUT/teacher_model from the complete assets in OUT; print its summary line."""
    from megatron_bapo.tiny.teacher import TeacherConfig, build_tiny_teacher

    config = TeacherConfig(num_eval=args.num_eval)
    if args.teacher_target_accuracy != "default":
        config.target_accuracy = args.teacher_target_accuracy
    if args.teacher_sft_steps is not None:
        config.max_steps = args.teacher_sft_steps
    bar = tqdm(total=config.max_steps, desc="teacher SFT", unit="step", file=sys.stderr, mininterval=1.0)
    try:
        record = build_tiny_teacher(args.out, config, force=args.force, on_step=lambda step, loss: bar.update(1))
    except (OutputExistsError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    print(json.dumps({"teacher_accuracy": record["accuracy"], "teacher_sft_steps": record["sft"]["num_steps"],
                      "teacher_sft_stopped_because": record["sft"]["stopped_because"]}))
    return 0


if __name__ == "__main__":
    from megatron_bapo.process_exit import exit_now

    exit_now(main())  # no module teardown once main has returned (megatron_bapo/process_exit.py)
