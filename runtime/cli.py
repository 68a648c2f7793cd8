"""`python -m kernelgen cache info|clear`: what the compiled-kernel cache holds, and emptying it."""
from __future__ import annotations

import argparse
import json

from .cache import KERNELS, load_persistent_stats


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kernelgen cache", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["info", "clear"])
    args = ap.parse_args(argv)
    if args.action == "clear":
        before = KERNELS.info()
        KERNELS.clear()
        print(f"removed {before['entries']} entries ({before['bytes']} bytes) from {before['directory']}")
        return 0
    info = KERNELS.info()
    info["lifetime"] = load_persistent_stats(KERNELS.directory)
    print(json.dumps(info, indent=1))
    return 0
