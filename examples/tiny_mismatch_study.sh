#!/usr/bin/env bash
# Training-inference mismatch study on the tiny task: BAPO with the ratio against the rollout's
# log-probs vs against the trainer's recomputed ones with TIS or MIS, rollouts from a bfloat16
# built-in server (a real mismatch against the fp32 trainer).
#
#   bash examples/tiny_mismatch_study.sh       # writes results/mismatch_study/{table.md,*.png}
#
# Arms (everything else the same: base model, data, seeds, budget, bapo preset):
#   rollout        actor.old_logprobs=rollout (the paper's and the default): ratio and clip against
#                  the behavior log-probs the bf16 server returned;
#   recompute-tis  actor.old_logprobs=recompute, correction tis (w = min(pi_old / pi_rollout, 2));
#   recompute-mis  actor.old_logprobs=recompute, correction mis (w kept in [0.5, 2], else masked).
# Level: replay + async of examples/tiny_staleness_study.sh (4 mini-batches x 2 epochs, 4-token
# segments, rollout 2 steps ahead, tokens up to 4 versions old), so the rollout arm is that study's
# replay-async bapo run with a bf16 server instead of an fp32 one.
# STEPS (default 60) / SEEDS (default "1 2 3") / ARMS / TINY_DIR / STUDY_DIR / RESULTS override the
# defaults. About 1.5 minutes per run on 2 CPU cores (9 runs by default), then a short lag-0 probe
# (below).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

STUDY_DIR=${STUDY_DIR:-runs/mismatch_study}
RESULTS=${RESULTS:-results/mismatch_study}
ARMS=${ARMS:-rollout recompute-tis recompute-mis}
# shellcheck source=examples/study_common.sh
source examples/study_common.sh
LEVEL="actor.n_minibatches=4 actor.ppo_epochs=2 rollout.segment_tokens=4 rollout.max_staleness=4 trainer.async_steps=2"

arm_args() {
  case "$1" in
    rollout) echo "actor.old_logprobs=rollout" ;;
    recompute-tis) echo "actor.old_logprobs=recompute actor.correction.mode=tis" ;;
    recompute-mis) echo "actor.old_logprobs=recompute actor.correction.mode=mis" ;;
    *) echo "unknown arm $1 (rollout, recompute-tis, recompute-mis)" >&2; exit 2 ;;
  esac
}

study_setup
mkdir -p "$RESULTS"
for arm in $ARMS; do
  # shellcheck disable=SC2046,SC2086
  study_arm "$arm" "$STUDY_DIR/$arm" bapo_preset=bapo rollout.builtin_server_dtype=bfloat16 $LEVEL $(arm_args "$arm")
done
"$PY" tools/plot_study.py --runs "${RUNS[@]}" --out "$RESULTS" > /dev/null

# Lag-0 probe. At the replay-async level only the first update has tokens of version lag 0 (the
# initial weights sampled the first rounds): every later token is at least one version old, so its
# mismatch mixes in the policy's drift. This probe measures the bare training-inference mismatch on
# every step of an on-policy run (one optimizer step per RL step, whole responses, no eval), with
# the bf16 server and with an fp32 one (PROBE_STEPS, default 10; seed 1; about 20 s each).
PROBE_STEPS=${PROBE_STEPS:-10}
probes=()
for dtype in bfloat16 float32; do
  out="$STUDY_DIR/lag0-probe/$dtype"
  if [ ! -f "$out/done" ]; then
    "$PY" -m megatron_bapo.train --config examples/configs/tiny_bapo.yaml --no-resume \
      bapo_preset=bapo trainer.seed=1 data.seed=1 model.hf_path="$TINY_DIR/base_model" \
      data.path="$TINY_DIR/data/train.jsonl" trainer.output_dir="$out" trainer.total_steps="$PROBE_STEPS" \
      trainer.save_every=0 trainer.progress=false eval.every_n_steps=0 rollout.builtin_server_dtype="$dtype" \
      actor.n_minibatches=1 actor.ppo_epochs=1 rollout.segment_tokens=12 rollout.max_staleness=0
    touch "$out/done"
  fi
  probes+=("$dtype=$out")
done
"$PY" tools/plot_study.py --runs "${probes[@]}" --out "$RESULTS/lag0_probe" > /dev/null
cat "$RESULTS/table.md" "$RESULTS/lag0_probe/table.md"
echo "results in $RESULTS (table.md and PNGs; lag0_probe/)"
