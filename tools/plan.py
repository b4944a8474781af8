#!/usr/bin/env python
"""Check a parallel layout and print the actor's per-GPU memory before submitting a job.

    python tools/plan.py --config examples/configs/qwen2.5-32b-bapo-64k.yaml \
        --hf-config examples/configs/qwen2.5-32b-config.json --gpus 64

Builds the model on the meta device from the HF config (no weights). Exit status: 0 when the layout
is valid and fits as configured (with activation recomputation when `actor.recompute: full`, without
otherwise; "selective" is judged as none, conservatively), 1 when it does not fit, 2 on an invalid
layout (the message names the config field).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="run YAML (the trainer's config file)")
    parser.add_argument("--hf-config", default=None, help="HF config.json or checkpoint dir (default: model.hf_path)")
    parser.add_argument("--gpus", type=int, default=None, help="actor GPUs (default: tp*pp*cp, i.e. DP 1)")
    parser.add_argument("--gpu-memory-gib", type=float, default=79.0, help="usable memory per GPU")
    parser.add_argument("--reserved-gib", type=float, default=4.0, help="CUDA context/NCCL/fragmentation reserve")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    parser.add_argument("--json-out", default=None, help="also write the plan as JSON to this file")
    parser.add_argument("overrides", nargs="*", help="a.b=c overrides of the run YAML")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")

    from megatron_bapo.planner import PlanError, format_plan, inputs_from_run_yaml, plan_memory

    try:
        inputs = inputs_from_run_yaml(
            args.config, args.overrides, hf_config=args.hf_config, num_gpus=args.gpus,
            gpu_memory_gib=args.gpu_memory_gib, reserved_gib=args.reserved_gib,
        )
        plan = plan_memory(inputs)
    except PlanError as exc:
        print(f"plan: invalid layout: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_dict(), indent=1) if args.json else format_plan(plan))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(plan.to_dict(), f, indent=1)
    return 0 if plan.fits(recompute=inputs.actor.recompute == "full") else 1


if __name__ == "__main__":
    sys.exit(main())
