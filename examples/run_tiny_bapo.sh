#!/usr/bin/env bash
# BAPO end to end on one CPU machine: the README's first command.
#
#   bash examples/run_tiny_bapo.sh [section.key=value ...]
#
# 1. installs the project into .venv (tools/install.sh; CPU torch, no CUDA download),
# 2. builds the tiny task once (tools/make_tiny.py): a small Qwen2-architecture model with a
#    character tokenizer, reversed-digit addition data, and a short SFT warm start,
# 3. trains it with BAPO (python -m megatron_bapo.train): built-in rollout server on loopback,
#    megatron-core actor on CPU/gloo, disk weight sync every step, TensorBoard in $OUT/tb,
# 4. prints reward and held-out accuracy at the start and at the end, what BAPO did and where the
#    outputs are (tools/summarize_run.py, which also draws $OUT/summary.png), and how long each
#    phase took: "timings: install 3 s, assets cached, train 141 s, total 150 s".
#
# Environment: TINY_DIR (task assets, default runs/tiny_assets), OUT (run dir, default
# runs/tiny_bapo; a trainer.output_dir=... argument sets it too), CONFIG (default
# examples/configs/tiny_bapo.yaml), TINY_ARCH (the model family of freshly built assets: qwen2 by
# default, qwen3_moe for a mixture of experts). Re-running resumes from
# the newest checkpoint in $OUT; pass trainer.resume=false (or delete $OUT) to start over.
# A tiny Qwen3-MoE with rollout routing replay:
#   TINY_ARCH=qwen3_moe TINY_DIR=runs/tiny_moe_assets OUT=runs/tiny_moe \
#     CONFIG=examples/configs/tiny_moe.yaml bash examples/run_tiny_bapo.sh
# The same run on the real SGLang server instead of the built-in one (rollout.engine=sglang): the
# script also builds .venv-sglang (tools/install.sh --with-sglang, a few minutes once) and, on a
# machine without a GPU, turns rollout.deterministic_inference off (SGLang's deterministic mode needs
# GPU attention kernels); pass a new trainer.output_dir to keep the built-in run's checkpoints apart:
#   bash examples/run_tiny_bapo.sh rollout.engine=sglang trainer.output_dir=runs/tiny_sglang
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TINY_DIR=${TINY_DIR:-runs/tiny_assets}
OUT=${OUT:-runs/tiny_bapo}
CONFIG=${CONFIG:-examples/configs/tiny_bapo.yaml}
PY=.venv/bin/python
ENGINE=builtin
for arg in "$@"; do  # an output_dir override moves the run, so the summary must read it there too
  case "$arg" in
    trainer.output_dir=*) OUT=${arg#trainer.output_dir=} ;;
    rollout.engine=*) ENGINE=${arg#rollout.engine=} ;;
  esac
done
engine_args=()
start=$SECONDS
if [ "$ENGINE" = sglang ]; then
  bash tools/install.sh --with-sglang
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "rollout.engine=sglang on CPU: rollout.deterministic_inference=false (SGLang's deterministic inference" \
         "needs GPU attention kernels)"
    engine_args+=(rollout.deterministic_inference=false)
  fi
else
  bash tools/install.sh
fi
install_s=$((SECONDS - start))
start=$SECONDS
assets=cached
if [ ! -f "$TINY_DIR/info.json" ]; then
  "$PY" tools/make_tiny.py --out "$TINY_DIR" --force ${TINY_ARCH:+--architecture "$TINY_ARCH"}
  assets="$((SECONDS - start)) s"
fi
start=$SECONDS
"$PY" -m megatron_bapo.train --config "$CONFIG" \
  model.hf_path="$TINY_DIR/base_model" \
  data.path="$TINY_DIR/data/train.jsonl" \
  "eval.datasets=[{name: tiny_test, path: $TINY_DIR/data/test.jsonl}]" \
  trainer.output_dir="$OUT" "${engine_args[@]}" "$@"
train_s=$((SECONDS - start))
"$PY" tools/summarize_run.py "$OUT"
echo "timings: install $install_s s, assets $assets, train $train_s s, total $SECONDS s"
