#!/usr/bin/env bash
# Staleness study on the tiny task: GRPO vs clip-higher vs BAPO at several levels of off-policy data.
#
#   bash examples/tiny_staleness_study.sh       # writes results/staleness_study/{table.md,<level>/*.png}
#
# Every preset runs with the same base model, data, seeds and budget at every level; only the
# clipping preset differs. Levels (how old the trained tokens are):
#   on-policy     1 optimizer step per RL step, whole responses in one request: no staleness;
#   replay        sample replay (4 mini-batches x 2 epochs: the last optimizer steps train on data
#                 7 updates old) + partial rollout (4-token segments, up to 2 versions old);
#   replay-async  replay + rollout 2 steps ahead of training (trainer.async_steps=2): tokens up to
#                 4 versions old when trained.
# STEPS (default 60) / SEEDS (default "1 2 3") / LEVELS / PRESETS / TINY_DIR / STUDY_DIR / RESULTS
# override the defaults. About 1-2 minutes per run on 2 CPU cores (27 runs by default).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TINY_DIR=${TINY_DIR:-runs/tiny_assets}
STUDY_DIR=${STUDY_DIR:-runs/staleness_study}
RESULTS=${RESULTS:-results/staleness_study}
STEPS=${STEPS:-60}
SEEDS=${SEEDS:-1 2 3}
LEVELS=${LEVELS:-on-policy replay replay-async}
PRESETS=${PRESETS:-grpo clip-higher bapo}
PY=.venv/bin/python

level_args() {
  case "$1" in
    on-policy) echo "actor.n_minibatches=1 actor.ppo_epochs=1 rollout.segment_tokens=12 rollout.max_staleness=0" ;;
    replay) echo "actor.n_minibatches=4 actor.ppo_epochs=2 rollout.segment_tokens=4 rollout.max_staleness=2" ;;
    replay-async) echo "actor.n_minibatches=4 actor.ppo_epochs=2 rollout.segment_tokens=4 rollout.max_staleness=4 trainer.async_steps=2" ;;
    *) echo "unknown level $1 (on-policy, replay, replay-async)" >&2; exit 2 ;;
  esac
}

bash tools/install.sh
if [ ! -f "$TINY_DIR/info.json" ]; then
  "$PY" tools/make_tiny.py --out "$TINY_DIR" --force
fi
mkdir -p "$RESULTS"
: > "$RESULTS/table.md"
for level in $LEVELS; do
  runs=()
  for preset in $PRESETS; do
    dirs=()
    for seed in $SEEDS; do
      out="$STUDY_DIR/$level/$preset/seed$seed"
      if [ ! -f "$out/done" ]; then  # a finished run is kept: rerunning the script resumes the study
        # shellcheck disable=SC2046
        "$PY" -m megatron_bapo.train --config examples/configs/tiny_bapo.yaml --no-resume \
          bapo_preset="$preset" trainer.seed="$seed" data.seed="$seed" \
          model.hf_path="$TINY_DIR/base_model" \
          data.path="$TINY_DIR/data/train.jsonl" \
          "eval.datasets=[{name: tiny_test, path: $TINY_DIR/data/test.jsonl}]" \
          trainer.output_dir="$out" trainer.total_steps="$STEPS" trainer.save_every=0 \
          trainer.progress=false eval.every_n_steps=10 $(level_args "$level")
        touch "$out/done"
      fi
      dirs+=("$out")
    done
    runs+=("$preset=$(IFS=,; echo "${dirs[*]}")")
  done
  "$PY" tools/plot_study.py --runs "${runs[@]}" --out "$RESULTS/$level" > /dev/null
  { echo "### $level"; echo; cat "$RESULTS/$level/table.md"; echo; } >> "$RESULTS/table.md"
done
cat "$RESULTS/table.md"
echo "results in $RESULTS (table.md, and PNGs per level)"
