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
# Environment: CONFIG (default examples/configs/tiny_bapo.yaml), TINY_DIR (task assets; default: the
# directory of the config's model.hf_path, runs/tiny_assets for the default), OUT (run dir; default:
# the config's trainer.output_dir, runs/tiny_bapo; a trainer.output_dir=... argument sets it too),
# TINY_ARCH (the model family of freshly built assets: qwen2 by default, qwen3_moe for a mixture of
# experts), TINY_TASK (addition, or tools when the config has rollout.agent.tools: the tool task).
# Re-running resumes from the newest checkpoint in $OUT; pass trainer.resume=false (or delete $OUT)
# to start over.
# On-policy distillation from a stronger tiny teacher (built once next to the assets: make_tiny.py --teacher):
#   CONFIG=examples/configs/tiny_distill.yaml bash examples/run_tiny_bapo.sh
# Multi-turn with a calculator tool (3-digit multiplication):
#   CONFIG=examples/configs/tiny_tools.yaml bash examples/run_tiny_bapo.sh
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

CONFIG=${CONFIG:-examples/configs/tiny_bapo.yaml}
PY=.venv/bin/python
ENGINE=builtin
for arg in "$@"; do
  case "$arg" in rollout.engine=*) ENGINE=${arg#rollout.engine=} ;; esac
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
# Defaults from the config: the assets next to its model, its output directory, its task.
read -r CFG_TINY_DIR CFG_OUT CFG_TASK CFG_TEACHER < <("$PY" - "$CONFIG" <<'PYEOF'
import os, sys, yaml
cfg = yaml.safe_load(open(sys.argv[1])) or {}
hf = (cfg.get("model") or {}).get("hf_path") or "runs/tiny_assets/base_model"
tools = ((cfg.get("rollout") or {}).get("agent") or {}).get("tools")
teacher = (cfg.get("teacher") or {}).get("model_path")
print(os.path.dirname(hf.rstrip("/")) or ".", (cfg.get("trainer") or {}).get("output_dir") or "runs/tiny_bapo",
      "tools" if tools else "addition", "yes" if teacher else "no")
PYEOF
)
TINY_DIR=${TINY_DIR:-$CFG_TINY_DIR}
OUT=${OUT:-$CFG_OUT}
TINY_TASK=${TINY_TASK:-$CFG_TASK}
for arg in "$@"; do  # an output_dir override moves the run, so the summary must read it there too
  case "$arg" in trainer.output_dir=*) OUT=${arg#trainer.output_dir=} ;; esac
done
start=$SECONDS
assets=cached
if [ ! -f "$TINY_DIR/info.json" ]; then
  "$PY" tools/make_tiny.py --out "$TINY_DIR" --force --task "$TINY_TASK" ${TINY_ARCH:+--architecture "$TINY_ARCH"}
  assets="$((SECONDS - start)) s"
fi
teacher_args=()
if [ "$CFG_TEACHER" = yes ]; then  # a distillation config: the teacher next to the base (a longer SFT)
  if [ ! -f "$TINY_DIR/teacher_model/config.json" ]; then
    "$PY" tools/make_tiny.py --out "$TINY_DIR" --teacher
    assets="$((SECONDS - start)) s"
  fi
  teacher_args+=(teacher.model_path="$TINY_DIR/teacher_model")
fi
start=$SECONDS
"$PY" -m megatron_bapo.train --config "$CONFIG" \
  model.hf_path="$TINY_DIR/base_model" \
  data.path="$TINY_DIR/data/train.jsonl" \
  "eval.datasets=[{name: tiny_test, path: $TINY_DIR/data/test.jsonl}]" \
  trainer.output_dir="$OUT" "${engine_args[@]}" "${teacher_args[@]}" "$@"
train_s=$((SECONDS - start))
"$PY" tools/summarize_run.py "$OUT"
echo "timings: install $install_s s, assets $assets, train $train_s s, total $SECONDS s"
