#!/usr/bin/env bash
# One run on a GPU machine: install, then the steps named in STEPS (default "tests bench"):
#   tests     the test suite on the GPU (gpu-marked tests included; TESTS, PYTEST_K, XDIST workers)
#   tests_bg  the same, in the background while the next steps run (sanitize only: not for timing)
#   wait      wait for tests_bg to finish (put it before any timing step)
#   bench     benchmarks/bench_decode.py (args: BENCH_ARGS) -> decode_grid.csv, .json, .png
#   bench2/3  more of the same grid, merged into those files (args: BENCH2_ARGS / BENCH3_ARGS, run with --merge);
#             copy decode_grid.* to benchmarks/results/ when the run is the new baseline
#   sanitize  compute-sanitizer memcheck, racecheck and initcheck (SAN_TOOLS) on benchmarks/sanitize.py per backend
#   sweep     benchmarks/sweep_kernel.py (SWEEP_BACKEND, SWEEP_ARGS) -> sweep.json
#   merge     benchmarks/bench_merge.py (MERGE_MODE=merge): the merge strategies side by side -> merge.json
#   cp        benchmarks/bench_cp.py: context-parallel decode over 2 GPUs (NCCL) -> cp.json
#   tune      attnplan tune (args: TUNE_ARGS): writes $ATTNPLAN_CACHE_DIR/plans/<device>.yaml, copied out
#   longtail  benchmarks/bench_longtail.py (args: LONGTAIL_ARGS): capacity vs live plans vs FlashInfer -> longtail.json
#   host      benchmarks/bench_host.py (args: HOST_ARGS): host cost per eager call -> host.json
#   cmd       the shell command in CMD (output: cmd.log); cmd_bg runs it in the background (untimed work only)
# Optional, for a machine without network access: wheels in .whl/ (e.g. pydantic, platformdirs, pyelftools) are
# installed first, and a FlashInfer copy in .peers/flashinfer/ (a flashinfer-python package with prebuilt sm_90a
# decode modules, as flashinfer_stripped.tar.xz, and its apache-tvm-ffi wheel) is put on the path. FlashInfer (the
# paged-decode peer; elsewhere `pip install flashinfer-python`) is used when it imports, and the benchmarks say so
# when it does not.
# Everything lands in $OUT/run/ and is packed into $OUT/run.tgz (one file to copy back);
# short summaries are printed last.
# Usage (repository root, on the GPU machine): STEPS="tests bench" bash benchmarks/gpu_run.sh
# Where the checkout's .git is absent or another commit's, pass the commit the results are for: ATTNPLAN_COMMIT=<sha>
# (the results files record it).
set -uo pipefail
OUT=${OUT:-gpu-out}; R="$OUT/run"; mkdir -p "$R"; export R  # CMD may write under $R
export PYTHONUNBUFFERED=1 ATTNPLAN_CACHE_DIR=$(mktemp -d) ATTNPLAN_FAILURE_LOG=$R/failures.log  # failures as they happen
trap 'rm -rf "$ATTNPLAN_CACHE_DIR"' EXIT  # the run's own plan / compile cache (a tune's table is copied out first)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || { cat "$R/install.log"; exit 1; }
if [ -f .peers/flashinfer/flashinfer_stripped.tar.xz ]; then
  mkdir -p /tmp/fi_site
  python3 -c "import tarfile; tarfile.open('.peers/flashinfer/flashinfer_stripped.tar.xz').extractall('/tmp/fi_site')"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fi_site .peers/flashinfer/apache_tvm_ffi-*.whl
  export PYTHONPATH=/tmp/fi_site:${PYTHONPATH:-} FLASHINFER_CUDA_ARCH_LIST=9.0 FLASHINFER_WORKSPACE_BASE=/tmp
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
[ -n "${ATTNPLAN_COMMIT:-}" ] && export ATTNPLAN_COMMIT || echo "ATTNPLAN_COMMIT unset: the results record this copy's git commit"
t0=$SECONDS
# With the default TESTS, the NVRTC compile tests run first, in a process of their own: NVRTC 13.0 with driver
# 580 printed no ptxas report for a program compiled a second time in a process (and for some first compiles),
# and the GPU tests compile the same programs. TEST_TIMEOUT bounds both runs together.
run_tests() {
  local tests=${TESTS:-tests} ign="" t0=$SECONDS to=${TEST_TIMEOUT:-300} rc0=skipped
  : > "$R/pytest-gpu.log"
  if [ "$tests" = tests ] && [ -z "${PYTEST_K:-}" ]; then
    timeout $(( to < 200 ? to : 200 )) python3 -m pytest -q -rfE --tb=short -p no:cacheprovider ${XDIST:+-n $XDIST} \
      ${PYTEST_ARGS:-} tests/test_cuda_ptx_compile.py >> "$R/pytest-gpu.log" 2>&1
    rc0=$?
    ign="--ignore=tests/test_cuda_ptx_compile.py"
  fi
  local left=$(( to - (SECONDS - t0) )); [ $left -lt 10 ] && left=10
  timeout $left python3 -m pytest -q -rfE --tb=short -p no:cacheprovider --timeout 250 \
    ${XDIST:+-n $XDIST} ${PYTEST_ARGS:-} $tests $ign ${PYTEST_K:+-k "$PYTEST_K"} >> "$R/pytest-gpu.log" 2>&1
  echo "pytest rc=$? (compile tests first: rc=$rc0)" >> "$R/pytest-gpu.log"
}
for step in ${STEPS-tests bench}; do  # STEPS="" installs only
  echo "== $step (t=$((SECONDS - t0)) s)"
  case $step in
    tests)  # a run cut short leaves pytest-xdist's workers (execnet children) running: before any timing, stop the
      # processes whose environment carries this run's tag (not every pytest on the machine)
      tag="gpu-run-$$-$RANDOM"; ( export ATTNPLAN_RUN_TAG=$tag; run_tests )
      for env in /proc/[0-9]*/environ; do
        grep -qzx "ATTNPLAN_RUN_TAG=$tag" "$env" 2>/dev/null && kill -TERM "${env//[^0-9]/}" 2>/dev/null
      done; sleep 1 ;;
    tests_bg) run_tests & TESTS_PID=$! ;;
    cmd) bash -c "$CMD" > "$R/cmd.log" 2>&1; echo "cmd rc=$?" ;;
    cmd_bg) bash -c "$CMD" > "$R/cmd.log" 2>&1 & CMD_PID=$! ;;
    wait) [ -n "${TESTS_PID:-}" ] && wait $TESTS_PID; TESTS_PID= ;;
    bench)
      timeout ${BENCH_TIMEOUT:-400} python3 benchmarks/bench_decode.py --out "$R/decode_grid" ${BENCH_ARGS:-} > "$R/bench.log" 2>&1; echo "bench rc=$?" ;;
    bench2|bench3|bench4)  # BENCH2_ARGS / BENCH3_ARGS / BENCH4_ARGS, merged into decode_grid.*
      args_var="${step^^}_ARGS"; to_var="${step^^}_TIMEOUT"
      timeout ${!to_var:-300} python3 benchmarks/bench_decode.py --out "$R/decode_grid" --merge ${!args_var:-} > "$R/$step.log" 2>&1; echo "$step rc=$?" ;;
    longtail)
      timeout ${LONGTAIL_TIMEOUT:-400} python3 benchmarks/bench_longtail.py --out "$R/longtail.json" ${LONGTAIL_ARGS:-} > "$R/longtail.log" 2>&1; echo "longtail rc=$?" ;;
    host)
      timeout ${HOST_TIMEOUT:-200} python3 benchmarks/bench_host.py --out "$R/host.json" ${HOST_ARGS:-} > "$R/host.log" 2>&1; echo "host rc=$?" ;;
    sweep)
      timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/sweep_kernel.py --backend ${SWEEP_BACKEND:-cuda_ptx} --out "$R/sweep.json" ${SWEEP_ARGS:-} \
        > "$R/sweep.log" 2>&1; echo "sweep rc=$?" ;;
    merge)
      timeout ${MERGE_TIMEOUT:-200} python3 benchmarks/bench_merge.py --mode ${MERGE_MODE:-merge} --backends ${MERGE_BACKENDS:-triton} \
        --iters ${MERGE_ITERS:-30} --out "$R/merge.json" > "$R/merge.log" 2>&1; echo "merge rc=$?" ;;
    sanitize)  # all backends x tools in parallel (one GPU, many cores); device-side errors only
      for be in ${SAN_BACKENDS:-triton numba cuda_ptx}; do
        for tool in ${SAN_TOOLS:-memcheck racecheck initcheck}; do
          ( timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool $tool --report-api-errors no --print-limit 1000 \
            python3 benchmarks/sanitize.py --backend $be > "$R/sanitize-$be-$tool.log" 2>&1; echo "rc=$?" >> "$R/sanitize-$be-$tool.log" ) &
        done
      done
      wait $(jobs -p | grep -v -x -e "${TESTS_PID:-none}" -e "${CMD_PID:-none}") 2>/dev/null ;;
    cp)  # needs 2 GPUs of one host (NCCL)
      python3 benchmarks/bench_cp.py --world ${CP_WORLD:-2} --kv ${CP_KV:-1048576,2097152} --out "$R/cp.json" \
        > "$R/cp.log" 2>&1; echo "cp rc=$?" ;;
    tune)
      timeout ${TUNE_TIMEOUT:-300} python3 -m attnplan.cli tune --json "$R/tune.json" ${TUNE_ARGS:-} > "$R/tune.log" 2>&1; echo "tune rc=$?"
      cp "$ATTNPLAN_CACHE_DIR"/plans/*.yaml "$R/" 2>/dev/null ;;
  esac
done
[ -n "${TESTS_PID:-}" ] && wait $TESTS_PID
[ -n "${CMD_PID:-}" ] && wait $CMD_PID
echo "== done (t=$((SECONDS - t0)) s)"
# summaries, last
[ -f "$R/pytest-gpu.log" ] && { grep -E "FAILED|ERROR" "$R/pytest-gpu.log" | grep -v "^E " | head -40; grep -E "passed|failed|rc=" "$R/pytest-gpu.log" | tail -4; }
for f in "$R"/sanitize-*.log; do [ -f "$f" ] && echo "$(basename $f): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|equal the reference|^rc=' $f | tr '\n' ' ')"; done
[ -f "$R/sweep.log" ] && grep -E "^(contiguous|paged) " "$R/sweep.log" | awk 'NR%3==1' | head -20
[ -f "$R/tune.log" ] && tail -32 "$R/tune.log"
[ -f "$R/merge.log" ] && grep -E "^(merge|partition) " "$R/merge.log" | cut -c1-150 | tail -60
[ -f "$R/cp.log" ] && tail -6 "$R/cp.log"
[ -f "$R/cmd.log" ] && tail -${CMD_TAIL:-8} "$R/cmd.log"
[ -f "$R/failures.log" ] && { echo "== failures ($(grep -c '^==== ' "$R/failures.log"))"; grep '^==== ' "$R/failures.log" | head -30; }
[ -f "$R/host.log" ] && sed -n '/^floor\|^host us/,$p' "$R/host.log"
[ -f "$R/longtail.log" ] && { grep -E "error|Error" "$R/longtail.log" | head -8; sed -n '/^heads /,$p' "$R/longtail.log"; }
for b in bench bench2 bench3 bench4; do [ -f "$R/$b.log" ] && sed -n '/^us per step/,$p' "$R/$b.log" | tail -70; done
[ -f "$R/decode_grid.csv" ] && python3 benchmarks/grid_stats.py "$R/decode_grid.csv" --baseline benchmarks/results/decode_grid.csv
tar czf "$OUT/run.tgz" -C "$OUT" run && rm -rf "$R"
