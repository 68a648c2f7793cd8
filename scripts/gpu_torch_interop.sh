#!/usr/bin/env bash
# GPU: a torchvision-style ResNet-18 CIFAR (batch 128) trained with torch's convolutions (cuDNN) and converted to
# kernelgen's (kernelgen.torch.convert), in one process: step times in fp32 and under bf16 autocast, and both loss
# curves (issue 31).  Writes $OUT/torch_interop.json and its log.  The interop GPU tests (pointer identity for torch,
# CuPy and JAX arrays, bfloat16, the 50-step loss curve) run through gpu_run.sh:
#   TEST_FILES=tests/interop bash scripts/gpu_run.sh tests
# Installs kernelgen as gpu_run.sh does (its numpy / platformdirs wheels from .whl/: fetch them once with
# `bash scripts/gpu_run.sh --fetch-wheels`).  KERNELGEN_CACHE_DIR (default /tmp/kgcache, gpu_run.sh's) keeps the
# compiled kernels for a second run on a warm machine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
rm -rf build  # setuptools reuses a stale build/lib from an earlier call on a warm machine
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site .
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 KERNELGEN_CACHE_DIR="${KERNELGEN_CACHE_DIR:-/tmp/kgcache}"
cd /tmp  # import the installed package, not the source tree (templates/ etc. map into kernelgen.*)
python3 -m kernelgen.torch.bench --out "$OUT/torch_interop.json" --batch 128 --steps "${STEPS:-30}" \
  --warmup "${WARMUP:-5}" --modes "${MODES:-fp32,bf16}" "$@" 2>&1 | tee "$OUT/torch_interop.log"
