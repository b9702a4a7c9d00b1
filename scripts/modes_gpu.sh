#!/usr/bin/env bash
# Issue 39's acceptance per serving mode on one GPU. SmolLM2-135M-Instruct renders the reasoning
# rules of Qwen3's chat template (specfoundry.testing.QWEN3_THINKING_TEMPLATE: ChatML, so SmolLM2's
# tokenizer renders it; enable_thinking on by default, false opens the turn with an empty
# <think></think> block). For each mode in TRAIN_MODES (nothink: {"enable_thinking": false};
# think: the template's default), sf-regen regenerates SYNTH synthesised conversations in that mode,
# sf-capture renders them in their recorded mode, and an EAGLE-3 draft trains EPOCHS epochs
# (recipes/smollm2-h200.yaml). Every draft is then evaluated with sf-eval --modes in both modes
# (chain k=7), and benchmarks/modes.py gathers the reports into benchmarks/results/modes.json:
# acceptance length per trained mode, evaluated mode and set. Every stage resumes.
#   RUN=DIR SYNTH=2048 EPOCHS=1 TRAIN_MODES="nothink think" bash scripts/modes_gpu.sh
# DEV=cpu SYNTH=6 EPOCHS=1 checks the script on a CPU (minutes; the figures mean nothing there).
# Environment: RUN (runs/smollm2-modes), SYNTH (2048), EPOCHS (1), TRAIN_MODES, DEV (cuda),
# REGEN_OPTS, TRAIN_OPTS, EVAL_OPTS, RESULT (modes).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-modes}
SYNTH=${SYNTH:-2048} EPOCHS=${EPOCHS:-1} DEV=${DEV:-cuda}
RECIPE=recipes/smollm2-h200.yaml
TRAIN_OPTS=${TRAIN_OPTS:---num-workers 2}
EVAL_OPTS="--device $DEV ${EVAL_OPTS:-}"
mkdir -p "$RUN/logs"
# shellcheck source=scripts/side_by_side.sh
. scripts/side_by_side.sh
TEMPLATE=$RUN/qwen3-reasoning-rules.jinja
python -c "from specfoundry.testing import QWEN3_THINKING_TEMPLATE as t; print(t, end='')" > "$TEMPLATE"
declare -A KWARGS=([nothink]='{"enable_thinking": false}' [think]='{"enable_thinking": true}')
BOTH='[{"enable_thinking": false}, {"enable_thinking": true}]'

trains=()
for mode in ${TRAIN_MODES:-nothink think}; do
  [ -n "${KWARGS[$mode]:-}" ] || { echo "TRAIN_MODES: unknown mode '$mode' (nothink, think)"; exit 2; }
  sf-regen run -o "$RUN/regen_$mode" --recipe "$RECIPE" --synthesize "$SYNTH" --device "$DEV" \
    --chat-template "$TEMPLATE" --chat-template-kwargs "${KWARGS[$mode]}" ${REGEN_OPTS:-}
  sf-capture run "$RUN/regen_$mode" -o "$RUN/features_$mode" --recipe "$RECIPE" --device "$DEV" \
    --chat-template "$TEMPLATE"
  trains+=("sf-train run $RUN/features_$mode -o $RUN/train_$mode --recipe $RECIPE --epochs $EPOCHS \
--warmup-steps 20 --eval-every 100000 --save-every 100000 $TRAIN_OPTS")
done
status=0
side_by_side train 2 "${trains[@]}" || status=1
evals=()
for mode in ${TRAIN_MODES:-nothink think}; do
  [ -f "$RUN/train_$mode/export/config.json" ] || { echo "no export in $RUN/train_$mode"; status=1; continue; }
  evals+=("sf-eval run $RUN/train_$mode -o $RUN/eval_$mode --recipe $RECIPE -k 7 --no-baseline \
--chat-template $TEMPLATE --modes '$BOTH' $EVAL_OPTS")
done
side_by_side eval 2 "${evals[@]}" || status=1
python -m benchmarks.modes "$RUN" --out "${RESULT:-modes}"
exit $status
