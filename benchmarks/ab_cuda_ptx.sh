#!/usr/bin/env bash
# A/B of two cuda_ptx kernel trees in one GPU call: runs CMD_AB (a shell command writing under $R, with
# $TAG = "new" / "old" / "new2") with this tree's backends/cuda_ptx, then with OLD's (a copy of an earlier
# commit's backends/cuda_ptx, e.g. `git archive <rev> backends/cuda_ptx | tar x -C .snap/old`), then with this
# tree's again (new2: drift between the two new runs bounds the noise). Each tree compiles its own kernels
# (separate ATTNPLAN_CACHE_DIR). The tree is restored afterwards.
#   OLD=.snap/old/backends/cuda_ptx CMD_AB='python3 benchmarks/profile_kernels.py ... --out $R/prof-$TAG.json' \
#     bash benchmarks/ab_cuda_ptx.sh
set -u
: "${OLD:?set OLD to the earlier backends/cuda_ptx tree}" "${CMD_AB:?set CMD_AB}"
[ -f "$OLD/decode.cu" ] || { echo "OLD=$OLD holds no decode.cu" >&2; exit 2; }
export R=${OUT:-ab-out}/run; mkdir -p "$R"
NEW=$(mktemp -d)/cuda_ptx; cp -r backends/cuda_ptx "$NEW" || exit 2
restore() { rm -rf backends/cuda_ptx && cp -r "$NEW" backends/cuda_ptx; }
trap restore EXIT
status=0
run() {
  export TAG=$1 ATTNPLAN_CACHE_DIR=$(mktemp -d)
  rm -rf backends/cuda_ptx && cp -r "$2" backends/cuda_ptx || { status=2; return; }
  echo "== $TAG"; bash -c "$CMD_AB" || status=1
}
run new "$NEW"; run old "$OLD"; run new2 "$NEW"
exit $status
