#!/usr/bin/env bash
# The specfoundry pipeline at scale on one GPU: SmolLM2-135M-Instruct regenerates ~18k synthesised
# conversations, they are captured, the EAGLE-3 draft trains with recipes/smollm2-h200.yaml, and
# sf-eval decodes every held-out prompt set with k=7, as a chain and as a token tree.
# Needs a CUDA machine with specfoundry installed (`pip install -e .` over your own torch).
# Every stage resumes when rerun with the same command; RUN sets where the work goes.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=${RUN:-runs/smollm2-gpu}
RECIPE=recipes/smollm2-h200.yaml
mkdir -p "$RUN"

# 1. Regenerate: synthesised prompts answered greedily (the decoding eval uses).
sf-regen run -o "$RUN/regen" --recipe "$RECIPE" --device cuda

# 2. Capture the target's hidden states (layers [1, 14, 26] + the final norm), bf16 safetensors.
sf-capture run "$RUN/regen" -o "$RUN/features" --recipe "$RECIPE" --device cuda
sf-capture verify "$RUN/features"

# 3. Train the draft (7 TTT steps, 16k-token batches, 7 epochs) and export it for SGLang.
sf-train run "$RUN/features" -o "$RUN/train" --recipe "$RECIPE"

# 4. Evaluate by real speculative decoding, k=7, fp32: the chain against the target alone, then
#    the tree 8,4,2,1,1,1,1 (360 nodes verified in one target forward).
sf-eval run "$RUN/train" -o "$RUN/eval" --recipe "$RECIPE" --device cuda
sf-eval run "$RUN/train" -o "$RUN/eval_tree" --recipe "$RECIPE" --device cuda --tree 8,4,2,1,1,1,1 --no-baseline
cat "$RUN/eval/eval.txt" "$RUN/eval_tree/eval.txt"
