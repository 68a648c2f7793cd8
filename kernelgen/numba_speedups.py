"""Compile-time fixes inside numba-cuda for the huge straight-line kernels kernelgen generates (issue 27).

Two of numba-cuda's passes are quadratic in the length of a block, and an unrolled k-loop body is a block of
thousands of IR statements:

* lowering decides, once per kernel, which variables are assigned exactly once (those get no stack slot:
  Lower._find_singly_assigned_variable), rescanning every Assign of a block for every variable defined in it:
  ~35% of the front half of compiling a ResNet-18 CIFAR step's kernels as planned on an H100 (the Winograd
  kernels most: 10-14 s each on the H200 machine's CPU), 20 s of the 166 s cold first step measured on the H200;
* SSA reconstruction locates a statement in its block by a linear scan for each use of each variable assigned
  more than once (ssa._FixSSAVars._stmt_index).

The replacements compute the same results in one pass per block (Assign targets counted once; statement
positions indexed once), and install() puts them in place of numba-cuda's.  They replace numba-cuda code, so they
are written against one version: install() patches a method only where numba-cuda's version and that method's
signature and source are the ones its replacement was written against, and otherwise leaves it alone (a debug log
says why: nothing a user could act on).  tests/runtime/test_numba_speedups.py checks equal results on random IR
and identical LLVM IR for generated kernels; scripts/compile_time.py measures them.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass

log = logging.getLogger(__name__)

NUMBA_CUDA_VERSIONS = ("0.30.4",)  # what the replacements were written against


def _find_singly_assigned_variable(self):
    """numba-cuda's Lower._find_singly_assigned_variable, linear: each block's Assign targets counted once instead
    of a scan of the block's Assign statements per variable.  Sets self._singly_assigned_vars (the variables
    defined by exactly one Assign, in one block, used only in that block, not needing an alloca) and resets
    self._blk_local_varmap, as the original does; the set's elements are added in the original's order."""
    from numba.cuda import lowering

    func_ir = self.func_ir
    blocks = func_ir.blocks
    sav = set()
    if not func_ir.func_id.is_generator:
        use_defs = lowering.compute_use_defs(blocks)
        alloca_vars = lowering.must_use_alloca(blocks)
        var_assign_map = defaultdict(set)  # variable -> the blocks that define it
        for blk, vl in use_defs.defmap.items():
            for var in vl:
                var_assign_map[var].add(blk)
        used_elsewhere = set()  # variables a block uses before (or without) defining them
        for vl in use_defs.usemap.values():
            used_elsewhere.update(vl)
        assign_counts = {}  # block label -> Counter of its Assign targets' names, built on first need
        for var, defblocks in var_assign_map.items():
            if var in alloca_vars or len(defblocks) != 1 or var in used_elsewhere:
                continue
            [defblk] = defblocks
            counts = assign_counts.get(defblk)
            if counts is None:
                counts = Counter(stmt.target.name for stmt in self.blocks[defblk].body
                                 if isinstance(stmt, lowering.ir.assign_types))
                assign_counts[defblk] = counts
            if counts[var] == 1:
                sav.add(var)
    self._singly_assigned_vars = sav
    self._blk_local_varmap = {}


def _stmt_index(self, defstmt, block, stop=-1):
    """numba-cuda's ssa._FixSSAVars._stmt_index from an index of the block's statements (by identity), built once
    per block per handler: a handler rewrites the uses of one variable, reading blocks it does not change.  The
    original's result: the first position of `defstmt` in the block if it is below `stop` (the original scans
    range(len(block.body))[:stop], so -1 means all but the last statement), else len(block.body)."""
    indexes = self.__dict__.setdefault("_kernelgen_positions", {})
    entry = indexes.get(id(block))
    if entry is None or entry[0] is not block:  # (an id outlives its block only if the block is gone)
        positions = {}
        for i, stmt in enumerate(block.body):
            positions.setdefault(id(stmt), i)
        entry = indexes[id(block)] = (block, positions)
    n = len(block.body)
    i = entry[1].get(id(defstmt))
    return i if i is not None and i < len(range(n)[:stop]) else n


@dataclass(frozen=True)
class Patch:
    module: str      # numba-cuda's module
    owner: str       # the class in it
    name: str        # the method replaced
    replacement: object
    signature: str   # the original's
    source_sha256: str  # of the original's source, each line stripped of its indentation, blank lines dropped

    def target(self):
        return getattr(importlib.import_module(self.module), self.owner)


PATCHES = (
    Patch("numba.cuda.lowering", "Lower", "_find_singly_assigned_variable", _find_singly_assigned_variable,
          "(self)", "ba18271f08eeeacefbfc3ef5040ab4958ed581ad933d1db8903310eb7b4f0503"),
    Patch("numba.cuda.core.ssa", "_FixSSAVars", "_stmt_index", _stmt_index,
          "(self, defstmt, block, stop=-1)", "24e734f4a02a53eacc68ffd99fb5665440ff0ff07f6836b6df3b649f0e147891"),
)

_lock = threading.Lock()
_originals = {}  # Patch -> numba-cuda's method, while the replacement is installed
_tried = False   # install() has run (since the last uninstall()): later calls only report


def _normalised_source(fn) -> str:
    return "\n".join(line.strip() for line in inspect.getsource(fn).splitlines() if line.strip())


def _numba_cuda_version() -> str | None:
    from importlib import metadata
    try:
        return metadata.version("numba-cuda")
    except metadata.PackageNotFoundError:
        return None


def _why_not(patch: Patch) -> str | None:
    """Why this numba-cuda's method is not the one the replacement was written against (None: it is)."""
    where = f"{patch.module}.{patch.owner}.{patch.name}"
    original = patch.target().__dict__.get(patch.name)
    if original is None:
        return f"{where} is not defined there"
    signature = str(inspect.signature(original))
    if signature != patch.signature:
        return f"{where}{signature}, written against {patch.signature}"
    try:
        digest = hashlib.sha256(_normalised_source(original).encode()).hexdigest()
    except (OSError, TypeError):
        return f"the source of {where} cannot be read"
    if digest != patch.source_sha256:
        return f"{where}'s source is not the one its replacement was written against"
    return None


def install() -> bool:
    """Put the replacements in place of numba-cuda's methods (once; thread-safe).  True when all of them are in
    place; False, with a debug log saying why, for each one left out: numba-cuda absent, another version, or a
    method not the one its replacement was written against (numba's own then stays)."""
    global _tried
    if _tried:  # (Launcher.from_module calls this before every CUDA kernel is compiled)
        return len(_originals) == len(PATCHES)
    with _lock:
        if _tried:
            return len(_originals) == len(PATCHES)
        version = _numba_cuda_version()
        if version not in NUMBA_CUDA_VERSIONS:
            log.debug("numba speedups not installed: numba-cuda %s, written against %s", version or "absent",
                      ", ".join(NUMBA_CUDA_VERSIONS))
            _tried = True
            return False
        for patch in PATCHES:
            if patch in _originals:
                continue
            try:
                reason = _why_not(patch)
            except ImportError as e:
                reason = f"{patch.module} cannot be imported ({e})"
            if reason is not None:
                log.debug("numba speedup not installed: %s", reason)
                continue
            owner = patch.target()
            _originals[patch] = owner.__dict__[patch.name]
            setattr(owner, patch.name, patch.replacement)
            log.debug("numba speedup installed: %s.%s.%s", patch.module, patch.owner, patch.name)
        _tried = True  # only now: a thread that sees it set (outside the lock) must find the patches in place
        return len(_originals) == len(PATCHES)


def uninstall() -> bool:
    """numba-cuda's own methods back (tests and the compile-time harness compare both).  True if any was
    installed."""
    global _tried
    with _lock:
        _tried = False
        for patch, original in _originals.items():
            setattr(patch.target(), patch.name, original)
        was = bool(_originals)
        _originals.clear()
        return was


def installed() -> bool:
    """Whether every replacement is in place."""
    return len(_originals) == len(PATCHES)


def original(name: str):
    """numba-cuda's own method `name` (one of PATCHES'), whether or not its replacement is installed."""
    [patch] = [p for p in PATCHES if p.name == name]
    return _originals.get(patch) or patch.target().__dict__[patch.name]
