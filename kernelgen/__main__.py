"""`python -m kernelgen <command>`: each command lives in the module that owns it."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("kernelgen.demo", "run a real convolution through kernelgen, check it, time it"),
    "cache": ("kernelgen.runtime.cli", "compiled-kernel cache: info | clear"),
    "bench": ("kernelgen.tuning.bench", "benchmark a shape table (optionally against torch/cuDNN)"),
    "tune": ("kernelgen.tuning.tuner", "autotune a shape table into the tuned database"),
    "db": ("kernelgen.tuning.database", "tuned-database files: merge a tune's entries into another"),
    "train": ("kernelgen.nn.train", "train a network through kernelgen kernels (e.g. `train digits`)"),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m kernelgen <command> [args]\n\ncommands:")
        for name, (_, doc) in COMMANDS.items():
            print(f"  {name:<6} {doc}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
    except ModuleNotFoundError as e:
        if e.name != COMMANDS[argv[0]][0]:
            raise
        print(f"python -m kernelgen {argv[0]}: not available in this build ({e.name} is missing)")
        return 2
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
