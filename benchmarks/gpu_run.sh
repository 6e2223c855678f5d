#!/usr/bin/env bash
# One device-machine session: install, run the whole test suite on the GPU, then the benchmark.
# Usage (repository root, on the GPU machine): bash benchmarks/gpu_run.sh [bench args...]
# Writes logs and JSON under $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ATTNPLAN_CACHE_DIR=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.txt"
python3 -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
TESTS=${TESTS:-tests}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x --timeout 120 -p no:cacheprovider $TESTS ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/pytest-gpu.log" | tail -40
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 benchmarks/bench_decode.py --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
fi
