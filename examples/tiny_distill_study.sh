#!/usr/bin/env bash
# On-policy distillation against RL from the reward alone on the tiny task (issue 41): how many steps,
# and how much wall time, each needs to reach the teacher's own eval.
#
#   bash examples/tiny_distill_study.sh      # writes results/distill_study/{table.md,curves.csv,eval_vs_step.png}
#
# Arms (everything else the same: the quick start's base model, data, seeds, 100 steps, BAPO loss):
#   distill   examples/configs/tiny_distill.yaml: the teacher (tools/make_tiny.py --teacher) scores every
#             sampled token; advantage -(log pi_old - log pi_teacher), distill.reward_coef 0;
#   rl        examples/configs/tiny_bapo.yaml: the quick start, GRPO advantages of the arithmetic reward;
#   distill-fixed-clip (a diagnostic, not in the default ARMS): distill with bapo_preset=grpo, clip
#             fixed at 0.8 / 1.2, to see what BAPO's search (pinned at its grid ends here) costs.
# Both evaluate avg@4 at temperature 1 on 200 held-out problems every 10 steps (study_common.sh). The
# target is the teacher's eval measured the same way (tools/evaluate.py with the runs' eval settings;
# also at n=32 to show how noisy n=4 is). Seeds reach trainer.seed (rollout sampling seeds, the
# servers' generators) and data.seed (prompt order); actor.seed stays 1234 (it seeds megatron's RNG
# tracker only, and the tiny model has no dropout).
# Needs .venv (tools/install.sh). ARMS (default "distill rl") / STEPS (default 100) / SEEDS (default "1 2 3") / TINY_DIR / STUDY_DIR /
# RESULTS override the defaults. About 1.5-2.5 minutes per run on 2 CPU cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STUDY_DIR=${STUDY_DIR:-runs/distill_study}
RESULTS=${RESULTS:-results/distill_study}
STEPS=${STEPS:-100}
ARMS=${ARMS:-distill rl}
# shellcheck source=examples/study_common.sh
source examples/study_common.sh

[ -f "$TINY_DIR/info.json" ] || "$PY" tools/make_tiny.py --out "$TINY_DIR" --force
[ -f "$TINY_DIR/teacher_model/config.json" ] || "$PY" tools/make_tiny.py --out "$TINY_DIR" --teacher
for n in 4 32; do  # the target (n=4: as the runs measure) and a less noisy reference (n=32)
  if [ ! -f "$STUDY_DIR/teacher_eval_n$n/metrics.json" ]; then
    "$PY" tools/evaluate.py --model-path "$TINY_DIR/teacher_model" --data "$TINY_DIR/data/test.jsonl" \
      --n "$n" --temperature 1.0 --top-p 1.0 --max-new-tokens 12 --reward arithmetic --max-problems 200 \
      --output "$STUDY_DIR/teacher_eval_n$n"
  fi
done

arm_config() {
  case "$1" in
    distill) echo examples/configs/tiny_distill.yaml ;;
    distill-fixed-clip) echo examples/configs/tiny_distill.yaml ;;
    rl) echo examples/configs/tiny_bapo.yaml ;;
    *) echo "unknown arm $1 (distill, rl, distill-fixed-clip)" >&2; exit 2 ;;
  esac
}
arm_args() {
  case "$1" in
    distill) echo "teacher.model_path=$TINY_DIR/teacher_model" ;;
    distill-fixed-clip) echo "teacher.model_path=$TINY_DIR/teacher_model bapo_preset=grpo" ;;
    rl) echo "" ;;
  esac
}

declare -A dirs=()
for seed in $SEEDS; do  # arms alternate, so a slow spell of the machine hits each
  for arm in $ARMS; do
    STUDY_CONFIG=$(arm_config "$arm")
    # shellcheck disable=SC2046
    study_run "$STUDY_DIR/$arm/seed$seed" "$seed" $(arm_args "$arm")
    dirs[$arm]="${dirs[$arm]:+${dirs[$arm]},}$STUDY_DIR/$arm/seed$seed"
  done
done
runs=()
for arm in $ARMS; do runs+=("$arm=${dirs[$arm]}"); done
"$PY" results/distill_study/plot_study.py --teacher-eval "$STUDY_DIR/teacher_eval_n4/metrics.json" \
  --teacher-eval-ref "$STUDY_DIR/teacher_eval_n32/metrics.json" --out "$RESULTS" --runs "${runs[@]}"
echo "results in $RESULTS (table.md, curves.csv, eval_vs_step.png)"
