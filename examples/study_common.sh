# Shared by the tiny studies (sourced, not run): the tiny assets, one run per arm and seed, the plot.
#
#   source examples/study_common.sh
#   study_setup                                  # .venv and runs/tiny_assets (built once)
#   study_run OUT SEED [section.key=value ...]   # one run of $STUDY_CONFIG (default examples/configs/tiny_bapo.yaml)
#   study_arm NAME OUT_PREFIX [overrides ...]    # study_run for every seed of $SEEDS; appends the
#                                                # arm's name=dir1,dir2,... to the RUNS array
#   "$PY" tools/plot_study.py --runs "${RUNS[@]}" --out DIR
#
# Every run has the same base model, data, budget and evaluation (STEPS steps, eval avg@4 on 200
# held-out problems every 10 steps, no checkpoints); only the overrides differ. A finished run
# (OUT/done) is kept, so rerunning a study script resumes it. TINY_DIR, STEPS, SEEDS override.
TINY_DIR=${TINY_DIR:-runs/tiny_assets}
STEPS=${STEPS:-60}
SEEDS=${SEEDS:-1 2 3}
PY=.venv/bin/python
RUNS=()

study_setup() {
  bash tools/install.sh
  if [ ! -f "$TINY_DIR/info.json" ]; then
    "$PY" tools/make_tiny.py --out "$TINY_DIR" --force
  fi
}

study_run() {
  local out=$1 seed=$2
  shift 2
  if [ ! -f "$out/done" ]; then
    "$PY" -m megatron_bapo.train --config "${STUDY_CONFIG:-examples/configs/tiny_bapo.yaml}" --no-resume \
      trainer.seed="$seed" data.seed="$seed" \
      model.hf_path="$TINY_DIR/base_model" \
      data.path="$TINY_DIR/data/train.jsonl" \
      "eval.datasets=[{name: tiny_test, path: $TINY_DIR/data/test.jsonl}]" \
      trainer.output_dir="$out" trainer.total_steps="$STEPS" trainer.save_every=0 \
      trainer.progress=false eval.every_n_steps=10 "$@"
    touch "$out/done"
  fi
}

study_arm() {
  local name=$1 prefix=$2 seed dirs=()
  shift 2
  for seed in $SEEDS; do
    study_run "$prefix/seed$seed" "$seed" "$@"
    dirs+=("$prefix/seed$seed")
  done
  RUNS+=("$name=$(IFS=,; echo "${dirs[*]}")")
}
