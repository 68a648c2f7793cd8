#!/usr/bin/env bash
# One benchmark on an older commit and on this tree, one after the other in one device call: "the same speed,
# bench before and after, same run" (issue 29).
#
# Here:   git archive --format=tar.gz -o .base/base.tgz COMMIT     (.base/ is git-ignored: carry it)
# There:  BASE_COMMIT=COMMIT bash scripts/gpu_same_run.sh [bench args...]   (BENCH_TABLE: default gpu_md)
#
# Each side is scripts/gpu_run.sh SAME_RUN_MODES (default bench; e.g. runtime: µs per call, with FIRSTCALL=0) of its
# own tree (SAME_RUN_COPY: files of this tree put in the old one first, e.g. runtime/bench_launch.py: the same
# measurement on both sides), with its own kernel cache; their results come back as $OUT/base.tgz and $OUT/head.tgz, and the two
# sides' summary lines (geo-means, µs per call) are printed one above the other.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf /tmp/kg_base && mkdir -p /tmp/kg_base && tar xzf "${BASE_TGZ:-.base/base.tgz}" -C /tmp/kg_base
cp -r .whl /tmp/kg_base/
for f in ${SAME_RUN_COPY:-}; do cp "$f" "/tmp/kg_base/$f"; done  # this tree's benchmark scripts, so both sides measure alike
(cd /tmp/kg_base && RESULTS_NAME=base KERNELGEN_CACHE_DIR=/tmp/kgcache_base KERNELGEN_COMMIT="${BASE_COMMIT:-base}" \
  bash scripts/gpu_run.sh "${SAME_RUN_MODES:-bench}" "$@" > /tmp/kg_same_base.log 2>&1) || echo "base: exit $?"
RESULTS_NAME=head KERNELGEN_CACHE_DIR=/tmp/kgcache_head bash scripts/gpu_run.sh "${SAME_RUN_MODES:-bench}" "$@" \
  > /tmp/kg_same_head.log 2>&1 || echo "head: exit $?"
for side in base head; do
  echo "== $side"; grep -iE "geo|us/call|^kernelgen\.|^ +of which|^torch conv2d|^dispatch|^empty numba" \
    "/tmp/kg_same_$side.log" | tail -30 || tail -5 "/tmp/kg_same_$side.log"
done
