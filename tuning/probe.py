"""`python -m kernelgen.tuning.probe`: evidence for performance work (PERF_NOTES.md).

For a few problems and configs: time each candidate (verified against float64) and count the SASS
instructions of its kernel by opcode (FFMA, LDS, LDS.128, LDG, IMAD, ...), so a change's effect on
the instruction mix is read, not guessed.
"""
from __future__ import annotations

import argparse
import collections
import json
import re

import numpy as np

from kernelgen.planner import Plan, get_launcher
from kernelgen.templates.config import TileConfig

from .shapes import load_table
from .tuner import device_sets, measure, random_inputs, reference_output

_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?P\w+\s+)?([A-Z][A-Z0-9_.]+)")


def sass_histogram(launcher):
    from numba import float32  # numba-cuda's signatures; imported where a GPU is used
    sig = tuple(float32[::1] for _ in launcher.params)
    sass = launcher.kernel.inspect_sass(sig)
    counts = collections.Counter(m.group(1) for m in _OPCODE.finditer(sass))
    keys = ("FFMA", "LDS", "LDS.64", "LDS.128", "STS", "LDG.E", "LDG.E.128", "IMAD", "IADD3", "LEA", "ISETP.GE.AND",
            "BAR.SYNC", "SHF.R.S32.HI", "IMAD.WIDE")
    return {k: counts.get(k, 0) for k in keys} | {"total": sum(counts.values())}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kernelgen.tuning.probe")
    ap.add_argument("--table", default="gpu_md")
    ap.add_argument("--layers", default="r18_c64_32,r50_3x3_28,c5x5_28")
    ap.add_argument("--directions", default="fwd")
    ap.add_argument("--configs", default="128,64,8,8,4,1;128,64,8,8,4,2;64,64,8,4,4,1;64,64,8,4,4,2;128,64,16,8,4,1")
    ap.add_argument("--out", default="probe.json")
    args = ap.parse_args(argv)
    _, layers = load_table(args.table)
    layers = [l for l in layers if l.name in args.layers.split(",")]
    # each config: BM,BN,BK,TM,TN,stages[,smem_pad]
    cfgs = [TileConfig(*map(int, c.split(",")[:5]), stages=int(c.split(",")[5]),
                       smem_pad=int(c.split(",")[6]) if len(c.split(",")) > 6 else 0) for c in args.configs.split(";")]
    rows = []
    rng = np.random.default_rng(0)
    for layer in layers:
        for d in args.directions.split(","):
            p = layer.problem(d)
            inputs = random_inputs(p, rng)
            ref = reference_output(p, inputs)
            sets = device_sets(inputs)
            for cfg in cfgs:
                row = {"layer": layer.name, "direction": d, "config": str(cfg)}
                try:
                    ms, err, _ = measure(p, "implicit_gemm", cfg, sets, ref)
                    launcher = get_launcher(Plan(p, "implicit_gemm", cfg, "cuda"))
                    row |= {"ms": ms, "tflops": p.flops / ms / 1e9, "rel_err": err,
                            "regs": next(iter(launcher.kernel.get_regs_per_thread().values())), "sass": sass_histogram(launcher)}
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "sass"}, default=str), row.get("sass"))
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
