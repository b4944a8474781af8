#!/usr/bin/env bash
# Policy losses and dynamic sampling on the tiny task: GRPO, BAPO, DPPO, balanced DPPO, CISPO, each
# with and without DAPO's refill.
#
#   bash examples/tiny_algorithms_study.sh      # writes results/algorithms_study/{table.md,*.png}
#
# Arms (everything else the same: base model, data, seeds, budget, level):
#   grpo            bapo_preset=grpo: PPO clip at fixed 0.8 / 1.2;
#   bapo            bapo_preset=bapo: PPO clip, bounds searched to a positive share rho0 = 0.4;
#   dppo            actor.policy_loss=dppo with bapo_preset=grpo: Binary-TV trust region, delta 0.15;
#   dppo-balanced   actor.policy_loss=dppo with bapo_preset=bapo: the thresholds searched to rho0;
#   cispo           actor.policy_loss=cispo with bapo_preset=grpo: weight clip [0, 5];
# and each "+refill": rollout.dynamic_sampling=refill (the others train every finished group: off).
# Level: replay + async of examples/tiny_staleness_study.sh (4 mini-batches x 2 epochs, 4-token
# segments, rollout 2 steps ahead, tokens up to 4 versions old), the level the mismatch study used:
# the most off-policy one, where trust regions decide the most, and the one that runs refill with
# partial rollout and rollout ahead.
# STEPS (default 60) / SEEDS (default "1 2 3") / ARMS / REFILL ("off refill") / TINY_DIR / STUDY_DIR /
# RESULTS override the defaults. About 1.1-1.4 minutes per run on 2 CPU cores (30 runs by default: about
# 50 minutes with building the tiny assets).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STUDY_DIR=${STUDY_DIR:-runs/algorithms_study}
RESULTS=${RESULTS:-results/algorithms_study}
ARMS=${ARMS:-grpo bapo dppo dppo-balanced cispo}
REFILL=${REFILL:-off refill}
# shellcheck source=examples/study_common.sh
source examples/study_common.sh
LEVEL="actor.n_minibatches=4 actor.ppo_epochs=2 rollout.segment_tokens=4 rollout.max_staleness=4 trainer.async_steps=2"

arm_args() {
  case "$1" in
    grpo) echo "bapo_preset=grpo" ;;
    bapo) echo "bapo_preset=bapo" ;;
    dppo) echo "bapo_preset=grpo actor.policy_loss=dppo" ;;
    dppo-balanced) echo "bapo_preset=bapo actor.policy_loss=dppo" ;;
    cispo) echo "bapo_preset=grpo actor.policy_loss=cispo" ;;
    *) echo "unknown arm $1 (grpo, bapo, dppo, dppo-balanced, cispo)" >&2; exit 2 ;;
  esac
}

study_setup
mkdir -p "$RESULTS"
for arm in $ARMS; do
  for sampling in $REFILL; do
    name=$arm
    [ "$sampling" = off ] || name="$arm+$sampling"
    # shellcheck disable=SC2046,SC2086
    study_arm "$name" "$STUDY_DIR/$name" $LEVEL $(arm_args "$arm") rollout.dynamic_sampling="$sampling"
  done
done
"$PY" tools/plot_study.py --runs "${RUNS[@]}" --out "$RESULTS" > /dev/null
cat "$RESULTS/table.md"
echo "results in $RESULTS (table.md and PNGs)"
