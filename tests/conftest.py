"""Session setup shared by every test file.  Read this before adding a test that touches CUDA.

Environment, decided here once, before anything imports numba or compiles a kernel:

* KERNELGEN_CACHE_DIR: a fresh temporary directory per session (removed at exit), so a run never
  reads kernels compiled by another version of the code.  If the caller set it (CI with a warm
  cache, scripts/gpu_run.sh), the caller's value wins and is left alone.

* NUMBA_ENABLE_CUDASIM: numba picks the real CUDA target or the simulator when numba.cuda is
  first imported, once per process.  So the session is in one of two modes:
    - no NVIDIA device visible (no /dev/nvidia*): the simulator is switched on for the whole
      session.  CPU tests are unaffected (the CPU backend never imports numba.cuda, and
      kernelgen.api.gpu_present() is False under the simulator, so backend=None still means
      "cpu"); tests marked `sim` run CUDA kernels in the simulator in-process; tests marked
      `gpu` are skipped.
    - an NVIDIA device visible: the real target; `gpu` tests run, `sim` tests are skipped
      (the same kernels run for real in test_conv_gpu.py).
  An explicit NUMBA_ENABLE_CUDASIM in the caller's environment wins either way.  The decision
  looks at device files rather than asking numba, because asking numba would fix the mode.

* NUMBA_BOUNDSCHECK=1 (unless set): the CPU kernels check every index, so a tile load that reads
  past a tensor (harmless-looking on the CPU, a fault on the GPU) fails a CPU test.

* NUMBA_OPT=1 (unless set; only without a GPU): LLVM optimises the CPU kernels at level 1, not numba's 3. The
  generated code and its checks are the same; compiling a tensor-core tile for the CPU takes ~35 % less (170 ->
  110 s for test_cpu_runs_the_gpu_schedule), and compiling is most of CI's time.  Level 0 is faster still but
  numba then cannot cache some kernels (globals left unfolded).  `NUMBA_OPT=3 python -m pytest ...` tests at the
  shipped level.

* slow tests (marker `slow`) are skipped unless KERNELGEN_SLOW_TESTS=1 or `-m slow`: see _slow_selected.

* hypothesis: a "kernelgen" profile with deadline=None (a new shape means a numba compile of
  seconds).  Example counts stay per test (settings(max_examples=...)), kept small for the same
  reason.  Examples are not derandomized: every run draws fresh shapes and data.

Helpers for tests: the `rng` fixture (a Generator with a fresh seed, reported on failure), and the float64
reference harness (harness.py: fresh inputs, NaN-poisoned outputs, kernelgen.reference, tolerances per
precision), whose common pieces are also session fixtures here (`random_array`, `assert_close`,
`run_poisoned`, `run_direction`), usable from hypothesis tests too.
"""
from __future__ import annotations

import atexit
import glob
import json
import os
import secrets
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, settings


def _nvidia_device_visible() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/dxg")


# Out-of-bounds reads are silent on the CPU but fault on the GPU: make the CPU tests catch them.
os.environ.setdefault("NUMBA_BOUNDSCHECK", "1")

if "NUMBA_ENABLE_CUDASIM" not in os.environ and not _nvidia_device_visible():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
if SIMULATOR:  # (a CPU machine: CI) the CPU kernels' LLVM level; numba reads it when first imported, below
    os.environ.setdefault("NUMBA_OPT", "1")

if not os.environ.get("KERNELGEN_CACHE_DIR"):
    _session_cache = tempfile.mkdtemp(prefix="kernelgen-test-cache-")
    os.environ["KERNELGEN_CACHE_DIR"] = _session_cache
    atexit.register(shutil.rmtree, _session_cache, ignore_errors=True)

# harness imports kernelgen, and so numba: only once the environment above is decided
import harness  # noqa: E402


def pytest_sessionstart(session):
    """The recursion limit every kernelgen process has once it loads a kernel (runtime.driver), set before any
    test: hypothesis warns when a test's first kernel load changes it mid-example.  (With numba's block order
    walked without recursion - kernelgen.numba_speedups, numba's own CPU pipeline - it stays as it is.)"""
    from kernelgen import numba_speedups
    from kernelgen import settings as kernelgen_settings
    from kernelgen.runtime.driver import allow_deep_cfg_walks
    if not kernelgen_settings.get("cuda_simulator"):  # (as Launcher.from_module: the simulator compiles nothing)
        numba_speedups.install()
    for backend in ("cuda", "cpu"):
        allow_deep_cfg_walks(backend)


settings.register_profile("kernelgen", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kernelgen")

def _slow_selected(config):
    """Tests marked `slow` (whole networks trained on the CPU, the largest CUDA tiles rendered for the
    CPU: minutes each) run with KERNELGEN_SLOW_TESTS=1 or when `-m` names them; the default run (CI)
    skips them, so it stays well inside its time budget on 2 cores."""
    return os.environ.get("KERNELGEN_SLOW_TESTS") == "1" or "slow" in (config.getoption("-m") or "")


def pytest_collection_modifyitems(config, items):
    skip_sim = pytest.mark.skip(reason="a real GPU is visible: simulator tests need NUMBA_ENABLE_CUDASIM=1")
    skip_slow = None if _slow_selected(config) else \
        pytest.mark.skip(reason="slow: set KERNELGEN_SLOW_TESTS=1 (or -m slow) to run it")
    gpu = None
    for item in items:
        if skip_slow is not None and "slow" in item.keywords:
            item.add_marker(skip_slow)
        if "sim" in item.keywords and not SIMULATOR:
            item.add_marker(skip_sim)
        if "gpu" in item.keywords:
            if gpu is None:  # import lazily: only sessions that collected gpu tests touch numba.cuda here
                from kernelgen.api import gpu_present
                gpu = gpu_present()
            if not gpu:
                item.add_marker(pytest.mark.skip(reason="needs a real CUDA GPU (kernelgen.api.gpu_present() is False)"))


@pytest.fixture
def set_setting():
    """`set_setting(name=value, ...)`: kernelgen.settings values for the rest of the test (the whole process),
    restored afterwards."""
    from kernelgen import settings
    saved = []

    def set_(**values):
        for name, value in values.items():
            saved.append((name, settings._process.get(name)))
            settings.set(name, value)
    yield set_
    for name, value in reversed(saved):
        settings.set(name, value)


@pytest.fixture
def rng(request):
    """A fresh random Generator per test; its seed is printed if the test fails."""
    seed = secrets.randbits(64)
    request.node.user_properties.append(("rng_seed", seed))
    return np.random.default_rng(seed)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        for name, value in item.user_properties:
            if name == "rng_seed":
                report.sections.append(("rng seed", f"np.random.default_rng({value})"))
    return report


@pytest.fixture(scope="session")
def random_array():
    return harness.random_array


@pytest.fixture(scope="session")
def assert_close():
    return harness.assert_close


@pytest.fixture(scope="session")
def run_poisoned():
    return harness.run_poisoned


@pytest.fixture(scope="session")
def run_direction():
    return harness.run_direction


@pytest.fixture(scope="module")
def torch():
    """PyTorch with CUDA as the comparator of the nn GPU tests, TF32 off (skips without it)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch


@pytest.fixture
def tiny_table(tmp_path):
    """A one-layer shape table, small enough for the simulator to tune (test_tuning*.py)."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"name": "tiny", "layers": [
        {"name": "a", "N": 1, "H": 4, "W": 5, "C": 4, "K": 4, "R": 3, "stride": 1, "padding": 1}]}))
    return path


@pytest.fixture
def tiny_tiles():
    """Two tiles (BM, BN, TM, TN, stages) for a simulator tune of tiny_table."""
    return [(16, 16, 4, 4, 2), (32, 8, 4, 4, 2)]
