#!/usr/bin/env bash
# The planner-quality check over the decode grid's head configurations: for each heads
# setting and backend, `attnplan tune --check-only` (exhaustive split search, then the planner's own
# choice timed beside the best split; nothing is written to the device table). Heads the table was
# tuned on (32,8,128 and 8,1,128) are in-sample there; the others are out of sample.
# Usage (GPU machine): OUT=dir HEADS="64,8,128 28,4,128" BACKENDS=triton,cuda_ptx bash benchmarks/planner_quality.sh
# (TUNE_EXTRA: more arguments for the tune, e.g. --planner-options to search at the planner's kernel options too)
# Writes the per-configuration JSON and logs, then $OUT/planner_quality.json: every point's planner and best times
# and the count within 5% (the compact result; SUMMARY_ONLY=1 rebuilds it from an existing $OUT).
set -uo pipefail
OUT=${OUT:-quality}; mkdir -p "$OUT"
[ -n "${SUMMARY_ONLY:-}" ] && HEADS_RUN="" || HEADS_RUN="${HEADS:-32,8,128 64,8,128 28,4,128 32,32,128 16,8,256 8,1,128}"
for heads in $HEADS_RUN; do
  for be in ${BACKENDS:-triton cuda_ptx}; do
    tag="${be}-${heads//,/-}"
    timeout ${EACH_TIMEOUT:-120} python3 -m attnplan.cli tune --check-only --backends "$be" --heads "$heads" \
      --iters ${ITERS:-15} ${TUNE_EXTRA:-} --batches ${BATCHES:-1,4,16,64,256} --kv ${KV:-1024,4096,16384,65536,131072} \
      --json "$OUT/quality-$tag.json" > "$OUT/quality-$tag.log" 2>&1
    echo "$tag rc=$? $(grep -E 'planner within 5%' "$OUT/quality-$tag.log")"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
points, gpus = [], set()
for f in sorted(glob.glob(os.path.join(out, "quality-*.json"))):
    backend, heads = os.path.basename(f)[len("quality-"):-len(".json")].split("-", 1)
    d = json.load(open(f))
    gpus.add(d.get("table", {}).get("measured", {}).get("device"))
    for r in d.get("quality", []):
        points.append({"backend": backend, "heads": heads.replace("-", "/"), "layout": r["layout"], "batch": r["batch"],
                       "kv": r["kv"], "planner_us": round(r["planner_us"], 1), "planner_splits": r["planner_splits"],
                       "best_us": round(r["best_us"], 1), "within_5pct": bool(r["within_5pct"])})
doc = {"what": "the planner's plan against an exhaustive split search (attnplan tune --check-only), CUDA-graph replay, "
               "L2 flushed", "command": os.environ.get("QUALITY_COMMAND", "bash benchmarks/planner_quality.sh"),
       "commit": os.environ.get("ATTNPLAN_COMMIT"), "gpu": sorted(g for g in gpus if g), "points": points,
       "summary": f"{sum(p['within_5pct'] for p in points)} of {len(points)} within 5%"}
json.dump(doc, open(os.path.join(out, "planner_quality.json"), "w"), indent=1)
print(doc["summary"])
PY
