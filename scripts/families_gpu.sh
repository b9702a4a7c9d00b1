#!/usr/bin/env bash
# Draft families side by side on one GPU, from one feature set: SmolLM2-135M-Instruct regenerates
# 10,240 synthesised conversations, one capture stores the layers of every family, then an
# EAGLE-3 draft (recipes/smollm2-h200.yaml), DFlash drafts of block 16 and 8, DFlash b16 with the
# D-PACE objective and with --final-norm-init 0.1, Domino b16 and DSpark b16
# (recipes/smollm2-h200-dflash.yaml, the same epochs) and a P-EAGLE draft of 7 depths
# (recipes/smollm2-h200-peagle.yaml, key peagle_k7) train from it, and sf-eval decodes every
# held-out set. benchmarks/families.py gathers the reports into benchmarks/results/families.json.
# Needs a CUDA machine with specfoundry installed (`pip install -e .` over your own torch).
#
# The trainings run side by side on the one GPU (SmolLM2's drafts are small: one alone leaves most
# of an H200 idle), then the evals side by side; their tokens/s are then not comparable between
# drafts (SEQUENTIAL=1 runs each alone). Every stage resumes when rerun with the same command.
# Environment:
#   RUN         where the work goes (runs/smollm2-families)
#   SYNTH       conversations synthesised (10240)
#   EPOCHS      every family's epochs (default: each recipe's)
#   REGEN_OPTS  more sf-regen options (e.g. --max-new-tokens 64)
#   TRAIN_OPTS  more sf-train options for every draft (--num-workers 2 by default: 8 side by side)
#   EVAL_OPTS   more sf-eval options for every draft (e.g. --limit 2 --max-new-tokens 32)
#   RESULT      the name of the result file under benchmarks/results (families)
#   JOBS        commands at most side by side (4: 8 DFlash-sized trainings overflow an H200's 140 GB)
#   DEV         the target's device (cuda)
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
DEV=${DEV:-cuda}
EAGLE3=recipes/smollm2-h200.yaml
DFLASH=recipes/smollm2-h200-dflash.yaml
PEAGLE=recipes/smollm2-h200-peagle.yaml
TRAIN_OPTS="${EPOCHS:+--epochs $EPOCHS} ${TRAIN_OPTS:---num-workers 2}"
EVAL_OPTS="--device $DEV ${EVAL_OPTS:-}"
mkdir -p "$RUN/logs"

# side_by_side NAME "CMD" ...: each command in the background, logged to $RUN/logs/NAME-k.log (one
# after another when SEQUENTIAL=1); fails, naming the failed logs, when any command failed
side_by_side() {
  local name=$1; shift
  local k=0 pids=() logs=() failed=() waited=()
  for cmd in "$@"; do
    local log="$RUN/logs/$name-$k.log"
    echo "$(date +%T) start $name-$k: $cmd" | tee "$log"
    if [ "${SEQUENTIAL:-0}" = 1 ]; then
      bash -c "$cmd" >> "$log" 2>&1 || failed+=("$log")
    else
      bash -c "$cmd" >> "$log" 2>&1 & pids+=($!)
      # at most JOBS at once: wait for the oldest still counted (its status is read again below)
      [ ${#pids[@]} -ge $(( ${JOBS:-4} + ${#waited[@]} )) ] && { wait "${pids[${#waited[@]}]}" || true; waited+=(1); }
    fi
    logs+=("$log"); k=$((k + 1))
  done
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed+=("${logs[$i]}"); done
  echo "$(date +%T) end $name: ${#failed[@]} of $k failed"
  if [ ${#failed[@]} -gt 0 ]; then
    for log in "${failed[@]}"; do echo "== $log"; tail -n 15 "$log"; done
    return 1
  fi
}

sf-regen run -o "$RUN/regen" --recipe "$EAGLE3" --synthesize "${SYNTH:-10240}" --device "$DEV" ${REGEN_OPTS:-}
sf-capture run "$RUN/regen" -o "$RUN/features" --recipe "$EAGLE3" --families eagle3,dflash,domino,dspark,peagle --device "$DEV"
sf-capture verify "$RUN/features"

F=$RUN/features
side_by_side train \
  "sf-train run $F -o $RUN/eagle3 --recipe $EAGLE3 $TRAIN_OPTS" \
  "sf-train run $F -o $RUN/dflash_b16 --recipe $DFLASH --block-size 16 $TRAIN_OPTS" \
  "sf-train run $F -o $RUN/dflash_b8 --recipe $DFLASH --block-size 8 $TRAIN_OPTS" \
  "sf-train run $F -o $RUN/dflash_b16_dpace --recipe $DFLASH --block-size 16 --objective dpace $TRAIN_OPTS" \
  "sf-train run $F -o $RUN/dflash_b16_norm01 --recipe $DFLASH --block-size 16 --final-norm-init 0.1 $TRAIN_OPTS" \
  "sf-train run $F -o $RUN/domino_b16 --recipe $DFLASH --block-size 16 --family domino $TRAIN_OPTS" \
  "sf-train run $F -o $RUN/dspark --recipe $DFLASH --block-size 16 --family dspark $TRAIN_OPTS" \
  "sf-train run $F -o $RUN/peagle_k7 --recipe $PEAGLE --num-depths 7 $TRAIN_OPTS"
# (--final-norm-init 0.1: the final norm's initial weight, docs/families.md "DFlash's first loss")

evals=("sf-eval run $RUN/eagle3 -o $RUN/eval_eagle3_chain_k7 --recipe $EAGLE3 $EVAL_OPTS"
       "sf-eval run $RUN/eagle3 -o $RUN/eval_eagle3_tree --recipe $EAGLE3 --tree 8,4,2,1,1,1,1 --no-baseline $EVAL_OPTS")
for draft in dflash_b16 dflash_b8 dflash_b16_dpace dflash_b16_norm01 domino_b16 dspark; do
  evals+=("sf-eval run $RUN/$draft -o $RUN/eval_$draft --recipe $DFLASH --no-baseline $EVAL_OPTS")
done
evals+=("sf-eval run $RUN/peagle_k7 -o $RUN/eval_peagle_k7 --recipe $PEAGLE --no-baseline $EVAL_OPTS")
side_by_side eval "${evals[@]}"
python -m benchmarks.families "$RUN" --out "${RESULT:-families}"
