#!/usr/bin/env bash
# One device-machine call: install, then the steps named in STEPS (default "tests bench"):
#   tests     the whole test suite on the GPU (gpu-marked tests included)
#   bench     benchmarks/bench_decode.py (args: BENCH_ARGS) -> $OUT/bench.json, bench.png
#   sanitize  compute-sanitizer memcheck + racecheck on benchmarks/sanitize.py for each backend
#   merge     benchmarks/bench_merge.py: separate vs fused merge -> $OUT/merge.json
#   cp        benchmarks/bench_cp.py: context-parallel decode over 2 GPUs (NCCL) -> $OUT/cp.json
#   tune      attnplan tune (args: TUNE_ARGS) -> $OUT/h200.yaml, $OUT/tune.json
# Usage (repository root, on the GPU machine): STEPS="tests bench" bash benchmarks/gpu_run.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ATTNPLAN_CACHE_DIR=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
for step in ${STEPS-tests bench}; do  # STEPS="" installs only
  case $step in
    tests)
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --timeout 200 ${TESTS:-tests} \
        ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/pytest-gpu.log" 2>&1; echo "pytest rc=$?"
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest-gpu.log" | tail -25 ;;
    numba-first-failure)
      timeout 120 python3 -m pytest -x -q --tb=long -p no:cacheprovider tests/test_numba_backend.py -m gpu \
        > "$OUT/numba-gpu.log" 2>&1; echo "numba rc=$?"; grep -E "Error|error|^E " "$OUT/numba-gpu.log" | head -30 ;;
    bench)
      python3 benchmarks/bench_decode.py --out "$OUT/bench.json" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1; echo "bench rc=$?"
      sed -n '/^ceiling/,$p' "$OUT/bench.log" | tail -40 ;;
    merge)
      python3 benchmarks/bench_merge.py --backends ${MERGE_BACKENDS:-triton} --out "$OUT/merge.json" > "$OUT/merge.log" 2>&1; echo "merge rc=$?"; tail -12 "$OUT/merge.log" ;;
    sanitize)  # all backends x tools in parallel (one GPU, many cores)
      for be in ${SAN_BACKENDS:-triton numba cuda_ptx}; do
        for tool in memcheck racecheck; do
          ( timeout ${SAN_TIMEOUT:-200} compute-sanitizer --tool $tool --print-limit 20 python3 benchmarks/sanitize.py --backend $be \
            > "$OUT/sanitize-$be-$tool.log" 2>&1; echo "rc=$?" >> "$OUT/sanitize-$be-$tool.log" ) &
        done
      done
      wait
      for f in "$OUT"/sanitize-*.log; do echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|equal the reference|^rc=' $f | tr '\n' ' ')"; done ;;
    cp)  # needs kind nvidia-h200-x2 (2 GPUs); keep NCCL_NVLS_ENABLE=0 as the machine sets it
      python3 benchmarks/bench_cp.py --world ${CP_WORLD:-2} --kv ${CP_KV:-1048576,2097152} --out "$OUT/cp.json" \
        > "$OUT/cp.log" 2>&1; echo "cp rc=$?"; tail -6 "$OUT/cp.log" ;;
    tune)
      python3 -m attnplan.cli tune --out "$OUT/h200.yaml" --json "$OUT/tune.json" ${TUNE_ARGS:-} > "$OUT/tune.log" 2>&1; echo "tune rc=$?"; tail -25 "$OUT/tune.log" ;;
  esac
done
