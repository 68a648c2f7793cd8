#!/usr/bin/env bash
# Data-parallel training on the 2-GPU machine (device kind nvidia-h100-x2), issue 32: everything goes to $OUT.
#
# Here, once (a machine with PyPI and scikit-learn):  bash scripts/gpu_run.sh --fetch-wheels   (.whl/, digits.npz)
# There (repo root):  bash scripts/gpu_ddp.sh [STAGES]   STAGES: comma-separated, default all =
#   tests   tests/distributed on the GPUs (the CPU ones too) and the 2-GPU pytest (test_ddp_gpu.py)
#   check   one step on NGPUS GPUs equals one GPU on the combined batch to 1e-5 ($OUT/check_N.json), for ResNet-18
#           and for a small net whose float32 floor is below 1e-5 ($OUT/check_small_N.json)
#   speed   ResNet-18 CIFAR, batch 128 per GPU: kernelgen 1 GPU, kernelgen NGPUS, PyTorch DDP 1 and NGPUS, in this
#           run; images/s, scaling, the last step's bucket timeline ($OUT/speed_N.json, torch_N.json, summary.txt)
#   digits  `train digits --gpus NGPUS` (>= 97 % test accuracy)
# NGPUS (default: every visible GPU) sets N, so the same script measures 4 and 8 GPUs where they are lent.
# NCCL_NVLS_ENABLE=0 is set here and by the launcher in every rank.
set -euo pipefail
cd "$(dirname "$0")/.."
stages=",${1:-all},"
[ "$stages" = ",all," ] && stages=",tests,check,speed,digits,"
has() { case "$stages" in *",$1,"*) return 0;; *) return 1;; esac; }
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 KERNELGEN_CACHE_DIR="${KERNELGEN_CACHE_DIR:-/tmp/kgcache}"
OUT="${OUT:-$PWD/out}"; mkdir -p "$OUT"
REPO="$PWD"
if [ -d .whl ]; then  # numpy pinned for the machine's numba-cuda, platformdirs: as scripts/gpu_run.sh installs them
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
rm -rf build
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site .
export PYTHONPATH=/tmp/site
NGPUS="${NGPUS:-$(nvidia-smi -L | wc -l)}"
python3 -c "import cupy; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version())" \
  | tee "$OUT/versions.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
run() { echo "+ $*"; "$@" 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it" ; }
L=(python3 -m kernelgen.distributed --nproc-per-node)
cd /tmp  # the installed package, not the source tree
if has tests; then
  run python3 -m pytest -q -x -p no:cacheprovider "$REPO/tests/distributed" | tee "$OUT/tests.log" || true
fi
if has check; then
  run "${L[@]}" "$NGPUS" -m kernelgen.distributed.bench check --out "$OUT" | tee "$OUT/check.log" || true
  run "${L[@]}" "$NGPUS" -m kernelgen.distributed.bench check --model small --out "$OUT" | tee -a "$OUT/check.log" || true
fi
if has speed; then
  run "${L[@]}" 1 -m kernelgen.distributed.bench speed --out "$OUT" | tee "$OUT/speed1.log" || true
  run "${L[@]}" "$NGPUS" -m kernelgen.distributed.bench speed --out "$OUT" | tee "$OUT/speedN.log" || true
  run "${L[@]}" 1 -m kernelgen.distributed.bench torch --out "$OUT" | tee "$OUT/torch1.log" || true
  run "${L[@]}" "$NGPUS" -m kernelgen.distributed.bench torch --out "$OUT" | tee "$OUT/torchN.log" || true
  python3 -m kernelgen.distributed.bench summary "$OUT" | tee "$OUT/summary.txt"
fi
if has digits; then
  data=(); python3 -c "import sklearn" 2>/dev/null || data=(--data "$REPO/.whl/digits.npz")
  run timeout "${DIGITS_TIMEOUT:-500}" python3 -m kernelgen train digits --gpus "$NGPUS" --min-accuracy 0.97 \
    "${data[@]}" | tee "$OUT/train_digits_gpus.log" || true
fi
