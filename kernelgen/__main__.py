"""`python -m kernelgen <command>`: each command lives in the module that owns it."""
from __future__ import annotations

import atexit
import gc
import importlib
import sys

from kernelgen import __version__

COMMANDS = {
    "demo": ("kernelgen.demo", "run a real convolution through kernelgen, check it, time it"),
    "cache": ("kernelgen.runtime.cli", "compiled-kernel cache: info [--json] | clear"),
    "bench": ("kernelgen.tuning.bench", "benchmark a shape table (optionally against torch/cuDNN)"),
    "tune": ("kernelgen.tuning.tuner", "autotune a shape table into the tuned database"),
    "db": ("kernelgen.tuning.database", "tuned-database files: merge a tune's entries into another"),
    "train": ("kernelgen.nn.train", "train a network through kernelgen kernels (e.g. `train digits`)"),
    "settings": ("kernelgen.settings", "every setting: its environment variable, value now, meaning"),
}


def _usage(file):
    print("usage: python -m kernelgen [--version] <command> [args]\n\ncommands:", file=file)
    for name, (_, doc) in COMMANDS.items():
        print(f"  {name:<6} {doc}", file=file)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        _usage(sys.stdout)
        return 0
    if argv[0] == "--version":
        print(f"kernelgen {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        # stderr, exit 2: argparse's convention for a usage error, so scripts can tell it from output
        print(f"python -m kernelgen: unknown command {argv[0]!r}", file=sys.stderr)
        _usage(sys.stderr)
        return 2
    # Registered first, so it runs after every other exit handler: the interpreter's teardown then skips the
    # garbage collector's passes over what numba left (0.35-0.4 s of a cold demo's ~5 s on the 2-core machine).
    atexit.register(gc.freeze)
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
    except ModuleNotFoundError as e:
        if e.name != COMMANDS[argv[0]][0]:
            raise
        print(f"python -m kernelgen {argv[0]}: not available in this build ({e.name} is missing)", file=sys.stderr)
        return 2
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
