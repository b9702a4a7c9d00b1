#!/usr/bin/env bash
# Draft families side by side on one GPU, from one feature set: SmolLM2-135M-Instruct regenerates
# 10,240 synthesised conversations, one capture stores the layers of both families, then an
# EAGLE-3 draft (recipes/smollm2-h200.yaml) and DFlash drafts of block 16 and 8
# (recipes/smollm2-h200-dflash.yaml) train from it, and sf-eval decodes every held-out set: the
# EAGLE-3 chain (k=7) and tree, the DFlash blocks. benchmarks/families.py gathers the reports
# into benchmarks/results/families.json.
# Needs a CUDA machine with specfoundry installed (`pip install -e .` over your own torch).
# Every stage resumes when rerun with the same command; RUN sets where the work goes.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-families}
EAGLE3=recipes/smollm2-h200.yaml
DFLASH=recipes/smollm2-h200-dflash.yaml
mkdir -p "$RUN"

sf-regen run -o "$RUN/regen" --recipe "$EAGLE3" --synthesize 10240 --device cuda
sf-capture run "$RUN/regen" -o "$RUN/features" --recipe "$EAGLE3" --families eagle3,dflash --device cuda
sf-capture verify "$RUN/features"

sf-train run "$RUN/features" -o "$RUN/eagle3" --recipe "$EAGLE3"
for b in 16 8; do
  sf-train run "$RUN/features" -o "$RUN/dflash_b$b" --recipe "$DFLASH" --block-size "$b"
done

sf-eval run "$RUN/eagle3" -o "$RUN/eval_eagle3_chain_k7" --recipe "$EAGLE3" --device cuda
sf-eval run "$RUN/eagle3" -o "$RUN/eval_eagle3_tree" --recipe "$EAGLE3" --device cuda --tree 8,4,2,1,1,1,1 \
  --no-baseline
for b in 16 8; do
  sf-eval run "$RUN/dflash_b$b" -o "$RUN/eval_dflash_b$b" --recipe "$DFLASH" --device cuda
done
python -m benchmarks.families "$RUN"
