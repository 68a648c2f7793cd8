"""Time the Winograd variant's candidate configs (state counts x tiles) against cuDNN, per table shape.

The forced-variant bench (`python -m kernelgen bench --algo winograd`) runs the default config only;
this sweep shows what the state count and tile choices are worth, so the defaults (templates/
winograd.py: CUDA_TILES, STATE_OVERHEAD) can be set from measurements.  GPU only.

    python scripts/wino_sweep.py --keep 4 --out sweep.json
    KERNELGEN_WINOGRAD_16=1 python scripts/wino_sweep.py --layers c7x7_28,c9x9_28 --directions fwd
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--table", default="winograd")
    ap.add_argument("--layers", default="")
    ap.add_argument("--directions", default="fwd,bwd_data")
    ap.add_argument("--keep", type=int, default=4, help="candidate configs per problem, cheapest modeled first")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default="wino_sweep.json")
    args = ap.parse_args(argv)
    from kernelgen.templates import winograd
    from kernelgen.tuning.bench import TorchConv, bench_problem
    from kernelgen.tuning.shapes import load_table
    _, layers = load_table(args.table)
    if args.layers:
        layers = [l for l in layers if l.name in set(args.layers.split(","))]
    tc = TorchConv()
    rows = []
    for layer in layers:
        for d in args.directions.split(","):
            p = layer.problem(d)
            if not winograd.applies(p):
                continue
            default = winograd.default_config(p, "cuda")
            cfgs = winograd.candidate_configs(p)[:args.keep]
            for cfg in [default] + [c for c in cfgs if c != default]:
                try:
                    row = bench_problem(layer, d, tc, repeat=args.repeat, config=cfg, algo="winograd")
                except Exception as e:  # a failing config must not hide the others
                    row = {"layer": layer.name, "direction": d, "config": str(cfg), "error": f"{type(e).__name__}: {e}"}
                row["default"] = cfg == default
                rows.append(row)
                print(f"{layer.name:12} {d:8} {str(cfg):36} {'*' if cfg == default else ' '} "
                      + (f"{row['kernelgen_ms']:8.3f} ms  cuDNN {row['cudnn_ms']:8.3f} ms  ratio {row['ratio']:.3f}  "
                         f"regs {row.get('registers', '?')}  err {row['rel_err_vs_cudnn']:.1e}"
                         if "ratio" in row else row["error"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
