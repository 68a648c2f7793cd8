"""kernelgen.numba_dataflow: its compute_live_map, compute_dead_maps, run_ssa, strip_phi_nodes and
fixup_var_define_in_scope give exactly numba-cuda's results on random CFGs and random IR with branches and loops
(the same live sets and dead maps, in the same dict order; the same statements, names, phis and scopes, in the same
order).  tests/runtime/test_numba_speedups.py installs them with the other patches and checks that generated
kernels' typing and LLVM IR are unchanged.
"""
from __future__ import annotations

import copy
import logging
import operator
import warnings
from types import SimpleNamespace

import pytest

from kernelgen import numba_dataflow, numba_speedups

pytest.importorskip("numba.cuda.lowering")
from numba.cuda.core import ir  # noqa: E402  (numba-cuda present: importorskip above)
from numba.cuda.core.controlflow import CFGraph  # noqa: E402


def _random_cfg(rng, n):
    """A CFG of n blocks (labels 0, 2, ...): a chain with random forward and backward edges, some blocks cut off
    (no edge into them), so that loops, joins and unreachable code all occur."""
    labels = [2 * i for i in range(n)]
    cfg = CFGraph()
    for label in labels:
        cfg.add_node(label)
    for i, label in enumerate(labels[:-1]):
        targets = {labels[int(rng.integers(n))] for _ in range(int(rng.integers(0, 3)))}
        if rng.random() < 0.8:
            targets.add(labels[i + 1])
        for t in targets:
            cfg.add_edge(label, t)
    cfg.set_entry_point(0)
    cfg.process()
    return labels, cfg


def test_live_map_as_numba(rng):
    names = [f"v{i}" for i in range(12)]
    pick = lambda: {names[int(i)] for i in rng.integers(len(names), size=int(rng.integers(0, 5)))}
    nonempty = 0
    for _ in range(400):
        labels, cfg = _random_cfg(rng, int(rng.integers(1, 12)))
        usemap = {label: pick() for label in labels}
        defmap = {label: pick() for label in labels}
        blocks = dict.fromkeys(labels)
        want = numba_speedups.original("compute_live_map")(cfg, blocks, usemap, defmap)
        got = numba_dataflow.compute_live_map(cfg, blocks, usemap, defmap)
        assert got == want and list(got) == list(want)
        nonempty += sum(len(v) > len(usemap[k]) for k, v in want.items())  # live beyond the block's own uses
    assert nonempty > 100


def _outcome(fn, *args):
    try:
        return fn(*args)
    except RuntimeError as e:  # (numba's coverage check: a message naming a set, whose order may differ)
        return type(e), str(e).split(":")[0]


def test_dead_maps_as_numba(rng):
    names = [f"v{i}" for i in range(12)]
    pick = lambda: {names[int(i)] for i in rng.integers(len(names), size=int(rng.integers(0, 5)))}
    scope, loc = ir.Scope(None, ir.Loc("f.py", 1)), ir.Loc("f.py", 2)
    seen = {"maps": 0, "raised": 0}
    for i in range(3000):  # 300 draws, and more until numba's check has raised on one (rarely: not every 300 do)
        if i >= 300 and all(seen.values()):
            break
        labels, cfg = _random_cfg(rng, int(rng.integers(1, 12)))
        usemap = {label: pick() for label in labels}
        defmap = {label: pick() for label in labels}
        blocks = {}
        for label in labels:  # (only the terminators' variables matter)
            blocks[label] = block = ir.Block(scope, loc)
            block.append(ir.Return(ir.Var(scope, names[int(rng.integers(len(names)))], loc), loc))
        live = numba_speedups.original("compute_live_map")(cfg, blocks, usemap, defmap)
        want = _outcome(numba_speedups.original("compute_dead_maps"), cfg, blocks, live, defmap)
        got = _outcome(numba_dataflow.compute_dead_maps, cfg, blocks, live, defmap)
        assert got == want
        if isinstance(want, tuple) and want[0] is RuntimeError:
            seen["raised"] += 1
            continue
        seen["maps"] += 1
        for mine, numbas in zip(got, want):
            assert list(mine.items()) == list(numbas.items()) and type(mine) is type(numbas)
    assert all(seen.values()), seen


def _random_function(rng, n, names=5):
    """Blocks of random Assigns to a few names (defined in the scope), each ending in a Jump to the next block or a
    Branch to it and to a random block (loops, joins), the last one returning: names assigned in several blocks
    and several times in one, used before and after, across loops: what SSA reconstruction rewrites and phis."""
    scope = ir.Scope(None, ir.Loc("f.py", 1))
    loc = ir.Loc("f.py", 2)
    variables = [scope.define(f"v{i}", loc) for i in range(names)]
    var = lambda: variables[int(rng.integers(names))]
    blocks = {}
    for i in range(n):
        block = ir.Block(scope, loc)
        for _ in range(int(rng.integers(0, 6))):
            kind = rng.integers(3)
            value = (ir.Const(int(rng.integers(100)), loc) if kind == 0 else var() if kind == 1
                     else ir.Expr.binop(operator.add, var(), var(), loc))
            block.append(ir.Assign(value, var(), loc))
        loc = ir.Loc("f.py", 3)  # (terminators: a line of their own, where numba's strip_phis may put assignments)
        if i == n - 1:
            block.append(ir.Return(var(), loc))
        elif rng.random() < 0.5:
            block.append(ir.Jump(2 * (i + 1), loc))
        else:
            block.append(ir.Branch(var(), 2 * (i + 1), 2 * int(rng.integers(n)), loc))
        blocks[2 * i] = block
        loc = ir.Loc("f.py", 2)
    return blocks


def _dump(blocks):
    """Everything SSA reconstruction decides: each block's statements (phis with their incoming values and blocks)
    and the scope's names, in order."""
    out = []
    for label, block in blocks.items():
        for stmt in block.body:
            out.append((label, str(stmt)))
            if isinstance(stmt, ir.Assign) and isinstance(stmt.value, ir.Expr) and stmt.value.op == "phi":
                incoming = [getattr(v, "name", str(v)) for v in stmt.value.incoming_values]
                out.append((incoming, list(stmt.value.incoming_blocks)))
    first = next(iter(blocks.values()))
    return out, list(first.scope.localvars._con)


def test_ssa_as_numba(rng):
    phis = 0
    for _ in range(300):
        blocks = _random_function(rng, int(rng.integers(1, 8)))
        mine = copy.deepcopy(blocks)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (numba's may warn of a variable used before any assignment)
            want = _dump(numba_speedups.original("_run_ssa")(blocks))
            got = _dump(numba_dataflow.run_ssa(mine))
        assert got == want
        phis += sum("phi(" in text for _, text in want[0] if isinstance(text, str))
    assert phis > 100  # phis were placed, so the comparison could fail


def test_ssa_debug_logging_gets_numbas(monkeypatch):
    """With numba's SSA debug logging on, numba's own _run_ssa runs (it logs each statement); otherwise ours."""
    from numba.cuda.core import ssa
    calls = []
    runner = numba_dataflow.RunSSA(lambda blocks: calls.append(blocks) or "numba's")
    assert runner({}) == {} and not calls
    monkeypatch.setattr(ssa, "_logger", logging.getLogger(ssa.__name__))  # (not the quiet stand-in, if installed)
    monkeypatch.setattr(ssa._logger, "level", logging.DEBUG)
    ssa._logger.manager._clear_cache()
    try:
        assert runner({}) == "numba's" and calls == [{}]
    finally:
        monkeypatch.undo()
        ssa._logger.manager._clear_cache()


def test_fixup_var_define_in_scope_as_numba(rng):
    """Blocks of two scopes (numba's passes do not keep one), each missing names the other's blocks use: the same
    names defined in each scope, in the same order, bound to the same variables."""
    defined = 0
    for _ in range(100):
        blocks = _random_function(rng, int(rng.integers(2, 8)), names=8)
        other = ir.Scope(None, ir.Loc("f.py", 3))
        for label in list(blocks)[1::2]:
            blocks[label].scope = other
        mine = copy.deepcopy(blocks)
        numba_speedups.original("fixup_var_define_in_scope")(blocks)
        numba_dataflow.fixup_var_define_in_scope(mine)
        for theirs, ours in zip(blocks.values(), mine.values()):
            want, got = theirs.scope.localvars._con, ours.scope.localvars._con
            assert list(got) == list(want) and [v.name for v in got.values()] == [v.name for v in want.values()]
        defined += len(other.localvars)
    assert defined > 100  # names were defined in the second scope, so the comparison could fail


def test_strip_phis_as_numba(rng):
    """numba's SSA of random functions (phis in loops and joins), some assignments duplicated (an equal copy
    earlier in the block: numba's list.index then finds the copy): phis stripped the same way, the incoming
    values' assignments at the same places with the same locations."""
    inserted = 0
    for _ in range(200):
        blocks = _random_function(rng, int(rng.integers(2, 8)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            blocks = numba_speedups.original("_run_ssa")(blocks)
        for block in blocks.values():
            assigns = [s for s in block.body if isinstance(s, ir.Assign) and not isinstance(s.value, ir.Expr)]
            if assigns and rng.random() < 0.5:
                block.body.insert(0, copy.copy(assigns[int(rng.integers(len(assigns)))]))
        theirs = SimpleNamespace(blocks=blocks, loc=ir.Loc("f.py", 7))
        ours = copy.deepcopy(theirs)
        before = sum(len(b.body) for b in blocks.values())
        numba_speedups.original("_strip_phi_nodes")(None, theirs)
        numba_dataflow.strip_phi_nodes(None, ours)
        dump = lambda f: [(label, str(s), s.loc.line) for label, b in f.blocks.items() for s in b.body]
        assert dump(ours) == dump(theirs)
        inserted += sum(len(b.body) for b in theirs.blocks.values()) - before
    assert inserted > 100


def test_the_block_order_is_numba_cuda_s_on_random_graphs_and_needs_no_recursion():
    """find_topo_order: numba-cuda's recursive depth-first reverse post-order, on an explicit stack - the same order
    on random control-flow graphs (loops, joins, unreachable blocks), and a chain deeper than the recursion limit."""
    import random
    import sys
    from numba.cuda.core.controlflow import CFGraph
    original = numba_speedups.original("_find_topo_order")

    def graph(n, edges):
        g = CFGraph()
        for i in range(n):
            g.add_node(i)
        for a, b in edges:
            g.add_edge(a, b)
        g.set_entry_point(0)
        g.process()
        return g
    for seed in range(200):
        r = random.Random(seed)
        n = r.randint(1, 40)
        g = graph(n, [(i, r.randrange(n)) for i in range(n) for _ in range(r.randint(0, 3))])
        assert numba_dataflow.find_topo_order(g) == original(g), seed
    # deeper than the recursion limit, no deeper: numba-cuda's back-edge search (which the walk reads) copies its
    # stack per node, quadratic in the chain (27 s of CI at 3x the limit)
    depth = sys.getrecursionlimit() + 200
    chain = graph(depth, [(i, i + 1) for i in range(depth - 1)])
    assert numba_dataflow.find_topo_order(chain) == list(range(depth))
