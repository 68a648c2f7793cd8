"""kernelgen's import graph is one-way: no import cycle among its modules, and kernelgen's own modules imported at
the top of a file, never inside a function, except where an optional dependency's import cost or absence is the
reason (LOCAL_IMPORTS says which and why).

The graph is read from the source with ast, so it holds wherever pytest runs; `lint-imports` (the contracts in
pyproject.toml, run by .ci/run) checks the layers on top of it.  Files live where the package maps them:
kernelgen/ is kernelgen, templates/ kernelgen.templates, runtime/ kernelgen.runtime, tuning/ kernelgen.tuning.
An import names the module it imports: `from kernelgen.nn import functional` is an edge to kernelgen.nn.functional,
`from kernelgen import __version__` one to the root package (kernelgen/__init__.py).
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {"kernelgen": "kernelgen", "templates": "kernelgen.templates", "runtime": "kernelgen.runtime",
                "tuning": "kernelgen.tuning"}

# Function-local imports of kernelgen modules that stay: (importing module, imported module) -> the reason
LOCAL_IMPORTS = {
    ("kernelgen.nn.tensor", "kernelgen.nn.cuda_ops"):
        "the device kernels import numba.cuda (about 0.5 s, and numba-cuda is optional): a host-only "
        "`import kernelgen.nn` must not pay for it",
    ("kernelgen.runtime.tensor_map", "kernelgen._cuda_tma_intrinsics"):
        "the TMA intrinsics import numba.cuda; only the on-GPU map check (copy_kernel) needs them",
    ("kernelgen.runtime.narrow", "kernelgen.cuda_memory"):
        "the device intrinsics import numba.cuda; only the bfloat16 narrowing kernel, made on first use, needs them",
}

# Edges left out of the cycle check, as pyproject.toml's contracts ignore them: (importer, imported) -> the reason
IGNORED_EDGES: dict = {}


def module_files(root=ROOT):
    """{module name: (path, is a package __init__)} for every .py file of the package."""
    modules = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if "__pycache__" in parts or (folder == "kernelgen" and parts[0] in PACKAGE_DIRS):
                continue
            is_package = parts[-1] == "__init__"
            modules[".".join([package] + parts[:-1 if is_package else None])] = (path, is_package)
    return modules


def _imports(tree):
    """(Import / ImportFrom node, inside a function?) for every import of a module's tree, in one walk."""
    found, stack = [], [(tree, False)]
    while stack:
        node, local = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append((node, local))
        local = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        stack.extend((child, local) for child in ast.iter_child_nodes(node))
    return found


def _imported(node, package, modules):
    """The kernelgen modules an Import / ImportFrom node names (a name that is no module: its module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = package.split(".")[:len(package.split(".")) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        names = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
    found = []
    for name in names:
        while name not in modules and "." in name:
            name = name.rpartition(".")[0]
        if name in modules:
            found.append(name)
    return found


def import_graph(modules):
    """[(importer, imported, line, function-local)] for every import of a kernelgen module by one."""
    edges = []
    for name, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if is_package else name.rpartition(".")[0]
        for node, local in _imports(tree):
            edges.extend((name, target, node.lineno, local)
                         for target in _imported(node, package, modules) if target != name)
    return edges


def find_cycles(edges):
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    succ = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for start in succ:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


@pytest.fixture(scope="module")
def graph():
    modules = module_files()
    return modules, import_graph(modules)


def test_the_graph_covers_every_package(graph):
    modules, edges = graph
    for name in ("kernelgen", "kernelgen.ir", "kernelgen.nn.tensor", "kernelgen.templates.tiled_gemm",
                 "kernelgen.runtime.cache", "kernelgen.tuning.tuner"):
        assert name in modules, name
    pairs = {(a, b) for a, b, _, _ in edges}
    assert ("kernelgen.ir", "kernelgen.ir_base") in pairs and ("kernelgen.nn.functional", "kernelgen.api") in pairs


def test_no_function_local_imports_of_kernelgen_modules(graph):
    """Each left is in LOCAL_IMPORTS with its reason."""
    _, edges = graph
    found = {(a, b): line for a, b, line, local in edges if local}
    unexplained = sorted(f"{a} (line {line}) imports {b} inside a function" for (a, b), line in found.items()
                         if (a, b) not in LOCAL_IMPORTS)
    assert not unexplained, "\n".join(unexplained)
    stale = sorted(set(LOCAL_IMPORTS) - set(found))
    assert not stale, f"LOCAL_IMPORTS entries with no such import left: {stale}"


def test_no_import_cycles(graph):
    _, edges = graph
    counted = [(a, b) for a, b, _, _ in edges if (a, b) not in IGNORED_EDGES]
    cycles = find_cycles(counted)
    report = []
    for component in cycles:
        inside = set(component)
        report.append(" ".join(component) + ":\n" + "\n".join(
            f"    {a} -> {b} (line {line}{', in a function' if local else ''})"
            for a, b, line, local in edges if a in inside and b in inside))
    assert not cycles, "import cycles:\n" + "\n".join(report)


def test_the_checks_see_what_they_forbid(tmp_path):
    """The graph reader on a made-up package: a cycle through a function-local relative import is found."""
    (tmp_path / "kernelgen" / "sub").mkdir(parents=True)
    for folder in ("templates", "runtime", "tuning"):
        (tmp_path / folder).mkdir()
    (tmp_path / "kernelgen" / "__init__.py").write_text("")
    (tmp_path / "kernelgen" / "sub" / "__init__.py").write_text("")
    (tmp_path / "kernelgen" / "sub" / "a.py").write_text("from kernelgen.sub.b import f\n")
    (tmp_path / "kernelgen" / "sub" / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    modules = module_files(tmp_path)
    edges = import_graph(modules)
    assert ("kernelgen.sub.a", "kernelgen.sub.b", 1, False) in edges
    assert ("kernelgen.sub.b", "kernelgen.sub.a", 2, True) in edges
    assert find_cycles([(a, b) for a, b, _, _ in edges]) == [["kernelgen.sub.a", "kernelgen.sub.b"]]


def test_every_core_module_is_placed_in_the_layers_contract():
    """pyproject's layers contract is exhaustive: a new module of kernelgen/ left out of it breaks lint-imports in CI
    (after the whole test run). This says so at once, wherever pytest runs."""
    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c for c in config["contracts"] if c["id"] == "layers"]
    placed = {name.strip().strip("()") for layer in layers["layers"] for name in layer.split("|")}
    ignored = set(layers.get("exhaustive_ignores", ()))
    modules = {p.stem for p in (root / "kernelgen").glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in (root / "kernelgen").glob("*/__init__.py")}
    assert modules - placed - ignored == set(), "place these modules in pyproject's layers contract"
