"""Module.precompile: every convolution kernel of a training step compiled before the first step (issue 27).

The step is traced once under kernelgen.precompile.recording(): a forward pass on a zero input of the given
shape and a backward pass from a gradient of ones, on the model's own device.  Each convolution call inside
(forward, backward-data, backward-weight; transposed convolutions' too) is validated and planned but not run -
it returns zeros of its output's shape - and the rest of the step (normalisation, activations, pooling) runs
as usual.  The plans then go to kernelgen.precompile.compile_plans: compiled side by side in worker
processes into the disk cache, and loaded here, so the first real step loads its kernels.

The trace leaves the model as it found it: its parameters and buffers (batch norm's running statistics move
in a training-mode forward) are restored, and so are the parameters' gradients.
"""
from __future__ import annotations

import logging

import numpy as np

from kernelgen import settings
from kernelgen.nn.tensor import Tensor, to_device_array
from kernelgen.precompile import PrecompileReport, compile_plans, recording
from kernelgen.tuning.compile_pool import pool_on_demand

log = logging.getLogger(__name__)


def model_device(model) -> str:
    """"cuda" if the model's parameters live on the GPU, else "cpu" (a model without parameters: "cpu")."""
    params = model.parameters()
    return "cuda" if params and params[0].is_cuda else "cpu"


def trace_plans(model, input_shape, dtype="float32", backward=True, on_plan=None) -> list:
    """The plans of every convolution call of one training step of `model` on an input of `input_shape`
    (N, *spatial, C) and `dtype` (backward=False: of its forward only); the model is left unchanged, the
    random generators of its layers (dropout's) included.  on_plan: shown each plan as it is traced."""
    if not isinstance(input_shape, (tuple, list)) or not input_shape or \
            not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n > 0 for n in input_shape):
        raise ValueError(f"input_shape must be a tuple of positive ints (N, *spatial, C), got {input_shape!r}")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a NumPy dtype or its name, got {dtype!r}") from None
    device = model_device(model)
    state = model.state_dict()
    params = model.parameters()
    grads = [p.grad for p in params]
    generators = [(g, g.bit_generator.state) for g in _generators(model)]
    try:
        with recording(on_plan) as plans:
            x = Tensor(to_device_array(np.zeros(tuple(input_shape), dtype), device))
            y = model(x)
            if backward:
                y.backward(to_device_array(np.ones(y.shape, y.dtype), device))
    finally:
        model.load_state_dict(state)
        for p, g in zip(params, grads):
            p.grad = g
        for g, generator_state in generators:
            g.bit_generator.state = generator_state
    return [plan for plan in plans if plan is not None]


def _compiles_for_real() -> bool:
    """False in numba's CUDA simulator, whose kernels are Python: nothing there is worth compiling ahead."""
    return not settings.get("cuda_simulator")


def _generators(module) -> list:
    """The numpy Generators held by `module` and its children (a Dropout's masks come from one)."""
    found = [v for v in vars(module).values() if isinstance(v, np.random.Generator)]
    for child in module.children():
        found += _generators(child)
    return found


def precompile_new_input(model, args):
    """Module.__call__'s step for the outermost module: on a CUDA model's first call on an input of a new shape
    and dtype (per train / eval mode), the kernels of a step on it - forward and, in training mode, backward - are
    compiled side by side first (the auto_precompile setting).  Anything the trace cannot do (a forward of
    several inputs, an output that is not one tensor, a model that refuses the zero input) leaves the call to
    compile its kernels itself, as it would without this: the trace is only a head start."""
    if len(args) != 1 or not isinstance(args[0], Tensor) or not args[0].is_cuda or \
            not settings.get("auto_precompile") or not _compiles_for_real():
        return
    x = args[0]
    key = (x.shape, x.dtype.str, model.training)
    seen = model.__dict__.setdefault("_precompiled_inputs", set())
    target = model.precompile_target()
    if key in seen or target is None or model_device(target) != "cuda":
        return
    seen.add(key)
    if settings.get("batch_fallback") and any(s[1:] == key[1:] and s[0][1:] == x.shape[1:] and s[0][0] > x.shape[0]
                                              for s in seen):
        return  # a smaller batch: its calls run on the larger batch's kernels while theirs compile in the background
    try:
        with pool_on_demand() as demand:  # (workers start at the first traced kernel not on disk, while tracing)
            plans = trace_plans(target, x.shape, x.dtype, backward=model.training, on_plan=demand.see)
            compile_plans(plans, pool=demand.pool)
    except Exception as e:  # noqa: BLE001 (a head start only: the call itself raises what is wrong)
        log.debug("no precompile for %s on %s: %s: %s", type(model).__name__, x.shape, type(e).__name__, e)


def precompile_model(model, input_shape, dtype="float32", workers=None) -> PrecompileReport:
    """Module.precompile's body: trace the step, compile its kernels (see kernelgen.precompile.precompile)."""
    return compile_plans(trace_plans(model, input_shape, dtype), workers)
