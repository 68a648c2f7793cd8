"""kernelgen.numba_speedups: its Lower._find_singly_assigned_variable and ssa._FixSSAVars._stmt_index give exactly
numba-cuda's results, on random IR and on generated kernels, compiled kernels' LLVM IR is the same with and without
them, and install() patches only the numba-cuda methods they were written against (thread-safe, idempotent, silent
otherwise).

The generated kernels are compiled for real (numba.cuda.compiler.compile_cuda: typing and lowering to LLVM, no GPU
needed) in two child processes, one with the patch and one without, since this session may run numba's simulator.
"""
from __future__ import annotations

import json
import logging
import operator
import os
import subprocess
import sys
import threading
import warnings
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kernelgen import numba_speedups

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "scripts" / "compile_time.py"

lowering = pytest.importorskip("numba.cuda.lowering")
from numba.cuda.core import ir, ssa  # noqa: E402  (numba-cuda present: importorskip above)

SAV = "_find_singly_assigned_variable"
OWNERS = {SAV: lowering.Lower, "_stmt_index": ssa._FixSSAVars}


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
    for name, owner in OWNERS.items():
        assert _current(name) is getattr(numba_speedups, name)
        assert numba_speedups.original(name).__module__ == owner.__module__
    assert numba_speedups.uninstall() and not numba_speedups.uninstall() and not numba_speedups.installed()
    for name in OWNERS:
        assert _current(name) is numba_speedups.original(name) is not getattr(numba_speedups, name)


@pytest.mark.parametrize("change", ["version", "signature", "source", "missing"])
def test_other_numba_cuda_left_alone_quietly(restored, monkeypatch, caplog, change):  # restored: torn down last
    """Another numba-cuda: nothing patched.  Another method (signature, source, absent): that one left alone, the
    other installed.  Never a warning, a debug log each time."""
    numba_speedups.uninstall()
    originals = {name: _current(name) for name in OWNERS}
    if change == "version":
        monkeypatch.setattr(numba_speedups, "NUMBA_CUDA_VERSIONS", ("0.0.1",))
    else:
        first, second = numba_speedups.PATCHES
        edit = {"signature": {"signature": "(self, extra)"}, "source": {"source_sha256": "0" * 64},
                "missing": {"name": "_no_such_method"}}[change]
        monkeypatch.setattr(numba_speedups, "PATCHES", (replace(first, **edit), second))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # never a user-visible warning
        with caplog.at_level(logging.DEBUG, logger=numba_speedups.__name__):
            assert numba_speedups.install() is False and numba_speedups.install() is False
    assert _current(SAV) is originals[SAV] and not numba_speedups.installed()
    assert (_current("_stmt_index") is originals["_stmt_index"]) == (change == "version")
    assert "not installed" in caplog.text and {r.levelno for r in caplog.records} == {logging.DEBUG}


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

        def both_stmt_index(self, defstmt, block, stop=-1):
            got = numba_speedups._stmt_index(self, defstmt, block, stop)
            checked["positions"] += 1
            checked["different positions"] += got != stmt_index(self, defstmt, block, stop)
            return got
        lowering.Lower._find_singly_assigned_variable = both_sav
        ssa._FixSSAVars._stmt_index = both_stmt_index
    for i, (variant, direction, x, w, kw, precision, tile, extra) in enumerate(KERNELS):
        problem = make_problem(direction, x, w, **kw)
        config = TileConfig(*tile, **extra) if tile else None
        plan = planner.make_plan(problem, "cuda", algo=variant, config=config, precision=precision)
        ir_kernel = plan.kernel_ir()
        module = harness.load_module(render_cuda(ir_kernel, cache=False), out_dir, f"kernel_{i}")
        argtypes = harness.argtypes_of(module, {b.name: b.dtype for b in ir_kernel.params})
        cres = harness.compile_kernel(module.KERNEL.py_func, argtypes)
        (out_dir / f"kernel_{i}.ll").write_text(cres.library.get_llvm_str())
    (out_dir / "checked.json").write_text(json.dumps(checked))


def _run_workers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_BOUNDSCHECK")}
    env["NUMBA_ENABLE_CUDASIM"] = "0"  # the real CUDA target's compiler (no GPU needed to lower to LLVM)
    env["PYTHONHASHSEED"] = "0"  # numba's allocas follow set orders of names: the same in both processes
    procs = {}
    for mode in ("original", "patched"):
        (tmp_path / mode).mkdir()
        procs[mode] = subprocess.Popen([sys.executable, __file__, mode, str(tmp_path / mode)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for mode, proc in procs.items():
        output, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{mode} worker failed:\n{output[-4000:]}"
    return tmp_path / "original", tmp_path / "patched"


def test_generated_kernels_same_sets_and_llvm_ir(tmp_path):
    original, patched = _run_workers(tmp_path)
    checked = json.loads((patched / "checked.json").read_text())
    assert checked["lowerings"] >= len(KERNELS) and checked["variables"] > 0 and checked["positions"] > 0
    assert checked["different"] == 0 and checked["different positions"] == 0, checked
    for i in range(len(KERNELS)):
        want = (original / f"kernel_{i}.ll").read_text()
        got = (patched / f"kernel_{i}.ll").read_text()
        assert "define" in want and got == want, f"kernel {i} ({KERNELS[i][:2]}): LLVM IR differs with the patch"


if __name__ == "__main__":
    _worker(Path(sys.argv[2]), sys.argv[1] == "patched")
