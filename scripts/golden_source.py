#!/usr/bin/env python
"""Golden rendered sources: the sha256 of the CUDA and CPU source of every variant x direction x precision over a
representative set of configs, against tests/ir/golden/rendered_sources.json ({case id: sha256}).

    python scripts/golden_source.py            # check every case, print the ids that changed (exit 1 if any)
    python scripts/golden_source.py --fast     # the fast subset only (what tests/ir/test_golden_source.py runs)
    python scripts/golden_source.py --update   # rewrite the digest file and the fast subset, print what changed
    python scripts/golden_source.py --times    # per-case render times, slowest first
    python scripts/golden_source.py --match winograd16 --times   # the cases whose id contains a text

Rendering is text generation only: each case builds its template's IR and prints it (render_cuda / render_cpu,
what kernelgen.api.Plan.render does), never compiles, and needs no GPU.  Cases:

* every entry of the shipped tuned databases (tuning/db/*.json): its problem, variant, config and precision;
* each variant's default config (templates.default_config; implicit_gemm_tc.default_config per precision) on a few
  layers of tuning/tables/*.json, in every direction the variant computes, float16 tensors for fp16;
* a few extra problems (bias + ReLU epilogue, groups, 1-D and 3-D, float64) and the untuned fp16 TMA tile;
* the cp.async pipelines (mma.sync and warpgroup MMAs), which no tuned entry runs;
* a few cases with a code setting flipped (SWITCHES, kernelgen.settings): KS-deconv-V2 (ks_deconv_trim), 16-state
  Winograd (winograd_16_states: the database's 16-state entries need it), the TMA k-loop's drain off
  (tma_drain_each_round) and 64-bit CUDA index math (index32).

Every other case renders with every code setting at its default, whatever the environment says.  Both backends
are rendered where the backend applies (the CPU has no split-K).  A case id reads
backend:variant:precision:problem key:config[+switch...].  The fast subset (tests/ir/golden/fast_cases.json, chosen
by --update) covers every facet of the whole set (Case.facets: each backend x variant x direction x precision, each
pipeline kind - TMA, warp-specialised TMA, cp.async, cp.async + wgmma, register double buffer, single stage - per
backend, direction and precision, each switch and schedule feature) with cases of short sources.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIGESTS = ROOT / "tests" / "ir" / "golden" / "rendered_sources.json"
FAST = ROOT / "tests" / "ir" / "golden" / "fast_cases.json"  # the fast subset's ids (written by --update)
DB_DIR = ROOT / "tuning" / "db"
TABLES_DIR = ROOT / "tuning" / "tables"

# label: (setting, flipped value).  Every setting that changes generated code (kernelgen.settings.CODE_SETTINGS)
# is scoped to its default for every case, then a case's switches flip theirs.
SWITCHES = {
    "trim": ("ks_deconv_trim", True),             # KS-deconv-V2
    "winograd16": ("winograd_16_states", True),   # 16-state Winograd
    "nodrain": ("tma_drain_each_round", False),   # MMAs in flight across a TMA k-loop's back edge
    "index64": ("index32", False),                # 64-bit CUDA index math
}

# the layers whose default configs are rendered (table, layer name): each kind of layer once
DEFAULT_LAYERS = (
    ("gpu_md", "r18_c64_32"),       # 3x3 stride 1 (Winograd 4 states)
    ("gpu_md", "r18_c128_s2"),      # 3x3 stride 2 (KS-deconv backward-data)
    ("gpu_md", "r18_down_1x1"),     # 1x1 stride 2
    ("gpu_md", "r50_stem_7x7"),     # 7x7 stride 2, 3 channels
    ("gpu_md", "r50_1x1_56"),       # 1x1 stride 1
    ("gpu_md", "r18_c512_4"),       # 4x4 images (ConvV2)
    ("gpu_md", "c5x5_28"),          # 5x5 (Winograd 8 states)
    ("gpu_md", "c7x7_28"),          # 7x7 stride 1
    ("gpu_md", "dil2_56"),          # dilation 2 (Sk-dilated)
    ("gpu_md", "deconv_s2_28"),     # a transposed convolution
    ("cks", "deconv5_s2_28"),       # a 5x5 transposed convolution
    ("winograd", "c9x9_28"),        # 9x9
    ("resnet18_cifar", "stem"),     # 3 channels, 3x3
)
DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")


@dataclass(frozen=True)
class Case:
    problem: object
    variant: str
    config: object
    precision: str
    backend: str
    switches: tuple = ()
    source: str = field(default="", compare=False)  # where the case comes from (db, default, extra)

    @property
    def id(self):
        flags = "".join(f"+{s}" for s in sorted(self.switches))
        return f"{self.backend}:{self.variant}:{self.precision}:{self.problem.key()}:{self.config}{flags}"

    @property
    def pipeline(self):
        c = self.config
        if not hasattr(c, "tma"):  # a DepthwiseConfig: the direct depthwise template has no GEMM pipeline
            return "direct"
        if c.tma:
            return "tma_warp_specialised" if c.tma == 2 else "tma"
        if c.async_copy:
            return "cp_async_wgmma" if c.wgmma else "cp_async"
        return "register_double_buffer" if c.stages > 1 else "single_stage"

    def facets(self):
        """What the fast subset must cover: each (backend, variant, direction, precision), each pipeline kind per
        backend, direction and precision, each switch and schedule feature per backend."""
        c, p, be = self.config, self.problem, self.backend
        out = {("variant", be, self.variant, p.direction, self.precision),
               ("pipeline", be, p.direction, self.precision, self.pipeline)}
        out |= {("switch", be, s) for s in self.switches}
        knob = lambda name, default=0: getattr(c, name, default)  # noqa: E731 (DepthwiseConfig has fewer knobs)
        features = {"split_k": c.split_k > 1, "b_mn": bool(knob("b_mn")), "state_groups": knob("state_groups", 1) > 1,
                    f"states{knob('states')}": bool(knob("states")), f"swizzle{knob('swizzle')}": bool(knob("swizzle")),
                    "min_blocks": knob("min_blocks") > 0, "epilogue": p.has_bias or bool(p.activation),
                    "groups": p.groups > 1, f"ndim{p.ndim}": True, p.dtype: True}
        out |= {("feature", be, f) for f, on in features.items() if on}
        return out


# --- the cases --------------------------------------------------------------------------------------------------

def _db_entries():
    from kernelgen.tuning import database
    for path in sorted(DB_DIR.glob("*.json")):
        for key, e in sorted(database.load(path).items()):
            yield database._problem_of(e), e["variant"], database.config_from(e), database.precision_of(e)


def _layers():
    from kernelgen.tuning.shapes import load_table
    tables = {}
    for table, name in DEFAULT_LAYERS:
        if table not in tables:
            tables[table] = {layer.name: layer for layer in load_table(TABLES_DIR / f"{table}.json")[1]}
        yield tables[table][name]


def _backends(config):
    return ("cuda",) if config.split_k > 1 else ("cuda", "cpu")  # the CPU target has no atomic adds


def _needs(variant, config):
    """Switches a config cannot render without (the database's 16-state Winograd entries)."""
    return ("winograd16",) if variant == "winograd" and config.states == 16 else ()


def _defaults(problem, backends=("cuda", "cpu")):
    """(variant, config, precision, backend) of every variant's default config on the problem."""
    from kernelgen.templates import TENSOR_CORE_VARIANTS, VARIANTS, computes, default_config
    from kernelgen.templates import implicit_gemm_tc
    for name, variant in VARIANTS.items():
        if computes(variant, problem) and problem.dtype != "float16":  # float16 tensors: precision fp16 only
            for backend in backends:
                yield name, default_config(problem, backend, variant), "fp32", backend
    for name, variant in TENSOR_CORE_VARIANTS.items():
        if not computes(variant, problem):
            continue
        for precision in variant.precisions:
            if (problem.dtype == "float16") != (precision == "fp16"):
                continue  # float16 tensors compute at fp16 (and fp16 is run on them: storage_dtype)
            for backend in backends:
                cfg = implicit_gemm_tc.default_config(problem, backend, precision)
                if backend in _backends(cfg):
                    yield name, cfg, precision, backend


def _extra_problems():
    from kernelgen.problem import make_problem
    yield make_problem("fwd", (8, 12, 12, 32), (48, 3, 3, 32), padding=1, has_bias=True, activation="relu")
    for d in DIRECTIONS:
        yield make_problem(d, (8, 12, 12, 32), (64, 3, 3, 16), padding=1, groups=2)
        yield make_problem(d, (4, 40, 24), (32, 5, 24), padding=2)                            # 1-D
        yield make_problem(d, (2, 6, 8, 8, 16), (32, 3, 3, 3, 16), padding=1, stride=(1, 2, 2))  # 3-D
        yield make_problem(d, (4, 10, 10, 16), (16, 3, 3, 16), padding=1, dtype="float64")


def _depthwise_cases():
    """The direct depthwise template (groups == C) at each of its precisions, both backends, its default configs:
    a strided 3x3 layer with a channel multiplier of 2 in every direction, and a forward pass with bias and ReLU."""
    from kernelgen.problem import make_problem
    from kernelgen.target import as_target
    from kernelgen.templates import depthwise
    variant = depthwise.VARIANT
    problems = [make_problem(d, (2, 10, 10, 24), (48, 3, 3, 1), padding=1, stride=2, groups=24, dtype=dtype)
                for d in DIRECTIONS for dtype in ("float32", "float16")]
    problems.append(make_problem("fwd", (2, 9, 9, 40), (40, 5, 5, 1), padding=2, groups=40, has_bias=True,
                                 activation="relu"))
    for problem in problems:
        for precision in variant.precisions:
            if (problem.dtype == "float16") != (precision == "fp16") or not variant.applies(problem, precision):
                continue
            for backend in ("cuda", "cpu"):
                cfg = variant.default_config(problem, as_target(backend), precision)
                if backend in _backends(cfg):
                    yield Case(problem, variant.name, cfg, precision, backend, (), "depthwise")


def _pipeline_cases():
    """The cp.async pipelines (no tuned entry runs them): mma.sync tiles fed by cp.async (tf32, bf16), and TF32
    warpgroup MMAs fed by cp.async, on one layer in each direction."""
    from kernelgen.templates import implicit_gemm_tc
    from kernelgen.templates.config import TileConfig
    from kernelgen.tuning.shapes import load_table
    layer = {layer.name: layer for layer in load_table(TABLES_DIR / "gpu_md.json")[1]}["r18_c64_32"]
    configs = (TileConfig(128, 64, 16, WM=64, WN=32, stages=3, swizzle=1, async_copy=1),
               TileConfig(128, 64, 32, WM=64, WN=64, stages=4, async_copy=1, wgmma=1))
    for d in DIRECTIONS:
        for cfg in configs:
            for precision in ("tf32", "bf16"):
                if implicit_gemm_tc.accepts(cfg, precision):
                    for be in ("cuda", "cpu"):
                        yield Case(layer.problem(d), "implicit_gemm_tc", cfg, precision, be, (), "pipeline")


def _switch_cases():
    from kernelgen.problem import make_problem
    from kernelgen.templates.config import TileConfig
    from kernelgen.tuning.shapes import load_table
    deconv = {layer.name: layer for layer in load_table(TABLES_DIR / "gpu_md.json")[1]}["deconv_s2_28"]
    p = deconv.problem("fwd")  # a transposed convolution's forward pass: backward-data, stride 2
    for be in ("cuda", "cpu"):
        yield Case(p, "ks_deconv", TileConfig(32, 64, 8, 4, 4), "fp32", be, ("trim",), "switch")
    # 16-state Winograd by default_config (7x7 picks 16 states when allowed)
    c7 = make_problem("fwd", (8, 28, 28, 32), (32, 7, 7, 32), padding=3)
    for be in ("cuda", "cpu"):
        yield Case(c7, "winograd", None, "fp32", be, ("winograd16",), "switch")
    # the smallest 16-state tiles, with and without state groups (the database's 16-state tiles render slowly)
    for d in ("fwd", "bwd_data"):
        p7 = c7.with_direction(d)
        for groups in (1, 2):
            for be in ("cuda", "cpu"):
                yield Case(p7, "winograd", TileConfig(16, 16, 8, 2, 2, smem_pad=4, states=16, state_groups=groups),
                           "fp32", be, ("winograd16",), "switch")
    # a TMA k-loop of 3 stages whose MMAs stay in flight across the back edge
    r = make_problem("fwd", (8, 16, 16, 64), (64, 3, 3, 64), padding=1, dtype="float16")
    tma = TileConfig(128, 64, 64, WM=64, WN=64, stages=3, wgmma=1, tma=1)
    for be in ("cuda", "cpu"):
        yield Case(r, "implicit_gemm_tc", tma, "fp16", be, ("nodrain",), "switch")
    yield Case(r, "implicit_gemm_tc", tma, "fp16", "cuda", ("index64",), "switch")
    f32 = make_problem("bwd_data", (8, 16, 16, 32), (32, 3, 3, 32), padding=1)
    yield Case(f32, "implicit_gemm", TileConfig(64, 64, 8, 4, 4, stages=2, smem_pad=4), "fp32", "cuda", ("index64",),
               "switch")


def all_cases():
    """Every case, in a fixed order, ids unique (the first of equal ids kept); chosen under the default settings."""
    with switched():
        return _all_cases()


def _all_cases():
    from kernelgen.templates import default_config, get_variant
    from kernelgen.templates.implicit_gemm_tc import untuned_tma_config
    out = {}

    def add(case):
        if case.config is None:  # a switch case's default config, chosen with its switches set
            with switched(case.switches):
                case = Case(case.problem, case.variant, default_config(case.problem, case.backend,
                                                                       get_variant(case.variant)),
                            case.precision, case.backend, case.switches, case.source)
        out.setdefault(case.id, case)

    for problem, variant, config, precision in _db_entries():
        for be in _backends(config):
            add(Case(problem, variant, config, precision, be, _needs(variant, config), "db"))
    problems = []
    for layer in _layers():
        problems += [layer.problem(d, dtype) for d in DIRECTIONS for dtype in ("float32", "float16")]
    problems += list(_extra_problems())
    for problem in problems:
        for variant, config, precision, be in _defaults(problem):
            add(Case(problem, variant, config, precision, be, (), "default"))
        tma = untuned_tma_config(problem, "fp16") if problem.dtype == "float16" else None
        if tma is not None:
            for be in _backends(tma):
                add(Case(problem, "implicit_gemm_tc", tma, "fp16", be, (), "untuned_tma"))
    for case in (*_depthwise_cases(), *_pipeline_cases(), *_switch_cases()):
        add(case)
    return list(out.values())


def select_fast(cases, lengths):
    """The fast subset: every facet of the whole set covered, cheaply (greedy weighted set cover: the case covering
    the most facets not yet covered per byte of source, render time growing with it)."""
    facets = {c.id: c.facets() for c in cases}
    left = set().union(*facets.values())
    chosen = []
    while left:
        best = max(cases, key=lambda c: (len(facets[c.id] & left) / max(lengths[c.id], 1), c.id))
        chosen.append(best.id)
        left -= facets[best.id]
    return sorted(chosen)


def fast_ids(path=FAST):
    return json.loads(Path(path).read_text()) if Path(path).exists() else []


# --- rendering --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def switched(labels=()):
    """Every setting that changes generated code at its default, or flipped where `labels` names it (in this thread
    only: kernelgen.settings.scope), whatever the environment or the process settings say."""
    from kernelgen import settings
    values = {s.name: s.default for s in settings.CODE_SETTINGS}
    for label in labels:
        name, value = SWITCHES[label]
        values[name] = value
    with settings.scope(**values):
        yield


def render(case: Case) -> str:
    """The case's source, as kernelgen.api.Plan(problem, variant, config, backend, precision).render() prints it."""
    from kernelgen.render_cpu import render_cpu
    from kernelgen.render_cuda import render_cuda
    from kernelgen.templates import get_variant
    with switched(case.switches):
        variant = get_variant(case.variant)
        if case.precision != "fp32":
            kernel = variant.build(case.problem, case.config, case.precision)
        else:
            kernel = variant.build(case.problem, case.config)
        return render_cuda(kernel) if case.backend == "cuda" else render_cpu(kernel)


def compute(cases, progress=False, times=None, lengths=None):
    """{case id: sha256 of its source}; a case that fails to render digests as 'error: ...' (so it shows as
    changed).  times, lengths: dicts to fill with each case's render time and source length."""
    out = {}
    for i, case in enumerate(cases):
        t = time.perf_counter()
        try:
            source = render(case)
            out[case.id] = hashlib.sha256(source.encode()).hexdigest()
        except Exception as e:  # noqa: BLE001 - reported as the case's digest
            source, out[case.id] = "", f"error: {type(e).__name__}: {e}"
        if times is not None:
            times[case.id] = time.perf_counter() - t
        if lengths is not None:
            lengths[case.id] = len(source)
        if progress:
            print(f"\r{i + 1}/{len(cases)}", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return out


def load_digests(path=DIGESTS) -> dict:
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}


def differences(got: dict, want: dict, complete=True):
    """(changed, new, missing) case ids of `got` against `want`; missing only when `got` is the complete set."""
    changed = sorted(k for k in got if k in want and got[k] != want[k])
    new = sorted(k for k in got if k not in want)
    missing = sorted(k for k in want if k not in got) if complete else []
    return changed, new, missing


def describe(changed, new, missing, got=None):
    lines = []
    for title, ids in (("changed", changed), ("new", new), ("missing (no longer a case)", missing)):
        if ids:
            lines.append(f"{len(ids)} {title}:")
            lines += [f"  {i}" + (f"  [{got[i]}]" if got and got.get(i, "").startswith("error") else "")
                      for i in ids]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--update", action="store_true", help="rewrite the digest file and the fast subset (every case)")
    ap.add_argument("--fast", action="store_true", help="check the fast subset only")
    ap.add_argument("--times", action="store_true", help="print the render time of each case, slowest first")
    ap.add_argument("--list", action="store_true", help="list the case ids (fast ones marked *) and exit")
    ap.add_argument("--match", default="", help="only the cases whose id contains this text")
    args = ap.parse_args(argv)
    cases = all_cases()
    fast = set(fast_ids())
    if args.list:
        for c in cases:
            print(("* " if c.id in fast else "  ") + c.id)
        print(f"{len(cases)} cases, {len(fast)} fast")
        return 0
    run = cases if args.update else [c for c in cases if (c.id in fast or not args.fast) and args.match in c.id]
    times, lengths = {}, {}
    t = time.perf_counter()
    got = compute(run, progress=sys.stderr.isatty(), times=times, lengths=lengths)
    elapsed = time.perf_counter() - t
    want = load_digests()
    changed, new, missing = differences(got, want, complete=len(run) == len(cases))
    if args.times:
        for cid, s in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"{s:8.3f} s  {cid}")
    print(f"{len(run)} cases rendered in {elapsed:.1f} s")
    report = describe(changed, new, missing, got)
    if args.update:
        errors = sorted(k for k, v in got.items() if v.startswith("error"))
        if errors:
            print(describe(errors, [], [], got))
            print("not updated: some cases fail to render")
            return 1
        DIGESTS.parent.mkdir(parents=True, exist_ok=True)
        DIGESTS.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        chosen = select_fast(cases, lengths)
        FAST.write_text(json.dumps(chosen, indent=1) + "\n")
        print(report or "no case changed")
        print(f"wrote {DIGESTS.relative_to(ROOT)} ({len(got)} cases) and {FAST.relative_to(ROOT)} "
              f"({len(chosen)} fast cases, {sum(times[i] for i in chosen):.1f} s of rendering here)")
        return 0
    print(report or "every case matches")
    return 1 if changed or new or missing else 0


if __name__ == "__main__":
    sys.exit(main())
