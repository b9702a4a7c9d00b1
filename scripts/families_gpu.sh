#!/usr/bin/env bash
# Draft families side by side on one GPU, from one feature set: SmolLM2-135M-Instruct regenerates
# 10,240 synthesised conversations, one capture stores the layers of every family, then an
# EAGLE-3 draft (recipes/smollm2-h200.yaml), DFlash drafts of block 16 and 8, DFlash b16 with the
# D-PACE objective and with --final-norm-init 0.1, Domino b16 and DSpark b16 (recipes/smollm2-h200-dflash.yaml, the same
# epochs) and a P-EAGLE draft of 7 depths (recipes/smollm2-h200-peagle.yaml, key peagle_k7)
# train from it, and sf-eval decodes every held-out set. benchmarks/families.py gathers the
# reports into benchmarks/results/families.json.
# Needs a CUDA machine with specfoundry installed (`pip install -e .` over your own torch).
# Every stage resumes when rerun with the same command; RUN sets where the work goes. SYNTH sets the
# conversations synthesised (10240), EPOCHS every family's epochs (default: each recipe's), for a
# run that fits a shorter slot of GPU time.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
EAGLE3=recipes/smollm2-h200.yaml
DFLASH=recipes/smollm2-h200-dflash.yaml
PEAGLE=recipes/smollm2-h200-peagle.yaml
mkdir -p "$RUN"

sf-regen run -o "$RUN/regen" --recipe "$EAGLE3" --synthesize "${SYNTH:-10240}" --device cuda
sf-capture run "$RUN/regen" -o "$RUN/features" --recipe "$EAGLE3" --families eagle3,dflash,domino,dspark,peagle --device cuda
sf-capture verify "$RUN/features"

sf-train run "$RUN/features" -o "$RUN/eagle3" --recipe "$EAGLE3" ${EPOCHS:+--epochs "$EPOCHS"}
for b in 16 8; do
  sf-train run "$RUN/features" -o "$RUN/dflash_b$b" --recipe "$DFLASH" --block-size "$b" ${EPOCHS:+--epochs "$EPOCHS"}
done
sf-train run "$RUN/features" -o "$RUN/dflash_b16_dpace" --recipe "$DFLASH" --block-size 16 --objective dpace ${EPOCHS:+--epochs "$EPOCHS"}
# the final norm's initial weight (docs/families.md, DFlash's first loss): its effect on acceptance
sf-train run "$RUN/features" -o "$RUN/dflash_b16_norm01" --recipe "$DFLASH" --block-size 16 --final-norm-init 0.1 ${EPOCHS:+--epochs "$EPOCHS"}
sf-train run "$RUN/features" -o "$RUN/domino_b16" --recipe "$DFLASH" --block-size 16 --family domino ${EPOCHS:+--epochs "$EPOCHS"}
sf-train run "$RUN/features" -o "$RUN/dspark" --recipe "$DFLASH" --block-size 16 --family dspark ${EPOCHS:+--epochs "$EPOCHS"}
sf-train run "$RUN/features" -o "$RUN/peagle_k7" --recipe "$PEAGLE" --num-depths 7 ${EPOCHS:+--epochs "$EPOCHS"}

sf-eval run "$RUN/eagle3" -o "$RUN/eval_eagle3_chain_k7" --recipe "$EAGLE3" --device cuda
sf-eval run "$RUN/eagle3" -o "$RUN/eval_eagle3_tree" --recipe "$EAGLE3" --device cuda --tree 8,4,2,1,1,1,1 \
  --no-baseline
for draft in dflash_b16 dflash_b8 dflash_b16_dpace dflash_b16_norm01 domino_b16 dspark; do
  sf-eval run "$RUN/$draft" -o "$RUN/eval_$draft" --recipe "$DFLASH" --device cuda
done
sf-eval run "$RUN/peagle_k7" -o "$RUN/eval_peagle_k7" --recipe "$PEAGLE" --device cuda
python -m benchmarks.families "$RUN"
