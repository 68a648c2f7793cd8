"""The native entry point of kernelgen.torch's modules: a converted convolution as one C++ autograd Function
(native.cpp) that replays the launch programs Python packed, so that a repeated call costs about what torch's own
convolution does on the host.

Why: a converted network's training step is host-bound, and the Python layers of a convolution (module and
functional code, the autograd Function and its backward node, the launches) cost ~250 µs of host time a
convolution against torch's ~70 (BENCHMARKS.md, issue 31, fifteenth session).  Here a module's call is a key lookup
(the input's shape, strides, dtype and device, the weight's, the autocast dtype, the module's hyper-parameters and
kernelgen's settings) and one C++ call.  The C++ side holds, per plan and slot (forward, backward-data,
backward-weight), the programs of the addresses it has seen; a call on other addresses, under a CUDA graph capture,
or after the tensor-map ring uploaded, calls back into `NativePlan.fallback`, which runs kernelgen's op (compiling on
the first call) into the output C++ made and hands C++ the program of those addresses.

The extension is built once per source, torch and Python version (torch.utils.cpp_extension, ~1 minute) in a
background process, into kernelgen's cache directory; until it is loaded - and wherever it cannot be built (no
compiler), is switched off (`torch_native=False`, KERNELGEN_TORCH_NATIVE=0), under torch.compile or a recording - the
modules take the Python path (kernelgen/torch/functional.py), which computes the same.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import subprocess
import sys
import threading
import weakref
from threading import get_ident

import torch

from kernelgen import api, settings
from kernelgen.problem import conv_out_size
from kernelgen.runtime.cache import cache_dir
from kernelgen.runtime.driver import as_numba_stream, libcuda
from kernelgen.torch.functional import _precision

SOURCE = os.path.join(os.path.dirname(__file__), "native.cpp")
DEVICES = ("cuda",)  # the tensors' device types that take the native path (tests add "cpu": its fallback each call)
FWD, BWD_DATA, BWD_WEIGHT = 0, 1, 2

_STATE = {"state": None, "detail": ""}  # None (not started), "building", "ready", "failed", "off"
_LOCK = threading.Lock()
_DONE = threading.Event()
_EXT = None  # the loaded extension module
# module -> {call key: its NativePlan, or False where the native path does not take it}: beside the module, not in
# it, so that copy.deepcopy, pickling and torch.save of a module see nothing of the extension's
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# C++'s calls back into Python, by kind (counted without a lock: statistics, never control flow): "new addresses"
# (no program kept for them: the op runs), "kept" (a program kept, but the op runs: a capture, or Python's copy gone),
# "maps read again" (the ring uploaded since: the program's maps looked up again, no op)
_CALLS_BACK: dict = {"new addresses": 0, "kept": 0, "maps read again": 0}
TRACE = None  # a list to trace into: (plan id, slot, key) of each call back that ran the op (scripts/native_misses.py)


def fallbacks() -> dict:
    """How many slot runs C++ has handed back to Python so far, by kind: in a training step's steady state, none."""
    return dict(_CALLS_BACK)


def status() -> str:
    """"ready", "building", "failed: why", "off" (the setting) or "not started"."""
    state = _STATE["state"]
    return "not started" if state is None else state if state != "failed" else f"failed: {_STATE['detail']}"


def start_build():
    """Build (or find built) and load the extension in a background thread; calls take the Python path meanwhile."""
    with _LOCK:
        if _STATE["state"] is not None:
            return
        if not settings.get("torch_native"):
            _STATE["state"] = "off"
            _DONE.set()
            return
        _STATE["state"] = "building"
    threading.Thread(target=_build_and_load, name="kernelgen-native-build", daemon=True).start()


def wait(timeout=None) -> bool:
    """Start the build if needed and wait for it (the torch bench and the GPU tests do); True where it is loaded."""
    start_build()
    _DONE.wait(timeout)
    return _EXT is not None


def _tag():
    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + f"{torch.__version__} {sys.version}".encode()).hexdigest()
    return f"kernelgen_torch_native_{digest[:12]}"


def _build_and_load():
    global _EXT
    try:
        name = _tag()
        build_dir = os.path.join(cache_dir(), "torch_native", name)
        os.makedirs(build_dir, exist_ok=True)
        path = os.path.join(build_dir, name + ".so")
        if not os.path.exists(path):
            _build(name, build_dir)
        spec = importlib.util.spec_from_file_location(name, path)
        ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ext)
        if torch.cuda.is_available():
            ext.set_is_capturing(ctypes.cast(libcuda().cuStreamIsCapturing, ctypes.c_void_p).value)
        _EXT = ext
        _STATE["state"] = "ready"
    except Exception as e:  # (no compiler, no ninja, a failed build: the Python path stays)
        _STATE["state"], _STATE["detail"] = "failed", f"{type(e).__name__}: {e}"[:2000]
    finally:
        _DONE.set()


_BUILD = ("import sys, torch.utils.cpp_extension as c; c.load_inline(name=sys.argv[1], cpp_sources=[open(sys.argv[2])"
          ".read()], build_directory=sys.argv[3], extra_cflags=['-O2'], verbose=False)")


def _build(name, build_dir):
    """In a process of its own (torch.utils.cpp_extension prints, warns and locks the build directory itself)."""
    done = subprocess.run([sys.executable, "-c", _BUILD, name, SOURCE, build_dir], capture_output=True, text=True,
                          timeout=1200)
    with open(os.path.join(build_dir, "build.log"), "w") as f:
        f.write(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"building the extension failed (exit {done.returncode}); see {build_dir}/build.log: "
                           f"{done.stderr[-500:]}")


# --- the module's call --------------------------------------------------------------------------------------------

def forward(module, x, w, bias):
    """module's convolution of x through the native path, or None where it does not take it (the caller's Python
    path runs)."""
    ext, device = _EXT, x.device
    if device.type not in DEVICES:
        return None
    if ext is None:
        if _STATE["state"] is None:
            start_build()
        return None
    if torch.compiler.is_compiling() or api.RECORDING.get() is not None:
        return None
    autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    key = (x.shape, x.stride(), x.dtype, device, w.shape, w.stride(), w.dtype,
           None if bias is None else (bias.dtype, bias.stride()), autocast, module.stride, module.padding,
           module.dilation, module.groups, settings.dispatch_token())
    plans = plans_of(module)
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = NativePlan.for_call(ext, module, x, w, bias)
        if len(plans) > 64:  # (a sweep over many shapes: start again)
            plans.clear()
    if plan is False:
        return None
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    return ext.conv(x, w, bias, plan.id, stream)


def plans_of(module) -> dict:
    """The native plans of a module's calls (call key -> NativePlan, or False)."""
    plans = _PLANS.get(module)
    return _PLANS.setdefault(module, {}) if plans is None else plans


class _RawStream:
    """A raw CUstream handle as kernelgen's stream= takes one (an object with cuda_stream)."""
    __slots__ = ("cuda_stream",)

    def __init__(self, handle):
        self.cuda_stream = handle


def _view(t):
    """(N, C, *spatial) -> the (N, *spatial, C) view kernelgen reads (a bias as it is)."""
    return None if t is None else t.detach() if t.dim() == 1 else t.detach().movedim(1, -1)


def _word(value):
    """A driver step's ctypes argument as the integer the C convention passes."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    if isinstance(value, ctypes.Array):
        return ctypes.addressof(value)
    return value.value or 0


class NativePlan:
    """One module call's signature on the native path: the C++ plan (its id) and what its fallback needs."""

    def __init__(self, ext, dtype, ops, kwargs, out_shapes):
        self.ext, self.ops, self.kwargs = ext, ops, kwargs
        self.kept = ({}, {}, {})  # per slot, key -> the LaunchProgram whose memory C++'s copy points into
        self.id = ext.new_plan(str(dtype).removeprefix("torch."), out_shapes, self.fallback, self.refresh)

    @classmethod
    def for_call(cls, ext, module, x, w, bias):
        """The plan of this call, or False where the native path does not take it (the Python path does)."""
        nd = x.dim() - 2
        if module.padding_mode != "zeros" or not isinstance(module.padding, tuple) or nd < 1 or w.dim() != nd + 2 \
                or not settings.get("torch_native"):
            return False
        precision, compute, _ = _precision(x)
        dtype = compute or x.dtype
        if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64) or compute is None and (
                w.dtype != x.dtype or bias is not None and bias.dtype != x.dtype):
            return False
        if (dtype == torch.float64) != (x.device.type == "cpu"):
            return False
        stride, padding, dilation, groups = module.stride, module.padding, module.dilation, module.groups
        n, c, *spatial = x.shape
        k, cg, *filt = w.shape
        out = [conv_out_size(i, f, s, p, d) for i, f, s, p, d in zip(spatial, filt, stride, padding, dilation)]
        x_shape, w_shape = (n, *spatial, c), (k, *filt, cg)
        kwargs = dict(stride=tuple(stride), padding=tuple(padding), dilation=tuple(dilation), groups=groups,
                      backend=x.device.type, precision=precision)
        ops = ((api.conv, ("x", "w", "bias"), ()), (api.conv_backward_data, ("dy", "w"), (x_shape,)),
               (api.conv_backward_weight, ("x", "dy"), (w_shape,)))
        return cls(ext, dtype, ops, kwargs, [[n, *out, k], list(x_shape), list(w_shape)])

    def fallback(self, slot, key, inputs, out):
        """C++ had no program for `key` - (stream, up to three inputs' addresses, 0 where absent, the output's),
        C++'s own key, kept with the program: kernelgen's op into `out`, and the program of these addresses kept in
        C++ where the op's CUDA route has one."""
        stream_handle = key[0]
        _CALLS_BACK["kept" if key in self.kept[slot] else "new addresses"] += 1
        if TRACE is not None:
            TRACE.append((self.id, slot, key))
        op, names, extra = self.ops[slot]
        views = [_view(t) for t in inputs]
        args = (*views, *extra)
        stream = None if not stream_handle else _RawStream(stream_handle)
        kwargs = dict(self.kwargs, out=out)
        if stream is not None:
            kwargs["stream"] = stream
        op(*args, **kwargs)
        if out.is_cuda:
            self._keep(slot, op, args, kwargs, dict(zip(names, views)), key, out, stream)

    def refresh(self, slot, key):
        """The ring uploaded since the program of `key` read its maps: read them again into its words (uploading the
        ones the ring lost); the ring's upload count after, or None where that program is no longer kept here."""
        program = self.kept[slot].get(key)
        if program is None:
            return None
        _CALLS_BACK["maps read again"] += 1
        return program.prepare()[1]

    def _keep(self, slot, op, args, kwargs, named, key, out, stream):
        cuda = api.cuda_route_of(op, args, kwargs)
        if cuda is None or cuda.fast is None or cuda.fast.thread != get_ident():
            return
        named[cuda.out_name] = out
        if any(named.get(name) is None for name in cuda.params):
            return
        ptr_sizes = tuple((named[name].data_ptr(), named[name].numel()) for name in cuda.params)
        launcher = cuda.launcher
        if launcher.kernel_any is not None and not launcher.aligned([p for p, _ in ptr_sizes]):
            return
        program = launcher.program(ptr_sizes, cuda.itemsize, as_numba_stream(stream))
        if not program.kept:
            return
        uploads_at, seen = program.prepare()
        steps = [(ctypes.cast(fn, ctypes.c_void_p).value, [_word(a) for a in step_args])
                 for fn, step_args, _, _ in program.steps]
        kept = self.kept[slot]
        if not self.ext.keep(self.id, slot, list(key), steps, uploads_at, seen):
            kept.clear()
        kept[key] = program
