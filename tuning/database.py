"""The tuned database: problem -> fastest verified (variant, config) per GPU.

One JSON file per device key ("sm_90" + GPU name) holding {problem key: entry}.  Shipped databases
live in kernelgen/tuning/db; the user's own (written by `python -m kernelgen tune`, and by first-call
autotuning, tuning/autotune.py, which also writes the CPU backend's, "sm_00_cpu") live in the cache
dir and take precedence.  Unseen problems fall back to the nearest tuned neighbour of the same
direction and filter size, else to the template's heuristic default.

Tensor-core precisions (`tune --precision tf32|fp16|bf16`) have entries of their own, keyed by the
problem key + "_" + precision (entry_key) and marked with a "precision" field; fp32 entries keep the
bare problem key and no such field.  Every lookup answers one precision only: an fp32 request never
sees a tensor-core entry (not even as a nearest neighbour), nor the reverse.  Tensor-core entries
answer exact problems only (tuned_config), like a forced variant.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import asdict, fields
from functools import lru_cache
from pathlib import Path

from kernelgen.problem import ConvProblem
from kernelgen.runtime.cache import cache_dir
from kernelgen.storage import check_precision
from kernelgen.templates import get_variant, winograd_wgrad
from kernelgen.templates.config import TileConfig
from kernelgen.templates.depthwise_config import DepthwiseConfig, is_depthwise_config

SHIPPED = Path(__file__).parent / "db"
FORMAT = 1
NEAREST_MAX_DISTANCE = 0.75  # sum of |log size ratios| (N, C, K, spatial) to trust a neighbour's config


def user_db_dir() -> Path:
    return cache_dir() / "tuned"


def db_name(device_key: str) -> str:
    """The file of a device's entries; device_key: kernelgen.target's device name ("sm_90_NVIDIA H100 80GB HBM3")."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", device_key) + ".json"


def load(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if data.get("format") != FORMAT:
        return {}
    return data.get("entries", {})


def save(path: Path, entries: dict, device: str):
    """Atomic write: a tune interrupted mid-write never leaves a broken database behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump({"format": FORMAT, "device": device, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def shipped_device(device_key: str) -> str:
    """The device whose shipped files (database, models) serve device_key: its own where kernelgen ships a database
    for it, else a shipped device of the same architecture ("sm_90_NVIDIA H200" reads the H100's: the same SMs, so
    the same tiles win), else device_key itself (nothing shipped: the links fall through to the defaults)."""
    return _shipped_device(SHIPPED, device_key)


@lru_cache(maxsize=32)
def _shipped_device(shipped: Path, device_key: str) -> str:  # (keyed by the directory: plan_with swaps SHIPPED)
    if (shipped / db_name(device_key)).exists():
        return device_key
    arch = re.match(r"sm_\d+_", device_key)
    for path in sorted(shipped.glob(f"{arch.group(0)}*.json") if arch else ()):
        try:
            device = json.loads(path.read_text()).get("device", "")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(device, str) and device.startswith(arch.group(0)) and path.name == db_name(device):
            return device
    return device_key


def described(device_key: str) -> str:
    """The device's name in a plan's reason, with the shipped device whose entries stand in for its own."""
    shipped = shipped_device(device_key)
    return device_key if shipped == device_key else f"{device_key} (shipped entries of {shipped}: same architecture)"


@lru_cache(maxsize=8)
def entries_for(device_key: str) -> dict:
    """The device's entries: the shipped database (shipped_device's), then the user's own over it."""
    merged = load(SHIPPED / db_name(shipped_device(device_key)))
    merged.update(load(user_db_dir() / db_name(device_key)))
    return merged


def entry_key(problem, precision="fp32"):
    """The key of a problem's entry at `precision`: the bare problem key for fp32 (the shipped databases'
    keys, unchanged), key + "_" + precision for a tensor-core precision, so that the two never collide."""
    check_precision(precision)
    return problem.key() if precision == "fp32" else f"{problem.key()}_{precision}"


def precision_of(entry):
    """The precision an entry was tuned at (entries without the field are fp32: every shipped one)."""
    return entry.get("precision", "fp32")


def config_from(entry):
    """The config of an entry: a DepthwiseConfig for the depthwise variant's entries (its own fields), else a
    TileConfig (fields a newer TileConfig dropped are ignored)."""
    if entry.get("variant") == "depthwise":
        return DepthwiseConfig.from_dict(entry["config"])
    names = {f.name for f in fields(TileConfig)}
    return TileConfig(**{k: v for k, v in entry["config"].items() if k in names})


def parse_config(text):
    """A config's string form (an entry's "tried" list) back into its config: DepthwiseConfig's ("DW_...") or
    TileConfig's."""
    return DepthwiseConfig.parse(text) if is_depthwise_config(text) else TileConfig.parse(text)


def _distance(a, b):
    """How unlike two problems are (same direction, filter and stride required, and both depthwise or neither: a
    depthwise entry's candidates are all direct depthwise configs); log-scale over sizes."""
    if a.direction != b.direction or a.filter_size != b.filter_size or a.stride != b.stride:
        return None
    if (a.groups == a.C > 1) != (b.groups == b.C > 1):
        return None
    pairs = [(a.N, b.N), (a.C, b.C), (a.K, b.K)] + list(zip(a.in_size, b.in_size))
    return sum(abs(math.log(x) - math.log(y)) for x, y in pairs)


def _considered(entry, variant):
    """Was `variant` among the candidates this entry's tune compared?  (A variant added after the
    tune must not lose to an entry that never measured it.)"""
    return variant is None or any(t.get("variant") == variant for t in entry.get("tried", ()))


def _ranked(entry):
    """(variant, TileConfig) of every candidate the entry's tune measured, the winner first, then the
    rest fastest first."""
    yield entry["variant"], config_from(entry)
    for t in sorted((t for t in entry.get("tried", ()) if "ms" in t), key=lambda t: t["ms"]):
        try:
            yield t["variant"], parse_config(t["config"])
        except (KeyError, ValueError):
            continue


def _usable(problem, variant, cfg, precision="fp32"):
    """Can this measured candidate run now, at `precision`?  Settings change what a variant may run
    (Winograd's 16-state kernels are off unless the caller allows them), so a tune's winner may not be;
    and a variant that computes in other precisions (a tensor-core one, for an fp32 request) never may; nor a
    hand-edited or older entry's config that the variant no longer builds."""
    try:
        v = get_variant(variant)
    except ValueError:
        return False
    return v.applies(problem, precision) and v.accepts(problem, cfg, precision)


def _pick(problem, entry, variant=None, precision="fp32", transfer=False):
    """The fastest candidate of the entry (of `variant`, if given) usable under the current settings
    at `precision`; None for an entry tuned at another precision.  transfer (the entry is a neighbour's): not the
    Winograd backward-weight where its rule would not take the problem (winograd_wgrad.suits: few channels, a width
    its tiles waste, measured 0.01-0.99x of the GEMM there)."""
    if precision_of(entry) != precision:
        return None
    for v, cfg in _ranked(entry):
        if transfer and v == winograd_wgrad.NAME and not winograd_wgrad.suits(problem):
            continue
        if (variant is None or v == variant) and _usable(problem, v, cfg, precision):
            return v, cfg
    return None


def problem_of(entry):
    """The ConvProblem an entry was tuned on (its "problem" field, lists back to tuples)."""
    p = entry["problem"]
    return ConvProblem(**{**p, **{k: tuple(v) for k, v in p.items() if isinstance(v, list)}})


_problem_of = problem_of  # (the name scripts/golden_source.py reads)


def lookup(problem, device_key: str, preferred=None):
    """(variant, TileConfig, how) for an fp32 problem, or None when the database has nothing near that
    measured the `preferred` variant (the one the heuristic would run).  Tensor-core entries are never
    considered (their keys differ, and the nearest search skips them)."""
    hit = resolve(problem, device_key, preferred)
    return None if hit is None else hit[:3]


def resolve(problem, device_key: str, preferred=None):
    """lookup's answer with the key of the entry that gave it: (variant, TileConfig, "tuned" | "nearest", entry
    key), or None."""
    table = entries_for(device_key)
    if not table:
        return None
    e = table.get(problem.key())
    if e is not None and _considered(e, preferred):
        hit = _pick(problem, e)
        if hit is not None:
            return (*hit, "tuned", problem.key())
    best, best_key, best_d = None, None, None
    for key, e in table.items():
        if precision_of(e) != "fp32" or not _considered(e, preferred):
            continue
        d = _distance(problem, problem_of(e))
        if d is not None and (best_d is None or d < best_d):
            best, best_key, best_d = e, key, d
    # measured on the H100 (BENCHMARKS.md): a neighbour further than ~2x in one size hurt more often than
    # it helped, so beyond that the cost-model default decides
    if best is None or best_d > NEAREST_MAX_DISTANCE:
        return None
    hit = _pick(problem, best, transfer=True)
    if hit is None or (problem.direction != "bwd_weight" and hit[1].split_k > 1):
        return None
    return (*hit, "nearest", best_key)


def measured(problem, device_key: str, precision="fp32") -> list:
    """(variant, TileConfig) of every candidate the tune of exactly this problem at `precision` timed, the winner
    first ([] where no tune did): the planner's rules step aside where a tune weighed their kind of kernel."""
    e = entries_for(device_key).get(entry_key(problem, precision))
    return [] if e is None or precision_of(e) != precision else list(_ranked(e))


def tuned_config(problem, device_key: str, variant, precision="fp32"):
    """The fastest measured config of one variant for exactly this problem at `precision` (a call that
    forces the variant with algo=, or a tensor-core call), or None."""
    hit = exact(problem, device_key, precision, variant)
    return None if hit is None else hit[1]


def exact(problem, device_key: str, precision="fp32", variant=None):
    """(variant, config) of the entry for exactly this problem at `precision`: its fastest candidate usable now
    (of `variant`, if given), or None.  The CPU backend's planner reads first-call autotuning's entries with it."""
    e = entries_for(device_key).get(entry_key(problem, precision))
    return None if e is None else _pick(problem, e, variant, precision)


_RECORD_LOCK = threading.Lock()


@contextmanager
def _locked(path: Path):
    """This process's threads one at a time, and (POSIX) other processes too, through a lock file beside `path`:
    a read-modify-write of the database never loses another writer's entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _RECORD_LOCK, open(path.with_suffix(".lock"), "a") as lock:
        try:
            import fcntl
        except ImportError:  # (Windows: threads only)
            yield
            return
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def record(problem, device_key: str, new_entry: dict, precision="fp32", path: Path | None = None) -> Path:
    """Add one entry to the database at `path` (default: the user's database of `device_key`), read again under
    the lock and written atomically, so that the first-call autotuner, the offline tuner and other processes
    never drop each other's entries; then forget the loaded databases so that the next plan reads it.  Returns
    the database's path."""
    path = Path(path) if path is not None else user_db_dir() / db_name(device_key)
    with _locked(path):
        entries = load(path)
        entries[entry_key(problem, precision)] = new_entry
        save(path, entries, device_key)
    entries_for.cache_clear()
    return path


def entry(problem, variant, config, ms, candidates_tried, precision="fp32"):
    """A database entry; a tensor-core precision is recorded in it (fp32 entries stay as they always were)."""
    p = asdict(problem)
    e = {"problem": p, "variant": variant, "config": config.as_dict(), "ms": ms, "tried": candidates_tried}
    return e if precision == "fp32" else {**e, "precision": precision}


def read_database(path: Path, what: str) -> dict:
    """The database file at `path` as parsed JSON; a ValueError that names the argument `what` and says whether
    the file is missing, unreadable or no database (load() answers {} for all three, which is right for lookups
    but not for a merge, where it hid a mistyped name behind "holds no database entries")."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{what}: {path} does not exist") from None
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
        raise ValueError(f"{what}: {path} holds no database entries of format {FORMAT}")
    return data


def merge(tuned: Path, into: Path, precision=None) -> int:
    """Entries of the database file `tuned` (a tune's output, e.g. the device run's copy) written into the database
    file `into` (a shipped one), replacing entries of the same key; only those tuned at `precision` if given.
    The device named stays `into`'s (a new `into` takes `tuned`'s).  Returns how many entries it wrote.
    Both files are checked before anything is written: a missing `tuned` or an `into` that exists but is no
    database (which the merge would otherwise overwrite) is a ValueError naming the file."""
    src, target = Path(tuned), Path(into)
    source = read_database(src, "tuned")
    if not source["entries"]:
        raise ValueError(f"tuned: {src} holds no database entries of format {FORMAT}")
    old = read_database(target, "into") if target.exists() else {"device": source.get("device", ""), "entries": {}}
    new = {k: e for k, e in source["entries"].items() if precision is None or precision_of(e) == precision}
    if new:
        save(target, {**old["entries"], **new}, old.get("device", ""))
        entries_for.cache_clear()
    return len(new)


def main(argv=None):
    """`python -m kernelgen db merge TUNED --into SHIPPED [--precision P]`."""
    ap = argparse.ArgumentParser(prog="python -m kernelgen db", description="tuned-database files")
    sub = ap.add_subparsers(dest="action", required=True)
    m = sub.add_parser("merge", help="write a tune's entries into another database file (e.g. the shipped one)")
    m.add_argument("tuned", help="the tune's database file")
    m.add_argument("--into", required=True, help="the database file to update (e.g. tuning/db/sm_90_....json)")
    m.add_argument("--precision", default=None, choices=["fp32", "tf32", "fp16", "bf16"],
                   help="only entries tuned at this precision")
    args = ap.parse_args(argv)
    try:
        n = merge(args.tuned, args.into, args.precision)
    except (ValueError, OSError) as e:  # OSError: `into` could not be written (save is atomic: it is unchanged)
        print(f"python -m kernelgen db merge: error: {e}", file=sys.stderr)
        return 2
    print(f"db merge: {n} entries of {args.tuned} written into {args.into}")
    return 0
