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

import numpy as np

from kernelgen.nn.tensor import Tensor, to_device_array
from kernelgen.precompile import PrecompileReport, compile_plans, recording


def model_device(model) -> str:
    """"cuda" if the model's parameters live on the GPU, else "cpu" (a model without parameters: "cpu")."""
    params = model.parameters()
    return "cuda" if params and params[0].is_cuda else "cpu"


def trace_plans(model, input_shape, dtype="float32") -> list:
    """The plans of every convolution call of one training step of `model` on an input of `input_shape`
    (N, *spatial, C) and `dtype`; the model is left unchanged."""
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
    try:
        with recording() as plans:
            x = Tensor(to_device_array(np.zeros(tuple(input_shape), dtype), device))
            y = model(x)
            y.backward(to_device_array(np.ones(y.shape, y.dtype), device))
    finally:
        model.load_state_dict(state)
        for p, g in zip(params, grads):
            p.grad = g
    return [plan for plan in plans if plan is not None]


def precompile_model(model, input_shape, dtype="float32", workers=None) -> PrecompileReport:
    """Module.precompile's body: trace the step, compile its kernels (see kernelgen.precompile.precompile)."""
    return compile_plans(trace_plans(model, input_shape, dtype), workers)
