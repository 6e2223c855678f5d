#!/usr/bin/env bash
# The planner-quality check over the decode grid's head configurations: for each heads
# setting and backend, `attnplan tune --check-only` (exhaustive split search, then the planner's own
# choice timed beside the best split; nothing is written to the device table). Heads the table was
# tuned on (32,8,128 and 8,1,128) are in-sample there; the others are out of sample.
# Usage (GPU machine): OUT=dir HEADS="64,8,128 28,4,128" BACKENDS=triton,cuda_ptx bash benchmarks/planner_quality.sh
set -uo pipefail
OUT=${OUT:-quality}; mkdir -p "$OUT"
for heads in ${HEADS:-32,8,128 64,8,128 28,4,128 32,32,128 16,8,256 8,1,128}; do
  for be in ${BACKENDS:-triton cuda_ptx}; do
    tag="${be}-${heads//,/-}"
    timeout ${EACH_TIMEOUT:-120} python3 -m attnplan.cli tune --check-only --backends "$be" --heads "$heads" \
      --iters ${ITERS:-15} --batches ${BATCHES:-1,4,16,64,256} --kv ${KV:-1024,4096,16384,65536,131072} \
      --json "$OUT/quality-$tag.json" > "$OUT/quality-$tag.log" 2>&1
    echo "$tag rc=$? $(grep -E 'planner within 5%' "$OUT/quality-$tag.log")"
  done
done
