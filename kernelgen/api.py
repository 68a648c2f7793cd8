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
from .problem import ConvProblem, deconv_output_shape, make_problem
from .render_cpu import render_cpu
from .render_cuda import render_cuda

BACKENDS = ("cuda", "cpu")


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


def tuned_choice(problem, preferred=None):
    """(variant name, TileConfig) from the tuned database for this GPU, or None."""
    if not gpu_present() or os.environ.get("KERNELGEN_NO_TUNED") == "1":
        return None  # databases are per GPU: rendering for CUDA on a GPU-less machine uses the heuristics
    from .tuning import database
    hit = database.lookup(problem, tuned_device(), preferred)
    return None if hit is None else hit[:2]


@dataclass(frozen=True)
class Plan:
    problem: ConvProblem
    variant: str
    config: object
    backend: str

    def key(self):
        from .templates import get_variant
        extra = getattr(get_variant(self.variant), "key_extra", None)  # module-level settings a variant reads
        return (self.problem, self.variant, self.config, self.backend, device_key(self.backend),
                extra(self.problem) if extra else None)

    def kernel_ir(self):
        from .templates import get_variant
        return get_variant(self.variant).build(self.problem, self.config)

    def render(self):
        k = self.kernel_ir()
        return render_cuda(k) if self.backend == "cuda" else render_cpu(k)


def make_plan(problem, backend, algo=None, config=None) -> Plan:
    from .templates import candidates, default_config, get_variant
    if algo is not None:
        variant = get_variant(algo)
        if problem.direction not in variant.DIRECTIONS or not variant.applies(problem):
            raise ValueError(f"algo {algo!r} cannot compute this problem ({problem.key()})")
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


def _run(problem: ConvProblem, inputs: dict, backend, algo, template, config=None):
    plan = make_plan(problem, backend, algo, config)
    launcher = get_launcher(plan)
    out_name = launcher.outputs[0]
    out_shape = problem.output_shape
    n_out = int(np.prod(out_shape))
    if backend == "cuda":
        from numba import cuda
        on_device = arrays.is_cuda_array(template)
        args = {}
        for name, a in inputs.items():
            d = arrays.to_device_view(a, name) if on_device else cuda.to_device(arrays.to_host(a, name, problem.dtype))
            args[name] = d.reshape(d.size)
        args[out_name] = cuda.device_array(n_out, dtype=problem.dtype)
        launcher(args)
        out = args[out_name].reshape(out_shape)
        return arrays.like_input(out, template) if on_device else out.copy_to_host()
    args = {name: arrays.to_host(a, name, problem.dtype).reshape(-1) for name, a in inputs.items()}
    args[out_name] = np.empty(n_out, dtype=problem.dtype)
    launcher(args)
    return args[out_name].reshape(out_shape)


def _check_bias(bias, channels, name="bias"):
    if bias is not None and arrays.shape_of(bias) != (channels,):
        raise ValueError(f"{name} must have shape ({channels},), got {arrays.shape_of(bias)}")


def conv(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, backend=None, algo=None):
    """Convolution (cross-correlation, as in PyTorch) in channels-last layout.

    x: (N, *spatial, C) with 1-3 spatial dims; w: (K, *filter, C // groups); bias: (K,) or None.
    Returns y: (N, *out, K), a NumPy array for NumPy inputs, a CUDA array for CUDA inputs.
    """
    backend = resolve_backend(backend, x, w, bias)
    dt = arrays.check_arrays({"x": x, "w": w, "bias": bias}, backend)
    p = make_problem("fwd", arrays.shape_of(x), arrays.shape_of(w), stride=stride, padding=padding,
                     dilation=dilation, groups=groups, dtype=dt, has_bias=bias is not None)
    _check_bias(bias, p.K)
    inputs = {"x": x, "w": w} if bias is None else {"x": x, "w": w, "bias": bias}
    return _run(p, inputs, backend, algo, x)


def _shape_arg(name, shape):
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, (int, np.integer)) for s in shape):
        raise TypeError(f"{name} must be a tuple of ints, got {shape!r}")
    return tuple(int(s) for s in shape)


def conv_backward_data(dy, w, x_shape, *, stride=1, padding=0, dilation=1, groups=1, backend=None, algo=None):
    """Gradient of conv with respect to x: dx of shape x_shape from dy (N, *out, K) and w."""
    x_shape = _shape_arg("x_shape", x_shape)
    backend = resolve_backend(backend, dy, w)
    dt = arrays.check_arrays({"dy": dy, "w": w}, backend)
    p = make_problem("bwd_data", x_shape, arrays.shape_of(w), stride=stride, padding=padding,
                     dilation=dilation, groups=groups, dtype=dt, y_shape=arrays.shape_of(dy))
    return _run(p, {"dy": dy, "w": w}, backend, algo, dy)


def conv_backward_weight(x, dy, w_shape, *, stride=1, padding=0, dilation=1, groups=1, backend=None, algo=None):
    """Gradient of conv with respect to w: dw of shape w_shape from x and dy."""
    w_shape = _shape_arg("w_shape", w_shape)
    backend = resolve_backend(backend, x, dy)
    dt = arrays.check_arrays({"x": x, "dy": dy}, backend)
    p = make_problem("bwd_weight", arrays.shape_of(x), w_shape, stride=stride, padding=padding,
                     dilation=dilation, groups=groups, dtype=dt, y_shape=arrays.shape_of(dy))
    return _run(p, {"x": x, "dy": dy}, backend, algo, x)


def deconv(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1, backend=None,
           algo=None):
    """Transposed convolution (PyTorch's conv_transpose semantics), channels-last.

    x: (N, *spatial, C_in); w: (C_in, *filter, C_out // groups); bias: (C_out,) or None.
    It is the backward-data pass of the convolution whose weight is w.
    """
    backend = resolve_backend(backend, x, w, bias)
    dt = arrays.check_arrays({"x": x, "w": w, "bias": bias}, backend)
    out_shape = deconv_output_shape(arrays.shape_of(x), arrays.shape_of(w), stride, padding, output_padding,
                                    dilation, groups)
    p = make_problem("bwd_data", out_shape, arrays.shape_of(w), stride=stride, padding=padding,
                     dilation=dilation, groups=groups, dtype=dt)
    _check_bias(bias, out_shape[-1])
    dy = x if p.y_shape == arrays.shape_of(x) else _zero_extend(x, p.y_shape)
    y = _run(p, {"dy": dy, "w": w}, backend, algo, x)
    if bias is not None:
        y = _add_bias(y, bias)
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


def _add_bias(y, bias):
    if isinstance(y, np.ndarray):
        y += np.asarray(bias, y.dtype)
        return y
    from .runtime.elementwise import add_channel_bias
    add_channel_bias(y, bias)
    return y


# --- explain ---------------------------------------------------------------------------------------

@dataclass
class Explanation:
    problem: ConvProblem
    variant: str
    config: object
    backend: str
    source: str

    def __str__(self):
        return (f"problem : {self.problem.key()}\nvariant : {self.variant}\nconfig  : {self.config}\n"
                f"backend : {self.backend}\n{'-' * 72}\n{self.source}")


_OPS = {"conv": "fwd", "conv_backward_data": "bwd_data", "conv_backward_weight": "bwd_weight", "deconv": "bwd_data"}


def explain(op, *args, **kwargs) -> Explanation:
    """What kernelgen would run for `op(*args, **kwargs)`: problem, variant, config and the generated
    source, without running it.  op is a kernelgen function or its name ("conv", "deconv", ...)."""
    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    if name not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    captured = {}

    def capture(problem, inputs, backend, algo, template, config=None):
        captured["plan"] = make_plan(problem, backend, algo, config)
        return None

    global _run
    real, _run = _run, capture
    try:
        globals()[name](*args, **kwargs)
    finally:
        _run = real
    plan = captured["plan"]
    return Explanation(plan.problem, plan.variant, plan.config, plan.backend, plan.render())
