#!/usr/bin/env bash
# Runs the GPU tests (`pytest -m gpu`) and keeps their log, headed by the commit, the date, the
# card and the versions, in benchmarks/results/gpu_tests.log (LOG= to put it elsewhere).
#   bash benchmarks/gpu_tests.sh [pytest args, e.g. tests/test_soft_ce.py]
# GIT_COMMIT names the commit for a copy of the tree without .git. The exit status is pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_tests.sh: no CUDA device here; the GPU tests need one" >&2
  exit 2
fi
LOG=${LOG:-benchmarks/results/gpu_tests.log}
{
  echo "# pytest -m gpu $*"
  echo "# commit ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}, $(date -u +%Y-%m-%dT%H:%MZ)"
  python3 -c "import torch, triton; print(f'# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}')"
} > "$LOG"
python3 -m pytest -m gpu -n 0 -p no:cacheprovider -rA --show-capture=stdout -q "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
