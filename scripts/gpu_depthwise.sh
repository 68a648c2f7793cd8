#!/usr/bin/env bash
# Issue 28 on the GPU machine: the depthwise table against cuDNN, its tune, the GPU tests, a MobileNetV2 step.
#
# One STAGE per device call (each fits the 10-minute limit; results land in $OUT as <stage>.tgz through
# scripts/gpu_run.sh, which installs the wheels and the package first):
#   bash scripts/gpu_depthwise.sh bench-fwd      fp32 forward + backward-data of tuning/tables/depthwise.json vs cuDNN
#                                                (ratio and % of the 3.0 TB/s roofline per row)
#   bash scripts/gpu_depthwise.sh bench-wgrad    fp32 backward-weight of the table
#   bash scripts/gpu_depthwise.sh bench-fp16     fp16 (float16 tensors) forward + backward-data
#   bash scripts/gpu_depthwise.sh tune           tune the table's batch-32 rows (TUNE_BUDGET s, default 420) and bench
#                                                them with the tuned database; the database comes back in $OUT
#   bash scripts/gpu_depthwise.sh tests          the GPU tests of the depthwise files and of kernelgen.nn's MobileNet
#   bash scripts/gpu_depthwise.sh step           MobileNetV2 training step (batch 128, 32x32 CIFAR stem) vs PyTorch
#   bash scripts/gpu_depthwise.sh step224        the same at 224x224 (ImageNet stem, batch 64 to fit the time)
# Extra arguments go to the bench (e.g. --layers mnv2_dw3_56_c144_s1_b32).
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:?stage: bench-fwd | bench-wgrad | bench-fp16 | tune | tests | step | step224}"; shift || true
export RESULTS_NAME="depthwise_$stage" BENCH_TABLE=depthwise
case "$stage" in
  bench-fwd)   bash scripts/gpu_run.sh bench --directions fwd,bwd_data "$@" ;;
  bench-wgrad) bash scripts/gpu_run.sh bench --directions bwd_weight "$@" ;;
  bench-fp16)  bash scripts/gpu_run.sh bench --precision fp16 --directions fwd,bwd_data "$@" ;;
  tune)
    # the tuner takes whole tables: a table of the depthwise batch-32 rows, written beside the shipped one before
    # gpu_run.sh installs the package (tables ship as its package data)
    python3 - <<'EOF'
import json
t = json.load(open("tuning/tables/depthwise.json"))
t["name"], t["layers"] = "depthwise_b32", [l for l in t["layers"] if l["N"] == 32 and l["groups"] == l["C"]]
json.dump(t, open("tuning/tables/depthwise_b32.json", "w"), indent=1)
EOF
    TUNE_TABLES=depthwise_b32 TUNE_BUDGET="${TUNE_BUDGET:-420}" BENCH_TABLE=depthwise_b32 \
      bash scripts/gpu_run.sh tune-bench --directions fwd,bwd_data,bwd_weight "$@" ;;
  tests)
    TEST_FILES="tests/templates/test_depthwise.py tests/templates/test_depthwise_tuning.py tests/nn/test_mobilenet.py" \
      bash scripts/gpu_run.sh tests ;;
  step)    STEP_ARGS="--model mobilenet_v2 --batch 128 --image 32 --steps 10" bash scripts/gpu_run.sh nn-bench ;;
  step224) STEP_ARGS="--model mobilenet_v2 --batch 64 --image 224 --steps 5 --warmup 2" bash scripts/gpu_run.sh nn-bench ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
