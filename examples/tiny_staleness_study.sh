#!/usr/bin/env bash
# Staleness study on the tiny task: GRPO vs clip-higher vs BAPO under the same off-policy setting.
#
#   bash examples/tiny_staleness_study.sh            # writes results/staleness_study/{table.md,*.png}
#
# Every preset runs with the same base model, data, seeds and budget; only the clipping preset differs.
# Staleness comes from sample replay (4 mini-batches x 2 epochs per RL step: the last optimizer
# steps train on data 7 updates old) and partial rollout (responses longer than one segment
# continue under newer policies, up to 2 versions old). STEPS (default 100) / SEEDS (default "1 2 3")
# / TINY_DIR / STUDY_DIR / RESULTS override the defaults. About 2 minutes per run on 2 CPU cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TINY_DIR=${TINY_DIR:-runs/tiny_assets}
STUDY_DIR=${STUDY_DIR:-runs/staleness_study}
RESULTS=${RESULTS:-results/staleness_study}
STEPS=${STEPS:-100}
SEEDS=${SEEDS:-1 2 3}
PY=.venv/bin/python

bash tools/install.sh
if [ ! -f "$TINY_DIR/info.json" ]; then
  "$PY" tools/make_tiny.py --out "$TINY_DIR" --force
fi
runs=()
for preset in grpo clip-higher bapo; do
  dirs=()
  for seed in $SEEDS; do
    out="$STUDY_DIR/$preset/seed$seed"
    "$PY" -m megatron_bapo.train --config examples/configs/tiny_bapo.yaml --no-resume \
      bapo_preset="$preset" trainer.seed="$seed" data.seed="$seed" \
      model.hf_path="$TINY_DIR/base_model" \
      data.path="$TINY_DIR/data/train.jsonl" \
      "eval.datasets=[{name: tiny_test, path: $TINY_DIR/data/test.jsonl}]" \
      trainer.output_dir="$out" trainer.total_steps="$STEPS" trainer.save_every=0 \
      trainer.progress=false eval.every_n_steps=10 \
      actor.n_minibatches=4 actor.ppo_epochs=2 rollout.segment_tokens=4 rollout.max_staleness=2
    dirs+=("$out")
  done
  runs+=("$preset=$(IFS=,; echo "${dirs[*]}")")
done
"$PY" tools/plot_study.py --runs "${runs[@]}" --out "$RESULTS"
echo "results in $RESULTS (table.md and PNGs)"
