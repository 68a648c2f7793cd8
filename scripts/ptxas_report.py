"""Registers, spills and local memory of generated CUDA kernels, without a GPU.

Renders each problem's kernel (default config of the chosen variant, or --config), compiles it to
sm_90 PTX with numba (NVVM, no device needed) and runs `ptxas -arch=sm_90 -v` on it.

    python scripts/ptxas_report.py                         # winograd table, fwd + bwd_data, winograd
    python scripts/ptxas_report.py --algo implicit_gemm    # same shapes, another variant
    python scripts/ptxas_report.py --table gpu_md --directions fwd --json out.json

Exit status 1 when any kernel uses local memory (stack frame) or spills.  The 16-state kernels are
enabled (the winograd_16_states setting) so that the table's 9x9 layer is checked too.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # compile for real: the simulator has no PTX
# numba asks NVRTC for the closest supported arch unless the CC is forced; a toolkit with NVVM and
# ptxas but no NVRTC (this build machine) is enough then.
os.environ.setdefault("NUMBA_FORCE_CUDA_CC", "9.0")
if os.path.isdir("/usr/local/cuda"):
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")


def _no_nvrtc_needed():
    """numba looks NVRTC up next to NVVM and libdevice; only NVVM is used to make PTX."""
    from numba.cuda import cuda_paths
    try:
        cuda_paths._get_nvrtc_path()
    except Exception:
        cuda_paths._get_nvrtc_path = lambda: cuda_paths._env_path_tuple("unavailable", None)


def _ptx(source, name, dtype="float32", launch_bounds=None):
    from numba import cuda, float32, float64
    from kernelgen.runtime.driver import allow_deep_cfg_walks
    _no_nvrtc_needed()
    allow_deep_cfg_walks()
    path = os.path.join(tempfile.mkdtemp(prefix="kg_ptx_"), f"{name}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ty = float64 if dtype == "float64" else float32
    ptx, _ = cuda.compile_ptx(mod.KERNEL.py_func, tuple(ty[::1] for _ in mod.PARAMS), cc=(9, 0),
                              launch_bounds=launch_bounds)  # py_func drops the decorator's bounds
    return ptx


def ptxas_info(ptx, maxrreg=None):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    cap = [f"-maxrregcount={maxrreg}"] if maxrreg else []
    out = subprocess.run(["ptxas", "-arch=sm_90", "-v", *cap, f.name, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, out)) else 0
    return {"registers": num(r"Used (\d+) registers"), "local_bytes": num(r"(\d+) bytes stack frame"),
            "spill_stores": num(r"(\d+) bytes spill stores"), "spill_loads": num(r"(\d+) bytes spill loads"),
            "smem_bytes": num(r"(\d+) bytes smem")}


def check(problems, algo="winograd", config=None, maxrreg=None):
    """problems: (direction, x_shape, w_shape, padding) tuples or ConvProblems -> one row each."""
    from kernelgen.api import make_plan
    from kernelgen.problem import make_problem
    from kernelgen.render_cuda import render_cuda
    from kernelgen import settings
    settings.set("winograd_16_states", True)
    rows = []
    for spec in problems:
        p = spec if not isinstance(spec, tuple) else make_problem(spec[0], spec[1], spec[2], padding=spec[3])
        plan = make_plan(p, "cuda", algo, config)
        kernel = plan.kernel_ir()
        ptx = _ptx(render_cuda(kernel, cache=False), f"kg_{kernel.name}", p.dtype, kernel.meta.get("launch_bounds"))
        rows.append({"problem": p.key(), "variant": plan.variant, "config": str(plan.config),
                     "threads": kernel.threads, **ptxas_info(ptx, maxrreg)})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", default="winograd")
    ap.add_argument("--algo", default="winograd")
    ap.add_argument("--directions", default="fwd,bwd_data")
    ap.add_argument("--config", default=None, help="TileConfig fields as JSON, e.g. '{\"BM\": 32, \"states\": 8}'")
    ap.add_argument("--only", default=None, help="comma-separated layer names of the table")
    ap.add_argument("--maxrreg", type=int, default=None, help="ptxas -maxrregcount: would a cap spill?")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from kernelgen.templates.config import TileConfig
    from kernelgen.tuning.shapes import load_table
    config = TileConfig(**json.loads(args.config)) if args.config else None
    _, layers = load_table(args.table)
    only = set(args.only.split(",")) if args.only else None
    probs = [(l.name, l.problem(d)) for l in layers for d in args.directions.split(",")
             if only is None or l.name in only]
    bad = 0
    print(f"{'layer':14} {'dir':8} {'config':34} {'regs':>4} {'local':>5} {'spill':>5} {'smem':>6}")
    rows = []
    for name, p in probs:
        try:
            row = check([p], args.algo, config, args.maxrreg)[0]
        except ValueError as e:
            print(f"{name:14} {p.direction:8} skipped: {e}")
            continue
        rows.append({"layer": name, **row})
        bad += row["local_bytes"] > 0 or row["spill_stores"] > 0
        print(f"{name:14} {p.direction:8} {row['config']:34} {row['registers']:4} {row['local_bytes']:5} "
              f"{row['spill_stores']:5} {row['smem_bytes']:6}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
