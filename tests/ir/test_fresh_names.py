"""kernelgen.fresh_names: renaming straight-line re-assignments keeps what a function computes (random programs with
loops, branches, jumps, augmented and tuple assignments, run both ways), renames what scripts/compile_time.py's
measured prototype renamed, keeps loop-carried names, comments and layout, and render_cuda applies it to CUDA
source only (the same module up to names otherwise)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np

from kernelgen import planner
from kernelgen.fresh_names import fresh_names
from kernelgen.problem import make_problem
from kernelgen.render_cpu import render_cpu
from kernelgen.render_cuda import render_cuda

HARNESS = Path(__file__).resolve().parents[2] / "scripts" / "compile_time.py"
NAMES = ("a", "b", "c")


def _expr(rng):
    return " + ".join(f"{rng.choice(NAMES)} * {int(rng.integers(1, 4))}" for _ in range(int(rng.integers(1, 3))))


def _suite(rng, depth, indent, in_loop):
    lines = []
    for _ in range(int(rng.integers(1, 7))):
        kind = rng.choice(["assign"] * 5 + ["aug", "tuple", "if", "for", "jump"])
        pad = "    " * indent
        if kind == "assign":
            lines.append(f"{pad}{rng.choice(NAMES)} = ({_expr(rng)}) % 97")
        elif kind == "aug":
            lines.append(f"{pad}{rng.choice(NAMES)} += 1")
        elif kind == "tuple":
            lines.append(f"{pad}{rng.choice(NAMES)}, {rng.choice(NAMES)} = {_expr(rng)}, {_expr(rng)}")
        elif kind == "jump" and in_loop:
            lines.append(f"{pad}if {rng.choice(NAMES)} % 3 == 0:\n{pad}    {rng.choice(['break', 'continue'])}")
        elif kind == "if" and depth:
            lines.append(f"{pad}if {rng.choice(NAMES)} % 2:")
            lines += _suite(rng, depth - 1, indent + 1, in_loop)
            lines.append(f"{pad}else:")
            lines += _suite(rng, depth - 1, indent + 1, in_loop)
        elif kind == "for" and depth:
            lines.append(f"{pad}for i in range({int(rng.integers(0, 4))}):")
            lines += _suite(rng, depth - 1, indent + 1, True)
    return lines or [f"{'    ' * indent}{rng.choice(NAMES)} = 1"]  # (no statement came out: a suite needs one)


def _program(rng):
    body = _suite(rng, 2, 1, False)
    return "def f(a, b):\n    c = 5\n" + "\n".join(body) + "\n    return a, b, c\n"


def _run(source, args):
    space = {}
    exec(compile(source, "<generated>", "exec"), space)
    return space["f"](*args)


def test_random_programs_compute_the_same(rng):
    renamed = 0
    for _ in range(400):
        source = _program(rng)
        fresh = fresh_names(source)
        renamed += fresh != source
        for args in ((1, 2), (3, 7), (10, 0)):
            assert _run(fresh, args) == _run(source, args), f"{source}\n---\n{fresh}"
        assert fresh_names(fresh) == fresh  # nothing left to rename
    assert renamed > 100  # the programs exercise the renaming


def test_loop_carried_and_later_names_kept_comments_survive():
    source = ("def k(x, y):\n"
              "    acc = 0.0  # the accumulator\n"
              "    for i in range(4):\n"
              "        t = x[i]\n"
              "        acc = acc + t\n"
              "        t = y[i]  # again\n"
              "        acc = acc + t\n"
              "    t = acc\n"
              "    return t\n")
    fresh = fresh_names(source)
    assert fresh == ("def k(x, y):\n"
                     "    acc = 0.0  # the accumulator\n"
                     "    for i in range(4):\n"
                     "        t__v1 = x[i]\n"
                     "        acc__v2 = acc + t__v1\n"
                     "        t = y[i]  # again\n"
                     "        acc = acc__v2 + t\n"
                     "    t = acc\n"
                     "    return t\n")


PROTOTYPE = ("_stores", "_jumps", "_rename_loads", "_single_assignment", "_transform_ast", "_fresh_names_prototype")


def _prototype():
    """The harness's prototype functions alone (the harness imports numba.cuda's compiler, which numba's simulator,
    that this session may run, lacks)."""
    tree = ast.parse(HARNESS.read_text())
    tree.body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in PROTOTYPE]
    assert len(tree.body) == len(PROTOTYPE)
    space = {"ast": ast}
    exec(compile(tree, str(HARNESS), "exec"), space)
    return space["_fresh_names_prototype"]


def _numbered(source):
    """The source as ast.unparse prints it, fresh names numbered by first appearance (the two number apart)."""
    seen = {}
    text = ast.unparse(ast.parse(source))
    return re.sub(r"\b\w+__v\d+\b", lambda m: seen.setdefault(m.group(0), f"_fresh{len(seen)}"), text)


def test_render_cuda_renames_as_measured_cpu_unchanged():
    """A generated CUDA kernel: the renderer's names are the prototype's (what was measured: -14 % compile time,
    identical PTX), the module is the unrenamed one up to names, and the CPU source has no fresh names."""
    problem = make_problem("fwd", (2, 8, 8, 16), (16, 3, 3, 16), padding=1)
    kernel = planner.make_plan(problem, "cuda", algo="implicit_gemm", precision="fp32").kernel_ir()
    fresh, plain = render_cuda(kernel, cache=False), render_cuda(kernel, cache=False, fresh=False)
    assert "__v" in fresh and "__v" not in plain and fresh.count("\n") == plain.count("\n")
    assert _numbered(fresh) == _numbered(_prototype()(plain))
    assert re.sub(r"__v\d+\b", "", fresh) == plain  # only names changed
    cpu_kernel = planner.make_plan(problem, "cpu", precision="fp32").kernel_ir()
    assert "__v" not in render_cpu(cpu_kernel)


def test_fresh_names_of_taken_names_skipped():
    source = "def f(a):\n    a__v1 = 1\n    a = a__v1\n    a = a + 1\n    return a\n"
    assert fresh_names(source) == "def f(a):\n    a__v1 = 1\n    a__v2 = a__v1\n    a = a__v2 + 1\n    return a\n"
    assert _run(fresh_names(source), (0,)) == 2 and np.isscalar(_run(source, (0,)))
