#!/usr/bin/env bash
# A/B of two source trees in one GPU call: runs CMD_AB (a shell command writing under $R, with $TAG = "new" /
# "old" / "new2") with this tree's AB_DIRS (default: backends/cuda_ptx backends/triton), then with OLD's (the root
# of an earlier commit's copy of them, e.g. `git archive <rev> backends | tar x -C .snap/old`), then with this
# tree's again (new2: drift between the two new runs bounds the noise). Each tree compiles its own kernels
# (separate ATTNPLAN_CACHE_DIR). The tree is restored afterwards. EXTRA="tag=root ..." adds more trees (variants of a
# change), run between old and new2.
#   OLD=.snap/old CMD_AB='python3 benchmarks/profile_kernels.py ... --out $R/prof-$TAG.json' bash benchmarks/ab_tree.sh
set -u
: "${OLD:?set OLD to the root of the earlier tree}" "${CMD_AB:?set CMD_AB}"
DIRS=${AB_DIRS:-backends/cuda_ptx backends/triton}
for root in "$OLD" $(for e in ${EXTRA:-}; do echo "${e#*=}"; done); do
  for d in $DIRS; do [ -d "$root/$d" ] || { echo "$root holds no $d" >&2; exit 2; }; done
done
export R=${R:-${OUT:-ab-out}/run}; mkdir -p "$R"
NEW=$(mktemp -d)
for d in $DIRS; do mkdir -p "$NEW/$(dirname $d)" && cp -r "$d" "$NEW/$d" || exit 2; done
place() { for d in $DIRS; do rm -rf "$d" && cp -r "$1/$d" "$d" || return 1; done; }
trap 'place "$NEW"' EXIT
status=0
run() {
  export TAG=$1 ATTNPLAN_CACHE_DIR=$(mktemp -d)
  place "$2" || { status=2; return; }
  echo "== $TAG"; bash -c "$CMD_AB" || status=1
}
run new "$NEW"; run old "$OLD"
for e in ${EXTRA:-}; do run "${e%%=*}" "${e#*=}"; done
run new2 "$NEW"
exit $status
