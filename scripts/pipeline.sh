#!/usr/bin/env bash
# The specfoundry pipeline on the embedded default target (SmolLM2-135M-Instruct, CPU).
# Each stage is a separate command reading the previous stage's folder: on your own data and
# model, run the same commands with --target /path/to/model and your dataset in place of
# --synthesize. Every stage resumes when rerun with the same command.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
RUN=${RUN:-runs/smollm2}
mkdir -p "$RUN"

# 1. Regenerate: synthesise user prompts from the target itself (no dataset needed) and answer
#    them at temperature 0.8, so the draft learns the target's own text.
sf-regen --synthesize "${N_PROMPTS:-40}" --max-new-tokens 96 --batch-size 40 --shard-size 40 -o "$RUN/regen"

# 2. Capture: chat template + assistant-only loss mask, target prefill, hidden states of layers
#    [1, 14, 26] and the final norm, stored as a Zarr v3 feature set; then check it.
sf-capture run "$RUN/regen" -o "$RUN/features" --max-length 1024 --shard-size 64
sf-capture verify "$RUN/features"

# 3. Train the EAGLE-3 draft with Training-Time Test and export it for SGLang.
sf-train --recipe recipes/smollm2-cpu.yaml --featureset "$RUN/features" --output "$RUN/train" \
  --epochs "${EPOCHS:-10}"

# 4. Evaluate by real speculative decoding on held-out prompts (never trained on): the draft
#    proposes k=4 tokens, the target verifies them in one forward. The untrained draft (same
#    config and vocabulary, fresh weights) is the floor it must beat.
sf-eval run "$RUN/train" --prompts "${EVAL_SETS:-chat}" --limit "${EVAL_PROMPTS:-6}" -k 4 \
  --max-new-tokens "${EVAL_TOKENS:-64}" --compare-untrained -o "$RUN/eval"
python - "$RUN/eval/eval.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for name, s in report["sets"].items():
    print(f"acceptance length on {name} (k=4): trained {s['trained']['accept_length']:.2f}, "
          f"untrained {s['untrained']['accept_length']:.2f}")
PY
