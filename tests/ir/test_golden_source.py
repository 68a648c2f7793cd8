"""Golden rendered sources: the CUDA and CPU source of every variant x direction x precision over a representative set
of configs (scripts/golden_source.py says which) hashes to what tests/ir/golden/rendered_sources.json recorded, so a
refactor of the templates, the passes or the renderers that changes a kernel's text is caught, and the ids of the
cases it changed are reported.  Rendering only builds IR and prints it: nothing is compiled, no GPU is needed.

After an intended change of the generated code: `python scripts/golden_source.py --update` (it prints the ids that
changed; the diff of the digest file shows them too).  The fast subset (tests/ir/golden/fast_cases.json: every facet
of the whole set covered) always runs; the whole set is marked slow (KERNELGEN_SLOW_TESTS=1 or -m slow).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "golden_source.py"
PIPELINES = {"tma", "tma_warp_specialised", "cp_async", "cp_async_wgmma", "register_double_buffer", "single_stage"}


def _load_script():
    spec = importlib.util.spec_from_file_location("golden_source", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("golden_source", module)
    spec.loader.exec_module(module)
    return module


golden = _load_script()


@pytest.fixture(scope="module")
def cases():
    return golden.all_cases()


def _check(run):
    want = golden.load_digests()
    got = golden.compute(run)
    changed, new, _ = golden.differences(got, want, complete=False)
    assert not changed and not new, (
        f"rendered sources differ from tests/ir/golden/rendered_sources.json in {len(changed) + len(new)} of "
        f"{len(run)} cases:\n{golden.describe(changed, new, [], got)}\n"
        "if the change is intended: python scripts/golden_source.py --update")


def test_digest_file_lists_every_case(cases):
    ids = {c.id for c in cases}
    want = golden.load_digests()
    missing, stale = sorted(ids - set(want)), sorted(set(want) - ids)
    assert not missing and not stale, (f"the digest file is out of date (python scripts/golden_source.py --update):\n"
                                       f"{golden.describe([], missing, stale)}")
    fast = set(golden.fast_ids())
    assert fast <= ids, sorted(fast - ids)
    covered = set().union(*(c.facets() for c in cases if c.id in fast))
    assert covered == set().union(*(c.facets() for c in cases)), \
        "the fast subset misses a facet of the whole set: python scripts/golden_source.py --update"


def test_fast_subset_covers_every_variant_direction_precision_and_pipeline(cases):
    from kernelgen.templates import TENSOR_CORE_VARIANTS, VARIANTS
    fast = [c for c in cases if c.id in set(golden.fast_ids())]
    seen = {(c.backend, c.variant, c.problem.direction, c.precision) for c in fast}
    for backend in ("cuda", "cpu"):
        for name, variant in {**VARIANTS, **TENSOR_CORE_VARIANTS}.items():
            for direction in variant.directions:
                for precision in variant.precisions:
                    assert (backend, name, direction, precision) in seen, (backend, name, direction, precision)
    for backend in ("cuda", "cpu"):
        assert {c.pipeline for c in fast if c.backend == backend} >= PIPELINES
    assert {s for c in fast for s in c.switches} == set(golden.SWITCHES)


def test_fast_cases_render_as_recorded(cases):
    fast = set(golden.fast_ids())
    _check([c for c in cases if c.id in fast])


@pytest.mark.slow
def test_every_case_renders_as_recorded(cases):
    _check(cases)


# --- the passes need no deep stack -----------------------------------------------------------------------------------

def _deep_kernel(depth=3000, nest=200):
    """A kernel no template builds: a 3000-deep expression stored twice (so the CSE names it), a 300-term condition,
    inside 200 nested loops and branches."""
    from kernelgen.ir import Assign, Buffer, Const, For, If, Kernel, Load, Store, Var
    i, m = Var("i"), Var("m")
    e = Load("x", (m % 64,))
    for k in range(depth):
        e = (e + Const(1.0)) * Var("v") if k % 2 else e + Load("x", ((m + k) % 64,))
    cond = i < 64
    for k in range(depth // 10):
        cond = cond & (i + k < 100)
    body = (Assign("m", i * 2), Assign("v", Load("x", (Const(3),))), Store("y", (m % 64,), e),
            Store("y", ((m + 1) % 64,), e))
    for k in range(nest):
        body = (If(cond, body) if k % 2 else For(f"l{k}", 2, body, "serial"),)
    return Kernel("deep", (Buffer("x", (64,)), Buffer("y", (64,), role="out")), (), (For("i", 64, body, "grid"),),
                  (64,), 1)


def test_passes_need_no_deep_stack(cases):
    """Every pass walks the IR iteratively: lowering a 3000-deep expression under 200 nested statements, and rendering
    the heaviest golden cases, fit Python's default recursion limit (the session raises it for numba-cuda's own
    recursive CFG walk: runtime.launch)."""
    from kernelgen.ir import Assign, For, If, Store, Var
    from kernelgen.passes import lower
    heavy = [c for c in cases if c.id in set(golden.fast_ids()) and "winograd16" in c.switches and c.backend == "cuda"]
    kernel = _deep_kernel()
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    try:
        lowered = {target: lower(kernel, target) for target in ("cuda", "cpu")}
        got = golden.compute(heavy)
    except RecursionError as e:  # no traceback: its frames hold expressions thousands of levels deep
        pytest.fail(f"a pass needs a deeper stack than Python's default: {e}", pytrace=False)
    finally:
        sys.setrecursionlimit(limit)
    for k in lowered.values():
        body = k.body
        while len(body) == 1 and isinstance(body[0], (For, If)):
            body = body[0].body
        stores = [s for s in body if isinstance(s, Store)]
        assert len(stores) == 2 and all(isinstance(s.value, Var) for s in stores), "the deep expression is not named"
        assert stores[0].value == stores[1].value
        assert [s for s in body if isinstance(s, Assign) and s.var == stores[0].value.name]
    want = golden.load_digests()
    assert heavy and all(got[c.id] == want[c.id] for c in heavy), golden.describe(
        [c.id for c in heavy if got[c.id] != want[c.id]], [], [], got)
