"""Compiled-kernel cache: in memory, and on disk as real Python modules.

Triton-style: an explicit specialisation key (problem, variant, config, backend, device, version)
names an entry, together with CODE_VERSION: the package version and a digest of the code that renders
kernels (kernelgen's own modules and the templates), so an edited or upgraded kernelgen never imports a
kernel that older code generated (Triton keys its cache on its compiler's source the same way).  On disk
each entry is a generated module `kg_<digest>.py` whose numba decorator has cache=True, so a warm process
skips both rendering (the module is imported as it is) and numba compilation (numba's own cache sits
beside it in __pycache__, in files named after the module: `kg_<digest>.<function>-<line>.py311.nbi`).

Entries are written atomically (temp file + os.replace) and carry a header with the key digest
and a checksum of the body; a truncated, corrupt or version-mismatched file is re-rendered, never
trusted.  Two processes filling one directory both succeed: the last rename wins with identical
content.

The directory may be shared with the user's own files (KERNELGEN_CACHE_DIR is any directory), so the cache
only ever deletes what it can tell is its own (see _scan).  Its size is bounded (KERNELGEN_CACHE_MAX_BYTES):
after a write, least recently used entries are evicted.  Eviction may delete a file another process is
about to import; for that process it is a miss like any other (KernelCache._load).  A directory that cannot
be written costs one KernelCacheWarning and the disk cache, never a call: entries then go to a private
temporary directory for this process only.
"""
from __future__ import annotations

import atexit
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import kernelgen.templates
import kernelgen.version
from kernelgen import compile_profile, settings
from kernelgen.version import __version__

_HEADER = "# kernelgen-cache {version} {digest} {checksum}\n"


def _code_version() -> str:
    h = hashlib.sha256()
    for root in (Path(kernelgen.version.__file__).parent, Path(kernelgen.templates.__file__).parent):
        for path in sorted(root.glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{__version__}+{h.hexdigest()[:12]}"


CODE_VERSION = _code_version()



# What the cache may delete in a directory it shares with the user: an entry is a kg_<hex digest>.py file whose
# first line is our header naming that digest; its __pycache__ files start with its stem and a dot (python's
# .pyc, numba's .nbi/.nbc and numba's own .tmp. files); our temporaries are mkstemp's ".tmp_" + 8 characters.
_ENTRY = re.compile(r"kg_([0-9a-f]{16,64})\.py")
_CACHED = re.compile(r"kg_([0-9a-f]{16,64})\..+")
_TEMP = re.compile(r"\.tmp_[A-Za-z0-9_]{8}\.(py|json)")
_STALE_TEMP_S = 3600     # a writer needs milliseconds: an older temporary is a killed writer's
_ATTEMPTS = 3            # imports of an entry that other processes keep evicting; the last from the private dir


class KernelCacheWarning(UserWarning):
    """The cache directory cannot be written: compiled kernels last for this process only."""


def cache_dir() -> Path:
    """The cache directory: the setting cache_dir (KERNELGEN_CACHE_DIR), else the user cache directory."""
    chosen = settings.get("cache_dir")
    if chosen:
        return Path(chosen)
    import platformdirs
    return Path(platformdirs.user_cache_dir("kernelgen"))


def max_bytes() -> int:
    """The disk cache's size bound: the setting cache_max_bytes (KERNELGEN_CACHE_MAX_BYTES; 4 GiB if unset)."""
    return settings.get("cache_max_bytes")


def format_bytes(n: int) -> str:
    """85.2 MiB: binary units, as KERNELGEN_CACHE_MAX_BYTES reads them."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def key_digest(key) -> str:
    return hashlib.sha256(repr((key, CODE_VERSION)).encode()).hexdigest()[:24]


def _checksum(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()[:16]


@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    corrupt: int = 0


_warned_unwritable = False


def _warn_unwritable(directory: Path, error: OSError):
    """Once per process: a warning at every miss would bury the user's own output."""
    global _warned_unwritable
    if _warned_unwritable:
        return
    _warned_unwritable = True
    warnings.warn(f"kernelgen: cannot write the kernel cache directory {directory} ({type(error).__name__}: "
                  f"{error}); compiled kernels are kept for this process only (set KERNELGEN_CACHE_DIR to a "
                  "writable directory)", KernelCacheWarning, stacklevel=3)


@dataclass
class _Entry:
    path: Path
    used: float                                    # recency: see KernelCache._touch
    bytes: int                                     # the entry and its __pycache__ files
    cached: list = field(default_factory=list)     # its __pycache__ files


def _is_entry(path: Path, digest: str) -> bool:
    """Our header naming this digest (any version: an old version's entry is ours to delete too)."""
    try:
        with os.fdopen(_open_noatime(path), "rb") as f:
            parts = f.readline(256).decode("ascii", "replace").split()
    except OSError:
        return False
    return len(parts) == 5 and parts[:2] == ["#", "kernelgen-cache"] and parts[3] == digest


def _open_noatime(path: Path) -> int:
    """Open for reading without marking the file used: recency is its access time (KernelCache._touch), and a
    scan reading every entry's header must not make every entry look recent.  O_NOATIME is Linux's and only
    allowed on one's own files; elsewhere relatime mostly spares us (it updates the atime once a day)."""
    flag = getattr(os, "O_NOATIME", 0)
    try:
        return os.open(path, os.O_RDONLY | flag)
    except PermissionError:
        if not flag:
            raise
        return os.open(path, os.O_RDONLY)


def _files(directory: Path):
    """Regular files directly in `directory`, symlinks excluded (never followed out of the directory)."""
    try:
        with os.scandir(directory) as it:
            return [e for e in it if e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def _scan(directory: Path):
    """kernelgen's own files in `directory`: ({digest: _Entry}, orphans, temporaries).  Orphans are __pycache__
    files of an entry whose module is gone (numba writes them after an eviction it raced with)."""
    entries, temps = {}, []
    for f in _files(directory):
        if _TEMP.fullmatch(f.name):
            temps.append(Path(f.path))
            continue
        m = _ENTRY.fullmatch(f.name)
        if m and _is_entry(Path(f.path), m.group(1)):
            try:
                st = f.stat(follow_symlinks=False)
            except OSError:
                continue  # evicted meanwhile
            entries[m.group(1)] = _Entry(Path(f.path), max(st.st_atime, st.st_mtime), st.st_size)
    orphans = []
    pycache = directory / "__pycache__"
    for f in ([] if pycache.is_symlink() else _files(pycache)):
        m = _CACHED.fullmatch(f.name)
        if not m:
            continue
        entry = entries.get(m.group(1))
        if entry is None:
            if not os.path.lexists(directory / f"kg_{m.group(1)}.py"):
                orphans.append(Path(f.path))
            continue
        try:
            entry.bytes += f.stat(follow_symlinks=False).st_size
        except OSError:
            continue
        entry.cached.append(Path(f.path))
    return entries, orphans, temps


def _unlink(path: Path) -> int:
    """Delete a file; its size, or 0 where another process deleted it first."""
    try:
        size = path.lstat().st_size
        path.unlink()
        return size
    except FileNotFoundError:
        return 0


def _remove(entry: _Entry) -> int:
    # the module first: a reader then sees a miss, never a module whose numba cache is half gone
    return sum(_unlink(p) for p in [entry.path, *entry.cached])


_STAMPS_CHECKED: set = set()  # (module path, mtime_ns, size) that restore_numba_stamp has read the index of


def restore_numba_stamp(path: Path) -> bool:
    """numba-cuda's index of a module records its (mtime, size) and is void once either changes: a copied cache
    (`cp -r`) would compile every kernel again, one by one (a 120 s first step where 2 s was due).  A module's name
    is its content's digest and its header a checksum, so a module of the recorded size is the one the index was
    made for: its recorded mtime is put back.  Returns whether it was.  Each (path, mtime, size) is read once: a
    warm step asks of each kernel three times (PoolOnDemand.see, compile_plans, the load)."""
    import pickle
    try:
        st = path.stat()
        seen = (str(path), st.st_mtime_ns, st.st_size)
        indexes = [] if seen in _STAMPS_CHECKED else list((path.parent / "__pycache__").glob(f"{path.stem}.*.nbi"))
    except OSError:
        return False
    if indexes:  # (none yet: numba writes one after this module's first compile, and it is read then)
        _STAMPS_CHECKED.add(seen)  # (a set's add is atomic: threads checking together only read twice)
    for index in indexes:
        try:
            with open(index, "rb") as f:
                pickle.load(f)  # (numba's version)
                stamp = pickle.loads(f.read())[0]
        except Exception:  # noqa: BLE001 (another numba's index, or a torn one: numba itself will not use it)
            continue
        if isinstance(stamp, tuple) and len(stamp) == 2 and stamp[1] == st.st_size and stamp[0] != st.st_mtime:
            try:
                os.utime(path, ns=(st.st_atime_ns, round(stamp[0] * 1e9)))
            except OSError:
                return False  # a read-only cache: it compiles, as it would have
            return True
    return False


@dataclass
class KernelCache:
    """Maps a specialisation key to a compiled object built by `build(function) -> object`."""
    root: Path | None = None
    stats: CacheStats = field(default_factory=CacheStats)
    _memory: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _building: dict = field(default_factory=dict)  # key -> the lock its first builder holds
    _private: Path | None = None    # this process's own directory, where the shared one cannot be used

    @property
    def directory(self) -> Path:
        return Path(self.root) if self.root is not None else cache_dir()

    def get(self, key, render, build=lambda module: module):
        """Return build(module) for key; render() -> module source is called only on a miss."""
        with self._lock:
            hit = self._memory.get(key)
        if hit is not None:
            self.stats.memory_hits += 1
            return hit
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        with building:  # one thread renders, imports and builds a key; the others wait and take its object
            with self._lock:
                hit = self._memory.get(key)
            if hit is not None:
                self.stats.memory_hits += 1
                return hit
            with compile_profile.stage("cache"):  # (less the render inside a miss: stages of their own)
                module = self._load(key_digest(key), render)
            obj = build(module)
            with self._lock:
                self._memory[key] = obj
                self._building.pop(key, None)
        return obj

    def _load(self, digest: str, render):
        """The entry's module, imported from disk; rendered and written first on a miss.  Another process may
        evict (delete) the file between our read and our import: that is a miss too, so the import is tried
        again, the last time from the private directory, where no other process deletes anything."""
        body = None
        for attempt in range(_ATTEMPTS):
            private = attempt == _ATTEMPTS - 1
            path = (self._private_dir() if private else self.directory) / f"kg_{digest}.py"
            if not private and self._read_valid(path, digest) is not None:
                self.stats.disk_hits += 1
                self._touch(path)
                restore_numba_stamp(path)
            else:
                if body is None:
                    self.stats.misses += 1
                    body = render()
                path = self._store(digest, body, private)
            try:
                return self._import(path, digest)
            except Exception as e:
                if private or (path.exists() and not isinstance(e, FileNotFoundError)):
                    raise  # the module itself failed: rendering it again would fail the same way
        raise AssertionError("unreachable")

    def _read_valid(self, path: Path, digest: str):
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            return None
        head, _, body = text.partition("\n")
        parts = head.split()
        ok = (len(parts) == 5 and parts[1] == "kernelgen-cache" and parts[2] == CODE_VERSION
            and parts[3] == digest and parts[4] == _checksum(body))
        if not ok:
            self.stats.corrupt += 1
            return None
        return body

    @staticmethod
    def _touch(path: Path):
        """Mark an entry used for eviction by its access time.  Not its mtime: numba before 0.68 stamps its
        cache index with the module's (mtime, size), so a new mtime would make every warm process compile
        again (numba PR #10659 made the stamp a content hash).  The mtime is set back to what it was."""
        try:
            st = path.stat()
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))
        except OSError:
            pass  # a read-only directory, or evicted meanwhile: recency is advisory

    def _store(self, digest: str, body: str, private: bool = False) -> Path:
        """Write an entry into the cache directory (evicting old ones beyond the size bound), or into the private
        directory if `private` or the cache directory cannot be written.  Returns the path written."""
        if not private:
            bound = max_bytes()  # a bad KERNELGEN_CACHE_MAX_BYTES fails before anything is written
            try:
                path = self._write(self.directory, digest, body)
            except OSError as e:
                _warn_unwritable(self.directory, e)
            else:
                try:
                    self.evict(bound, keep=digest)
                except OSError:
                    pass  # eviction is housekeeping: the entry is written and the call goes on
                return path
        return self._write(self._private_dir(), digest, body)

    @staticmethod
    def _write(directory: Path, digest: str, body: str) -> Path:
        path = directory / f"kg_{digest}.py"
        text = _HEADER.format(version=CODE_VERSION, digest=digest, checksum=_checksum(body)) + body
        for attempt in range(2):  # a concurrent `cache clear` may delete our temporary (or the directory)
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp_", suffix=".py")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.replace(tmp, path)
                return path
            except FileNotFoundError:
                if attempt:
                    raise
            except BaseException:
                _unlink(Path(tmp))  # disk full, say: leave no half-written temporary behind
                raise

    def _private_dir(self) -> Path:
        with self._lock:
            if self._private is None:
                self._private = Path(tempfile.mkdtemp(prefix="kernelgen-cache-"))
                atexit.register(shutil.rmtree, self._private, True)
            return self._private

    def _import(self, path: Path, digest: str):
        name = f"kernelgen_cache.kg_{digest}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        return module

    # --- maintenance (python -m kernelgen cache info|clear) -------------------------------------
    def evict(self, bound: int, keep: str | None = None) -> int:
        """Delete least recently used entries until the directory's entries take at most `bound` bytes, never
        the entry `keep` (the one just written).  Also deletes orphaned __pycache__ files and temporaries
        killed writers left.  Returns the number of entries evicted."""
        entries, orphans, temps = _scan(self.directory)
        for p in orphans:
            _unlink(p)
        now = time.time()
        for p in temps:
            try:
                if now - p.lstat().st_mtime > _STALE_TEMP_S:
                    _unlink(p)
            except OSError:
                pass
        total = sum(e.bytes for e in entries.values())
        evicted = 0
        for digest, e in sorted(entries.items(), key=lambda de: de[1].used):
            if total <= bound:
                break
            if digest != keep:
                _remove(e)
                total -= e.bytes
                evicted += 1
        return evicted

    def compiled_on_disk(self, digest: str) -> bool:
        """Does the disk cache hold this kernel's module and numba's compiled code for it (its index file), valid
        for the module as it is (restore_numba_stamp)?"""
        directory = self.directory
        path = directory / f"kg_{digest}.py"
        if not (path.exists() and any((directory / "__pycache__").glob(f"kg_{digest}.*.nbi"))):
            return False
        restore_numba_stamp(path)
        return True

    def entries(self):
        return sorted(e.path for e in _scan(self.directory)[0].values())

    def info(self) -> dict:
        entries = _scan(self.directory)[0]
        return {"directory": str(self.directory), "entries": len(entries),
                "bytes": sum(e.bytes for e in entries.values()), "max_bytes": max_bytes(),
                "memory_entries": len(self._memory), **self.stats.__dict__}

    def clear(self, memory=True) -> dict:
        """Delete kernelgen's own files from the directory, and nothing else: the directory may hold the
        user's files too (KERNELGEN_CACHE_DIR is any directory).  Ours are the entries with their
        __pycache__ files, orphaned __pycache__ files, temporaries and stats.json; __pycache__ and the
        directory themselves go only if that leaves them empty.  Returns {"entries", "bytes", "kept"}:
        what was removed, and how many other names the directory still holds."""
        d = self.directory
        entries, orphans, temps = _scan(d)
        removed = sum(_remove(e) for e in entries.values())
        removed += sum(_unlink(p) for p in orphans + temps)
        if _is_stats_file(d / "stats.json"):
            removed += _unlink(d / "stats.json")
        for empty in (d / "__pycache__", d):
            try:
                if not empty.is_symlink():
                    empty.rmdir()  # only if empty
            except OSError:
                pass
        if memory:
            with self._lock:
                self._memory.clear()
                private, self._private = self._private, None
            if private is not None:
                shutil.rmtree(private, ignore_errors=True)  # ours alone: mkdtemp made it
        try:
            kept = len(os.listdir(d))
        except OSError:
            kept = 0
        return {"entries": len(entries), "bytes": removed, "kept": kept}


def _is_stats_file(path: Path) -> bool:
    """stats.json as _save_persistent_stats writes it: counters named like CacheStats's, nothing else."""
    if path.is_symlink() or not path.is_file():
        return False
    data = load_persistent_stats(path.parent)
    return isinstance(data, dict) and bool(data) and set(data) <= set(CacheStats.__dataclass_fields__)


def load_persistent_stats(directory) -> dict:
    try:
        return json.loads((Path(directory) / "stats.json").read_text())
    except (OSError, ValueError):
        return {}


def _save_persistent_stats(cache: KernelCache):
    """Add this process's counters to the directory's lifetime totals (best effort, atomic)."""
    mine = cache.stats.__dict__
    if not any(mine.values()) or not cache.directory.exists():
        return
    try:
        totals = load_persistent_stats(cache.directory)
        for k, v in mine.items():
            totals[k] = totals.get(k, 0) + v
        fd, tmp = tempfile.mkstemp(dir=cache.directory, prefix=".tmp_", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(totals, f)
        os.replace(tmp, cache.directory / "stats.json")
    except OSError:
        pass


KERNELS = KernelCache()
atexit.register(_save_persistent_stats, KERNELS)
