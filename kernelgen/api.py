"""The public API: conv, conv_backward_data, conv_backward_weight, deconv, explain, bind.

problem -> planner -> template -> IR -> passes -> renderer -> cache -> launch, in that order, one way.
Each op is written once as a function that checks and plans the call (returning a `Call`, nothing run);
the public op runs that Call, `explain` renders it, `bind` binds it.  No public call changes state that
another call reads.  All validation happens before anything is compiled or launched.
"""
from __future__ import annotations

import dataclasses
import functools
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np

from . import arrays, compile_profile, settings
from .planner import (BACKENDS, Plan, check_precision, device_key, forget_rendered, get_launcher,  # noqa: F401
                      gpu_present, make_plan, resolve_precision, tuned_choice, tuned_device, tuned_tensor_core_config,
                      tuned_variant_config)
from .problem import ConvProblem, check_activation, conv_out_size, deconv_output_shape, make_problem
from .dispatch import DispatchCache, signature
from .runtime import batch_fallback
from .runtime.capture import raw_handle, refuse_if_capturing
from .runtime.cuda_call import CudaRoute, bound_call
from .runtime.driver import as_numba_stream, fill_device, quiet_launches
from .runtime.elementwise import add_channel_bias
from .storage import PRECISIONS, numpy_dtype  # noqa: F401 (PRECISIONS re-exported)
from .tuning import autotune, database


def set_precision(precision):
    """The default precision of every later call that passes no precision= (like PyTorch's
    allow_tf32), in every thread: "fp32" (the default), or a tensor-core precision with fp32 accumulation
    and float32 inputs and outputs: "tf32" (operands rounded to 10 mantissa bits; about 1e-4 relative
    error), "fp16" (10 bits, fp16's range: large inputs overflow; float16 inputs and outputs too) or "bf16"
    (7 bits; about 1e-3 to 1e-2).  Returns the previous setting.  For one block of one thread:
    `with kernelgen.settings.scope(precision="tf32"):`."""
    return settings.set("precision", check_precision(precision))


def get_precision():
    return settings.get("precision")


def set_autotune(enabled: bool) -> bool:
    """First-call autotuning on or off for every later call, in every thread (like torch.backends.cudnn.benchmark;
    for one block of one thread: `with kernelgen.settings.scope(autotune=True):`).  On, the first call of a problem
    no tuned entry decides compiles the planner's pick and the next candidates side by side, verifies them against
    float64, times them within the autotune_budget setting's seconds and keeps the fastest in the user's tuned
    database, which later calls and processes plan from (kernelgen.tuning.autotune).  Returns the previous value."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    return settings.set("autotune", enabled)


def resolve_backend(backend, *inputs):
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'cuda' or 'cpu', got {backend!r}")
    if backend is None:
        on_device = any(arrays.is_cuda_array(a) for a in inputs if a is not None)
        backend = "cuda" if on_device or gpu_present() else "cpu"
    elif backend == "cuda":
        _check_cuda_available()  # before planning, which reads the device's facts
    return backend


@dataclass
class Prepared:
    """Everything a call with a given signature needs: validated problem, plan, and (fetched on the
    first run, so that explain() never compiles) the launcher.  plan is None for a problem with nothing
    to compute (N = 0, or an empty spatial size): its output is empty, or zeros for backward-weight."""
    problem: ConvProblem
    plan: Plan | None
    backend: str
    _launcher: object = None
    kept_borrow: object = None  # runtime.batch_fallback: the larger batch's Prepared this call runs on for good

    @property
    def launcher(self):
        if self._launcher is None:
            self._launcher = get_launcher(self.plan)  # two threads may both fetch it: the cache returns one
        return self._launcher

    @property
    def has_launcher(self) -> bool:
        """Is the launcher fetched already (its kernel compiled or loaded, or adopted)?"""
        return self._launcher is not None

    def adopt(self, launcher):
        """Run `launcher` for this call from now on, not the plan's own kernel (runtime.batch_fallback: a larger
        batch's kernel on fewer blocks, which computes this call's problem)."""
        self._launcher = launcher


class Call:
    """One op's call, checked and planned, not yet run: what `explain` shows and `bind` binds.  (A plain class
    with slots, not a frozen dataclass: one is made on every call that misses the dispatch cache, and a frozen
    dataclass's __init__ sets each field through object.__setattr__.)"""
    __slots__ = ("prep", "inputs", "template", "stream", "out", "finish", "borrowed")

    def __init__(self, prep: Prepared, inputs: dict, template, stream=None, out=None, finish=None):
        self.prep = prep
        self.inputs = inputs
        self.template = template  # the input whose kind (NumPy, torch, CuPy, numba) the result takes
        self.stream = stream
        self.out = out
        self.finish = finish  # result -> result, after the kernel (deconv's bias)
        self.borrowed = False  # ran on a larger batch's kernel (runtime.batch_fallback): no route kept


# call signature (op, argument types/shapes/dtypes, keyword values with their types, settings) -> Prepared.
# A repeated call with the same signature skips validation, planning, the database and the cache; a value
# of another type (stride=1.0 after stride=1) is another signature, so it is validated (and refused).
_PREPARED: dict = {}
# the public ops' fast path (kernelgen.dispatch): the full signature of a call that succeeded -> its _Route
_DISPATCH = DispatchCache()
# kernelgen.precompile.recording(): while set (a list, per thread / task), calls are planned, their Prepared
# appended, and zero-filled outputs returned; nothing runs
RECORDING: ContextVar = ContextVar("kernelgen_recording", default=None)


def clear_caches():
    """Forget prepared calls, dispatch routes, loaded tuning databases (after tuning in this process, say) and
    rendered sources."""
    _PREPARED.clear()
    _DISPATCH.clear()
    database.entries_for.cache_clear()
    forget_rendered()


def _array_sig(a):
    return None if a is None else (type(a), tuple(a.shape), a.dtype)


def _typed(v):
    """A keyword value as it enters a signature: with its type, since 1 == 1.0 == True as dict keys."""
    if type(v) is int or v is None:
        return v
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_typed(e) for e in v))
    return (type(v), v)


def _prepare(sig, build, algo, config=None, precision=None) -> Prepared:
    """The memoised front half of every op: `build()` validates arguments and returns (problem,
    backend); it runs only on the first call with this signature.  precision: the call's argument
    (None: the setting in force), resolved on every call so that set_precision() takes effect; bfloat16 tensors
    compute at "bf16", their one precision, unless the call names another (which the plan then refuses)."""
    given, precision = precision, resolve_precision(precision)
    # dispatch_token, not only code_token: settings that steer planning without changing code (no_tuned, model)
    key = sig + (_typed(algo), config, settings.dispatch_token(), precision)
    try:
        hit = _PREPARED.get(key)
    except TypeError:  # an unhashable argument (a dict for padding, say): validate every time
        key, hit = None, None
    if hit is None:
        problem, backend = build()
        if given is None and problem.dtype == "bfloat16":  # (the signature holds the dtype: one answer per key)
            precision = "bf16"
        if problem.empty:  # nothing runs, but the call's algo / config / precision are checked as for any size
            make_plan(_stand_in(problem), backend, algo, config, precision)
        with compile_profile.kernel_scope(problem.key()):
            with compile_profile.stage("plan"):
                plan = None if problem.empty else make_plan(problem, backend, algo, config, precision)
            if autotune.wanted(plan, config):  # (opt-in: the first call of an untuned problem times its candidates)
                with compile_profile.stage("autotune"):
                    plan = autotune.autotune(plan, algo)
        hit = Prepared(problem, plan, backend)
        if key is not None:
            _PREPARED[key] = hit
    return hit


def _stand_in(problem):
    """The smallest non-empty problem with problem's hyper-parameters: a batch of one, and each empty spatial size
    the smallest that gives one output."""
    sizes = tuple(i or max(1, d * (f - 1) + 1 - 2 * p) for i, f, p, d in
                  zip(problem.in_size, problem.filter_size, problem.padding, problem.dilation))
    out = tuple(conv_out_size(*a) for a in zip(sizes, problem.filter_size, problem.stride, problem.padding,
                                                  problem.dilation))
    return dataclasses.replace(problem, N=max(problem.N, 1), in_size=sizes, out_size=out)


def _run(call: Call):
    prep = call.prep
    if prep.plan is None:
        result = _empty_output(call)
    elif prep.backend == "cuda":
        _check_cuda_available()
        result, call.borrowed = batch_fallback.run(prep, call.inputs, call.template, call.stream, call.out)
    else:
        result = _run_cpu(call)
    return result if call.finish is None else call.finish(result)


class _Route:
    """A dispatch-cache entry: how a call whose signature once succeeded runs again.  `binding(prep, *args,
    **kwargs)` names the call's arrays (as the op's own planning did the first time); everything the signature
    fixes (the checks, the plan, the CUDA availability and the output's kind) is not looked at again.  Holds no
    array of any call."""
    __slots__ = ("prep", "binding", "cuda")

    def __init__(self, prep: Prepared, binding, template, inputs: dict):
        self.prep = prep
        self.binding = binding
        fast = prep.plan is not None and prep.backend == "cuda"
        self.cuda = CudaRoute(prep, template, inputs) if fast else None

    def __call__(self, args, kwargs):
        inputs, template, stream, out, finish = self.binding(self.prep, *args, **kwargs)
        if self.cuda is not None:
            result = self.cuda(inputs, template, stream, out)
        else:
            call = Call(self.prep, inputs, template, stream, out)
            result = _empty_output(call) if self.prep.plan is None else _run_cpu(call)
        return result if finish is None else finish(result)


def _check_cuda_available():
    if not settings.get("cuda_simulator") and not gpu_present():
        raise ValueError("backend='cuda' needs a CUDA GPU, and numba finds none here; pass backend='cpu' "
                         "(or NumPy arrays with backend=None)")


def _run_cpu(call: Call):
    prep = call.prep
    if call.stream is not None:
        raise ValueError(f"stream must be None on the cpu backend, got {call.stream!r}")
    problem = prep.problem
    result = arrays.check_out(call.out, problem.output_shape, problem.dtype, False) if call.out is not None \
        else np.empty(problem.output_shape, dtype=numpy_dtype(problem.dtype))  # (checked before the kernel compiles)
    launcher = prep.launcher
    args = {name: arrays.to_host(a, name, problem.dtype).reshape(-1) for name, a in call.inputs.items()}
    args[launcher.outputs[0]] = result.reshape(-1)
    launcher(args)
    return call.out if call.out is not None else arrays.like_input(result, call.template)


def _empty_output(call: Call):
    """The result of a problem with nothing to compute: an empty output, or (backward-weight over an empty
    batch) a zero gradient, as PyTorch gives."""
    problem, out = call.prep.problem, call.out
    shape, dtype = problem.output_shape, problem.dtype
    if call.prep.backend != "cuda":
        if call.stream is not None:
            raise ValueError(f"stream must be None on the cpu backend, got {call.stream!r}")
        if out is not None:
            arrays.check_out(out, shape, dtype, False)[...] = 0
            return out
        return arrays.like_input(np.zeros(shape, numpy_dtype(dtype)), call.template)
    _check_cuda_available()
    nstream = as_numba_stream(call.stream)
    if out is not None:
        arrays.check_out(out, shape, dtype, True)
        view = arrays.to_device_view(out, "out")
    else:
        from numba import cuda
        view = cuda.device_array(shape, numpy_dtype(dtype), stream=nstream or 0)
    if view.size:
        fill_device(view.reshape(view.size), 0, nstream)
    return out if out is not None else arrays.like_input(view, call.template)


def _check_bias(bias, channels, name="bias"):
    if bias is not None and arrays.shape_of(bias) != (channels,):
        raise ValueError(f"{name} must have shape ({channels},), got {arrays.shape_of(bias)}")


def _op(binding):
    """The public op of a planning function: look the call's signature up in the dispatch cache and run its
    route; on a miss plan the call (validating everything), run it, and keep its route once it succeeded.
    `binding(prep, *args, **kwargs)` -> (inputs, template, stream, out, finish) names the call's arrays, for the
    planning function and the route alike.  `op.plan_call` is what explain and bind use, so they never swap out
    a function that concurrent calls go through."""
    def decorate(plan_call):
        name = plan_call.__name__

        @functools.wraps(plan_call)
        def op(*args, **kwargs):
            recording = RECORDING.get()
            if recording is not None:
                return _record(recording, plan_call(*args, **kwargs))
            key = signature(name, args, kwargs)
            route = _DISPATCH.get(key)
            if route is not None:
                return route(args, kwargs)
            stream = kwargs.get("stream")
            if stream is not None:  # (planning compiles and loads a kernel: never inside a CUDA graph capture)
                refuse_if_capturing(raw_handle(stream), "a call's first run (it plans and compiles its kernel)")
            call = plan_call(*args, **kwargs)
            result = _run(call)
            if not call.borrowed:
                _DISPATCH.put(key, _Route(call.prep, binding, call.template, call.inputs))
            return result
        op.plan_call = plan_call
        return op
    return decorate


def cuda_route_of(op, args, kwargs):
    """The CUDA route (runtime.cuda_call.CudaRoute) that a repeated call op(*args, **kwargs) takes, or None where no
    call of its signature has succeeded yet or it has none (the CPU backend, an empty problem, a borrowed kernel).
    kernelgen.torch launches a repeated torch call through it directly (kernelgen/torch/direct.py)."""
    route = _DISPATCH.get(signature(op.__name__, args, kwargs))
    return None if route is None else route.cuda


def _record(recording: list, call: Call):
    """A call under kernelgen.precompile.recording(): its plan kept, a zero-filled output of the right shape
    and kind (host, device, torch) returned, no kernel compiled or run."""
    recording.append(call.prep.plan)  # (None for an empty problem)
    if call.prep.backend == "cuda" and not arrays.is_cuda_array(call.template):  # host arrays, cuda backend
        return arrays.like_input(np.zeros(call.prep.problem.output_shape, numpy_dtype(call.prep.problem.dtype)),
                                 call.template)
    return _empty_output(call)


def _bind_x_w(prep, x, w, bias=None, *, stream=None, out=None, **_):
    """conv's arrays: x (the result's kind), w and bias."""
    return ({"x": x, "w": w} if bias is None else {"x": x, "w": w, "bias": bias}), x, stream, out, None


def _bind_dy_w(prep, dy, w, x_shape=None, *, stream=None, out=None, **_):
    return {"dy": dy, "w": w}, dy, stream, out, None


def _bind_x_dy(prep, x, dy, w_shape=None, *, stream=None, out=None, **_):
    return {"x": x, "dy": dy}, x, stream, out, None


def _bind_deconv(prep, x, w, bias=None, *, stream=None, out=None, **_):
    """deconv's arrays: x is dy, zero-extended where output_padding makes the transposed convolution's y longer
    than x; the bias is added after the kernel."""
    problem = prep.problem
    dy = x if problem.empty or problem.y_shape == arrays.shape_of(x) else _zero_extend(x, problem.y_shape)
    finish = None if bias is None or problem.empty else functools.partial(_add_bias, bias=bias, stream=stream)
    return {"dy": dy, "w": w}, x, stream, out, finish


@_op(_bind_x_w)
def conv(x, w, bias=None, *, stride=1, padding=0, dilation=1, groups=1, activation=None, backend=None, algo=None,
         stream=None, out=None, precision=None):
    """Convolution (cross-correlation, as in PyTorch) in channels-last layout.

    x: (N, *spatial, C) with 1-3 spatial dims; w: (K, *filter, C // groups); bias: (K,) or None.
    padding: an int, one per spatial dim, or "valid" / "same" (stride 1; PyTorch's semantics).
    activation: None or "relu", applied in the kernel's epilogue after the bias (one pass over y, as
    cuDNN's fused convolution + bias + activation).
    Returns y: (N, *out, K), a NumPy array for NumPy inputs (a torch tensor for torch CPU tensors), a CUDA
    array for CUDA inputs (written into `out` when given).  `stream`: a numba/torch/CuPy CUDA stream to run
    on (default stream if None).  `precision`: "fp32", or "tf32" / "fp16" / "bf16" (tensor cores); None:
    the setting in force (kernelgen.set_precision / kernelgen.settings.scope), "fp32" unless changed.
    """
    x, w, bias = arrays.as_array_arg(x, "x"), arrays.as_array_arg(w, "w"), arrays.as_array_arg(bias, "bias")

    def build():
        be = resolve_backend(backend, x, w, bias)
        dt = arrays.check_arrays({"x": x, "w": w, "bias": bias}, be)
        p = make_problem("fwd", arrays.shape_of(x), arrays.shape_of(w), stride=stride, padding=padding,
                         dilation=dilation, groups=groups, dtype=dt, has_bias=bias is not None, activation=activation)
        _check_bias(bias, p.K)
        return p, be
    sig = ("fwd", _array_sig(x), _array_sig(w), _array_sig(bias), _typed(stride), _typed(padding),
           _typed(dilation), _typed(groups), check_activation(activation), _typed(backend))
    prep = _prepare(sig, build, algo, precision=precision)
    return Call(prep, *_bind_x_w(prep, x, w, bias, stream=stream, out=out))


def _shape_arg(name, shape):
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool)
                                                       for s in shape):
        raise TypeError(f"{name} must be a tuple of ints, got {shape!r}")
    return tuple(int(s) for s in shape)


@_op(_bind_dy_w)
def conv_backward_data(dy, w, x_shape, *, stride=1, padding=0, dilation=1, groups=1, backend=None, algo=None,
                       stream=None, out=None, precision=None):
    """Gradient of conv with respect to x: dx of shape x_shape from dy (N, *out, K) and w."""
    dy, w = arrays.as_array_arg(dy, "dy"), arrays.as_array_arg(w, "w")

    def build():
        be = resolve_backend(backend, dy, w)
        dt = arrays.check_arrays({"dy": dy, "w": w}, be)
        p = make_problem("bwd_data", _shape_arg("x_shape", x_shape), arrays.shape_of(w), stride=stride,
                         padding=padding, dilation=dilation, groups=groups, dtype=dt, y_shape=arrays.shape_of(dy))
        return p, be
    sig = ("bwd_data", _array_sig(dy), _array_sig(w), _typed(x_shape), _typed(stride), _typed(padding),
           _typed(dilation), _typed(groups), _typed(backend))
    prep = _prepare(sig, build, algo, precision=precision)
    return Call(prep, *_bind_dy_w(prep, dy, w, stream=stream, out=out))


@_op(_bind_x_dy)
def conv_backward_weight(x, dy, w_shape, *, stride=1, padding=0, dilation=1, groups=1, backend=None, algo=None,
                         stream=None, out=None, precision=None):
    """Gradient of conv with respect to w: dw of shape w_shape from x and dy."""
    x, dy = arrays.as_array_arg(x, "x"), arrays.as_array_arg(dy, "dy")

    def build():
        be = resolve_backend(backend, x, dy)
        dt = arrays.check_arrays({"x": x, "dy": dy}, be)
        p = make_problem("bwd_weight", arrays.shape_of(x), _shape_arg("w_shape", w_shape), stride=stride,
                         padding=padding, dilation=dilation, groups=groups, dtype=dt, y_shape=arrays.shape_of(dy))
        return p, be
    sig = ("bwd_weight", _array_sig(x), _array_sig(dy), _typed(w_shape), _typed(stride), _typed(padding),
           _typed(dilation), _typed(groups), _typed(backend))
    prep = _prepare(sig, build, algo, precision=precision)
    return Call(prep, *_bind_x_dy(prep, x, dy, stream=stream, out=out))


@_op(_bind_deconv)
def deconv(x, w, bias=None, *, stride=1, padding=0, output_padding=0, dilation=1, groups=1, backend=None,
           algo=None, stream=None, out=None, precision=None):
    """Transposed convolution (PyTorch's conv_transpose semantics), channels-last.

    x: (N, *spatial, C_in); w: (C_in, *filter, C_out // groups); bias: (C_out,) or None.
    It is the backward-data pass of the convolution whose weight is w.
    """
    x, w, bias = arrays.as_array_arg(x, "x"), arrays.as_array_arg(w, "w"), arrays.as_array_arg(bias, "bias")

    def build():
        be = resolve_backend(backend, x, w, bias)
        dt = arrays.check_arrays({"x": x, "w": w, "bias": bias}, be)
        out_shape = deconv_output_shape(arrays.shape_of(x), arrays.shape_of(w), stride, padding, output_padding,
                                        dilation, groups)
        p = make_problem("bwd_data", out_shape, arrays.shape_of(w), stride=stride, padding=padding,
                         dilation=dilation, groups=groups, dtype=dt)
        _check_bias(bias, out_shape[-1])
        return p, be
    sig = ("deconv", _array_sig(x), _array_sig(w), _array_sig(bias), _typed(stride), _typed(padding),
           _typed(output_padding), _typed(dilation), _typed(groups), _typed(backend))
    prep = _prepare(sig, build, algo, precision=precision)
    return Call(prep, *_bind_deconv(prep, x, w, bias, stream=stream, out=out))


def _zero_extend(a, shape):
    """`a` followed by zeros up to `shape`.  An output_padding >= stride (allowed when dilation > stride)
    makes the convolution that deconv transposes produce trailing outputs that no element of x feeds:
    its dy there is zero."""
    if not arrays.is_cuda_array(a):
        a = arrays.host_view(a)
        return np.pad(a, [(0, n - m) for n, m in zip(shape, a.shape)])
    from numba import cuda  # numba.cuda only where a CUDA array is in hand (its import is slow)
    d = arrays.to_device_view(a, "x")
    out = cuda.device_array(shape, d.dtype)
    fill_device(out.reshape(out.size), 0)
    with quiet_launches():  # numba's strided copy kernel, on a grid of numba's choosing
        out[tuple(slice(0, m) for m in d.shape)] = d
    return out


def _add_bias(y, bias, stream=None):
    if arrays.is_cuda_array(y):
        add_channel_bias(y, bias, stream)
        return y
    view = arrays.host_view(y)
    view += arrays.host_view(bias).astype(view.dtype, copy=False)
    return y


# --- explain and bind ------------------------------------------------------------------------------

@dataclass
class Explanation:
    problem: ConvProblem
    variant: str
    config: object
    backend: str
    source: str
    precision: str = "fp32"
    decided_by: str = ""  # the planner's link that chose the config ("config=", "tuned", "nearest tuned K", "model",
    reason: str = ""      # "default", ...: kernelgen.planner) and why

    def __str__(self):
        return (f"problem : {self.problem.key()}\nvariant : {self.variant}\nconfig  : {self.config}\n"
                f"backend : {self.backend}\nprecision: {self.precision}\ndecided : {self.decided_by}\n"
                f"reason  : {self.reason}\n{'-' * 72}\n{self.source}")


_OPS = {op.__name__: op for op in (conv, conv_backward_data, conv_backward_weight, deconv)}


def planned_call(op, args, kwargs) -> Call:
    """The Call of any op's `op(*args, **kwargs)` (op a kernelgen op or its name), checked and planned, not run:
    what kernelgen.precompile compiles."""
    return _planned_call(op, args, kwargs, _OPS)


def _planned_call(op, args, kwargs, allowed) -> Call:
    """The Call of `op(*args, **kwargs)`, checked and planned, not run."""
    name = op if isinstance(op, str) else getattr(op, "__name__", "")
    if name not in allowed or not (isinstance(op, str) or op is _OPS[name]):
        raise ValueError(f"op must be one of {sorted(allowed)} (the kernelgen function or its name), got {op!r}")
    return _OPS[name].plan_call(*args, **kwargs)


def bind(op, *args, **kwargs):
    """`op(*args, **kwargs)` on CUDA arrays, run once and bound to its buffers: returns a zero-argument
    callable that reruns it on whatever those buffers hold now and returns the same output array
    (`out=` if given, else the one the first run allocated).  Argument checks, planning and pointer
    extraction happen once, so a call costs one kernel launch from Python (like replaying a CUDA
    graph).  For conv, conv_backward_data and conv_backward_weight."""
    call = _planned_call(op, args, kwargs, set(_OPS) - {"deconv"})
    if call.prep.backend != "cuda" or not arrays.is_cuda_array(call.template):
        raise ValueError(f"bind needs CUDA arrays on the cuda backend, got {type(call.template).__name__} on "
                         f"the {call.prep.backend} backend")
    if call.prep.plan is None:  # nothing to compute: the bound call refills the empty (or zero) output
        result = _run(call)
        return lambda: _run(Call(call.prep, call.inputs, call.template, call.stream, result))
    _check_cuda_available()
    return bound_call(call.prep, call.inputs, call.template, call.stream, call.out)


def explain(op, *args, **kwargs) -> Explanation:
    """What kernelgen would run for `op(*args, **kwargs)`: problem, variant, config, which link of the planner's
    resolution chain chose it and why, and the generated source, without running it.  op is a kernelgen function or
    its name ("conv", "deconv", ...)."""
    prep = _planned_call(op, args, kwargs, _OPS).prep
    if prep.plan is None:
        raise ValueError(f"nothing to compute for {prep.problem.key()}: the output is empty (N = 0 or an empty "
                         f"spatial size), so no kernel runs")
    plan = prep.plan
    return Explanation(plan.problem, plan.variant, plan.config, plan.backend, plan.render(), plan.precision,
                       plan.decided_by, plan.reason)
