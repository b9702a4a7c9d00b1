# Runs the GPU tests (`pytest -m gpu`) and keeps their log as a result, so that "the GPU tests
# pass on this code" is a file in benchmarks/results/, not a memory of a session.
#   GIT_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_tests.sh [pytest args, e.g. tests/test_soft_ce.py]
# On the device the working tree arrives without .git: pass the commit it is a copy of. Wheels the
# device image lacks (zarr, datasets, gguf) are installed from .whl/ when that folder is carried.
# The log goes to $OUT/gpu_tests.log when $OUT is set (the device tool), else to
# benchmarks/results/gpu_tests.log; the exit status is pytest's.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-deps .whl/*.whl
fi
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_tests.sh: no CUDA device here; the GPU tests run on a GPU machine (the device tool)" >&2
  exit 2
fi
LOG=${OUT:+$OUT/gpu_tests.log}
LOG=${LOG:-benchmarks/results/gpu_tests.log}
{
  echo "# pytest -m gpu $*"
  echo "# commit ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}, $(date -u +%Y-%m-%dT%H:%MZ)"
  python3 -c "import torch, triton; print(f'# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}')"
} > "$LOG"
python3 -m pytest -m gpu -p no:cacheprovider -rA --show-capture=stdout -q "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
