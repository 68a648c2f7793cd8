"""The float64 reference harness every test shares: how a kernel's result is checked.

A test draws fresh random inputs, runs the kernel into an output poisoned with NaN (so an element the kernel
never writes shows), computes the float64 reference of the same direction with kernelgen.reference (the
library's own ground truth, itself checked against a naive loop, the adjoint identities and torch in
tests/templates/test_conv_cpu.py), and bounds the relative error by the tolerance of the result's precision.

* random_array, conv_tensors: fresh standard-normal data
* poisoned: a NaN-filled host array; launch_poisoned, run_poisoned: a kernel run into one
* reference, reference_fn, direction_inputs: the float64 reference of a direction
* rel_err, norm_err: the error measures; TOLERANCE, tolerance, assert_close: the bounds per precision
* run_direction: all of it for one problem (fresh inputs, poisoned run, reference)

Importable from every area folder under tests/ (pyproject's pytest `pythonpath`); conftest.py also hands the
common ones to tests as fixtures (random_array, assert_close, run_poisoned, run_direction).
"""
from __future__ import annotations

import numpy as np

from kernelgen import reference as ref
from kernelgen.api import get_launcher, make_plan
from kernelgen.problem import make_problem

# Relative error bounds (max |got - want| / max |want|) against the float64 reference: by storage dtype for
# precision="fp32", by precision for the tensor-core ones (issue 9's bounds: operands rounded to TF32 / fp16 /
# bf16, products accumulated in float32).
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "tf32": 1e-3, "fp16": 1e-2, "bf16": 1e-2}

DIRECTIONS = ("fwd", "bwd_data", "bwd_weight")
# the launcher's input names of each direction
_INPUT_NAMES = {"fwd": ("x", "w"), "bwd_data": ("dy", "w"), "bwd_weight": ("x", "dy")}


def tolerance(dtype, precision="fp32"):
    """The relative error bound of a result stored in `dtype` and computed with `precision`."""
    return TOLERANCE[np.dtype(dtype).name if precision == "fp32" else precision]


# --- inputs and outputs -------------------------------------------------------------------------------------

def random_array(rng, shape, dtype="float32"):
    """Standard-normal data: never zeros, signs mixed, so a missed term or a dropped store shows."""
    return rng.standard_normal(shape).astype(dtype)


def conv_tensors(rng, x_shape, w_shape, kw, dtype="float32"):
    """Fresh x, w and dy (shaped like the forward's output) of one convolution; kw: its conv arguments."""
    y_shape = make_problem("fwd", x_shape, w_shape, **kw).y_shape
    return tuple(random_array(rng, shape, dtype) for shape in (x_shape, w_shape, y_shape))


def poisoned(shape, dtype="float32"):
    """A host array of NaN: an element a kernel never writes stays NaN and fails every comparison."""
    return np.full(shape, np.nan, dtype)


# --- the float64 reference ----------------------------------------------------------------------------------

def reference(direction, x, w, dy, kw, bias=None):
    """The float64 reference of `direction` on x, w, dy (the ones the direction reads), kw: the conv arguments."""
    if direction == "fwd":
        return ref.conv_forward(x, w, bias, **kw)
    if direction == "bwd_data":
        return ref.conv_backward_data(dy, w, x.shape, **kw)
    if direction == "bwd_weight":
        return ref.conv_backward_weight(x, dy, w.shape, **kw)
    raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")


def reference_fn(direction, kw):
    """(x, w, dy) -> the float64 reference of `direction`: for tests that also want the reference of rounded
    operands (the tensor-core precisions)."""
    return lambda x, w, dy: reference(direction, x, w, dy, kw)


def direction_inputs(problem, kw, rng):
    """Fresh random inputs of `problem`'s direction (launcher name -> host array; the bias too when the problem
    has one) and the float64 reference of its output (relu applied when the problem's activation is relu).
    kw: the conv arguments the problem was made with."""
    shapes = (problem.x_shape, problem.w_shape, problem.y_shape)
    x, w, dy = (random_array(rng, shape, problem.dtype) for shape in shapes)
    arrays = {"x": x, "w": w, "dy": dy}
    inputs = {name: arrays[name] for name in _INPUT_NAMES[problem.direction]}
    if problem.direction == "fwd" and problem.has_bias:
        inputs["bias"] = random_array(rng, problem.K, problem.dtype)
    want = reference(problem.direction, x, w, dy, kw, inputs.get("bias"))
    if problem.activation == "relu":
        want = np.maximum(want, 0.0)
    return inputs, want


# --- running a kernel into a poisoned output ----------------------------------------------------------------

def launch_poisoned(launcher, problem, inputs, backend):
    """Run `launcher` on host `inputs` (name -> array) into an output filled with NaN beforehand (on the device
    for backend "cuda"); the output on the host, in the problem's output shape."""
    args = {name: np.ascontiguousarray(a).reshape(-1) for name, a in inputs.items()}
    out = poisoned(int(np.prod(problem.output_shape)), problem.dtype)
    if backend == "cuda":
        from numba import cuda  # optional: only sessions that run CUDA kernels (simulator or GPU) import it
        args = {name: cuda.to_device(a) for name, a in args.items()}
        args[launcher.outputs[0]] = device_out = cuda.to_device(out)
        launcher(args)
        out = device_out.copy_to_host()
    else:
        args[launcher.outputs[0]] = out
        launcher(args)
    return out.reshape(problem.output_shape)


def run_poisoned(problem, inputs, backend, algo=None, config=None):
    """The kernel kernelgen picks for `problem` (or `algo` / `config`) run on host inputs into a poisoned
    output.  Returns (plan, output)."""
    plan = make_plan(problem, backend, algo, config)
    return plan, launch_poisoned(get_launcher(plan), problem, inputs, backend)


def run_direction(problem, kw, backend, algo=None, config=None, rng=None):
    """Fresh random inputs for `problem`, its kernel run poisoned (as run_poisoned) and the float64 reference.
    kw: the conv arguments the problem was made with.  Returns (plan, got, want)."""
    inputs, want = direction_inputs(problem, kw, np.random.default_rng() if rng is None else rng)
    plan, got = run_poisoned(problem, inputs, backend, algo, config)
    return plan, got, want


# --- the checks ---------------------------------------------------------------------------------------------

def rel_err(got, want):
    """max |got - want| / max |want|, in float64 (NaN where got has a NaN: it fails every bound)."""
    want = np.asarray(want, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def norm_err(got, want):
    """||got - want|| / ||want||, in float64: the norm-wise relative error."""
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1e-30))


def assert_close(got, want, dtype=None, what="result", tol=None, precision="fp32"):
    """`got` (any array with a host copy) against its float64 reference: the shape, the dtype (`dtype`, default
    got's own), every element finite (a NaN is an element never written), and the relative error within `tol`
    (default: the bound of `dtype` at `precision`)."""
    if hasattr(got, "copy_to_host"):
        got = got.copy_to_host()
    got = np.asarray(got)
    dtype = np.dtype(dtype or got.dtype).name
    assert got.shape == tuple(want.shape), f"{what}: shape {got.shape}, expected {tuple(want.shape)}"
    assert got.dtype == np.dtype(dtype), f"{what}: dtype {got.dtype}, expected {dtype}"
    assert np.isfinite(got).all(), f"{what}: {np.count_nonzero(~np.isfinite(got))} non-finite elements"
    err = rel_err(got, want)
    tol = tol or tolerance(dtype, precision)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g} ({dtype}, {precision})"


class DLPackProducer:
    """An array known to kernelgen only through DLPack (as a JAX or TensorFlow array is): wraps one that speaks it."""

    def __init__(self, a):
        self._a, self.shape = a, tuple(a.shape)

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()
