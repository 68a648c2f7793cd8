"""`python -m kernelgen cache info|clear`: what the compiled-kernel cache holds, and emptying it."""
from __future__ import annotations

import argparse
import json
import sys

from kernelgen.runtime.cache import KERNELS, format_bytes, load_persistent_stats


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kernelgen cache", description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["info", "clear"])
    ap.add_argument("--json", action="store_true", help="info: machine-readable output")
    args = ap.parse_args(argv)
    try:
        if args.action == "clear":
            _clear()
        else:
            _info(args.json)
    except ValueError as e:  # a bad KERNELGEN_CACHE_MAX_BYTES: the message names it
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


def _clear():
    directory = KERNELS.directory
    done = KERNELS.clear()
    print(f"removed {done['entries']} entries ({format_bytes(done['bytes'])}) from {directory}")
    if done["kept"]:
        print(f"left {done['kept']} other files or folders there untouched (not kernelgen's kernels)")


def _info(as_json: bool):
    info = KERNELS.info()
    info["lifetime"] = load_persistent_stats(KERNELS.directory)
    if as_json:
        print(json.dumps(info, indent=1))
        return
    life = info["lifetime"]
    print(f"directory  {info['directory']}")
    print(f"entries    {info['entries']} ({format_bytes(info['bytes'])})")
    print(f"limit      {format_bytes(info['max_bytes'])} (KERNELGEN_CACHE_MAX_BYTES; least recently used go first)")
    if life:
        print(f"lifetime   {life.get('disk_hits', 0)} disk hits, {life.get('misses', 0)} misses "
              f"(compiled), {life.get('corrupt', 0)} corrupt entries replaced, "
              f"{life.get('memory_hits', 0)} memory hits")
