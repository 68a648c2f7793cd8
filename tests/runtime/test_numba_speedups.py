"""kernelgen.numba_speedups: its Lower._find_singly_assigned_variable and ssa._FixSSAVars._stmt_index give exactly
numba-cuda's results, on random IR and on generated kernels; the call-type memo gives numba's signatures, per
compile; compiled kernels' typing and LLVM IR are the same with and without all the patches; and install() patches
only the numba methods they were written against (thread-safe, idempotent, silent otherwise).

The generated kernels are compiled for real (numba.cuda.compiler.compile_cuda: typing and lowering to LLVM, no GPU
needed) in two child processes, one with the patch and one without, since this session may run numba's simulator.
"""
from __future__ import annotations

import json
import logging
import operator
import os
import re
import subprocess
import sys
import threading
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kernelgen import numba_dataflow, numba_speedups

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "scripts" / "compile_time.py"

lowering = pytest.importorskip("numba.cuda.lowering")
from numba.cuda.core import (analysis, controlflow, ir, ssa, typed_passes,  # noqa: E402  (numba-cuda present: importorskip)
                             untyped_passes)

from numba.core.types import functions  # noqa: E402
from numba.cuda.typing import templates  # noqa: E402

SAV = "_find_singly_assigned_variable"
OWNERS = {SAV: lowering.Lower, "_stmt_index": ssa._FixSSAVars, "get_call_type": functions.BaseFunction,
          "generic": templates._IntrinsicTemplate, "_logger": ssa, "_run_ssa": ssa, "compute_live_map": analysis,
          "compute_dead_maps": analysis, "_strip_phi_nodes": typed_passes.PreLowerStripPhis,
          "fixup_var_define_in_scope": untyped_passes, "_find_topo_order": controlflow.CFGraph}


def _current(name):
    return OWNERS[name].__dict__[name]


@pytest.fixture
def restored():
    """numba-cuda's own methods back after the test, whatever the test installed."""
    yield
    numba_speedups.uninstall()
    for name in OWNERS:
        assert _current(name) is numba_speedups.original(name)


# --- the set, on random IR ----------------------------------------------------------------------------------------

def _random_function(rng, blocks=4, statements=12, names=6):
    """A stand-in for a Lower: func_ir with random blocks of Assigns (constants, copies, binops of a few names, so
    that names are assigned several times in one block, in several blocks, used before or after their definition)
    and blocks (as Lower keeps them)."""
    scope = ir.Scope(None, ir.Loc("f.py", 1))
    loc = ir.Loc("f.py", 2)
    var = lambda i: ir.Var(scope, f"v{i}", loc)
    out = {}
    for label in range(0, blocks * 10, 10):
        block = ir.Block(scope, loc)
        for _ in range(rng.integers(1, statements)):
            kind = rng.integers(3)
            if kind == 0:
                value = ir.Const(int(rng.integers(100)), loc)
            elif kind == 1:
                value = var(rng.integers(names))
            else:
                value = ir.Expr.binop(operator.add, var(rng.integers(names)), var(rng.integers(names)), loc)
            block.append(ir.Assign(value, var(rng.integers(names)), loc))
        block.append(ir.Return(var(rng.integers(names)), loc) if label == (blocks - 1) * 10 else ir.Jump(label + 10, loc))
        out[label] = block
    func_ir = SimpleNamespace(blocks=out, func_id=SimpleNamespace(is_generator=False))
    return SimpleNamespace(func_ir=func_ir, blocks=dict(sorted(out.items())))


def _sets(fake):
    numba_speedups.original(SAV)(fake)
    want, fake._singly_assigned_vars = fake._singly_assigned_vars, None
    numba_speedups._find_singly_assigned_variable(fake)
    return want, fake._singly_assigned_vars


def _candidates(fake):
    """The names defined in one block only and used in no other: the set before the one-Assign condition."""
    use_defs = lowering.compute_use_defs(fake.func_ir.blocks)
    defined = [n for names in use_defs.defmap.values() for n in names]
    used = set().union(*use_defs.usemap.values())
    return {n for n in defined if defined.count(n) == 1 and n not in used}


def test_same_set_as_numba_on_random_ir(rng):
    seen = {"kept": 0, "dropped for a second assignment": 0}
    for _ in range(300):
        fake = _random_function(rng, blocks=int(rng.integers(1, 5)))
        want, got = _sets(fake)
        assert got == want and list(got) == list(want)  # same elements, added in the same order
        assert fake._blk_local_varmap == {}
        seen["kept"] += len(want)
        seen["dropped for a second assignment"] += len(_candidates(fake) - want)
    assert all(seen.values()), seen  # both outcomes occurred, so the comparison could fail


def test_generator_has_none():
    fake = _random_function(np.random.default_rng(1))
    fake.func_ir.func_id.is_generator = True
    assert _sets(fake) == (set(), set())


def test_stmt_index_as_numba(rng):
    """Positions of statements in a block (each object once; one twice, as the original tolerates), of phis that
    are not in it, below every stop the SSA pass passes (-1: all but the last, 0..n), and in other blocks."""
    scope, loc = ir.Scope(None, ir.Loc("f.py", 1)), ir.Loc("f.py", 2)
    handler = ssa._FixSSAVars(None)
    for n in (0, 1, 2, 7):
        block, other = ir.Block(scope, loc), ir.Block(scope, loc)
        stmts = [ir.Assign(ir.Const(i, loc), ir.Var(scope, f"v{i}", loc), loc) for i in range(n)]
        block.body = stmts + stmts[:1]  # the first statement again at the end
        other.body = list(reversed(stmts))
        phi = ir.Assign(ir.Expr.phi(loc), ir.Var(scope, "phi", loc), loc)
        for stmt in stmts + [phi]:
            for stop in (-1, *range(n + 2)):
                for where in (block, other):
                    want = numba_speedups.original("_stmt_index")(handler, stmt, where, stop)
                    assert numba_speedups._stmt_index(handler, stmt, where, stop) == want, (n, stop)


# --- install() ----------------------------------------------------------------------------------------------------

def test_install_is_idempotent_and_thread_safe(restored):
    numba_speedups.uninstall()
    results = []
    threads = [threading.Thread(target=lambda: results.append(numba_speedups.install())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8 and numba_speedups.install() and numba_speedups.installed()
    for patch in numba_speedups.PATCHES:
        if patch.wraps:
            assert isinstance(_current(patch.name), patch.replacement)
        else:
            assert _current(patch.name) is patch.replacement
    for name in (SAV, "_stmt_index"):
        assert numba_speedups.original(name).__module__ == OWNERS[name].__module__
    assert numba_speedups.uninstall() and not numba_speedups.uninstall() and not numba_speedups.installed()
    for patch in numba_speedups.PATCHES:
        assert _current(patch.name) is numba_speedups.original(patch.name)
        assert _current(patch.name) is not patch.replacement and not isinstance(_current(patch.name), _Quiet)
    assert ssa._logger is logging.getLogger(ssa.__name__)


_Quiet = numba_speedups._QuietLogger


@pytest.mark.parametrize("change", ["version", "numba", "signature", "source", "missing", "module", "debug"])
def test_other_numba_cuda_left_alone_quietly(restored, monkeypatch, caplog, change):  # restored: torn down last
    """Another numba-cuda: nothing patched.  Another numba: the memo of numba's own method left out.  Another
    method (signature, source, absent), another ssa module, or SSA debug logging on: that one left alone, the
    others installed.  Never a warning, a debug log each time."""
    numba_speedups.uninstall()
    originals = {name: _current(name) for name in OWNERS}
    patches = list(numba_speedups.PATCHES)
    by_name = {p.name: i for i, p in enumerate(patches)}
    left_out = {"version": set(OWNERS), "numba": {"get_call_type"}, "signature": {SAV}, "source": {SAV},
                "missing": {SAV}, "module": {"_logger"}, "debug": {"_logger"}}[change]
    if change == "version":
        monkeypatch.setattr(numba_speedups, "NUMBA_CUDA_VERSIONS", ("0.0.1",))
    elif change == "numba":
        monkeypatch.setattr(numba_speedups, "NUMBA_VERSIONS", ("0.0.1",))
    elif change == "debug":
        monkeypatch.setattr(ssa._logger, "level", logging.DEBUG)
        ssa._logger.manager._clear_cache()
    else:
        name = "_logger" if change == "module" else SAV
        edit = {"signature": {"signature": "(self, extra)"}, "source": {"source_sha256": "0" * 64},
                "module": {"source_sha256": "0" * 64}, "missing": {"name": "_no_such_method"}}[change]
        patches[by_name[name]] = replace(patches[by_name[name]], **edit)
        monkeypatch.setattr(numba_speedups, "PATCHES", tuple(patches))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # never a user-visible warning
            with caplog.at_level(logging.DEBUG, logger=numba_speedups.__name__):
                assert numba_speedups.install() is False and numba_speedups.install() is False
    finally:
        ssa._logger.manager._clear_cache()  # (monkeypatch puts the level back; the cache must not keep DEBUG)
    assert not numba_speedups.installed()
    for name in OWNERS:
        assert (_current(name) is originals[name]) == (name in left_out), name
    assert "not installed" in caplog.text and {r.levelno for r in caplog.records} == {logging.DEBUG}


# --- the call-type memo ---------------------------------------------------------------------------------------------

def _sqrt_type():
    import math

    from numba.cuda.descriptor import cuda_target
    context = cuda_target.typing_context
    context.refresh()
    return context, context.resolve_value_type(math.sqrt)


def _check_memo_per_compile():
    """Within one compile's flags: numba's signature, from the memo the second time (the implementation key
    recorded again); other flags (another compile): their own memo; outside a compile, with keywords or in the
    CPU's typing context: numba's method alone.  A memo goes with its compile's flags."""
    import gc

    from numba.core import typing as cpu_typing
    from numba.cuda.core.targetconfig import ConfigStack
    from numba.cuda.flags import CUDAFlags
    from numba.core.types import float32, float64
    assert numba_speedups.install()
    context, fnty = _sqrt_type()
    want = numba_speedups.original("get_call_type")(fnty, context, (float32,), {})
    memos = numba_speedups._call_types
    before = len(memos)
    assert fnty.get_call_type(context, (float32,), {}) == want and len(memos) == before  # not in a compile
    first, second = CUDAFlags(), CUDAFlags()
    with ConfigStack().enter(first):
        for _ in range(2):
            assert fnty.get_call_type(context, (float32,), {}) == want
        memo = memos[id(first)][1]
        assert list(memo) == [(fnty, (float32,))]
        fnty._impl_keys[want.args] = "something else"  # a hit records numba's key again
        assert fnty.get_call_type(context, (float32,), {}) == want and fnty._impl_keys[want.args] != "something else"
        cpu = cpu_typing.Context()
        assert fnty.get_call_type(cpu, (float64,), {}) is not None and len(memo) == 1  # another context
        with ConfigStack().enter(second):
            assert fnty.get_call_type(context, (float32,), {}) == want
            assert memos[id(second)][1] is not memo
    del first, second, memo
    gc.collect()
    assert len(memos) == before


def _check_memo_threads():
    """Threads typing at once (each its own flags, as each compile pushes its own on its thread's stack): each
    gets numba's signature."""
    from numba.cuda.core.targetconfig import ConfigStack
    from numba.cuda.flags import CUDAFlags
    from numba.core.types import float32, float64
    assert numba_speedups.install()
    context, fnty = _sqrt_type()
    want = {t: numba_speedups.original("get_call_type")(fnty, context, (t,), {}) for t in (float32, float64)}
    errors = []

    def run():
        try:
            with ConfigStack().enter(CUDAFlags()):
                for i in range(2000):
                    t = (float32, float64)[i % 2]
                    assert fnty.get_call_type(context, (t,), {}) == want[t]
        except BaseException as e:  # (reported below: an assert in a thread does not fail the test)
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def _real_target_env():
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_BOUNDSCHECK")}
    env["NUMBA_ENABLE_CUDASIM"] = "0"  # the real CUDA target's typing (no GPU needed)
    env["PYTHONHASHSEED"] = "0"  # numba's allocas follow set orders of names: the same in both processes
    return env


def test_call_type_memo():
    """_check_memo_per_compile and _check_memo_threads, in a child process: this one may run numba's simulator,
    which has no CUDA typing context."""
    proc = subprocess.run([sys.executable, __file__, "memo"], env=_real_target_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.split() == ["per-compile", "threads"]


# --- generated kernels, compiled for real ---------------------------------------------------------------------------

# (variant, direction, input NHWC, filter KRSC, keywords, precision, tile): small tiles keep the compiles short
KERNELS = (
    ("implicit_gemm", "fwd", (2, 8, 8, 16), (16, 3, 3, 16), {"padding": 1}, "fp32", (16, 8, 4, 2, 2), {"stages": 2}),
    ("implicit_gemm", "bwd_weight", (2, 8, 8, 16), (16, 3, 3, 16), {"padding": 1}, "fp32", (8, 16, 4, 2, 2),
     {"split_k": 2}),
    ("winograd", "fwd", (2, 8, 8, 16), (16, 3, 3, 16), {"padding": 1}, "fp32", None, {}),
    ("ks_deconv", "bwd_data", (2, 8, 8, 16), (16, 3, 3, 16), {"padding": 1, "stride": 2}, "fp32", (16, 8, 4, 2, 2), {}),
    ("implicit_gemm_tc", "fwd", (2, 8, 8, 16), (16, 3, 3, 16), {"padding": 1}, "tf32", None, {}),
)


def _worker(out_dir: Path, patched: bool):
    """Child process: compile KERNELS (patched or not); write each one's LLVM IR and, patched, how many Lower
    instances ran and on how many numba's set and the linear one differed."""
    import importlib.util

    from kernelgen import planner
    from kernelgen.problem import make_problem
    from kernelgen.render_cuda import render_cuda
    from kernelgen.templates.config import TileConfig
    spec = importlib.util.spec_from_file_location("compile_time", HARNESS)
    harness = sys.modules["compile_time"] = importlib.util.module_from_spec(spec)  # (its dataclasses need it there)
    spec.loader.exec_module(harness)
    checked = {"lowerings": 0, "different": 0, "variables": 0, "positions": 0, "different positions": 0}
    if patched:
        assert numba_speedups.install()
        sav, stmt_index = numba_speedups.original(SAV), numba_speedups.original("_stmt_index")

        def both_sav(self):  # numba's set first, then ours (which lowering then uses)
            sav(self)
            want = self._singly_assigned_vars
            numba_speedups._find_singly_assigned_variable(self)
            checked["lowerings"] += 1
            checked["variables"] += len(want)
            checked["different"] += list(want) != list(self._singly_assigned_vars)

        def checked_index(mine):  # ours, counted and compared with numba's scan
            def index(self, defstmt, block, stop=-1):
                got = mine(self, defstmt, block, stop)
                checked["positions"] += 1
                checked["different positions"] += got != stmt_index(self, defstmt, block, stop)
                return got
            return index
        lowering.Lower._find_singly_assigned_variable = both_sav
        ssa._FixSSAVars._stmt_index = checked_index(numba_speedups._stmt_index)
        # (with numba_dataflow.run_ssa installed its handlers place statements from its own index: that one)
        numba_dataflow._stmt_index = checked_index(numba_dataflow._stmt_index)
    for i, (variant, direction, x, w, kw, precision, tile, extra) in enumerate(KERNELS):
        problem = make_problem(direction, x, w, **kw)
        config = TileConfig(*tile, **extra) if tile else None
        plan = planner.make_plan(problem, "cuda", algo=variant, config=config, precision=precision)
        ir_kernel = plan.kernel_ir()
        module = harness.load_module(render_cuda(ir_kernel, cache=False), out_dir, f"kernel_{i}")
        argtypes = harness.argtypes_of(module, {b.name: b.dtype for b in ir_kernel.params})
        cres = harness.compile_kernel(module.KERNEL.py_func, argtypes)
        (out_dir / f"kernel_{i}.ll").write_text(cres.library.get_llvm_str())
        text = lambda items: sorted(re.sub(r" at 0x[0-9a-f]+", "", f"{k}: {v}") for k, v in items)  # (no addresses)
        typing = {"typemap": text(cres.type_annotation.typemap.items()),
                  "calltypes": text(cres.type_annotation.calltypes.items())}
        (out_dir / f"kernel_{i}.types.json").write_text(json.dumps(typing))
    (out_dir / "checked.json").write_text(json.dumps(checked))


def _run_workers(tmp_path):
    env = _real_target_env()
    procs = {}
    for mode in ("original", "patched"):
        (tmp_path / mode).mkdir()
        procs[mode] = subprocess.Popen([sys.executable, __file__, mode, str(tmp_path / mode)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for mode, proc in procs.items():
        output, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{mode} worker failed:\n{output[-4000:]}"
    return tmp_path / "original", tmp_path / "patched"


def test_generated_kernels_same_sets_typing_and_llvm_ir(tmp_path):
    original, patched = _run_workers(tmp_path)
    checked = json.loads((patched / "checked.json").read_text())
    assert checked["lowerings"] >= len(KERNELS) and checked["variables"] > 0 and checked["positions"] > 0
    assert checked["different"] == 0 and checked["different positions"] == 0, checked
    for i in range(len(KERNELS)):
        want = (original / f"kernel_{i}.ll").read_text()
        got = (patched / f"kernel_{i}.ll").read_text()
        assert "define" in want and got == want, f"kernel {i} ({KERNELS[i][:2]}): LLVM IR differs with the patch"
        want, got = ((d / f"kernel_{i}.types.json").read_text() for d in (original, patched))
        assert len(json.loads(want)["calltypes"]) > 10 and got == want, f"kernel {i}: typing differs with the patches"


if __name__ == "__main__":
    if sys.argv[1] == "memo":
        _check_memo_per_compile()
        print("per-compile")
        _check_memo_threads()
        print("threads")
    else:
        _worker(Path(sys.argv[2]), sys.argv[1] == "patched")
