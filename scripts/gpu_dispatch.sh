#!/usr/bin/env bash
# Issue 27 on the GPU machine: per-call dispatch cost, the dispatch and precompile GPU tests, and the cold first
# training step with and without kernelgen's precompile.  One STAGE per device call (each fits its 10 minutes;
# results come back in $OUT as <name>.tgz through scripts/gpu_run.sh, which installs the package first):
#   bash scripts/gpu_dispatch.sh launch           bench_launch: kernelgen.conv on numba arrays (new output, out=),
#                                                 torch tensors, bind(), torch conv2d, same run; then --python-only
#   bash scripts/gpu_dispatch.sh tests            the GPU tests of the dispatch cache, precompile and the call path,
#                                                 then the demo (gpu_run.sh's tests mode)
#   bash scripts/gpu_dispatch.sh step-cold        ResNet-18 CIFAR batch 128, empty cache, first step compiles
#   bash scripts/gpu_dispatch.sh step-precompile  the same, model.precompile first (precompile_s, then warmup_s)
#   bash scripts/gpu_dispatch.sh step-warm        a fresh process on the cache step-precompile filled (same machine)
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:?stage: launch | tests | step-cold | step-precompile | step-warm}"; shift || true
export RESULTS_NAME="dispatch_$stage"
step_args="--warmup 1 --steps 5 --no-torch"
case "$stage" in
  launch)
    FIRSTCALL=0 bash scripts/gpu_run.sh runtime
    (cd /tmp && PYTHONPATH=/tmp/site python3 -m kernelgen.runtime.bench_launch --python-only --calls 50000) 2>&1 \
      | tee "${OUT:-$PWD/out}/dispatch_python_only.log" ;;
  tests)
    TEST_FILES="tests/runtime/test_dispatch.py tests/runtime/test_dispatch_concurrency.py tests/runtime/test_precompile.py \
tests/runtime/test_runtime_calls.py" bash scripts/gpu_run.sh tests ;;
  step-cold)
    rm -rf /tmp/kg_step_cold
    KERNELGEN_CACHE_DIR=/tmp/kg_step_cold STEP_TIMEOUT=570 STEP_ARGS="$step_args $*" bash scripts/gpu_run.sh nn-bench ;;
  step-precompile)
    rm -rf /tmp/kg_step_pre
    KERNELGEN_CACHE_DIR=/tmp/kg_step_pre STEP_TIMEOUT=570 STEP_ARGS="$step_args --precompile $*" \
      bash scripts/gpu_run.sh nn-bench ;;
  step-warm)
    KERNELGEN_CACHE_DIR=/tmp/kg_step_pre STEP_ARGS="$step_args $*" bash scripts/gpu_run.sh nn-bench ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
