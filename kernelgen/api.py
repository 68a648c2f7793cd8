"""The public API: conv, conv_backward_data, conv_backward_weight, deconv, explain.

problem -> template -> IR -> passes -> renderer -> cache -> launch, in that order, one way.
All validation happens in the first step, before anything is compiled or launched.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from . import arrays
from .problem import ConvProblem, check_activation, deconv_output_shape, make_problem
from .render_cpu import render_cpu
from .render_cuda import render_cuda
from .storage import check_dtype_precision, check_split_k

BACKENDS = ("cuda", "cpu")

# --- precision: the caller's choice, never silent ----------------------------------------------------
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
_precision = "fp32"


def check_precision(precision, name="precision"):
    if precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {PRECISIONS}, got {precision!r}")
    return precision


def set_precision(precision):
    """The default precision of every later call that passes no precision= (like PyTorch's
    allow_tf32): "fp32" (the default), or a tensor-core precision with fp32 accumulation and float32
    inputs and outputs: "tf32" (operands rounded to 10 mantissa bits; about 1e-4 relative error),
    "fp16" (10 bits, fp16's range: large inputs overflow; float16 inputs and outputs too) or "bf16"
    (7 bits; about 1e-3 to 1e-2).  Returns the previous setting."""
    global _precision
    old, _precision = _precision, check_precision(precision)
    return old


def get_precision():
    return _precision


def resolve_precision(precision):
    """A call's precision: its own argument, else the global setting."""
    return _precision if precision is None else check_precision(precision)


@functools.lru_cache(maxsize=None)
def gpu_present() -> bool:
    """A real GPU (the simulator does not count: it is a debugging tool, ~ms per thread)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    from .runtime.arena import install_from_env
    install_from_env()  # KERNELGEN_ARENA=1: numba accepts a memory manager only before its context exists
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:
        return False


def resolve_backend(backend, *inputs):
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'cuda' or 'cpu', got {backend!r}")
    if backend is None:
        on_device = any(arrays.is_cuda_array(a) for a in inputs if a is not None)
        backend = "cuda" if on_device or gpu_present() else "cpu"
    return backend


def device_key(backend):
    if backend != "cuda":
        return "cpu"
    from numba import cuda
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "cudasim"
    return "sm_%d%d" % cuda.get_current_device().compute_capability


@functools.lru_cache(maxsize=None)
def tuned_device():
    from .tuning.tuner import device_name
    return device_name()


def _tuned_db():
    if not gpu_present() or os.environ.get("KERNELGEN_NO_TUNED") == "1":
        return None  # databases are per GPU: rendering for CUDA on a GPU-less machine uses the heuristics
    from .tuning import database
    return database


def tuned_choice(problem, preferred=None):
    """(variant name, TileConfig) from the tuned database for this GPU, or None."""
    db = _tuned_db()
    hit = None if db is None else db.lookup(problem, tuned_device(), preferred)
    return None if hit is None else hit[:2]


def tuned_variant_config(problem, variant):
    """The tuned database's fastest config of a forced variant on exactly this problem, or None."""
    db = _tuned_db()
    return None if db is None else db.tuned_config(problem, tuned_device(), variant)


def tuned_tensor_core_config(problem, precision):
    """The tuned database's fastest tensor-core config for exactly this problem at `precision` (written by
    `python -m kernelgen tune TABLE --precision ...`), or None."""
    db = _tuned_db()
    if db is None:
        return None
    from .templates import implicit_gemm_tc
    return db.tuned_config(problem, tuned_device(), implicit_gemm_tc.NAME, precision)


@dataclass(frozen=True)
class Plan:
    problem: ConvProblem
    variant: str
    config: object
    backend: str
    precision: str | None = None  # None: the variant's own (fp32, or tf32 for a tensor-core variant)

    def __post_init__(self):
        from .templates import get_variant
        own = getattr(get_variant(self.variant), "PRECISIONS", ("fp32",))
        if self.precision is None:
            object.__setattr__(self, "precision", own[0])
        elif self.precision not in own:
            raise ValueError(f"variant {self.variant!r} computes in {own}, not precision={self.precision!r}")

    def key(self):
        from .templates import get_variant
        extra = getattr(get_variant(self.variant), "key_extra", None)  # module-level settings a variant reads
        from .render_cuda import index32_enabled
        options = ("index32", index32_enabled()) if self.backend == "cuda" else ()  # what the renderer reads
        return (self.problem, self.variant, self.config, self.backend, device_key(self.backend),
                extra(self.problem) if extra else None, self.precision) + options

    def kernel_ir(self):
        from .templates import get_variant
        if self.precision != "fp32":  # a tensor-core variant: the operand format is a build argument
            return get_variant(self.variant).build(self.problem, self.config, self.precision)
        return get_variant(self.variant).build(self.problem, self.config)

    def render(self):
        k = self.kernel_ir()
        return render_cuda(k) if self.backend == "cuda" else render_cpu(k)


def _hopper_untuned_config(problem, precision):
    """fp16 on an sm_90 GPU with no tuned entry: the TMA tile measured best on average there
    (tuner.untuned_tma_config; the template's mma.sync default is 2-3x slower on those problems), or None."""
    if precision != "fp16" or not gpu_present():
        return None
    from .tuning.tuner import untuned_tma_config
    config = untuned_tma_config(problem, precision)
    return config if config is not None and device_key("cuda") == "sm_90" else None


def _tensor_core_plan(problem, backend, algo, config, precision) -> Plan:
    """The tensor-core implicit GEMM at `precision`: the given config, else (CUDA, a GPU present, tuned
    databases not turned off) the tuned entry for exactly (problem, precision), else (fp16 on sm_90) the untuned
    TMA tile, else the template's default."""
    from .templates import implicit_gemm, implicit_gemm_tc
    if algo not in (None, implicit_gemm.NAME, implicit_gemm_tc.NAME):
        raise ValueError(f"precision={precision!r} is implemented by algo={implicit_gemm.NAME!r} only, got "
                         f"algo={algo!r}")
    if config is None and backend == "cuda":
        config = tuned_tensor_core_config(problem, precision) or _hopper_untuned_config(problem, precision)
    if config is None:
        config = implicit_gemm_tc.default_config(problem, backend, precision)
    if not config.tensor_core:
        raise ValueError(f"config must be a tensor-core TileConfig (WM, WN > 0) for precision={precision!r}, "
                         f"got {config}")
    config.validate()
    implicit_gemm_tc.check_config(config, precision)
    check_split_k(problem.dtype, config)
    if backend != "cuda" and config.split_k > 1:
        raise ValueError(f"config.split_k must be 1 on the {backend} backend, got {config.split_k}")
    return Plan(problem, implicit_gemm_tc.NAME, config, backend, precision)


def make_plan(problem, backend, algo=None, config=None, precision="fp32") -> Plan:
    """precision: "fp32" (the fp32 variants) or "tf32" / "fp16" / "bf16" (the tensor-core implicit GEMM); never the global
    setting here: the API functions resolve that."""
    from .templates import candidates, computes, default_config, get_variant
    check_dtype_precision(problem.dtype, check_precision(precision))  # float16 tensors: precision="fp16" only
    if precision != "fp32":
        return _tensor_core_plan(problem, backend, algo, config, precision)
    if algo is not None:
        variant = get_variant(algo)
        if not computes(variant, problem):
            raise ValueError(f"algo {algo!r} cannot compute this problem ({problem.key()})")
        if getattr(variant, "PRECISIONS", ("fp32",)) != ("fp32",):
            raise ValueError(f"algo {algo!r} computes in {variant.PRECISIONS[0]}: ask for it with "
                             f"precision={variant.PRECISIONS[0]!r}")
        if config is None and backend == "cuda":
            config = tuned_variant_config(problem, variant.NAME)
    else:
        variant = candidates(problem)[0]
        if config is None and backend == "cuda":
            tuned = tuned_choice(problem, variant.NAME)
            if tuned is not None:
                variant, config = get_variant(tuned[0]), tuned[1]
    if config is None:
        config = default_config(problem, backend, variant)
    if backend != "cuda" and config.split_k > 1:
        raise ValueError(f"config.split_k must be 1 on the {backend} backend, got {config.split_k}")
    return Plan(problem, variant.NAME, config, backend)


def get_launcher(plan: Plan):
    from .runtime.cache import KERNELS
    from .runtime.launch import Launcher
    return KERNELS.get(plan.key(), plan.render, lambda module: Launcher.from_module(module, plan.backend))


@dataclass
class Prepared:
    """Everything a call with a given signature needs: validated problem, plan, and (fetched on the
    first run, so that explain() never compiles) the launcher."""
    problem: ConvProblem
    plan: Plan
    _launcher: object = None

    @property
    def backend(self):
        return self.plan.backend

    @property
    def launcher(self):
        if self._launcher is None:
            self._launcher = get_launcher(self.plan)
        return self._launcher


# call signature (op, argument types/shapes/dtypes, keyword values, variant settings) -> Prepared.
# A repeated call with the same signature skips validation, planning, the database and the cache.
_PREPARED: dict = {}


def clear_caches():
    """Forget prepared calls and loaded tuning databases (after tuning in this process, say)."""
    _PREPARED.clear()
    from .tuning import database
    database.entries_for.cache_clear()


def _array_sig(a):
    return None if a is None else (type(a), tuple(a.shape), a.dtype) if hasattr(a, "shape") else (type(a), id(a))


def _settings_token():
    from .templates import settings_token  # imported here: templates import this package
    global _settings_token
    _settings_token = settings_token      # every later call goes straight to it
    return settings_token()


def _prepare(sig, build, algo, config=None, precision=None) -> Prepared:
    """The memoised front half of every op: `build()` validates arguments and returns (problem,
    backend); it runs only on the first call with this signature.  precision: the call's argument
    (None: the global setting), resolved on every call so that set_precision() takes effect."""
    key = sig + (algo, config, _settings_token(), _precision if precision is None else check_precision(precision))
    precision = key[-1]
    try:
        hit = _PREPARED.get(key)
    except TypeError:  # an unhashable argument (a list for padding, say): validate every time
        key, hit = None, None
    if hit is None:
        problem, backend = build()
        plan = make_plan(problem, backend, algo, config, precision)
        hit = Prepared(problem, plan)
        if key is not None:
            _PREPARED[key] = hit
    return hit


def _run_cuda(*args):
    from .runtime.cuda_call import run_cuda
    global _run_cuda
    _run_cuda = run_cuda
    return run_cuda(*args)


def _run(prep: Prepared, inputs: dict, template, stream=None, out=None):
    if prep.backend == "cuda":
        return _run_cuda(prep, inputs, template, stream, out)
    if stream is not None:
        raise ValueError(f"stream must be None on the cpu backend, got {stream!r}")
    problem = prep.problem
    result = arrays.check_out(out, problem.output_shape, problem.dtype, False) if out is not None else \
        np.empty(problem.output_shape, dtype=problem.dtype)  # (checked before the kernel is compiled)
    launcher = prep.launcher
    args = {name: arrays.to_host(a, name, problem.dtype).reshape(-1) for name, a in inputs.items()}
    args[launcher.outputs[0]] = result.reshape(-1)
    launcher(args)
    return result


def _check_bias(bias, channels, name="bias"):
    if bias is not None and arrays.shape_of(bias) != (channels,):
        raise ValueError(f"{name} must have shape ({channels},), got {arrays.shape_of(bias)}")


def conv(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, activation=None, backend=None, algo=None,
         stream=None, out=None, precision=None):
    """Convolution (cross-correlation, as in PyTorch) in channels-last layout.

    x: (N, *spatial, C) with 1-3 spatial dims; w: (K, *filter, C // groups); bias: (K,) or None.
    activation: None or "relu", applied in the kernel's epilogue after the bias (one pass over y, as
    cuDNN's fused convolution + bias + activation).
    Returns y: (N, *out, K), a NumPy array for NumPy inputs, a CUDA array for CUDA inputs (written
    into `out` when given).  `stream`: a numba/torch/CuPy CUDA stream to run on (default stream if None).
    `precision`: "fp32", or "tf32" / "fp16" / "bf16" (tensor cores); None: kernelgen.set_precision's
    setting, "fp32" unless changed.
    """
    def build():
        be = resolve_backend(backend, x, w, bias)
        dt = arrays.check_arrays({"x": x, "w": w, "bias": bias}, be)
        p = make_problem("fwd", arrays.shape_of(x), arrays.shape_of(w), stride=stride, padding=padding,
                         dilation=dilation, groups=groups, dtype=dt, has_bias=bias is not None, activation=activation)
        _check_bias(bias, p.K)
        return p, be
    sig = ("fwd", _array_sig(x), _array_sig(w), _array_sig(bias), stride, padding, dilation, groups,
           check_activation(activation), backend)  # checked before it is hashed into the signature
    prep = _prepare(sig, build, algo, precision=precision)
    inputs = {"x": x, "w": w} if bias is None else {"x": x, "w": w, "bias": bias}
    return _run(prep, inputs, x, stream, out)


def _shape_arg(name, shape):
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, (int, np.integer)) for s in shape):
        raise TypeError(f"{name} must be a tuple of ints, got {shape!r}")
    return tuple(int(s) for s in shape)


def conv_backward_data(dy, w, x_shape, *, stride=1, padding=0, dilation=1, groups=1, backend=None, algo=None,
                       stream=None, out=None, precision=None):
    """Gradient of conv with respect to x: dx of shape x_shape from dy (N, *out, K) and w."""
    def build():
        be = resolve_backend(backend, dy, w)
        dt = arrays.check_arrays({"dy": dy, "w": w}, be)
        p = make_problem("bwd_data", _shape_arg("x_shape", x_shape), arrays.shape_of(w), stride=stride,
                         padding=padding, dilation=dilation, groups=groups, dtype=dt, y_shape=arrays.shape_of(dy))
        return p, be
    sig = ("bwd_data", _array_sig(dy), _array_sig(w), x_shape, stride, padding, dilation, groups, backend)
    return _run(_prepare(sig, build, algo, precision=precision), {"dy": dy, "w": w}, dy, stream, out)


def conv_backward_weight(x, dy, w_shape, *, stride=1, padding=0, dilation=1, groups=1, backend=None, algo=None,
                         stream=None, out=None, precision=None):
    """Gradient of conv with respect to w: dw of shape w_shape from x and dy."""
    def build():
        be = resolve_backend(backend, x, dy)
        dt = arrays.check_arrays({"x": x, "dy": dy}, be)
        p = make_problem("bwd_weight", arrays.shape_of(x), _shape_arg("w_shape", w_shape), stride=stride,
                         padding=padding, dilation=dilation, groups=groups, dtype=dt, y_shape=arrays.shape_of(dy))
        return p, be
    sig = ("bwd_weight", _array_sig(x), _array_sig(dy), w_shape, stride, padding, dilation, groups, backend)
    return _run(_prepare(sig, build, algo, precision=precision), {"x": x, "dy": dy}, x, stream, out)


def deconv(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1, backend=None,
           algo=None, stream=None, out=None, precision=None):
    """Transposed convolution (PyTorch's conv_transpose semantics), channels-last.

    x: (N, *spatial, C_in); w: (C_in, *filter, C_out // groups); bias: (C_out,) or None.
    It is the backward-data pass of the convolution whose weight is w.
    """
    def build():
        be = resolve_backend(backend, x, w, bias)
        dt = arrays.check_arrays({"x": x, "w": w, "bias": bias}, be)
        out_shape = deconv_output_shape(arrays.shape_of(x), arrays.shape_of(w), stride, padding, output_padding,
                                        dilation, groups)
        p = make_problem("bwd_data", out_shape, arrays.shape_of(w), stride=stride, padding=padding,
                         dilation=dilation, groups=groups, dtype=dt)
        _check_bias(bias, out_shape[-1])
        return p, be
    sig = ("deconv", _array_sig(x), _array_sig(w), _array_sig(bias), stride, padding, output_padding, dilation,
           groups, backend)
    prep = _prepare(sig, build, algo, precision=precision)
    dy = x if prep.problem.y_shape == arrays.shape_of(x) else _zero_extend(x, prep.problem.y_shape)
    y = _run(prep, {"dy": dy, "w": w}, x, stream, out)
    if bias is not None:
        y = _add_bias(y, bias, stream)
    return y


def _zero_extend(a, shape):
    """`a` followed by zeros up to `shape`.  An output_padding >= stride (allowed when dilation > stride)
    makes the convolution that deconv transposes produce trailing outputs that no element of x feeds:
    its dy there is zero."""
    if not arrays.is_cuda_array(a):
        a = np.asarray(a)
        return np.pad(a, [(0, n - m) for n, m in zip(shape, a.shape)])
    from numba import cuda
    from .runtime.launch import fill_device
    d = arrays.to_device_view(a, "x")
    out = cuda.device_array(shape, d.dtype)
    fill_device(out.reshape(out.size), 0)
    out[tuple(slice(0, m) for m in d.shape)] = d
    return out


def _add_bias(y, bias, stream=None):
    if isinstance(y, np.ndarray):
        y += np.asarray(bias, y.dtype)
        return y
    from .runtime.elementwise import add_channel_bias
    add_channel_bias(y, bias, stream)
    return y


# --- explain ---------------------------------------------------------------------------------------

@dataclass
class Explanation:
    problem: ConvProblem
    variant: str
    config: object
    backend: str
    source: str
    precision: str = "fp32"

    def __str__(self):
        return (f"problem : {self.problem.key()}\nvariant : {self.variant}\nconfig  : {self.config}\n"
                f"backend : {self.backend}\nprecision: {self.precision}\n{'-' * 72}\n{self.source}")


_OPS = {"conv": "fwd", "conv_backward_data": "bwd_data", "conv_backward_weight": "bwd_weight", "deconv": "bwd_data"}


def _captured_call(op, args, kwargs, allowed):
    """(prep, inputs, template, stream, out) of `op(*args, **kwargs)`, captured before it would run."""
    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    if name not in allowed:
        raise ValueError(f"op must be one of {sorted(allowed)}, got {op!r}")
    captured = {}

    def capture(prep, inputs, template, stream=None, out=None):
        captured["call"] = (prep, inputs, template, stream, out)
        return None

    global _run
    real, _run = _run, capture
    try:
        globals()[name](*args, **kwargs)
    finally:
        _run = real
    return captured["call"]


def bind(op, *args, **kwargs):
    """`op(*args, **kwargs)` on CUDA arrays, run once and bound to its buffers: returns a zero-argument
    callable that reruns it on whatever those buffers hold now and returns the same output array
    (`out=` if given, else the one the first run allocated).  Argument checks, planning and pointer
    extraction happen once, so a call costs one kernel launch from Python (like replaying a CUDA
    graph).  For conv, conv_backward_data and conv_backward_weight."""
    prep, inputs, template, stream, out = _captured_call(op, args, kwargs, set(_OPS) - {"deconv"})
    if prep.backend != "cuda" or not arrays.is_cuda_array(template):
        raise ValueError(f"bind needs CUDA arrays on the cuda backend, got {type(template).__name__} on "
                         f"the {prep.backend} backend")
    from .runtime.cuda_call import bound_call
    return bound_call(prep, inputs, template, stream, out)


def explain(op, *args, **kwargs) -> Explanation:
    """What kernelgen would run for `op(*args, **kwargs)`: problem, variant, config and the generated
    source, without running it.  op is a kernelgen function or its name ("conv", "deconv", ...)."""
    plan = _captured_call(op, args, kwargs, _OPS)[0].plan
    return Explanation(plan.problem, plan.variant, plan.config, plan.backend, plan.render(), plan.precision)
