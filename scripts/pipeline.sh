#!/usr/bin/env bash
# The specfoundry pipeline on the embedded default target (SmolLM2-135M-Instruct, CPU).
# Each stage is a separate command reading the previous stage's folder, with its settings in
# recipes/smollm2-cpu.yaml: on your own data and model, run the same commands with your
# dataset in place of `synthesize:` and `--target /path/to/model`. Every stage resumes when
# rerun with the same command.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
RUN=${RUN:-runs/smollm2}
RECIPE=recipes/smollm2-cpu.yaml

# 1. Regenerate: the target writes 40 user prompts itself (no dataset needed) and answers them
#    at temperature 0.8, so the draft learns the target's own text.
sf-regen run -o "$RUN/regen" --recipe "$RECIPE"

# 2. Capture: chat template + assistant-only loss mask, target prefill, hidden states of layers
#    [1, 14, 26] and the final norm, stored as a Zarr v3 feature set; then check it.
sf-capture run "$RUN/regen" -o "$RUN/features" --recipe "$RECIPE"
sf-capture verify "$RUN/features"

# 3. Train the EAGLE-3 draft with Training-Time Test and export it for SGLang.
sf-train run "$RUN/features" -o "$RUN/train" --recipe "$RECIPE"

# 4. Evaluate by real speculative decoding on held-out chat prompts (never trained on): the
#    draft proposes k=4 tokens, the target verifies them in one forward. The untrained draft
#    (same config and vocabulary, fresh weights) is the floor it must beat.
sf-eval run "$RUN/train" -o "$RUN/eval" --recipe "$RECIPE"

python -m specfoundry.summary "$RUN"
