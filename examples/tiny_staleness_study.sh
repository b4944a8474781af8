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

STUDY_DIR=${STUDY_DIR:-runs/staleness_study}
RESULTS=${RESULTS:-results/staleness_study}
LEVELS=${LEVELS:-on-policy replay replay-async}
PRESETS=${PRESETS:-grpo clip-higher bapo}
# shellcheck source=examples/study_common.sh
source examples/study_common.sh

level_args() {
  case "$1" in
    on-policy) echo "actor.n_minibatches=1 actor.ppo_epochs=1 rollout.segment_tokens=12 rollout.max_staleness=0" ;;
    replay) echo "actor.n_minibatches=4 actor.ppo_epochs=2 rollout.segment_tokens=4 rollout.max_staleness=2" ;;
    replay-async) echo "actor.n_minibatches=4 actor.ppo_epochs=2 rollout.segment_tokens=4 rollout.max_staleness=4 trainer.async_steps=2" ;;
    *) echo "unknown level $1 (on-policy, replay, replay-async)" >&2; exit 2 ;;
  esac
}

study_setup
mkdir -p "$RESULTS"
: > "$RESULTS/table.md"
for level in $LEVELS; do
  RUNS=()
  for preset in $PRESETS; do
    # shellcheck disable=SC2046
    study_arm "$preset" "$STUDY_DIR/$level/$preset" bapo_preset="$preset" $(level_args "$level")
  done
  "$PY" tools/plot_study.py --runs "${RUNS[@]}" --out "$RESULTS/$level" > /dev/null
  { echo "### $level"; echo; cat "$RESULTS/$level/table.md"; echo; } >> "$RESULTS/table.md"
done
cat "$RESULTS/table.md"
echo "results in $RESULTS (table.md, and PNGs per level)"
