"""Every setting kernelgen reads, in one place: name, environment variable, default, meaning, and whether
it changes generated code.

A setting's value is, first found wins:
  1. the innermost `with kernelgen.settings.scope(name=value):` of this thread / task (a ContextVar, so
     one thread's scope never leaks into another thread's calls),
  2. `kernelgen.settings.set(name, value)` for the whole process,
  3. its environment variable, read when asked (so a test's monkeypatch.setenv takes effect),
  4. its default.

Settings marked `affects_code` change the source a kernel is rendered from.  `code_token()` lists all of
them, and the kernel cache key includes it, so no setting can ever make a kernel compiled under other settings
be reused (Triton's knobs and tinygrad's ContextVars are the models).  `dispatch_token()` lists every setting
that can change what a call does (`affects_calls`, and the code settings): the prepared-call memo and the
dispatch cache (kernelgen.dispatch) key on it.  Both are computed once per (scope, process settings, environment
text) and then cost a lookup, as every kernelgen call reads them.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable

from kernelgen.storage import PRECISIONS

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE or t in _FALSE:
        return t in _TRUE
    raise ValueError(f"expected one of {_TRUE + _FALSE[:-1]}, got {text!r}")


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text) -> int:
    """A byte count: 1000000, 512M, 2G, 1.5GiB, 4 GB (binary units either way)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
        if not m:
            raise ValueError(f"expected a byte count such as 4000000000, 512M or 2G, got {text!r}")
        value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value <= 0:
        raise ValueError(f"expected a positive byte count, got {text!r}")
    return value


def parse_states(text) -> tuple:
    """Winograd state counts, e.g. "4,8,16" or (4, 8)."""
    items = text.replace(",", " ").split() if isinstance(text, str) else list(text)
    try:
        states = tuple(sorted({int(s) for s in items}))
    except (TypeError, ValueError):
        raise ValueError(f"expected state counts from (4, 8, 16), got {text!r}") from None
    if not frozenset(states) <= {4, 8, 16}:
        raise ValueError(f"expected state counts from (4, 8, 16), got {text!r}")
    return states


def _check_type(kind):
    def check(value):
        if kind is bool and not isinstance(value, bool):
            raise TypeError(f"expected True or False, got {value!r}")
        if not isinstance(value, kind):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value
    return check


@dataclass(frozen=True)
class Setting:
    name: str
    env: str | None            # the environment variable, None if set only from code
    default: Any
    parse: Callable[[str], Any]  # environment text -> value (ValueError on bad text)
    doc: str
    affects_code: bool = False  # changes rendered source: part of every kernel's cache key
    check: Callable[[Any], Any] | None = None  # a value from code -> the value (or TypeError/ValueError)
    # can change what a kernelgen call does (its plan, its route): part of the dispatch cache's key
    affects_calls: bool = True

    def coerce(self, value):
        """A value given in code (scope/set), validated; strings are parsed as the environment's are."""
        if isinstance(value, str) and self.parse is not str:
            return self.parse(value)
        return (self.check or _check_type(type(self.default)))(value)


def _precision(text):
    if text not in PRECISIONS:
        raise ValueError(f"expected one of {PRECISIONS}, got {text!r}")
    return text


def _target_name(text):
    """A KNOWN_TARGETS name (kernelgen.target checks it is one where the target is used: the table imports this
    module, so this module does not import the table)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"expected a known GPU's name such as 'h100' or 'a100', got {text!r}")
    return text.strip().lower()


def _seconds_budget(value) -> float:
    """A time budget in seconds: a number >= 0 (text parsed)."""
    try:
        seconds = float(value) if isinstance(value, str) or not isinstance(value, bool) else None
    except ValueError:
        seconds = None
    if seconds is None or not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"expected a number of seconds >= 0, got {value!r}")
    return seconds


def _positive_int(value) -> int:
    """A count >= 1 (text parsed)."""
    try:
        n = int(value) if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)) else None
    except ValueError:
        n = None
    if n is None or n < 1:
        raise ValueError(f"expected an int >= 1, got {value!r}")
    return n


def _model_mode(value):
    """The `model` setting: "auto", "on" or "off" (booleans and their words too: True / "1" -> "on")."""
    if isinstance(value, bool):
        return "on" if value else "off"
    text = value.strip().lower() if isinstance(value, str) else value
    if text == "auto":
        return text
    if isinstance(text, str) and text in _TRUE + _FALSE[:-1]:
        return "on" if text in _TRUE else "off"
    raise ValueError(f"expected 'auto', 'on' or 'off', got {value!r}")


_ALL = (
    # --- what is computed and how -------------------------------------------------------------------
    Setting("precision", "KERNELGEN_PRECISION", "fp32", _precision,
            "default precision of calls that pass no precision= (kernelgen.set_precision)", check=_precision),
    Setting("index32", "KERNELGEN_INDEX32", True, parse_bool,
            "32-bit index arithmetic in CUDA kernels where the tensors allow it", affects_code=True),
    Setting("winograd_16_states", "KERNELGEN_WINOGRAD_16", False, parse_bool,
            "allow 16-state Winograd kernels (about 1e-4 relative error in fp32)", affects_code=True),
    Setting("winograd_states", "KERNELGEN_WINOGRAD_STATES", (4, 8, 16), parse_states,
            "Winograd state counts that may be chosen (16 also needs winograd_16_states)", affects_code=True,
            check=parse_states),
    Setting("ks_deconv_trim", "KERNELGEN_KS_DECONV_TRIM", False, parse_bool,
            "KS-deconv-V2: filter trimming in strided backward-data where the schedule fits", affects_code=True),
    Setting("tma_drain_each_round", "KERNELGEN_TMA_DRAIN_EACH_ROUND", True, parse_bool,
            "TMA k-loops wait for each round's MMAs (False reproduces a schedule measured wrong at fp16)",
            affects_code=True),
    # --- planning -----------------------------------------------------------------------------------
    Setting("no_tuned", "KERNELGEN_NO_TUNED", False, parse_bool,
            "ignore the tuned databases: plan from the cost model only"),
    Setting("model", "KERNELGEN_MODEL", "auto", _model_mode,
            "the planner's performance model (tuning/perf_model.py) where no tuned entry answers: auto (on a GPU), "
            "on (also planning offline, for the target setting's GPU) or off", check=_model_mode),
    Setting("autotune", "KERNELGEN_AUTOTUNE", False, parse_bool,
            "first-call autotuning (kernelgen.set_autotune): an untuned problem's first call times the planner's pick "
            "and the model's next candidates and keeps the fastest verified one in the user's tuned database"),
    Setting("autotune_budget", "KERNELGEN_AUTOTUNE_BUDGET", 10.0, _seconds_budget,
            "seconds one problem's first-call autotuning may spend (compiling included) before it stops timing",
            check=_seconds_budget, affects_calls=False),
    Setting("autotune_candidates", "KERNELGEN_AUTOTUNE_CANDIDATES", 8, _positive_int,
            "candidates one problem's first-call autotuning compiles and times, the planner's pick among them",
            check=_positive_int, affects_calls=False),
    Setting("target", "KERNELGEN_TARGET", "h100", _target_name,
            "the GPU planned for where none is present (kernelgen.target.KNOWN_TARGETS: h100, h200, a100, l40s)",
            affects_code=True, check=_target_name),
    # --- runtime ------------------------------------------------------------------------------------
    Setting("cache_dir", "KERNELGEN_CACHE_DIR", None, str,
            "compiled-kernel cache directory (default: the user cache directory)", check=lambda v: os.fspath(v),
            affects_calls=False),
    Setting("cache_max_bytes", "KERNELGEN_CACHE_MAX_BYTES", 4 << 30, parse_bytes,
            "size bound of the disk cache; least recently used entries go first", check=parse_bytes,
            affects_calls=False),
    Setting("arena", "KERNELGEN_ARENA", False, parse_bool,
            "install kernelgen's pooled arena as numba's memory manager at first GPU use"),
    Setting("auto_precompile", "KERNELGEN_AUTO_PRECOMPILE", True, parse_bool,
            "kernelgen.nn: a CUDA model's first call on a new input shape first compiles every convolution kernel of "
            "a step on that shape side by side in worker processes (Module.precompile), not one by one",
            affects_calls=False),
    Setting("batch_fallback", "KERNELGEN_BATCH_FALLBACK", True, parse_bool,
            "a CUDA call whose kernel is not compiled yet runs on the kernel of a larger batch of the same convolution "
            "that ran in this process (inputs zero-extended), while its own compiles in a background process",
            affects_calls=False),
    Setting("fast_launch", "KERNELGEN_FAST_LAUNCH", True, parse_bool,
            "launch compiled kernels through prepacked cuLaunchKernel calls (not numba's dispatcher)"),
    Setting("nn_recompute", "KERNELGEN_NN_RECOMPUTE", True, parse_bool,
            "kernelgen.nn in training on the GPU: a batch norm's output (with its ReLU and residual) is kept only until "
            "the forward pass has read it, and computed again from the batch norm's input when the backward reads it "
            "(one elementwise pass each; ResNet-18 keeps about half the activations)", affects_calls=False),
    Setting("nn_half_activations", "KERNELGEN_NN_HALF_ACTIVATIONS", True, parse_bool,
            "kernelgen.nn on the GPU at fp16 precision (amp.autocast): convolutions read and write float16 arrays, "
            "so activations and their gradients are kept in 16 bits (parameters and their gradients stay float32); "
            "off: float32 arrays rounded inside the kernels", affects_calls=False),
    Setting("torch_native", "KERNELGEN_TORCH_NATIVE", True, parse_bool,
            "kernelgen.torch's modules call through a C++ autograd Function that replays launch programs "
            "(kernelgen/torch/native.cpp, built once in the background with torch's C++ extension tools); off: the "
            "Python path"),
    Setting("cuda_simulator", "NUMBA_ENABLE_CUDASIM", False, parse_bool,
            "numba's CUDA simulator (numba reads it once, at its first CUDA import)"),
    # --- tests and benchmarks -----------------------------------------------------------------------
    Setting("fuzz_examples", "KERNELGEN_FUZZ", 0, int, "extra hypothesis examples for the API fuzz suite",
            affects_calls=False),
    Setting("commit", "KERNELGEN_COMMIT", None, str, "the commit a benchmark records (no .git on the GPU machine)",
            check=str, affects_calls=False),
)
SETTINGS = {s.name: s for s in _ALL}
CODE_SETTINGS = tuple(s for s in _ALL if s.affects_code)
CALL_SETTINGS = tuple(s for s in _ALL if s.affects_calls or s.affects_code)

_scoped: ContextVar[dict] = ContextVar("kernelgen_settings", default={})
_process: dict = {}
_process_lock = threading.Lock()
_process_version = 0  # bumped by every set(): part of what a cached snapshot of the values is checked against
_parsed: dict = {}  # (name, environment text) -> value: the environment is parsed once per distinct text


def _setting(name) -> Setting:
    try:
        return SETTINGS[name]
    except KeyError:
        raise ValueError(f"unknown kernelgen setting {name!r}; known: {', '.join(SETTINGS)}") from None


# os.environ.get encodes the name and decodes the value on every call; the code settings are read on every
# kernelgen call, so on POSIX the raw bytes dict behind os.environ (which setenv/monkeypatch keep current) is read.
_RAW_ENVIRON = os.environ._data if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict) else None
_ENV_KEYS = {s.name: os.fsencode(s.env) for s in _ALL if s.env} if _RAW_ENVIRON is not None else {}


def _from_env(s: Setting):
    if not s.env:
        return s.default
    text = _RAW_ENVIRON.get(_ENV_KEYS[s.name]) if _RAW_ENVIRON is not None else os.environ.get(s.env)
    if text is None or not text.strip():  # an empty variable is an unset one
        return s.default
    key = (s.name, text)
    try:
        return _parsed[key]
    except KeyError:
        pass
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    try:
        value = s.parse(text)
    except (TypeError, ValueError) as e:
        raise ValueError(f"environment variable {s.env}: {e}") from None
    _parsed[key] = value
    return value


def get(name: str):
    """The value of setting `name` in force here and now."""
    scoped = _scoped.get()
    if name in scoped:
        return scoped[name]
    if name in _process:
        return _process[name]
    return _from_env(_setting(name))


def _coerced(name, value):
    s = _setting(name)
    try:
        return s.coerce(value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"setting {name}: {e}") from None


def set(name: str, value):  # noqa: A001 (the natural name, as in Triton's knobs)
    """Set `name` for the whole process (every thread); returns the previous value.  None restores the
    environment/default."""
    global _process_version
    previous = get(name)
    with _process_lock:
        if value is None:
            _process.pop(name, None)
        else:
            _process[name] = _coerced(name, value)
        _process_version += 1  # after the change: a reader that sees the new version sees the new value
    return previous


@contextlib.contextmanager
def scope(**overrides):
    """`with kernelgen.settings.scope(index32=False, ks_deconv_trim=True): ...` — the values hold inside
    the block, in this thread (or asyncio task) only."""
    values = {name: _coerced(name, v) for name, v in overrides.items()}
    token = _scoped.set({**_scoped.get(), **values})
    try:
        yield
    finally:
        _scoped.reset(token)


def export_default(name: str, value: str):
    """Put `value` in setting `name`'s environment variable unless it is already there, so that worker
    processes started later (the tuner's and the benchmark's compile pools) inherit it."""
    os.environ.setdefault(_setting(name).env, str(value))


def process_environment():
    """The process's environment itself, for what is not a kernelgen setting but a protocol between processes: the
    launcher's job layout (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, as torchrun sets them) and the
    environments it gives the ranks.  Read here so that settings.py stays the one module that touches os.environ."""
    return os.environ


BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def cap_worker_blas_threads(threads: int = 1):
    """Give worker processes started later (the tuner's compile and reference pool) `threads` BLAS threads each,
    unless the environment already says how many: a pool of N workers x N BLAS threads oversubscribes the CPUs."""
    for var in BLAS_THREAD_VARIABLES:
        os.environ.setdefault(var, str(threads))


def _raw_environment() -> tuple:
    """The environment text of every setting, unparsed (os.environ's own bytes on POSIX: one C-level lookup
    each), to tell whether a snapshot of the values is still current: () where none is set, the common case, which
    one C-level pass over the names tells (a third of the lookups' cost, on every call)."""
    if _RAW_ENVIRON is not None:
        if _RAW_ENVIRON.keys().isdisjoint(_ENV_BYTE_SET):
            return ()
        return tuple(map(_RAW_ENVIRON.get, _ENV_BYTES))
    return tuple(map(os.environ.get, _ENV_NAMES))


_ENV_NAMES = tuple(s.env for s in CALL_SETTINGS if s.env)
_ENV_BYTES = tuple(os.fsencode(name) for name in _ENV_NAMES)
_ENV_BYTE_SET = frozenset(_ENV_BYTES)
# id(scope dict) -> (that dict, the process dict, its version, raw environment, (code values, call values)).  A
# scope's dict is made once per `with scope(...)` and never changed, and the entry holds it, so its id cannot be
# reused for another dict while the entry lives; the version and the environment text catch set() and setenv,
# the process dict's identity a test's monkeypatch of it.
_snapshots: dict = {}
_SNAPSHOTS_MAX = 64


def _snapshot() -> tuple:
    """(code_token(), dispatch_token()) here and now, computed once per (scope, process dict and version,
    environment text): every kernelgen call reads it, so a repeated call costs one lookup."""
    scoped = _scoped.get()
    version = _process_version  # read before the values: a set() in between then fails the next check
    env = _raw_environment()
    process = _process
    hit = _snapshots.get(id(scoped))
    if hit is not None and hit[0] is scoped and hit[1] is process and hit[2] == version and hit[3] == env:
        return hit[4]
    values = tuple(scoped[s.name] if s.name in scoped else process[s.name] if s.name in process else _from_env(s)
                   for s in CALL_SETTINGS)
    snap = (tuple(v for s, v in zip(CALL_SETTINGS, values) if s.affects_code), values)
    if len(_snapshots) >= _SNAPSHOTS_MAX:
        _snapshots.clear()  # many short-lived scopes: start again rather than keep their dicts alive
    _snapshots[id(scoped)] = (scoped, process, version, env, snap)
    return snap


def code_token() -> tuple:
    """The values of every setting that changes generated code: part of every kernel's key."""
    return _snapshot()[0]


def dispatch_token() -> tuple:
    """The value of every setting that can change what a call does (affects_calls or affects_code): part of the
    dispatch cache's key (kernelgen.api), so a call under another scope, set() or environment value of one of them
    never reuses a call prepared under these."""
    return _snapshot()[1]


def describe() -> str:
    """One line a setting: name, environment variable, value now, whether it changes generated code, meaning."""
    rows = [f"{s.name:<22} {s.env or '-':<32} {get(s.name)!r:<14} {'code' if s.affects_code else '':<5} {s.doc}"
            for s in _ALL]
    return "\n".join([f"{'setting':<22} {'environment variable':<32} {'value':<14} {'':<5} meaning"] + rows)


def main(argv=None):
    """`python -m kernelgen settings`: every setting and its value in this environment ("code": part of every
    kernel's cache key).  A bad environment value is reported by name, exit 2."""
    if argv:
        print(f"python -m kernelgen settings: takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    try:
        print(describe())
    except ValueError as e:
        print(f"python -m kernelgen settings: {e}", file=sys.stderr)
        return 2
    return 0
