"""Compile-time fixes inside numba-cuda for the huge straight-line kernels kernelgen generates (issue 27).

Two of numba-cuda's passes are quadratic in the length of a block, and an unrolled k-loop body is a block of
thousands of IR statements:

* lowering decides, once per kernel, which variables are assigned exactly once (those get no stack slot:
  Lower._find_singly_assigned_variable), rescanning every Assign of a block for every variable defined in it:
  ~35% of the front half of compiling a ResNet-18 CIFAR step's kernels as planned on an H100 (the Winograd
  kernels most: 10-14 s each on the H200 machine's CPU), 20 s of the 166 s cold first step measured on the H200;
* SSA reconstruction locates a statement in its block by a linear scan for each use of each variable assigned
  more than once (ssa._FixSSAVars._stmt_index).

Three more are quadratic in the number of blocks (every `and` of a generated predicate is a branch): SSA
reconstruction rewrites every block for each variable assigned more than once, the post-processor's liveness
(run ~9 times per compile) builds, per block, the set of every variable defined on a path to it, and the closure
inliner checks every variable against every block's (shared) scope.  Their
replacements live in kernelgen/numba_dataflow.py (its docstring says how); on the TF32 wgmma backward-weight kernel
of issue 27 they are most of a ~175 s front end.

The replacements compute the same results in one pass per block (Assign targets counted once; statement
positions indexed once), and install() puts them in place of numba-cuda's.  They replace numba-cuda code, so they
are written against one version: install() patches a method only where numba-cuda's version and that method's
signature and source are the ones its replacement was written against, and otherwise leaves it alone (a debug log
says why: nothing a user could act on).  tests/runtime/test_numba_speedups.py checks equal results on random IR
and identical LLVM IR for generated kernels; scripts/compile_time.py measures them.

Three more cut constant factors of typing and SSA (measured by scripts/compile_time.py's --experiment prototypes on
the H200 host: -18 % of the compile time for the first, a few % for the others):

* BaseFunction.get_call_type (numba's, which numba-cuda's typing calls for every call site of a function type:
  add32, uidx, float32, ... thousands per kernel) memoised per compile (see _get_call_type);
* _IntrinsicTemplate.generic looks in its own cache before refreshing the target context (~1 ms per call site of
  an @intrinsic; see _intrinsic_generic);
* SSA's module logger, whose debug() runs ~5M times on a large kernel, swapped for one whose debug() does
  nothing, when numba's SSA debug logging is off at install (see _QuietLogger).

And one removes a recursion: CFGraph._find_topo_order walks the blocks depth-first with one Python frame per block
of the longest chain (numba_dataflow.find_topo_order: the same order on an explicit stack), so loading a kernel no
longer raises the interpreter's recursion limit for the whole process (runtime.driver.allow_deep_cfg_walks).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import threading
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass

from .numba_dataflow import (RunSSA, compute_dead_maps, compute_live_map,
                             find_topo_order, fixup_var_define_in_scope, strip_phi_nodes)

log = logging.getLogger(__name__)

NUMBA_CUDA_VERSIONS = ("0.30.4",)  # what the replacements were written against
# ... and, for the one that replaces a method of numba's own, numba's: the GPU machine has 0.68.0, whose
# numba/core/types/functions.py is byte-identical to 0.68.1's (checked against both wheels, 2026-11-26)
NUMBA_VERSIONS = ("0.68.0", "0.68.1")


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


# --- per-compile memo of call types -------------------------------------------------------------------------------

_call_types = {}  # id(compile's flags) -> (weak reference to the flags, {(function type, args): (sig, impl key)})


def _forget_call_types(ref, key):
    entry = _call_types.get(key)
    if entry is not None and entry[0] is ref:  # (not a later compile's flags at a reused id)
        _call_types.pop(key, None)


def _call_type_memo():
    """This compile's memo: keyed by the identity of the flags on numba's ConfigStack, which one compile pushes
    (a nested compile, such as a device function's, pushes its own), kept while those flags live; None outside
    a compile."""
    flags = _config_stack().top_or_none()
    if flags is None:
        return None
    key = id(flags)
    entry = _call_types.get(key)
    if entry is None or entry[0]() is not flags:
        entry = _call_types[key] = (weakref.ref(flags, lambda ref: _forget_call_types(ref, key)), {})
    return entry[1]


def _get_call_type(self, context, args, kws):
    """numba's BaseFunction.get_call_type, memoised within one CUDA compile on (function type, argument types).
    The original tries the function's templates in order and returns the first signature that applies, recording
    self._impl_keys[sig.args] (which implementation lowering then calls); it is deterministic for one function
    type, argument types, typing context and target, and a compile's flags pin those: a hit returns the signature
    the original returned and records the same implementation key again, as the original would (a later call with
    other arguments of the same signature may have recorded another in between).  Failures are not memoised (the
    original runs and raises again); keyword arguments, the CPU's typing context and calls outside a compile go
    to the original untouched."""
    original = _originals_by_name["get_call_type"]
    if kws or context is not _cuda_typing_context():
        return original(self, context, args, kws)
    memo = _call_type_memo()
    if memo is None:
        return original(self, context, args, kws)
    hit = memo.get((self, args))
    if hit is not None:
        self._impl_keys[hit[0].args] = hit[1]
        return hit[0]
    sig = original(self, context, args, kws)
    impl = self._impl_keys.get(sig.args, _MISSING)
    if impl is not _MISSING:
        memo[(self, args)] = (sig, impl)
    return sig


_MISSING = object()


_numba_objects = {}  # numba's objects the replacements consult, looked up once (numba-cuda is optional: not at import)


def _config_stack():
    stack = _numba_objects.get("ConfigStack")
    if stack is None:
        from numba.cuda.core import targetconfig
        stack = _numba_objects["ConfigStack"] = targetconfig.ConfigStack
    return stack


def _cuda_typing_context():
    context = _numba_objects.get("typing_context")
    if context is None:
        from numba.cuda.descriptor import cuda_target
        context = _numba_objects["typing_context"] = cuda_target.typing_context
    return context


# --- the intrinsic template's cache first --------------------------------------------------------------------------

def _intrinsic_generic(self, args, kws):
    """numba-cuda's _IntrinsicTemplate.generic with its cache read first.  The original refreshes the target
    context (to pick the registry it registers a new intrinsic's lowering in), then returns the cached signature
    for (typing context, args, kws) if there is one.  On a hit nothing is registered, and the refresh only loads
    registrations pending in other registries, which the target context loads anyway when lowering asks it for an
    implementation it lacks (BaseContext.get_function refreshes) and at the start of every compile: a hit returns
    the same signature without it.  A miss runs the original."""
    hit = self._impl_cache.get((self.context, args, tuple(kws.items())))
    return hit if hit is not None else _originals_by_name["generic"](self, args, kws)


# --- a quiet SSA logger -------------------------------------------------------------------------------------------

class _QuietLogger:
    """Stands in for numba-cuda's ssa._logger, which the SSA pass calls only as _logger.debug(...) with
    arguments that format lazily (the module's source is checked for that): debug() does nothing, as the
    logger's own does while DEBUG is off for it, without the two Python calls per message.  Installed only when
    DEBUG is off for that logger; turning numba's SSA debug logging on afterwards needs uninstall() first.
    Anything else is the real logger's."""

    def __init__(self, logger):
        self._logger = logger

    def debug(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return getattr(self._logger, name)


@dataclass(frozen=True)
class Patch:
    module: str      # numba-cuda's (or numba's) module
    owner: str | None  # the class in it (None: a module attribute)
    name: str        # the method (or attribute) replaced
    replacement: object  # what goes in its place; with wraps, a callable making that from the original
    signature: str | None  # the original's (None: source_sha256 is of the whole module's: for an attribute that is
                           # no function, or a replacement that relies on the module's other functions too)
    source_sha256: str  # of the original's source, each line stripped of its indentation, blank lines dropped
    numba: bool = False  # a method of numba's own (not numba-cuda's): numba's version is checked too
    wraps: bool = False

    def target(self):
        module = importlib.import_module(self.module)
        return module if self.owner is None else getattr(module, self.owner)

    def where(self) -> str:
        return ".".join(p for p in (self.module, self.owner, self.name) if p)


PATCHES = (
    Patch("numba.cuda.lowering", "Lower", "_find_singly_assigned_variable", _find_singly_assigned_variable,
          "(self)", "ba18271f08eeeacefbfc3ef5040ab4958ed581ad933d1db8903310eb7b4f0503"),
    Patch("numba.cuda.core.ssa", "_FixSSAVars", "_stmt_index", _stmt_index,
          "(self, defstmt, block, stop=-1)", "24e734f4a02a53eacc68ffd99fb5665440ff0ff07f6836b6df3b649f0e147891"),
    Patch("numba.core.types.functions", "BaseFunction", "get_call_type", _get_call_type,
          "(self, context, args, kws)", "0fadc5ac86cec70611553aa8bfcefa86e132ecc2590f1c6c0ccce57ebfebf7ed", numba=True),
    Patch("numba.cuda.typing.templates", "_IntrinsicTemplate", "generic", _intrinsic_generic,
          "(self, args, kws)", "6b97706ea3409d70adf54675299cc7d5f12130a17c1ed1273694833776518e40"),
    Patch("numba.cuda.core.ssa", None, "_logger", _QuietLogger,
          None, "b143dcb979a2359fff7414d0857da7b9d5c79c79492b8ee3c5ef916004cd837b", wraps=True),
    # (run_ssa calls the ssa module's helpers and mirrors two of them: the whole module is pinned)
    Patch("numba.cuda.core.ssa", None, "_run_ssa", RunSSA,
          None, "b143dcb979a2359fff7414d0857da7b9d5c79c79492b8ee3c5ef916004cd837b", wraps=True),
    Patch("numba.cuda.core.analysis", None, "compute_live_map", compute_live_map,
          "(cfg, blocks, var_use_map, var_def_map)",
          "71ebabd8a4148c116f6ba4c335c52322b2f230f71bca5b6dfa557bdb80f54ea1"),
    Patch("numba.cuda.core.analysis", None, "compute_dead_maps", compute_dead_maps,
          "(cfg, blocks, live_map, var_def_map)", "e6904c915cb01867ebaa216c92740b9bd664acd74b116a053be3efeb269265d9"),
    Patch("numba.cuda.core.typed_passes", "PreLowerStripPhis", "_strip_phi_nodes", strip_phi_nodes,
          "(self, func_ir)", "6172e2563c11ffb0c95915ccdf0b92a4c88ae3a19b93d86cccedff49a3f8915f"),
    # (ir_utils' function, as untyped_passes imported it: the name that InlineClosureCallPass calls)
    Patch("numba.cuda.core.untyped_passes", None, "fixup_var_define_in_scope", fixup_var_define_in_scope,
          "(blocks)", "aa924ac1dd8116a08040d03b1deb69e3ffebb6b3c97bf19eb24e2512d890e42a"),
    # (no recursion: with it installed, runtime.driver.allow_deep_cfg_walks leaves the recursion limit alone)
    Patch("numba.cuda.core.controlflow", "CFGraph", "_find_topo_order", find_topo_order,
          "(self)", "14ca4b98abfa7cb31ce79d56ff6563eb8ec36cc77441f9056600f6689a3a2606"),
)

_lock = threading.Lock()
_originals = {}  # Patch -> numba-cuda's method, while the replacement is installed
_originals_by_name = {}  # name -> numba's method, for the replacements that call it (kept after uninstall(): a
                         # compile in another thread may still be inside a replacement)
_tried = False   # install() has run (since the last uninstall()): later calls only report


def _normalised_source(fn) -> str:
    return "\n".join(line.strip() for line in inspect.getsource(fn).splitlines() if line.strip())


def _version(distribution="numba-cuda") -> str | None:
    from importlib import metadata
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _numba_cuda_version() -> str | None:
    return _version("numba-cuda")


def _why_not(patch: Patch) -> str | None:
    """Why this numba's method is not the one the replacement was written against (None: it is)."""
    where = patch.where()
    if patch.numba and _version("numba") not in NUMBA_VERSIONS:
        return f"{where}: numba {_version('numba')}, written against {', '.join(NUMBA_VERSIONS)}"
    original = patch.target().__dict__.get(patch.name)
    if original is None:
        return f"{where} is not defined there"
    if patch.signature is not None:
        signature = str(inspect.signature(original))
        if signature != patch.signature:
            return f"{where}{signature}, written against {patch.signature}"
    try:
        read = original if patch.signature is not None else importlib.import_module(patch.module)
        digest = hashlib.sha256(_normalised_source(read).encode()).hexdigest()
    except (OSError, TypeError):
        return f"the source of {where} cannot be read"
    if digest != patch.source_sha256:
        return f"{where}'s source is not the one its replacement was written against"
    if isinstance(original, logging.Logger) and original.isEnabledFor(logging.DEBUG):
        return f"{where} logs at DEBUG (it is kept, so that its messages still come)"
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
            original = _originals[patch] = _originals_by_name[patch.name] = owner.__dict__[patch.name]
            setattr(owner, patch.name, patch.replacement(original) if patch.wraps else patch.replacement)
            log.debug("numba speedup installed: %s", patch.where())
        _tried = True  # only now: a thread that sees it set (outside the lock) must find the patches in place
        return len(_originals) == len(PATCHES)


def uninstall(names=None) -> bool:
    """numba's own methods back (tests and the compile-time harness compare both): all of them, or those of the
    PATCHES named in `names` (the harness measures each patch's share).  True if any was installed."""
    global _tried
    with _lock:
        _tried = False  # (the next install() puts back any left out)
        undone = [p for p in _originals if names is None or p.name in names]
        for patch in undone:
            setattr(patch.target(), patch.name, _originals.pop(patch))
        return bool(undone)


def installed() -> bool:
    """Whether every replacement is in place."""
    return len(_originals) == len(PATCHES)


def installed_names() -> set:
    """The names of the PATCHES in place."""
    return {p.name for p in _originals}


def original(name: str):
    """numba-cuda's own method `name` (one of PATCHES'), whether or not its replacement is installed."""
    [patch] = [p for p in PATCHES if p.name == name]
    return _originals.get(patch) or patch.target().__dict__[patch.name]
