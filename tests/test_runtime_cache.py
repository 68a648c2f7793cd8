"""The compiled-kernel cache: memory hits, warm start from disk in a fresh process, corrupt entries,
concurrent writers, and `python -m kernelgen cache info|clear`.

Child processes run a small CPU convolution and print the cache counters as JSON; every child also
checks its result against the float64 reference, so a wrong kernel loaded from disk would fail here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

import kernelgen
from kernelgen import reference as ref
from kernelgen.runtime import cache
from kernelgen.runtime.cache import KERNELS

CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import kernelgen
    from kernelgen import reference as ref
    from kernelgen.runtime.cache import KERNELS
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 6, 5, 4)).astype(np.float32)
    w = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)
    y = kernelgen.conv(x, w, padding=1, backend="cpu")
    want = ref.conv_forward(x, w, padding=1)
    err = float(np.abs(y - want).max() / np.abs(want).max())
    print(json.dumps({**KERNELS.stats.__dict__, "err": err}))
""")


def run_child(cache_dir, wait=True):
    env = {**os.environ, "KERNELGEN_CACHE_DIR": str(cache_dir)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    return finish(proc) if wait else proc


def finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats.pop("err") < 1e-5
    return stats


def test_memory_hit_does_not_render_again(rng, monkeypatch):
    x = rng.standard_normal((1, 5, 4, 2)).astype(np.float32)
    w = rng.standard_normal((3, 2, 2, 2)).astype(np.float32)
    kernelgen.conv(x, w, backend="cpu")
    renders = []
    import kernelgen.api as api
    real = api.Plan.render
    monkeypatch.setattr(api.Plan, "render", lambda self: renders.append(1) or real(self))
    before = KERNELS.stats.memory_hits
    kernelgen.conv(x, w, backend="cpu")  # same signature: the prepared call, not even a cache lookup
    assert KERNELS.stats.memory_hits == before and not renders
    api.clear_caches()                   # a new call of the same kernel: a memory hit, no render
    y = kernelgen.conv(x, w, backend="cpu")
    assert KERNELS.stats.memory_hits == before + 1 and not renders
    assert np.abs(y - ref.conv_forward(x, w)).max() < 1e-5 * np.abs(y).max()


def test_warm_start_from_disk_in_a_fresh_process(tmp_path):
    cold = run_child(tmp_path)
    assert cold["misses"] == 1 and cold["disk_hits"] == 0
    warm = run_child(tmp_path)
    assert warm["misses"] == 0 and warm["disk_hits"] == 1 and warm["corrupt"] == 0


def test_corrupt_or_truncated_entry_is_rebuilt(tmp_path):
    run_child(tmp_path)
    (entry,) = tmp_path.glob("kg_*.py")
    text = entry.read_text()
    entry.write_text(text[: len(text) // 2])  # truncated mid-file: the checksum no longer matches
    stats = run_child(tmp_path)
    assert stats["corrupt"] == 1 and stats["misses"] == 1
    version = text.split(maxsplit=3)[2]  # the header: "# kernelgen-cache VERSION DIGEST CHECKSUM"
    entry.write_text(text.replace("kernelgen-cache " + version, "kernelgen-cache 0.0.0-old", 1))
    stats = run_child(tmp_path)  # another version's entry is not trusted either
    assert stats["corrupt"] == 1 and stats["misses"] == 1
    assert run_child(tmp_path)["disk_hits"] == 1  # and the rebuilt entry is good


def test_key_names_the_code_that_rendered_it(monkeypatch):
    """An edited template (same package version) must not import kernels the old code generated."""
    assert cache.CODE_VERSION.startswith(kernelgen.__version__ + "+")
    before = cache.key_digest(("fwd", "implicit_gemm"))
    monkeypatch.setattr(cache, "CODE_VERSION", kernelgen.__version__ + "+000000000000")
    assert cache.key_digest(("fwd", "implicit_gemm")) != before


def test_two_processes_fill_one_directory_at_once(tmp_path):
    procs = [run_child(tmp_path, wait=False) for _ in range(2)]
    for p in procs:
        finish(p)
    assert len(list(tmp_path.glob("kg_*.py"))) == 1
    assert not list(tmp_path.glob(".tmp_*"))


def test_cache_cli_info_and_clear(tmp_path):
    run_child(tmp_path)
    env = {**os.environ, "KERNELGEN_CACHE_DIR": str(tmp_path)}
    info = subprocess.run([sys.executable, "-m", "kernelgen", "cache", "info"], env=env, capture_output=True,
                          text=True, check=True)
    data = json.loads(info.stdout)
    assert data["entries"] == 1 and data["bytes"] > 0 and data["lifetime"]["misses"] == 1
    out = subprocess.run([sys.executable, "-m", "kernelgen", "cache", "clear"], env=env, capture_output=True,
                         text=True, check=True)
    assert "removed 1 entries" in out.stdout
    assert not list(tmp_path.glob("kg_*.py"))
