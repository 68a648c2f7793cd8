"""Compiled-kernel cache: in memory, and on disk as real Python modules.

Triton-style: an explicit specialisation key (problem, variant, config, backend, device, version)
names an entry, together with CODE_VERSION: the package version and a digest of the code that renders
kernels (kernelgen's own modules and the templates), so an edited or upgraded kernelgen never imports a
kernel that older code generated (Triton keys its cache on its compiler's source the same way).  On disk
each entry is a generated module `<digest>.py` whose numba decorator has cache=True, so a warm process
skips both rendering (the module is imported as it is) and numba compilation (numba's own cache sits
beside it in __pycache__).

Entries are written atomically (temp file + os.replace) and carry a header with the key digest
and a checksum of the body; a truncated, corrupt or version-mismatched file is re-rendered, never
trusted.  Two processes filling one directory both succeed: the last rename wins with identical
content.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import importlib.util
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import kernelgen
from kernelgen import __version__

_HEADER = "# kernelgen-cache {version} {digest} {checksum}\n"


def _code_version() -> str:
    import kernelgen.templates
    h = hashlib.sha256()
    for pkg in (kernelgen, kernelgen.templates):
        root = Path(pkg.__file__).parent
        for path in sorted(root.glob("*.py")):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return f"{__version__}+{h.hexdigest()[:12]}"


CODE_VERSION = _code_version()


def cache_dir() -> Path:
    env = os.environ.get("KERNELGEN_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs
    return Path(platformdirs.user_cache_dir("kernelgen"))


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


@dataclass
class KernelCache:
    """Maps a specialisation key to a compiled object built by `build(function) -> object`."""
    root: Path | None = None
    stats: CacheStats = field(default_factory=CacheStats)
    _memory: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

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
        digest = key_digest(key)
        path = self.directory / f"kg_{digest}.py"
        body = self._read_valid(path, digest)
        if body is None:
            self.stats.misses += 1
            body = render()
            self._write(path, digest, body)
        else:
            self.stats.disk_hits += 1
        module = self._import(path, digest)
        obj = build(module)
        with self._lock:
            self._memory[key] = obj
        return obj

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

    def _write(self, path: Path, digest: str, body: str):
        path.parent.mkdir(parents=True, exist_ok=True)
        text = _HEADER.format(version=CODE_VERSION, digest=digest, checksum=_checksum(body)) + body
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp_", suffix=".py")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)

    def _import(self, path: Path, digest: str):
        name = f"kernelgen_cache.kg_{digest}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    # --- maintenance (python -m kernelgen cache info|clear) -------------------------------------
    def entries(self):
        d = self.directory
        return sorted(d.glob("kg_*.py")) if d.exists() else []

    def info(self) -> dict:
        d = self.directory
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.exists() else 0
        return {"directory": str(d), "entries": len(self.entries()), "bytes": size,
                "memory_entries": len(self._memory), **self.stats.__dict__}

    def clear(self, memory=True):
        import shutil
        d = self.directory
        if d.exists():
            shutil.rmtree(d)
        if memory:
            with self._lock:
                self._memory.clear()


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
