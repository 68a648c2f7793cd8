#!/usr/bin/env bash
# What a new batch size costs (issue 27), for this tree and, where .base/base.tgz is there, a base commit, in one
# device call.  Each side fills its own kernel cache with ResNet-18 CIFAR at batch 128 (one process, no torch), then
# a fresh process takes one warm step at 128 and steps on NEW_BATCH (default 96) for NEW_BATCH_SECONDS (40):
# `python -m kernelgen.nn.bench_step --new-batch` (its first step, and the seconds beyond its steady step in all),
# then, where the tree's bench_step has the flag, NEW_BATCH_CONTROL_SECONDS (20) more: the control window.
#
# Here:   git archive --format=tar.gz -o .base/base.tgz COMMIT     (optional; .base/ is git-ignored: carry it)
# There:  bash scripts/gpu_new_batch.sh     -> $OUT/{head,base}{_fill,}.tgz (gpu_run.sh's packed results)
set -euo pipefail
cd "$(dirname "$0")/.."
FINAL_OUT="${OUT:-$PWD/out}"; mkdir -p "$FINAL_OUT"
NEW="--warmup 1 --new-batch ${NEW_BATCH:-96} --new-batch-seconds ${NEW_BATCH_SECONDS:-40}"

side() {  # name, tree
  rm -rf "/tmp/kg_new_batch_$1"
  for run in fill measure; do
    local args="--no-torch --warmup 1 --steps 3" name="$1_fill"
    [ "$run" = measure ] && args="$NEW" name="$1"
    if [ "$run" = measure ] && grep -q -- "--new-batch-control-seconds" "$2/kernelgen/nn/bench_step.py"; then
      args="$args --new-batch-control-seconds ${NEW_BATCH_CONTROL_SECONDS:-20}"
    fi
    (cd "$2" && OUT="$FINAL_OUT" RESULTS_NAME="$name" KERNELGEN_CACHE_DIR="/tmp/kg_new_batch_$1" STEP_ARGS="$args" \
      bash scripts/gpu_run.sh nn-bench > "/tmp/kg_new_batch_$name.log" 2>&1) || echo "$name: exit $?"
    grep -E "^kernelgen|^torch|batch ${NEW_BATCH:-96}" "/tmp/kg_new_batch_$name.log" | sed "s/^/$name: /" || true
  done
}

side head "$PWD"
if [ -f .base/base.tgz ]; then
  rm -rf /tmp/kg_base && mkdir -p /tmp/kg_base && tar xzf .base/base.tgz -C /tmp/kg_base && cp -r .whl /tmp/kg_base/
  side base /tmp/kg_base
fi
