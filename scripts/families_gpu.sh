#!/usr/bin/env bash
# Draft families side by side on one GPU, from one feature set: SmolLM2-135M-Instruct regenerates
# 10,240 synthesised conversations, one capture stores the layers of every family, then an
# EAGLE-3 draft (recipes/smollm2-h200.yaml), DFlash b16 plain, with the D-PACE objective and with
# --final-norm-init 0.1, Domino b16 and DSpark b16 (recipes/smollm2-h200-dflash.yaml) and a P-EAGLE
# draft of 7 depths (recipes/smollm2-h200-peagle.yaml, key peagle_k7) train from it, all for the
# same epochs, and sf-eval decodes every held-out set. benchmarks/families.py gathers the reports
# into benchmarks/results/families.json.
# Needs a CUDA machine with specfoundry installed (`pip install -e .` over your own torch).
#
# SmolLM2's drafts are small: one training alone leaves most of an H200 idle, so the trainings run
# side by side (JOBS at a time), then the acceptance evals (EVAL_JOBS at a time).
# Side by side, their tokens/s are not comparable, so a timing pass follows: each draft decodes
# alone, TIMING_LIMIT prompts of every set, the EAGLE-3 chain with the target alone too; its reports
# (timing_<draft>) give families.json's tokens/s. SEQUENTIAL=1 runs everything one at a time.
# Every stage resumes when rerun with the same command.
# Environment:
#   RUN           where the work goes (runs/smollm2-families)
#   SYNTH         conversations synthesised (10240)
#   REGEN_FROM    a .tar.gz of a finished regen folder `regen/` of the same command, used instead
#                 of regenerating (sf-regen then finds it complete)
#   EPOCHS        every family's epochs (default: each recipe's)
#   JOBS          trainings at once (default: scripts/side_by_side.sh's train_jobs, one per 35 GiB of
#                 GPU memory: 4 on an H200, 2 on an 80 GB H100), EVAL_JOBS evals at once (8)
#   TIMING_LIMIT  prompts per set in the timing pass (4; 0 skips the pass); STOP_AT: epoch seconds
#                 after which no timing decode starts (families.json is written before the pass too)
#   REGEN_OPTS, TRAIN_OPTS, EVAL_OPTS  more options for every sf-regen, sf-train (options every family
#                 reads: another family's is refused; default
#                 --num-workers 2), sf-eval (acceptance and timing) command
#   TIMING_OPTS   more options for the timing pass's sf-eval alone (e.g. --compile-target: the target's
#                 steps compiled, where the acceptance evals keep the captured steps)
#   DRAFT_TIMING_OPTS  more options for the timing pass of the drafts that take --compile-draft (the
#                 EAGLE-3 chain, DFlash, D-PACE, Domino, DSpark; not the tree, not P-EAGLE)
#   ONLY          the drafts to train, by name, space-separated (default all seven); the others are
#                 not evaluated (no export)
#   RESULT        the result file's name under benchmarks/results (families)
#   DEV           the target's device (cuda)
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
DEV=${DEV:-cuda}
EAGLE3=recipes/smollm2-h200.yaml
DFLASH=recipes/smollm2-h200-dflash.yaml
PEAGLE=recipes/smollm2-h200-peagle.yaml
TRAIN_OPTS="${EPOCHS:+--epochs $EPOCHS} ${TRAIN_OPTS:---num-workers 2}"
EVAL_OPTS="--device $DEV ${EVAL_OPTS:-}"
# the allocator returns freed blocks' tails to the other processes sharing the GPU; up to 8
# processes share the CPU cores too, so each keeps to 2 threads (their work is on the GPU)
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
[ "$DEV" = cuda ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$RUN/logs"

# shellcheck source=scripts/side_by_side.sh
. scripts/side_by_side.sh

if [ -n "${REGEN_FROM:-}" ] && [ ! -e "$RUN/regen" ]; then tar xzf "$REGEN_FROM" -C "$RUN"; fi
sf-regen run -o "$RUN/regen" --recipe "$EAGLE3" --synthesize "${SYNTH:-10240}" --device "$DEV" ${REGEN_OPTS:-}
sf-capture run "$RUN/regen" -o "$RUN/features" --recipe "$EAGLE3" --families eagle3,dflash,domino,dspark,peagle --device "$DEV"
sf-capture verify "$RUN/features"

# draft name, recipe and options; the slowest first, so that the last slots hold the short ones
DRAFTS=("dspark|$DFLASH|--block-size 16 --family dspark"
        "domino_b16|$DFLASH|--block-size 16 --family domino"
        "dflash_b16|$DFLASH|--block-size 16"
        "dflash_b16_dpace|$DFLASH|--block-size 16 --objective dpace"
        "dflash_b16_norm01|$DFLASH|--block-size 16 --final-norm-init 0.1"
        "eagle3|$EAGLE3|"
        "peagle_k7|$PEAGLE|--num-depths 7")
keep_only DRAFTS  # ONLY: the drafts named
trains=()
for d in "${DRAFTS[@]}"; do
  IFS='|' read -r name recipe opts <<< "$d"
  trains+=("sf-train run $RUN/features -o $RUN/$name --recipe $recipe $opts $TRAIN_OPTS")
done
# a training that fails (its log is named) leaves the others to be evaluated; the script fails at the end
status=0
side_by_side train "$(train_jobs)" "${trains[@]}" || status=1

# the evals of every draft: NAME|DRAFT|RECIPE|OPTIONS (the EAGLE-3 draft decodes as a chain and a tree)
EVALS=("eagle3_chain_k7|eagle3|$EAGLE3|"
       "eagle3_tree|eagle3|$EAGLE3|--tree 8,4,2,1,1,1,1")
for name in dflash_b16 dflash_b16_dpace dflash_b16_norm01 domino_b16 dspark; do EVALS+=("$name|$name|$DFLASH|"); done
EVALS+=("peagle_k7|peagle_k7|$PEAGLE|")
trained=()  # the evals of the drafts that trained (an export in their folder)
for e in "${EVALS[@]}"; do
  IFS='|' read -r name draft recipe opts <<< "$e"
  if [ -f "$RUN/$draft/export/config.json" ]; then trained+=("$e"); else echo "no export in $RUN/$draft: $name not evaluated"; fi
done
evals=()
for e in "${trained[@]}"; do
  IFS='|' read -r name draft recipe opts <<< "$e"
  evals+=("sf-eval run $RUN/$draft -o $RUN/eval_$name --recipe $recipe $opts --no-baseline $EVAL_OPTS")
done
side_by_side eval "${EVAL_JOBS:-8}" "${evals[@]}" || status=1
# the acceptance figures now, whatever the timing pass then has time for
python -m benchmarks.families "$RUN" --out "${RESULT:-families}"

if [ "${TIMING_LIMIT:-4}" -gt 0 ]; then
  for e in "${trained[@]}"; do  # one at a time; none started after STOP_AT (epoch seconds), if given
    IFS='|' read -r name draft recipe opts <<< "$e"
    if [ -n "${STOP_AT:-}" ] && [ "$(date +%s)" -ge "$STOP_AT" ]; then echo "timing: $name skipped (STOP_AT)"; continue; fi
    [ "$name" = eagle3_chain_k7 ] && base=--baseline || base=--no-baseline
    case $name in eagle3_tree|peagle*) draft_opts= ;; *) draft_opts=${DRAFT_TIMING_OPTS:-} ;; esac
    side_by_side "timing_$name" 1 \
      "sf-eval run $RUN/$draft -o $RUN/timing_$name --recipe $recipe $opts $base $EVAL_OPTS ${TIMING_OPTS:-} $draft_opts --limit ${TIMING_LIMIT:-4}" \
      || status=1
  done
  python -m benchmarks.families "$RUN" --out "${RESULT:-families}"
fi
exit $status
