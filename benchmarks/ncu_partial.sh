#!/usr/bin/env bash
# Nsight Compute (ncu) profile of the split-KV partial (or single-pass) kernel of one decode step per backend, on the GPU
# machine: hardware counters (DRAM throughput, occupancy, warp stall reasons) to see why one backend's
# partial streams slower than another's. Clocks left alone (--clock-control none), as the timings leave them.
#   OUT=dir BACKENDS="triton cuda_ptx" KVS="32768" BATCH=1 LAYOUT=contiguous HEADS=32,8,128 [KV_DTYPE=float8_e4m3fn] [DIST=one_long] [NCU_SOURCE=cuda_ptx] \
#     bash benchmarks/ncu_partial.sh
# cuda_ptx runs with benchmarks/configs/cuda-ptx-no-pdl.yaml (one kernel at a time, no early launch). With NCU_SOURCE, that
# backend's SASS with stall samples lands in <report>-sass.csv and ncu_sass.py's summary in <report>-sass.txt.
set -uo pipefail
OUT=${OUT:-ncu-out}; mkdir -p "$OUT"; status=0
for kv in ${KVS:-32768}; do
  for be in ${BACKENDS:-triton cuda_ptx}; do
    rep="$OUT/ncu-$be-${LAYOUT:-contiguous}-b${BATCH:-1}-$kv${KV_DTYPE:+-$KV_DTYPE}${DIST:+-$DIST}"
    ATTNPLAN_CONFIG=benchmarks/configs/cuda-ptx-no-pdl.yaml timeout ${NCU_TIMEOUT:-120} \
      ncu --clock-control none --set full -k 'regex:attnplan_decode|split_kv' --launch-skip 3 --launch-count 1 -f -o "$rep" \
      python3 benchmarks/profile_kernels.py --plain --iters 5 --backends $be --batches ${BATCH:-1} --layouts ${LAYOUT:-contiguous} --kv $kv --heads ${HEADS:-32,8,128} --kv-dtype ${KV_DTYPE:-bfloat16} ${DIST:+--dist $DIST} \
      > "$rep.log" 2>&1
    rc=$?; echo "ncu $be ${LAYOUT:-contiguous} b${BATCH:-1} kv$kv rc=$rc"
    if [ $rc -ne 0 ] || [ ! -f "$rep.ncu-rep" ]; then status=1; tail -5 "$rep.log"; continue; fi
    ncu --import "$rep.ncu-rep" --page details > "$rep.txt" 2>&1
    if [ "$be" = "${NCU_SOURCE:-}" ]; then  # the SASS with stall samples, and where they fall (ncu_sass.py)
      ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-sass.csv" 2> "$rep-sass.err"
      python3 "$(dirname "$0")/ncu_sass.py" "$rep-sass.csv" --top 10 > "$rep-sass.txt" 2>&1; head -40 "$rep-sass.txt"
    fi
    grep -E "^  [A-Za-z]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Waves Per SM|Theoretical Occupancy|Block Limit|Dynamic Shared|Issued Ipc|Warp Cycles Per Issued|L2 Hit|Eligible Warps|No Eligible" "$rep.txt" | head -60
  done
done
exit $status
