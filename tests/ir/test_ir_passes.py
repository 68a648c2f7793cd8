"""The IR passes: each keeps a kernel's meaning and does the one rewrite it promises.

Expression folding is checked by evaluating random expression trees before and after (through
the renderer's printer, so the printed form is covered too); statement passes on small kernels
built by hand; the CUDA pipeline on the real conv template.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernelgen.ir import (Assign, BinOp, Buffer, Call, Const, For, If, Kernel, Load, Select, Var, minimum,
                          select)
from kernelgen.passes import (demote_unroll, flatten_buffers, fold_constants, fold_expr, lower,
                              scalarize_registers, unroll)
from kernelgen.ir_walk import unrolled_statements, walk_stmts
from kernelgen.problem import make_problem
from kernelgen.render_base import SourcePrinter
from kernelgen.render_cuda import render_cuda
from kernelgen.templates import default_config, get_variant
from kernelgen.templates.config import TileConfig

i, j = Var("i"), Var("j")


def kernel(body, params=(), locals_=(), threads=1):
    return Kernel("k", tuple(params), tuple(locals_), tuple(body), (1,), threads)


def show(e):
    return SourcePrinter(kernel([])).expr(e)


def evaluate(e, env):
    return eval(show(e), {"min": min, "max": max}, dict(env))


# --- constant folding ----------------------------------------------------------------------------

@pytest.mark.parametrize("expr, folded", [
    (Const(2) + Const(3) * Const(4), Const(14)),
    (i + 0, i), (0 + i, i), (i * 1, i), (1 * i, i), (i - 0, i), (i // 1, i),
    (i % 1, Const(0)), (i * 0, Const(0)),
    ((i + 1) + 2, BinOp("+", i, Const(3))),
    (i - 3, BinOp("+", i, Const(-3))),
    (Const(7) // Const(2), Const(3)), (Const(-7) % Const(3), Const(2)),  # Python semantics, as numba's
    (minimum(3, 5), Const(3)),
    (select(Const(True), i, j), i), (select(Const(False), i, j), j),
    ((i < 3) & Const(True), BinOp("<", i, Const(3))), (Const(False) & (i < 3), Const(False)),
    ((i < 3) | Const(True), Const(True)), (Const(False) | (i < 3), BinOp("<", i, Const(3))),
])
def test_fold_expr(expr, folded):
    assert fold_expr(expr) == folded


def test_fold_keeps_what_it_must():
    x = Load("x", (i,))
    assert fold_expr(x * Const(0.0)) == BinOp("*", x, Const(0.0))  # x may be NaN/inf: 0.0 * x is not 0
    assert fold_expr(Const(1) // Const(0)) == BinOp("//", Const(1), Const(0))  # left for the target to raise


INT_OPS = ["+", "-", "*"]


@st.composite
def int_exprs(draw, depth=4):
    if depth == 0 or draw(st.integers(0, 3)) == 0:
        return draw(st.one_of(st.integers(-5, 5).map(Const), st.sampled_from([i, j])))
    kind = draw(st.integers(0, 4))
    a, b = draw(int_exprs(depth=depth - 1)), draw(int_exprs(depth=depth - 1))
    if kind == 0:
        return BinOp(draw(st.sampled_from(INT_OPS)), a, b)
    if kind == 1:  # divisors: nonzero constants, as the templates use them
        return BinOp(draw(st.sampled_from(["//", "%"])), a, Const(draw(st.integers(1, 4))))
    if kind == 2:
        return Call(draw(st.sampled_from(["min", "max"])), (a, b))
    cond = BinOp(draw(st.sampled_from(["<", "<=", "==", "!=", ">="])), a, b)
    if kind == 3:
        other = BinOp("<", b, Const(draw(st.integers(-3, 3))))
        cond = BinOp(draw(st.sampled_from(["and", "or"])), cond, draw(st.sampled_from([other, Const(True),
                                                                                       Const(False)])))
    return Select(cond, a, b)


@settings(max_examples=300)
@given(e=int_exprs(), vi=st.integers(-6, 6), vj=st.integers(-6, 6))
def test_fold_preserves_value(e, vi, vj):
    assert evaluate(fold_expr(e), {"i": vi, "j": vj}) == evaluate(e, {"i": vi, "j": vj})


def test_fold_constants_drops_dead_code():
    out = Buffer("out", (4,), role="out")
    body = [If(Const(1) < Const(2), (out.store(0, 1.0),), (out.store(0, 2.0),)),
            If(Const(False), (out.store(1, 3.0),)),
            For("e", Const(3) - Const(3), (out.store(2, 4.0),)),
            For("f", Const(2) * Const(2), (out.store(Var("f"), 5.0),))]
    folded = fold_constants(kernel(body, [out])).body
    assert folded == (out.store(0, 1.0), For("f", 4, (out.store(Var("f"), 5.0),)))


# --- unroll, demote_unroll ---------------------------------------------------------------------------

def test_unroll_expands_with_folded_indices():
    out = Buffer("out", (2, 3), role="out")
    body = [For("a", 2, (For("b", 3, (out.store((Var("a"), Var("b") + 1 - 1), Var("a") * 3 + Var("b")),),
                                "unroll"),), "serial")]
    k = unroll(kernel(body, [out]))
    (loop,) = k.body
    assert loop.binding == "serial" and loop.var == "a"
    a3 = BinOp("*", Var("a"), Const(3))
    assert loop.body == (out.store((Var("a"), Const(0)), a3), out.store((Var("a"), Const(1)), BinOp("+", a3, Const(1))),
                         out.store((Var("a"), Const(2)), BinOp("+", a3, Const(2))))


def test_unroll_respects_start_and_leaves_dynamic_loops():
    out = Buffer("out", (8,), role="out")
    dyn = For("d", Var("n"), (out.store(Var("d"), 0.0),), "unroll")
    k = unroll(kernel([For("s", 2, (out.store(Var("s"), 1.0),), "unroll", start=5), dyn], [out]))
    assert k.body == (out.store(Const(5), 1.0), out.store(Const(6), 1.0), dyn)


def test_unrolled_statements_counts_what_unroll_makes():
    out = Buffer("out", (8,), role="out")
    dyn = For("d", Var("n"), (out.store(Var("d"), 0.0),), "unroll")
    nested = For("a", 2, (For("b", 3, (out.store(Var("b"), 0.0), out.store(Var("a"), 1.0)), "unroll"),), "serial")
    for body in ([For("s", 2, (out.store(Var("s"), 1.0),), "unroll", start=5), dyn], [nested, dyn]):
        k = kernel(body, [out])
        assert unrolled_statements(k.body) == sum(1 for _ in walk_stmts(unroll(k).body))
    p = make_problem("fwd", (2, 9, 9, 8), (16, 3, 3, 8), padding=1)
    v = get_variant("implicit_gemm")
    k = v.build(p, default_config(p, "cuda", v))
    assert unrolled_statements(k.body) == sum(1 for _ in walk_stmts(unroll(k).body)) > 100


def test_demote_unroll():
    out = Buffer("out", (3,), role="out")
    inner = For("b", 3, (out.store(Var("b"), 0.0),), "unroll")
    k = demote_unroll(kernel([If(Var("c"), (inner,))], [out]))
    assert k.body[0].body[0].binding == "serial"


# --- scalarize_registers ---------------------------------------------------------------------------

def test_scalarize_constant_indexed_registers():
    out = Buffer("out", (4,), role="out")
    acc = Buffer("acc", (2,), scope="register")
    dyn = Buffer("dyn", (2,), scope="register")
    body = [acc.store(0, 0.0), acc.store(1, 1.0), acc.store(0, Load("out", (i,)), accumulate=True),
            dyn.store(i, 2.0), If(acc[1] < 0.5, (out.store(0, acc[0] + dyn[1]),))]
    k = scalarize_registers(kernel(body, [out], [acc, dyn]))
    assert [b.name for b in k.locals] == ["dyn"] and k.meta["scalarized_registers"] == ["acc"]
    assert k.body[:3] == (Assign("acc_0", Const(0.0)), Assign("acc_1", Const(1.0)),
                          Assign("acc_0", BinOp("+", Var("acc_0"), Load("out", (i,)))))
    assert k.body[3] == dyn.store(i, 2.0)
    assert k.body[4] == If(BinOp("<", Var("acc_1"), Const(0.5)),
                           (out.store(0, BinOp("+", Var("acc_0"), Load("dyn", (Const(1),)))),))


# --- flatten_buffers -----------------------------------------------------------------------------------

def test_flatten_buffers():
    x = Buffer("x", (3, 4, 5))
    out = Buffer("out", (3, 4), role="out")
    reg = Buffer("r", (2, 2), scope="register")
    body = [For("a", 3, (out.store((Var("a"), 2), x[Var("a"), 1, Var("c")] + reg[1, 0]),)),
            If(x[0, 0, 1] < 0.0, (out.store((0, 0), 0.0),))]
    k = flatten_buffers(kernel(body, [x, out], [reg]))
    assert [b.shape for b in k.params] == [(60,), (12,)] and k.locals == (reg,)
    assert k.meta["logical_shapes"] == {"x": (3, 4, 5), "out": (3, 4)}
    (store,) = k.body[0].body
    assert evaluate(store.index[0], {"a": 2}) == 2 * 4 + 2
    assert store.value.a.buf == "x" and evaluate(store.value.a.index[0], {"a": 2, "c": 3}) == 2 * 20 + 5 + 3
    assert store.value.b == reg[1, 0]  # register buffers keep their shape
    assert k.body[1].cond.a == Load("x", (Const(1),)) and k.body[1].body[0].index == (Const(0),)


# --- the CUDA pipeline on the real template ------------------------------------------------------------

CONFIGS = [None, TileConfig(BM=16, BN=8, BK=4, TM=2, TN=2), TileConfig(BM=8, BN=12, BK=4, TM=2, TN=3, stages=2),
           TileConfig(BM=32, BN=32, BK=8, TM=4, TN=4, split_k=3)]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_cuda_lowering_keeps_register_tiles_in_registers(direction, config):
    p = make_problem(direction, (2, 7, 9, 6), (10, 3, 3, 3), stride=(2, 1), padding=1, groups=2,
                     has_bias=direction == "fwd")
    config = config or default_config(p, "cuda", get_variant("implicit_gemm"))
    k = get_variant("implicit_gemm").build(p, config)
    registers = {b.name for b in k.locals if b.scope == "register"}
    assert {"acc", "a_frag", "b_frag"} <= registers
    lowered = lower(k, "cuda")
    assert not [b.name for b in lowered.locals if b.scope == "register"], "register buffers left as arrays"
    assert all(len(b.shape) == 1 for b in lowered.params + lowered.locals), "buffers not flattened"
    src = render_cuda(k)
    assert "cuda.local.array" not in src
    assert "acc_0_0" in src and f"acc_{config.TM - 1}_{config.TN - 1}" in src
    assert src.count("cuda.shared.array") == 2
    assert ("cuda.atomic.add" in src) == (config.split_k > 1)
    compile(src, "<generated>", "exec")


def test_cpu_lowering_keeps_register_arrays_and_loops():
    p = make_problem("fwd", (2, 7, 9, 6), (10, 3, 3, 3), padding=1, groups=2)
    k = lower(get_variant("implicit_gemm").build(p, TileConfig(BM=16, BN=8, BK=4, TM=2, TN=2)), "cpu")
    assert "acc" in {b.name for b in k.locals if b.scope == "register"}

    def bindings(stmts):
        for s in stmts:
            if isinstance(s, For):
                yield s.binding
                yield from bindings(s.body)
            elif isinstance(s, If):
                yield from bindings(s.body + s.orelse)
    assert "unroll" not in set(bindings(k.body))


def test_cse_never_names_an_expression_reading_a_written_buffer():
    """A register array reused for the next item (CPU target) changes between two identical loads:
    naming `r[0] * r[1]` once would reuse the first item's product (the Winograd staging bug)."""
    from kernelgen.passes import eliminate_common_subexpressions
    x = Buffer("x", (4,))
    y = Buffer("y", (2,), role="out")
    r = Buffer("r", (2,), scope="register")
    prod = (r[0] * r[1]) * 2.0
    body = [r.store(0, x[0]), r.store(1, x[1]), y.store(0, prod),
            r.store(0, x[2]), r.store(1, x[3]), y.store(1, prod)]
    out = eliminate_common_subexpressions(kernel(body, (x, y), (r,)))
    assert out.body == tuple(body)  # nothing named: the two products differ
    # reads of buffers nobody writes are still shared
    z = (x[0] * x[1]) * 2.0
    out = eliminate_common_subexpressions(kernel([y.store(0, z + 1.0), y.store(1, z + 2.0)], (x, y)))
    assert any(isinstance(s, Assign) for s in out.body)
