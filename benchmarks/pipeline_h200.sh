#!/usr/bin/env bash
# The SmolLM2 pipeline at scale on one GPU (issue 6): regen ~5,000 conversations with the target,
# capture, train several epochs, and evaluate with k=7 on every held-out prompt set, with and
# without the draft. Stages are arguments, run in order; each resumes when run again:
#   bash benchmarks/pipeline_h200.sh target regen     # GGUF=path/to/SmolLM2.gguf for `target`
#   bash benchmarks/pipeline_h200.sh capture train eval
# Extra options per stage: REGEN_FLAGS (e.g. "--greedy --on-truncated trim"), TRAIN_FLAGS (sf-train overrides),
# EVAL_SETS (default chat,code,math,multiturn), EVAL_LIMIT (prompts per set), EVAL_NAME,
# EVAL_FLAGS (e.g. "--tree 4,2,2,1").
# Keeping a trained draft for later evals (so a session can evaluate without regen + train):
#   bash benchmarks/pipeline_h200.sh keep      # alone in its call: $OUT/draft/ = the export's json
#                                              # files + model.safetensors in 15 MB parts (a call returns 8 files)
#   DRAFT_PARTS=.draft bash benchmarks/pipeline_h200.sh restore eval   # .draft = those files, carried
# Work goes to $WORK (default ~/sfrun); logs and results to $OUT (default $WORK/out).
# It runs from the source tree without installing (the device image has torch and transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-$HOME/sfrun}
OUT=${OUT:-$WORK/out}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 SPECFOUNDRY_CACHE="$WORK/cache"
mkdir -p "$WORK" "$OUT"

sf() {  # sf STAGE ARGS...: the console script sf-STAGE, without an installed package
  local module=$1
  shift
  python3 -c "import sys; from specfoundry.$module.cli import main; sys.argv[0] = 'sf-$module'; main()" "$@"
}

stage() {  # stage NAME COMMAND...: run with its log in $OUT/NAME.log and print its time
  local name=$1 start=$SECONDS
  shift
  echo "== $name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then
    echo "== $name done in $((SECONDS - start)) s"
  else
    echo "== $name FAILED after $((SECONDS - start)) s"; tail -c 3000 "$OUT/$name.log"; exit 1
  fi
}

for s in "$@"; do
  case "$s" in
    target) stage target python3 -c "from pathlib import Path; from specfoundry.common.target import *
convert_gguf(Path('${GGUF:?set GGUF}'), cache_root() / EMBEDDED_DIR_NAME)" ;;
    regen) stage regen sf generate --synthesize "${N:-6000}" --max-new-tokens "${TOKENS:-256}" \
             --batch-size "${BATCH:-512}" --shard-size "${BATCH:-512}" ${REGEN_FLAGS:-} -o "$WORK/regen"
           python3 -c "import json; m = json.load(open('$WORK/regen/manifest.json')); print({k: v for k, v in m.items() if k != 'shards'})" | tee "$OUT/regen_manifest.txt" ;;
    capture) stage capture sf capture run "$WORK/regen" -o "$WORK/features" --codec safetensors --max-length 2048 \
               --shard-size 512 --max-batch-tokens 65536
             du -sh "$WORK/features" | tee "$OUT/features_size.txt" ;;
    train) stage train sf train --recipe recipes/smollm2-h200.yaml --featureset "$WORK/features" \
             --output "$WORK/train" ${EPOCHS:+--epochs $EPOCHS} ${TRAIN_FLAGS:-}
           cp "$WORK/train/history.json" "$WORK/train/train_config.json" "$OUT/" ;;
    keep) mkdir -p "$OUT/draft"
          cp "$WORK/train/export/"*.json "$OUT/draft/"
          split -b 15M "$WORK/train/export/model.safetensors" "$OUT/draft/model.safetensors.part-"
          ls -l "$OUT/draft" ;;
    restore) mkdir -p "$WORK/draft"
             cp "${DRAFT_PARTS:?set DRAFT_PARTS}"/*.json "$WORK/draft/"
             cat "$DRAFT_PARTS"/model.safetensors.part-* > "$WORK/draft/model.safetensors"
             DRAFT=${DRAFT:-$WORK/draft} ;;
    eval) name=${EVAL_NAME:-eval}
          stage "$name" sf eval run "${DRAFT:-$WORK/train}" --prompts "${EVAL_SETS:-chat,code,math,multiturn}" -k "${K:-7}" \
            --max-new-tokens "${EVAL_TOKENS:-96}" ${EVAL_LIMIT:+--limit $EVAL_LIMIT} --dtype float32 ${EVAL_FLAGS:-} -o "$OUT/$name"
          cat "$OUT/$name/eval.txt" ;;
    gate) stage gate sf eval gate -w "$WORK/gate" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
