#!/usr/bin/env bash
# Issue 36's end-to-end figure on one GPU: a SmolLM2 EAGLE-3 draft from a short pipeline (sf-regen
# of SYNTH synthesised conversations, capture, EPOCHS epochs with recipes/smollm2-h200.yaml), then
# sf-eval of every built-in prompt set (60 prompts, 96 new tokens, chain k=7, with the target-alone
# baseline) in each of DTYPES, and in each of COMPILE ("off": the captured steps as they are, "on":
# --compile-target, "all": --compile-target --compile-draft), the wall time of each sf-eval
# printed. Every stage resumes.
#   RUN=DIR SYNTH=2048 EPOCHS=1 DTYPES="float32 bfloat16" COMPILE="off on" bash scripts/decode_gpu.sh
#   (DTYPES= : up to the draft)
# DEV=cpu SYNTH=8 DTYPES=float32 checks the script on a CPU (minutes; the figures mean nothing there).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/decode-gpu}
SYNTH=${SYNTH:-2048} EPOCHS=${EPOCHS:-1} DTYPES=${DTYPES-float32 bfloat16} DEV=${DEV:-cuda} COMPILE=${COMPILE:-off}
RECIPE=recipes/smollm2-h200.yaml
mkdir -p "$RUN"
sf-regen run -o "$RUN/regen" --recipe "$RECIPE" --synthesize "$SYNTH" --device "$DEV" \
  $([ "$DEV" = cpu ] && echo "--batch-size 8 --max-new-tokens 32")
sf-capture run "$RUN/regen" -o "$RUN/features" --recipe "$RECIPE" --device "$DEV"
sf-train run "$RUN/features" -o "$RUN/train" --recipe "$RECIPE" --epochs "$EPOCHS" --warmup-steps 20 \
  --eval-every 100000 --save-every 100000 $([ "$DEV" = cpu ] && echo "--num-workers 0")
for dtype in $DTYPES; do
  for compile in $COMPILE; do
    case $compile in
      off) out=$RUN/eval-$dtype opts= ;;
      on) out=$RUN/eval-$dtype-compiled opts=--compile-target ;;
      all) out=$RUN/eval-$dtype-compiled-draft opts="--compile-target --compile-draft" ;;
      *) echo "COMPILE: off, on or all, not $compile" >&2; exit 2 ;;
    esac
    start=$(date +%s%N)
    sf-eval run "$RUN/train" -o "$out" --recipe "$RECIPE" --device "$DEV" --dtype "$dtype" $opts \
      $([ "$DEV" = cpu ] && echo "--max-new-tokens 8 --prompts chat")
    echo "sf-eval --dtype $dtype $opts: $(( ($(date +%s%N) - start) / 1000000 )) ms of wall time, every stage of it"
    cat "$out/eval.txt"
  done
done
