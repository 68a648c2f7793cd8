"""Compile-time fixes inside numba-cuda for the huge straight-line kernels kernelgen generates (issue 27).

numba-cuda's lowering decides, once per kernel, which variables are assigned exactly once (those get no stack
slot: Lower._find_singly_assigned_variable).  For every variable defined and used in one block it rescans all
the Assign statements of that block, which is quadratic in the block's length: an unrolled k-loop body of a
few thousand statements made it ~20% of a cold ResNet-18 step's compile time (cProfile on the H200: 116 s of
539 profiled, 191M ir.Block.find_insts iterations).  `_find_singly_assigned_variable` here computes the same
set in one pass per block (Assign targets counted once), and install() puts it in place of numba-cuda's.

It replaces numba-cuda code, so it is written against one version: install() patches only where numba-cuda's
version and the original method's signature and source are the ones it was written against, and otherwise leaves
numba alone (a debug log says why: nothing a user could act on).  The replacement returns exactly the original's
set; tests/runtime/test_numba_speedups.py checks that, and identical LLVM IR, on generated kernels.
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import threading
from collections import Counter, defaultdict

log = logging.getLogger(__name__)

# what the replacement was written against: numba-cuda's version and numba.cuda.lowering.Lower's original method
# (its signature, and the sha256 of its source with the indentation of each line stripped)
NUMBA_CUDA_VERSIONS = ("0.30.4",)
_SIGNATURE = "(self)"
_SOURCE_SHA256 = "ba18271f08eeeacefbfc3ef5040ab4958ed581ad933d1db8903310eb7b4f0503"

_lock = threading.Lock()
_original = None  # numba-cuda's Lower._find_singly_assigned_variable while ours is installed


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


def _normalised_source(fn) -> str:
    return "\n".join(line.strip() for line in inspect.getsource(fn).splitlines() if line.strip())


def _why_not(lower_cls) -> str | None:
    """Why the numba-cuda in this process is not the one the replacement was written against (None: it is)."""
    from importlib import metadata
    try:
        version = metadata.version("numba-cuda")
    except metadata.PackageNotFoundError:
        return "numba-cuda is not installed"
    if version not in NUMBA_CUDA_VERSIONS:
        return f"numba-cuda {version}, written against {', '.join(NUMBA_CUDA_VERSIONS)}"
    original = lower_cls.__dict__.get("_find_singly_assigned_variable")
    if original is None:
        return "numba.cuda.lowering.Lower has no _find_singly_assigned_variable of its own"
    signature = str(inspect.signature(original))
    if signature != _SIGNATURE:
        return f"Lower._find_singly_assigned_variable{signature}, written against {_SIGNATURE}"
    try:
        digest = hashlib.sha256(_normalised_source(original).encode()).hexdigest()
    except (OSError, TypeError):
        return "the source of Lower._find_singly_assigned_variable cannot be read"
    if digest != _SOURCE_SHA256:
        return "Lower._find_singly_assigned_variable's source is not the one the replacement was written against"
    return None


def install() -> bool:
    """Put the linear _find_singly_assigned_variable in place of numba-cuda's (once; thread-safe).  True when it
    is in place; False, with a debug log saying why, where numba-cuda is absent or not the version it was
    written against (numba is then left alone)."""
    global _original
    with _lock:
        if _original is not None:
            return True
        try:
            from numba.cuda import lowering
        except ImportError as e:
            log.debug("numba speedups not installed: numba.cuda cannot be imported (%s)", e)
            return False
        reason = _why_not(lowering.Lower)
        if reason is not None:
            log.debug("numba speedups not installed: %s", reason)
            return False
        _original = lowering.Lower.__dict__["_find_singly_assigned_variable"]
        lowering.Lower._find_singly_assigned_variable = _find_singly_assigned_variable
        log.debug("numba speedups installed: linear Lower._find_singly_assigned_variable")
        return True


def uninstall() -> bool:
    """Put numba-cuda's own method back (tests and the compile-time harness compare both).  True if it was
    installed."""
    global _original
    with _lock:
        if _original is None:
            return False
        from numba.cuda import lowering
        lowering.Lower._find_singly_assigned_variable = _original
        _original = None
        return True


def installed() -> bool:
    return _original is not None


def original():
    """numba-cuda's own Lower._find_singly_assigned_variable, whether or not the replacement is installed."""
    from numba.cuda import lowering
    return _original if _original is not None else lowering.Lower.__dict__["_find_singly_assigned_variable"]
