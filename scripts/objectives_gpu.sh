#!/usr/bin/env bash
# Issue 40's comparison of token losses on one GPU, from one feature set: SmolLM2-135M-Instruct
# regenerates SYNTH synthesised conversations (8,000 or more kept), one capture stores the EAGLE-3
# and DFlash layers, then at equal steps (the same recipe and epochs for every variant):
#   EAGLE-3 (recipes/smollm2-h200.yaml) with --token-loss ce, lk-alpha and lk-lambda, seeds 0 and 1;
#   DFlash b16 (recipes/smollm2-h200-dflash.yaml, --teacher soft for both: the LK losses take the
#   target's whole distribution, so ce gets the same teacher) with ce and lk-lambda;
# sf-eval decodes every held-out set (EAGLE-3 as a chain of k=7, DFlash blocks of 16), and
# benchmarks/objectives.py gathers the reports into benchmarks/results/objectives.json. With
# CURVE_EPOCHS > 0 one more EAGLE-3 run (ce, seed 0) trains that many epochs with --keep-best,
# evaluating every CURVE_EVAL_EVERY steps: the held-out acceptance curve, and the step kept.
# Needs a CUDA machine with specfoundry installed (`pip install -e .` over your own torch).
# Environment (as scripts/families_gpu.sh's): RUN (runs/smollm2-objectives), SYNTH (10240),
# REGEN_FROM, EPOCHS (2), JOBS (train_jobs: 4 on an H200, 2 on an H100), EVAL_JOBS (8),
# REGEN_OPTS, TRAIN_OPTS, EVAL_OPTS, RESULT (objectives), DEV (cuda), CURVE_EPOCHS (6; 0 skips
# the curve run), CURVE_EVAL_EVERY (40), ONLY (the drafts to train, by name, space-separated;
# default all: a pilot that fits less device time), WITH_RUN (an earlier run's drafts joined to this
# one's in the result: benchmarks/objectives.py --with-run; the same data required, else this run's
# drafts are written alone, as RESULT_alone).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-objectives}
DEV=${DEV:-cuda}
EAGLE3=recipes/smollm2-h200.yaml
DFLASH=recipes/smollm2-h200-dflash.yaml
TRAIN_OPTS=${TRAIN_OPTS:---num-workers 2}
EVAL_OPTS="--device $DEV ${EVAL_OPTS:-}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
[ "$DEV" = cuda ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$RUN/logs"
# shellcheck source=scripts/side_by_side.sh
. scripts/side_by_side.sh

if [ -n "${REGEN_FROM:-}" ] && [ ! -e "$RUN/regen" ]; then tar xzf "$REGEN_FROM" -C "$RUN"; fi
sf-regen run -o "$RUN/regen" --recipe "$EAGLE3" --synthesize "${SYNTH:-10240}" --device "$DEV" ${REGEN_OPTS:-}
sf-capture run "$RUN/regen" -o "$RUN/features" --recipe "$EAGLE3" --families eagle3,dflash --device "$DEV"
sf-capture verify "$RUN/features"

# NAME|RECIPE|OPTIONS|EVAL OPTIONS; the DFlash ones first (the slower trainings)
DRAFTS=("dflash_ce|$DFLASH|--block-size 16 --teacher soft|"
        "dflash_lk_lambda|$DFLASH|--block-size 16 --teacher soft --token-loss lk-lambda|")
for loss in ce lk-alpha lk-lambda; do
  for seed in 0 1; do DRAFTS+=("eagle3_${loss//-/_}_seed$seed|$EAGLE3|--token-loss $loss --seed $seed|-k 7"); done
done
keep_only DRAFTS  # ONLY: the drafts named
if [ "${CURVE_EPOCHS:-6}" -gt 0 ]; then
  CURVE="--token-loss ce --seed 0 --keep-best --eval-every ${CURVE_EVAL_EVERY:-40}"
fi
trains=()
for d in "${DRAFTS[@]}"; do
  IFS='|' read -r name recipe opts _ <<< "$d"
  trains+=("sf-train run $RUN/features -o $RUN/$name --recipe $recipe $opts --epochs ${EPOCHS:-2} $TRAIN_OPTS")
done
[ -n "${CURVE:-}" ] && trains=("sf-train run $RUN/features -o $RUN/curve_eagle3 --recipe $EAGLE3 $CURVE \
--epochs ${CURVE_EPOCHS:-6} $TRAIN_OPTS" "${trains[@]}")
status=0
side_by_side train "$(train_jobs)" "${trains[@]}" || status=1

evals=()
for d in "${DRAFTS[@]}"; do
  IFS='|' read -r name recipe _ eopts <<< "$d"
  if [ -f "$RUN/$name/export/config.json" ]; then
    evals+=("sf-eval run $RUN/$name -o $RUN/eval_$name --recipe $recipe $eopts --no-baseline $EVAL_OPTS")
  else
    echo "no export in $RUN/$name: not evaluated"; status=1
  fi
done
side_by_side eval "${EVAL_JOBS:-8}" "${evals[@]}" || status=1
if ! python -m benchmarks.objectives "$RUN" --out "${RESULT:-objectives}" ${WITH_RUN:+--with-run "$WITH_RUN"}; then
  # WITH_RUN refused (other data, or unreadable): this run's drafts are written alone, not lost
  [ -n "${WITH_RUN:-}" ] && python -m benchmarks.objectives "$RUN" --out "${RESULT:-objectives}_alone"
  status=1
fi
exit $status
