#!/usr/bin/env bash
# Prepare the GPU machine and run kernelgen there: GPU tests, demo, benchmark against cuDNN.
#
# Here (once, on a machine with PyPI):   bash scripts/gpu_run.sh --fetch-wheels
# There (device machine, repo root):     bash scripts/gpu_run.sh [MODES] [bench args...]
#   MODES: one or more of tests, runtime, bench, all (= tests bench), tune-bench, tune, probe, wino-sweep,
#   comma-separated
#   tests: `pytest -m gpu` over tests/ (TEST_FILES: a subset, e.g. "tests/templates/test_variants_gpu.py"; TEST_SHARDS=N: N
#   pytest processes side by side, each every N-th test), then the demo; with TEST_SHARDS the tests that passed or were skipped
#   are listed in $OUT/gpu-tests-done.txt, and TEST_DONE=FILE (a repo path: such a list, carried) leaves those out,
#   so a second call finishes what the first one's time limit cut off
#   train (= nn-tests,nn-bench,nn-digits): kernelgen.nn on the GPU - nn-tests: tests/nn/test_nn_gpu.py (ops vs
#   PyTorch); nn-bench: bench_step (ResNet-18 training step vs PyTorch, $OUT/bench_step.json, STEP_ARGS passed
#   on); nn-digits: `train digits --device cuda` (data from .whl/digits.npz, written by --fetch-wheels).  One mode per call fits 10 minutes.
#   mma-ceiling: scripts/mma_ceiling.py (TF32 mma.sync ceilings, $OUT/mma_ceiling.json)
#   wgmma-check: scripts/wgmma_check.py (wgmma layout checks + ceilings, $OUT/wgmma_check.json; WGMMA_ARGS go to it,
#   e.g. "--parts mn-major")
#   tma-check: scripts/tma_check.py (TMA im2col/tiled copies checked, copy streams TMA vs cp.async, TMA + wgmma
#   conv beside cuDNN, $OUT/tma_check.json; TMA_ARGS="--generated-only": kernelgen's generated TMA kernels only)
#   ncu: Nsight Compute sections of one layer's kernel (scripts/profile_conv.py; NCU_LAYER, NCU_DIR, NCU_SETS), and cuDNN's
#   launch-cost: scripts/launch_cost.py (a TMA launcher's call: rounding kernels, conv kernel, host time; args go to it)
#   wino-sweep: scripts/wino_sweep.py (Winograd state counts x tiles vs cuDNN, $OUT/wino_sweep.json; args passed on)
#   autotune-bench: scripts/autotune_bench.py BENCH_TABLE (default unseen): first-call autotuning of each problem,
#   then the bench against cuDNN on what it recorded ($OUT/autotune_*.json, bench_autotuned_*.json; args passed on,
#   e.g. --precision tf32 --directions fwd)
#   fuzz: tests/api/test_fuzz_api.py on the CPU backend with FUZZ_N (5000) more examples over FUZZ_SHARDS (16) processes
#   runtime: µs per call against torch (bench_launch) and first-call times cold, then warm, over BENCH_TABLE
#   tune-bench: TUNE_TABLES (default gpu_md) are tuned within TUNE_BUDGET seconds each, then the bench runs
#   with the tuned database; the database is copied to $OUT.  TUNE_ARGS go to the tuner (e.g. "--directions fwd";
#   "--precision tf32" tunes the tensor-core tiles: pass `--precision tf32` to the bench too, as in
#   TUNE_ARGS="--precision tf32" bash scripts/gpu_run.sh tune-bench --precision tf32).  TUNE_SEED (a path in the
#   repo): a database file put in the tuned dir first, so a tune resumes on a fresh machine.
#
# The device machine's numba-cuda 0.30.4 breaks with its numpy 2.5.2 (np.row_stack is gone), so numpy 2.4.6
# travels as a wheel in .whl/ (git-ignored) with platformdirs, which that image lacks.  Results go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then
  for pkg in numpy==2.4.6 platformdirs==4.14.7; do
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl "$pkg"
  done
  python3 -m kernelgen train digits --save-data .whl/digits.npz  # the GPU machine has no scikit-learn
  exit 0
fi
mode=",${1:-all},"; shift || true
[ "$mode" = ",all," ] && mode=",tests,bench,"
has() { case "$mode" in *",$1,"*) return 0;; *) return 1;; esac; }
# the device tool returns at most 8 files: everything is written to a work folder and packed into
# $OUT/results.tgz on exit (also when a step fails)
FINAL_OUT="${OUT:-$PWD/out}"; mkdir -p "$FINAL_OUT"
OUT=/tmp/kg_results_${RESULTS_NAME:-results}; rm -rf "$OUT"; mkdir -p "$OUT"
pack() { tar czf "$FINAL_OUT/${RESULTS_NAME:-results}.tgz" -C "$OUT" . 2>/dev/null || true; }
trap pack EXIT  # and after every stage: a stage killed by an outer timeout loses only itself
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
rm -rf build  # setuptools reuses a stale build/lib from an earlier call on a warm machine
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site .
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 KERNELGEN_CACHE_DIR="${KERNELGEN_CACHE_DIR:-/tmp/kgcache}"
REPO="$PWD"
cd /tmp  # import the installed package, not the source tree (templates/ etc. map into kernelgen.*)
python3 -c "import numpy, numba, kernelgen; from numba import cuda; print('numpy', numpy.__version__, 'numba', numba.__version__, 'gpu', cuda.get_current_device().name)"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/nvidia-smi.txt"
if has tests; then
  if [ -d "$REPO/tests" ]; then
    files=(); for f in ${TEST_FILES:-tests}; do files+=("$REPO/$f"); done  # paths relative to the repo root
    if [ "${TEST_SHARDS:-1}" -gt 1 ]; then
      # TEST_SHARDS processes share the GPU, each running every N-th test: compiling, not the GPU, is what they wait for
      python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only "${files[@]}" 2>/dev/null | grep -E "^tests/[^ :]+\.py::" > "$OUT/gpu-test-ids.txt" || true  # not the warnings' "file.py:56:" lines
      # the arena fault tests read the whole device's free memory: alone first, never beside the shards
      mapfile -t alone < <(grep "test_arena_faults.py" "$OUT/gpu-test-ids.txt" | sed "s|^|$REPO/|")
      [ "${#alone[@]}" -gt 0 ] && (timeout -s INT -k 20 "${TEST_TIMEOUT:-300}" python3 -m pytest -v -m gpu \
        -p no:cacheprovider -rfE "${alone[@]}" > "$OUT/gpu-tests-alone.log" 2>&1)
      grep -v "test_arena_faults.py" "$OUT/gpu-test-ids.txt" > "$OUT/gpu-test-ids-shared.txt" || true
      if [ -n "${TEST_DONE:-}" ] && [ -f "$REPO/$TEST_DONE" ]; then  # an earlier call's passed and skipped tests
        grep -vxF -f "$REPO/$TEST_DONE" "$OUT/gpu-test-ids-shared.txt" > "$OUT/gpu-test-ids-todo.txt" || true
        mv "$OUT/gpu-test-ids-todo.txt" "$OUT/gpu-test-ids-shared.txt"
      fi
      for i in $(seq 0 $((TEST_SHARDS - 1))); do
        mapfile -t ids < <(awk -v n="$TEST_SHARDS" -v i="$i" -v r="$REPO/" 'NR % n == i {print r $0}' \
          "$OUT/gpu-test-ids-shared.txt")
        # -v: each test's outcome on its own line as it finishes (a shard killed at the limit keeps what it did)
        [ "${#ids[@]}" -gt 0 ] && (timeout -s INT -k 20 "${TEST_TIMEOUT:-300}" python3 -m pytest -v -m gpu \
          -p no:cacheprovider -rfE --durations=15 "${ids[@]}" > "$OUT/gpu-tests-$i.log" 2>&1) &
      done
      wait
      cat "$OUT"/gpu-tests-*.log > "$OUT/gpu-tests.log"
      { [ -n "${TEST_DONE:-}" ] && [ -f "$REPO/$TEST_DONE" ] && cat "$REPO/$TEST_DONE"
        grep -hE "::[^ ]* (PASSED|SKIPPED)" "$OUT"/gpu-tests-[0-9]*.log "$OUT"/gpu-tests-alone.log | sed -E 's#^.*(tests/[^ ]*) (PASSED|SKIPPED).*$#\1#'
      } | sort -u > "$OUT/gpu-tests-done.txt"
      echo "done so far: $(wc -l < "$OUT/gpu-tests-done.txt") of $(wc -l < "$OUT/gpu-test-ids.txt") tests"
      grep -h "passed\|failed\|^FAILED\|^ERROR" "$OUT"/gpu-tests-*.log | tail -40 || true
    else
      timeout -s INT -k 20 "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider "${files[@]}" 2>&1 \
        | tee "$OUT/gpu-tests.log" | grep -v "Warning\|warn(\|^$\|^tests/.*::" | tail -15 || true
    fi
    pack
  fi
  python3 -m kernelgen demo 2>&1 | tee "$OUT/demo.log"
  pack
fi
if has fuzz && [ -d "$REPO/tests" ]; then
  # the API fuzz (tests/api/test_fuzz_api.py) on the CPU backend with FUZZ_N more examples (default 5000), its test items
  # round-robin over FUZZ_SHARDS processes (default 16); the simulator is set so that backend=None means the CPU here too
  python3 -m pytest -q -p no:cacheprovider --collect-only "$REPO/tests/api/test_fuzz_api.py" 2>/dev/null | grep "::" \
    > "$OUT/fuzz-ids.txt" || true
  for i in $(seq 0 $((${FUZZ_SHARDS:-16} - 1))); do
    mapfile -t ids < <(awk -v n="${FUZZ_SHARDS:-16}" -v i="$i" -v r="$REPO/" 'NR % n == i {print r $0}' "$OUT/fuzz-ids.txt")
    [ "${#ids[@]}" -gt 0 ] && (NUMBA_ENABLE_CUDASIM=1 KERNELGEN_FUZZ="${FUZZ_N:-5000}" timeout -s INT -k 20 \
      "${FUZZ_TIMEOUT:-480}" python3 -m pytest -q -p no:cacheprovider -rfE --hypothesis-show-statistics "${ids[@]}" \
      > "$OUT/fuzz-$i.log" 2>&1) &
  done
  wait
  cat "$OUT"/fuzz-*.log > "$OUT/fuzz.log"
  grep -h "passing examples\|failing examples\| passed\| failed\|^FAILED\|^ERROR" "$OUT"/fuzz-*.log | sort | uniq -c | tail -40 || true
  pack
fi
if has runtime; then
  python3 -m kernelgen.runtime.bench_launch --calls 3000 --profile 2>&1 | tee "$OUT/launch.log"
  python3 -m kernelgen.runtime.bench_launch --python-only 2>&1 | tee -a "$OUT/launch.log"
  pack
  rm -rf /tmp/kg_firstcall
  [ "${FIRSTCALL:-1}" = 1 ] && for run in cold warm; do
    KERNELGEN_CACHE_DIR=/tmp/kg_firstcall python3 -m kernelgen.runtime.bench_firstcall "${BENCH_TABLE:-gpu_md}" \
      --out "$OUT/firstcall_$run.json" 2>&1 | tail -3
  done
fi
if has train; then mode="$mode,nn-tests,nn-bench,nn-digits,"; fi
if has nn-tests && [ -d "$REPO/tests" ]; then
  timeout -s INT -k 20 "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider "$REPO/tests/nn/test_nn_gpu.py" 2>&1 \
      | tee "$OUT/nn-gpu-tests.log" | grep -v "Warning\|warn(\|^$" | tail -25 || true
  pack
fi
if has nn-bench; then
  timeout "${STEP_TIMEOUT:-420}" python3 -m kernelgen.nn.bench_step --out "$OUT/bench_step.json" ${STEP_ARGS:-} 2>&1 \
    | tee "$OUT/bench_step.log" | grep -v "Warning\|warn(" || true
  pack
fi
if has nn-digits; then
  data=(); python3 -c "import sklearn" 2>/dev/null || data=(--data "$REPO/.whl/digits.npz")  # no scikit-learn there
  timeout "${DIGITS_TIMEOUT:-400}" python3 -m kernelgen train digits --device cuda --min-accuracy 0.97 "${data[@]}" 2>&1 \
    | tr '\r' '\n' | grep -v "it/s\|s/it\|Warning\|warn(" | tee "$OUT/train_digits_cuda.log" || true
  pack
fi
if has probe; then
  python3 -m kernelgen.tuning.probe --out "$OUT/probe.json" "$@" 2>&1 | tee "$OUT/probe.log" | grep -v Warning
fi
if has mma-ceiling; then  # mma.sync issue / feed / barrier ceilings (scripts/mma_ceiling.py)
  python3 "$REPO/scripts/mma_ceiling.py" --out "$OUT/mma_ceiling.json" 2>&1 | tee "$OUT/mma_ceiling.log" | grep -v "Warning\|warn("
  pack
fi
if has wgmma-check; then  # sm_90a wgmma: descriptor layout check and issue ceilings (scripts/wgmma_check.py)
  python3 "$REPO/scripts/wgmma_check.py" --out "$OUT/wgmma_check.json" ${WGMMA_ARGS:-} 2>&1 | tee "$OUT/wgmma_check.log" | grep -v "Warning\|warn("
  pack
fi
if has tma-check; then  # TMA copies, copy-stream throughput, TMA-fed wgmma conv vs cuDNN (scripts/tma_check.py)
  timeout "${TMA_TIMEOUT:-360}" python3 "$REPO/scripts/tma_check.py" --out "$OUT/tma_check.json" ${TMA_ARGS:-} 2>&1 | tee "$OUT/tma_check.log" | grep -v "Warning\|warn("
  pack
fi
if has ncu; then  # Nsight Compute on one layer (NCU_LAYER, NCU_DIR): kernelgen per ';'-separated NCU_SETS, then cuDNN
  sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
            --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis ${NCU_EXTRA:-})
  IFS=';' read -ra sets <<< "${NCU_SETS:-}"
  i=0
  base=(""); [ "${NCU_BASE:-1}" = 1 ] || base=()
  for s in "${base[@]}" "${sets[@]}"; do
    timeout 240 ncu "${sections[@]}" -k regex:conv_ --launch-skip 1 --launch-count 1 python3 "$REPO/scripts/profile_conv.py" \
      "${NCU_LAYER:-r50_3x3_28}" "${NCU_DIR:-fwd}" --set "$s" > "$OUT/ncu_kg_$i.txt" 2>&1 || true
    grep -v "^==PROF==\|Warning\|warn(" "$OUT/ncu_kg_$i.txt" | grep -i "BM\|Duration\|Throughput\|Registers\|Occupancy\|Stall\|Issued\|Eligible\|Active Warps\|Shared Memory\|L1/\|L2 \|DRAM\|Executed Ipc\|Block Limit\|Pipe" | head -60 || true
    i=$((i+1)); pack
  done
  [ "${NCU_CUDNN:-1}" != 1 ] || timeout 240 ncu "${sections[@]}" --launch-skip 2 --launch-count 2 python3 "$REPO/scripts/profile_conv.py" \
    "${NCU_LAYER:-r50_3x3_28}" "${NCU_DIR:-fwd}" --torch > "$OUT/ncu_cudnn.txt" 2>&1 || true
  grep -v "^==PROF==\|Warning\|warn(" "$OUT/ncu_cudnn.txt" | grep -i "sm90\|xmma\|cutlass\|void\|Duration\|Throughput\|Registers\|Occupancy\|Issued\|Eligible\|Shared Memory Config\|Dynamic Shared\|Block Size\|Grid Size" | head -40 || true
  pack
fi
if has launch-cost; then  # a TMA launcher's call taken apart: rounding, conv, host time (scripts/launch_cost.py)
  python3 "$REPO/scripts/launch_cost.py" --out "$OUT/launch_cost.json" "$@" 2>&1 | tee "$OUT/launch_cost.log" | grep -v "Warning\|warn("
  pack
fi
if has autotune-bench; then  # first-call autotuning, then the bench on its entries (scripts/autotune_bench.py)
  python3 "$REPO/scripts/autotune_bench.py" "${BENCH_TABLE:-unseen}" --out-dir "$OUT" "$@" 2>&1 \
    | tee "$OUT/autotune_bench.log" | grep --line-buffered -v "Warning\|warn(\|bench:"
fi
if has wino-sweep; then  # Winograd state counts x tiles against cuDNN (scripts/wino_sweep.py; args go to it)
  python3 "$REPO/scripts/wino_sweep.py" --out "$OUT/wino_sweep.json" "$@" 2>&1 | tee "$OUT/wino_sweep.log" | grep -v "Warning\|warn("
  pack
fi
if has tune-bench || has tune; then
  # TUNE_SEED: a database an earlier call wrote (its $OUT copy, carried back): the tune resumes from it
  if [ -n "${TUNE_SEED:-}" ]; then mkdir -p "$KERNELGEN_CACHE_DIR/tuned"; cp "$REPO/$TUNE_SEED" "$KERNELGEN_CACHE_DIR/tuned/"; fi
  for t in ${TUNE_TABLES:-gpu_md}; do
    python3 -m kernelgen tune "$t" --time-budget "${TUNE_BUDGET:-280}" ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune-$t.log" | grep -v "tune:\|Warning\|warn(" || true
  done
  cp "$KERNELGEN_CACHE_DIR"/tuned/*.json "$OUT/" || true
fi
if has bench || has tune-bench; then
  python3 -m kernelgen bench "${BENCH_TABLE:-gpu_md}" --compare torch --out "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "bench:"
fi
