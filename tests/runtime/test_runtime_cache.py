"""The compiled-kernel cache: memory hits, warm start from disk in a fresh process, corrupt entries,
concurrent writers, `python -m kernelgen cache info|clear`, clear() sparing the user's files, an unwritable
directory, the size bound (KERNELGEN_CACHE_MAX_BYTES) and entries evicted under a reader.

Child processes run a small CPU convolution and print the cache counters as JSON; every child also
checks its result against the float64 reference, so a wrong kernel loaded from disk would fail here.
Tests of the cache's own file handling use KernelCache(root=...) with trivial module bodies: no numba.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

import kernelgen
from kernelgen import reference as ref
from kernelgen import settings
from kernelgen.runtime import cache
from kernelgen.runtime.cache import KERNELS, KernelCache, KernelCacheWarning

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
    info = subprocess.run([sys.executable, "-m", "kernelgen", "cache", "info", "--json"], env=env,
                          capture_output=True, text=True, check=True)
    data = json.loads(info.stdout)
    assert data["entries"] == 1 and data["bytes"] > 0 and data["lifetime"]["misses"] == 1
    assert data["max_bytes"] == settings.SETTINGS["cache_max_bytes"].default and data["directory"] == str(tmp_path)
    human = subprocess.run([sys.executable, "-m", "kernelgen", "cache", "info"], env=env, capture_output=True,
                           text=True, check=True).stdout
    assert "entries    1 (" in human and "KiB)" in human and str(tmp_path) in human and "4.0 GiB" in human
    out = subprocess.run([sys.executable, "-m", "kernelgen", "cache", "clear"], env=env, capture_output=True,
                         text=True, check=True)
    assert "removed 1 entries" in out.stdout
    assert not list(tmp_path.glob("kg_*.py"))


# --- the cache's own files, without numba: KernelCache(root=...) with trivial module bodies ------------------

def body(n=0, pad=0):
    return f"X = {n}\n" + "# padding\n" * pad


def put(root, n, pad=0):
    """A real entry (written and imported by a KernelCache) with numba-like cache files beside it."""
    module = KernelCache(root=root).get(("test-entry", n), lambda: body(n, pad))
    assert module.X == n
    stem = os.path.basename(module.__file__)[:-3]
    pycache = root / "__pycache__"
    pycache.mkdir(exist_ok=True)
    for name in (f"{stem}.conv_fwd-9.py311.nbi", f"{stem}.conv_fwd-9.py311.1.nbc", f"{stem}.cpython-311.pyc"):
        (pycache / name).write_bytes(b"\0" * 100)
    return root / f"{stem}.py"


def user_files(d):
    """Files a user may keep in the directory they point KERNELGEN_CACHE_DIR at; returns {path: content}."""
    files = {d / "notes.txt": "mine", d / "notes.py": "print('mine')\n", d / "kg_fake.py": "X = 'not kernelgen'\n",
             d / "sub" / "data.csv": "1,2\n", d / "sub" / "kg_0123456789abcdef0123.py": "# kernelgen-cache fake\n",
             d / "__pycache__" / "notes.cpython-311.pyc": "pyc", d / ".tmp_notes": "mine too"}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


def test_clear_deletes_only_kernelgens_own_files(tmp_path):
    """`clear` used to rmtree the directory: with KERNELGEN_CACHE_DIR pointing at a folder of the user's, it
    deleted everything in it."""
    d = tmp_path / "cache"
    entries = [put(d, n) for n in range(2)]
    mine = user_files(d)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("outside")
    os.symlink(outside, d / "link")                                  # never followed
    os.symlink(outside / "keep.txt", d / "kg_00112233445566778899aabb.py")  # a symlink is never ours
    (d / ".tmp_abcdefgh.py").write_text("# a killed writer's")
    cache._save_persistent_stats(KernelCache(root=d, stats=cache.CacheStats(misses=2)))
    assert (d / "stats.json").exists()
    done = KernelCache(root=d).clear()
    for path, text in mine.items():
        assert path.exists() and path.read_text() == text, path
    assert done["entries"] == 2 and done["bytes"] > 0
    assert (outside / "keep.txt").read_text() == "outside" and (d / "link").is_symlink()
    assert (d / "kg_00112233445566778899aabb.py").is_symlink()
    assert not any(p.exists() for p in entries) and not (d / ".tmp_abcdefgh.py").exists()
    assert not (d / "stats.json").exists()
    assert sorted(p.name for p in (d / "__pycache__").iterdir()) == ["notes.cpython-311.pyc"]
    assert done["kept"] == len(os.listdir(d))


def test_clear_removes_a_directory_left_empty(tmp_path):
    d = tmp_path / "cache"
    put(d, 0)
    KernelCache(root=d).clear()
    assert not d.exists()


def test_cli_clear_spares_the_users_files(tmp_path, monkeypatch, capsys):
    from kernelgen.__main__ import main
    d = tmp_path / "cache"
    entry = put(d, 0)
    mine = user_files(d)
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(d))
    assert main(["cache", "clear"]) == 0
    assert all(path.exists() and path.read_text() == text for path, text in mine.items())
    out = capsys.readouterr().out
    assert "removed 1 entries" in out and "left" in out
    assert not entry.exists()


def test_unwritable_directory_falls_back_to_memory_with_one_warning(tmp_path, monkeypatch):
    """A cache directory that cannot be created (its parent is a file: fails even for root) used to fail
    every call; now calls work, from a private temporary directory, after one warning per process."""
    monkeypatch.setattr(cache, "_warned_unwritable", False, raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a directory")
    d = blocker / "sub"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(3):
            assert KernelCache(root=d).get(("unwritable", n), lambda: body(n)).X == n
        kc = KernelCache(root=d)
        assert kc.get(("unwritable", 9), lambda: body(9)).X == 9
    ours = [w for w in caught if issubclass(w.category, KernelCacheWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert str(d) in str(ours[0].message) and "Not a directory" in str(ours[0].message)
    private = kc._private
    assert private is not None and (private / f"kg_{cache.key_digest(('unwritable', 9))}.py").exists()
    kc.clear()
    assert not private.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway")
def test_read_only_directory_falls_back(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "_warned_unwritable", False, raising=False)
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.warns(KernelCacheWarning, match="Permission denied"):
            assert KernelCache(root=d).get(("read-only", 0), lambda: body(7)).X == 7
    finally:
        d.chmod(0o700)


@pytest.mark.parametrize("text, value", [(None, 4 << 30), ("", 4 << 30), ("1000", 1000), ("512M", 512 << 20),
                                         ("2G", 2 << 30), ("2GiB", 2 << 30), ("64k", 64 << 10)])
def test_max_bytes_reads_the_environment(monkeypatch, text, value):
    if text is None:
        monkeypatch.delenv("KERNELGEN_CACHE_MAX_BYTES", raising=False)
    else:
        monkeypatch.setenv("KERNELGEN_CACHE_MAX_BYTES", text)
    assert cache.max_bytes() == value


@pytest.mark.parametrize("text", ["lots", "-1", "0", "2X", "1,5G"])
def test_bad_max_bytes_is_a_value_error_naming_the_variable(tmp_path, monkeypatch, text):
    monkeypatch.setenv("KERNELGEN_CACHE_MAX_BYTES", text)
    with pytest.raises(ValueError, match="KERNELGEN_CACHE_MAX_BYTES"):
        cache.max_bytes()
    with pytest.raises(ValueError, match="KERNELGEN_CACHE_MAX_BYTES"):
        KernelCache(root=tmp_path).get(("bad-bound", 0), lambda: body(0))
    assert not list(tmp_path.iterdir())  # checked before anything is written


def set_used(path, seconds_ago):
    t = time.time_ns() - int(seconds_ago * 1e9)
    os.utime(path, ns=(t, t))


def test_least_recently_used_entries_are_evicted_beyond_the_bound(tmp_path, monkeypatch):
    d = tmp_path
    mine = user_files(d)
    a, b, c = (put(d, n, pad=100) for n in range(3))   # ~1.3 kB each with their __pycache__ files
    for age, path in ((300, a), (200, b), (100, c)):
        set_used(path, age)
    per_entry = KernelCache(root=d).info()["bytes"] // 3
    mtime = a.stat().st_mtime_ns
    assert KernelCache(root=d).get(("test-entry", 0), lambda: pytest.fail("a is on disk")).X == 0  # a used now
    assert a.stat().st_mtime_ns == mtime  # recency is the access time: numba < 0.68 stamps its cache by mtime
    monkeypatch.setenv("KERNELGEN_CACHE_MAX_BYTES", str(3 * per_entry))
    d_module = KernelCache(root=d).get(("test-entry", 3), lambda: body(3, pad=100))
    assert not b.exists() and a.exists() and c.exists() and os.path.exists(d_module.__file__)
    assert not list((d / "__pycache__").glob(b.stem + ".*"))  # b's numba files went with it
    assert all(path.read_text() == text for path, text in mine.items())  # never counted, never evicted
    monkeypatch.setenv("KERNELGEN_CACHE_MAX_BYTES", "1")
    big = KernelCache(root=d).get(("test-entry", 4), lambda: body(4, pad=1000))
    assert [p.name for p in KernelCache(root=d).entries()] == [os.path.basename(big.__file__)]  # never the new one
    assert all(path.read_text() == text for path, text in mine.items())


def test_entry_evicted_between_read_and_import_is_rendered_again(tmp_path, monkeypatch):
    """Another process may evict the file after we validated it and before we import it: a miss, not an error
    (it used to raise FileNotFoundError out of the call)."""
    path = put(tmp_path, 5)
    real = KernelCache._import
    vanish = {"times": 1}

    def evicted_before_import(self, p, digest):
        if vanish["times"] and p.parent == tmp_path:
            vanish["times"] -= 1
            p.unlink()
        return real(self, p, digest)

    monkeypatch.setattr(KernelCache, "_import", evicted_before_import)
    kc = KernelCache(root=tmp_path)
    assert kc.get(("test-entry", 5), lambda: body(5)).X == 5
    assert kc.stats.disk_hits == 1 and kc.stats.misses == 1 and path.exists() and kc._private is None
    vanish["times"] = 99  # evicted before every import: the private directory serves it
    kc = KernelCache(root=tmp_path)
    assert kc.get(("test-entry", 5), lambda: body(5)).X == 5 and kc._private is not None


def test_a_module_that_fails_to_import_is_not_retried(tmp_path):
    renders = []
    with pytest.raises(ZeroDivisionError):
        KernelCache(root=tmp_path).get(("broken", 0), lambda: renders.append(1) or "X = 1 / 0\n")
    assert renders == [1]


def test_a_copied_cache_s_modules_get_the_mtime_numba_cuda_s_index_recorded(tmp_path):
    """numba-cuda's index records its module's (mtime, size) and is void after either changes: a copied cache
    (cp -r: new mtimes) would compile every kernel again.  restore_numba_stamp puts the recorded mtime back, so
    numba-cuda's own index loads; a module of another size, or an index with a content-hash stamp (numba's CPU
    cache), is left alone."""
    import os

    from numba.cuda.core.caching import IndexDataCacheFile

    from kernelgen.runtime.cache import restore_numba_stamp
    module = tmp_path / "kg_0123abcd.py"
    module.write_text("# a kernel module\n")
    os.utime(module, ns=(1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
    st = module.stat()
    pycache = tmp_path / "__pycache__"
    pycache.mkdir()

    def index(stamp):
        return IndexDataCacheFile(str(pycache), "kg_0123abcd.kernel-3.py312", stamp)
    index((st.st_mtime, st.st_size))._save_index({"overload": "data"})
    os.utime(module, ns=(1_800_000_000_000_000_000, 1_800_000_000_000_000_000))  # as cp -r leaves it
    moved = module.stat()
    assert index((moved.st_mtime, moved.st_size))._load_index() == {}  # numba-cuda would compile again
    assert restore_numba_stamp(module)
    back = module.stat()
    assert back.st_mtime == st.st_mtime
    assert index((back.st_mtime, back.st_size))._load_index() == {"overload": "data"}
    assert not restore_numba_stamp(module)  # nothing left to restore
    module.write_text("# a kernel module, longer\n")  # another size: not the module the index was made for
    os.utime(module, ns=(1_800_000_000_000_000_000, 1_800_000_000_000_000_000))
    assert not restore_numba_stamp(module) and module.stat().st_mtime != st.st_mtime
