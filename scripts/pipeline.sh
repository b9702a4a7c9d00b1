#!/usr/bin/env bash
# The whole specfoundry pipeline on the embedded default target (SmolLM2-135M-Instruct, CPU).
# Each stage is a separate command that reads the previous stage's output folder, so on your own
# data and model you run the same commands with --target /path/to/model and your own dataset.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
RUN=${RUN:-runs/smollm2}
mkdir -p "$RUN"

# 1. Regenerate: synthesise user prompts from the target (no dataset needed) and answer them
#    with the target at temperature 0.8, so the draft later learns the target's own text.
sf-regen --synthesize "${N_PROMPTS:-64}" --max-new-tokens 128 --batch-size 16 --shard-size 32 -o "$RUN/regen"
