"""Several processes sharing one cache directory at once: racing to write and read the same entries while
entries are evicted under them and a writer is killed mid-run, every result checked against a float64 NumPy
reference; a user's file in the directory survives all of it.

Workers forget their in-memory cache before every call, so each call reads (and imports) the shared
directory: the race is on the files, not in memory.  One shape, padding 1 (light test) or 0 and 1 (heavy):
a CPU compile takes a second or two, and numba's on-disk cache makes the rest loads.  Halfway through, every worker
waits at a barrier while the test evicts every entry, so the second halves all miss and re-render the same
entries at once.  The light test (2 workers, 20 calls) runs by default; the heavy one (4 workers, 50 calls,
evictions at random moments and a worker SIGKILLed at a random moment) with KERNELGEN_SLOW_TESTS=1.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kernelgen.runtime.cache import KernelCache

WORKER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import kernelgen
    import kernelgen.api as api
    from kernelgen import reference
    from kernelgen.runtime.cache import KERNELS

    calls, seed, flags, me = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    paddings = [int(p) for p in sys.argv[5].split(",")]
    rng = np.random.default_rng(seed)

    for i in range(calls):
        if i == calls // 2 and flags != "-":  # the barrier: the test evicts everything, then says go
            open(os.path.join(flags, "halfway-" + me), "w").close()
            deadline = time.time() + 120
            while not os.path.exists(os.path.join(flags, "go")):
                assert time.time() < deadline, "no go from the test"
                time.sleep(0.02)
        p = paddings[int(rng.integers(len(paddings)))]
        x = rng.standard_normal((1, 5, 4, 2)).astype(np.float32)
        w = rng.standard_normal((2, 3, 3, 2)).astype(np.float32)
        api.clear_caches()
        KERNELS._memory.clear()
        y = kernelgen.conv(x, w, padding=p, backend="cpu")
        want = reference.conv_forward(x, w, padding=p)  # float64: the reference every test uses
        err = float(np.abs(y - want).max() / np.abs(want).max())
        if not err < 1e-5:
            sys.exit(f"worker {me} call {i}: padding {p}: relative error {err:.3g}")
        time.sleep(0.01)
    from kernelgen.runtime.cache import CODE_VERSION
    print(json.dumps({**KERNELS.stats.__dict__, "version": CODE_VERSION}))
""")


def start(cache_dir, calls, seed, flags="-", name="0", paddings=(0, 1)):
    """A worker: `calls` convolutions with padding drawn from `paddings` (one kernel each)."""
    env = {k: v for k, v in os.environ.items() if k != "KERNELGEN_CACHE_MAX_BYTES"}
    env.update(KERNELGEN_CACHE_DIR=str(cache_dir), NUMBA_NUM_THREADS="1")  # 2 cores shared by all workers
    argv = [str(calls), str(seed), str(flags), name, ",".join(map(str, paddings))]
    return subprocess.Popen([sys.executable, "-c", WORKER, *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def user_files(d):
    files = {d / "notes.txt": "the user's", d / "sub" / "data.csv": "1,2\n"}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


def evict_at_barrier(d, flags, workers, procs):
    """Wait until every worker is halfway, evict every entry, let them go on."""
    deadline = time.time() + 240
    while len(list(flags.glob("halfway-*"))) < workers:
        assert time.time() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate()[1][-3000:] for p in procs if p.poll() is not None]
        time.sleep(0.05)
    KernelCache(root=d).evict(1)
    (flags / "go").touch()


def check_after_a_killed_writer(d, files, paddings):
    """A writer killed mid-write leaves at worst a truncated entry (if it wrote in place) and a temporary file:
    the next process still computes the right answers, and `clear` removes both but not the user's files."""
    if not KernelCache(root=d).entries():  # the last eviction came after the workers' last calls
        finish(start(d, 2, seed=2, paddings=paddings))
    entry = sorted(KernelCache(root=d).entries())[0]
    text = entry.read_text()
    entry.write_text(text[: len(text) // 2])
    (d / ".tmp_deadbeef.py").write_text(text[:100])
    stats = finish(start(d, 6, seed=1, paddings=paddings))
    if stats["version"] == text.split()[2]:  # else kernelgen's code was edited meanwhile: a new key, no corrupt entry
        assert stats["corrupt"] == 1 and stats["misses"] >= 1
    assert all(path.read_text() == t for path, t in files.items())
    KernelCache(root=d).clear()
    assert all(path.read_text() == t for path, t in files.items())
    assert not KernelCache(root=d).entries() and not (d / ".tmp_deadbeef.py").exists()


def test_two_processes_race_on_one_directory(tmp_path):
    d, flags = tmp_path / "cache", tmp_path / "flags"
    flags.mkdir()
    files = user_files(d)
    procs = [start(d, 20, seed, flags, str(seed), paddings=(1,)) for seed in range(2)]  # one kernel: a light test
    evict_at_barrier(d, flags, 2, procs)
    stats = [finish(p) for p in procs]
    assert sum(s["misses"] for s in stats) >= 2  # the entry was rendered before and again after the eviction
    assert all(path.read_text() == t for path, t in files.items())
    check_after_a_killed_writer(d, files, (1,))


@pytest.mark.slow
def test_four_processes_race_with_evictions_and_a_killed_writer(tmp_path):
    d, flags = tmp_path / "cache", tmp_path / "flags"
    flags.mkdir()
    files = user_files(d)
    victim = start(d, 10_000, seed=99)  # no barrier: runs until killed
    procs = [start(d, 50, seed, flags, str(seed)) for seed in range(4)]
    time.sleep(random.uniform(1.0, 6.0))  # mid-compile, mid-write or mid-read: wherever it is
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    evict_at_barrier(d, flags, 4, procs)
    time.sleep(random.uniform(0.1, 1.5))
    KernelCache(root=d).evict(1)  # and once more, while the workers read
    stats = [finish(p) for p in procs]
    assert sum(s["misses"] for s in stats) >= 2
    assert all(path.read_text() == t for path, t in files.items())
    check_after_a_killed_writer(d, files, (0, 1))
