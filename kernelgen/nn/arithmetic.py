"""Element-wise arithmetic of Tensors (re-exported by functional as F.add, F.sub, F.mul, F.div, F.pow, F.neg),
with numpy broadcasting and PyTorch's type promotion for scalars.

A Python (or NumPy) scalar operand does not promote, as in PyTorch: float32 * 0.5 stays float32 and
float16 + 1 stays float16.  Only a scalar of a higher kind than the tensor changes the dtype, to PyTorch's
default of that kind (an integer tensor times 0.5 is float32).  numpy alone would not do this: a scalar
turned into a 0-d int64 or float64 array promotes float32 data to float64.  Two tensors promote as numpy.

add and mul run on the device too (cuda_ops, both operands device tensors); sub, div, pow and neg are host-only
so far.  They are Tensor's operators as well: bound onto it at the end of this module (tensor.py is below this
one in the import graph and cannot import it; kernelgen.nn imports this module, so the operators are always
there)."""
from __future__ import annotations

import numpy as np

from kernelgen.nn.tensor import Tensor
from kernelgen.nn.tensor import as_tensor as _as_tensor
from kernelgen.nn.tensor import device_ops as _dev

# PyTorch's kinds, lowest first, and its default dtype for a scalar of a kind the tensor does not reach
_CATEGORY = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}
_DEFAULT = {1: np.dtype(np.int64), 2: np.dtype(np.float32), 3: np.dtype(np.complex64)}


def _scalar_category(v):
    """The kind of a Python or NumPy scalar (0 bool, 1 integer, 2 float, 3 complex), None for anything else."""
    if isinstance(v, (bool, np.bool_)):
        return 0
    if isinstance(v, (int, np.integer)):
        return 1
    if isinstance(v, (float, np.floating)):
        return 2
    if isinstance(v, (complex, np.complexfloating)):
        return 3
    return None


def _scalar_tensor(s, category, like, name):
    """Scalar s as a 0-d Tensor of the dtype it computes in with a tensor of dtype `like`."""
    dtype = like if category <= _CATEGORY.get(like.kind, 3) else _DEFAULT[category]
    try:
        return Tensor(np.asarray(s, dtype))
    except OverflowError as e:  # e.g. -1 with a uint8 tensor
        raise ValueError(f"{name}={s!r} does not fit the other operand's dtype {dtype}") from e


def _operands(a, b, names):
    """(a, b, result dtype): both as Tensors, a scalar taking the other operand's dtype (see the module)."""
    ca, cb = _scalar_category(a), _scalar_category(b)
    if (ca is None) == (cb is None):  # two tensors (or two scalars): numpy's promotion
        a, b = _as_tensor(a), _as_tensor(b)
        return a, b, np.result_type(a.dtype, b.dtype)
    if ca is None:
        a = _as_tensor(a)
        b = _scalar_tensor(b, cb, a.dtype, names[1])
        return a, (b.to("cuda") if a.is_cuda else b), b.dtype  # (a scalar goes where the tensor is)
    b = _as_tensor(b)
    a = _scalar_tensor(a, ca, b.dtype, names[0])
    return (a.to("cuda") if b.is_cuda else a), b, a.dtype


def _cast(data, dtype):
    """data in the op's result dtype: only an integer or bool tensor with a float scalar differs (numpy would
    take the 0-d float32 array as float64's equal and compute in float64)."""
    return data if data.dtype == dtype else data.astype(dtype)


def _sum_to(g, shape):
    """Undo numpy broadcasting: sum the gradient back down to the operand's shape."""
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for axis, n in enumerate(shape):
        if n == 1 and g.shape[axis] != 1:
            g = g.sum(axis=axis, keepdims=True)
    return g


def _host_only(name, *tensors):
    if any(t.is_cuda for t in tensors):
        raise TypeError(f"{name} has no device implementation yet: its operands must be cpu tensors")


def add(a, b):
    a, b, dtype = _operands(a, b, ("a", "b"))
    if ops := _dev(a, b, names=("a", "b")):
        return Tensor.from_op(ops.add(a.data, b.data), (a, b), lambda g: (g, g))
    return Tensor.from_op(_cast(a.data, dtype) + _cast(b.data, dtype), (a, b), lambda g: (
        _sum_to(g, a.shape) if a.requires_grad else None, _sum_to(g, b.shape) if b.requires_grad else None))


def sub(a, b):
    a, b, dtype = _operands(a, b, ("a", "b"))
    _host_only("sub", a, b)
    return Tensor.from_op(_cast(a.data, dtype) - _cast(b.data, dtype), (a, b), lambda g: (
        _sum_to(g, a.shape) if a.requires_grad else None, _sum_to(-g, b.shape) if b.requires_grad else None))


def mul(a, b):
    """a * b with numpy broadcasting, on the device too (its backward sums over the broadcast dimensions)."""
    a, b, dtype = _operands(a, b, ("a", "b"))
    if ops := _dev(a, b, names=("a", "b")):
        y = ops.mul(a.data, b.data)
        return Tensor.from_op(y, (a, b), lambda g: (
            ops.mul_backward(g, a.shape, b.data) if a.requires_grad else None,
            ops.mul_backward(g, b.shape, a.data) if b.requires_grad else None))
    return Tensor.from_op(_cast(a.data, dtype) * _cast(b.data, dtype), (a, b), lambda g: (
        _sum_to(g * b.data, a.shape) if a.requires_grad else None,
        _sum_to(g * a.data, b.shape) if b.requires_grad else None))


def div(a, b):
    """True division a / b (an integer tensor divided gives float32, as PyTorch's)."""
    a, b, dtype = _operands(a, b, ("a", "b"))
    _host_only("div", a, b)
    if dtype.kind in "biu":
        dtype = np.dtype(np.float32)
    y = _cast(a.data, dtype) / _cast(b.data, dtype)
    return Tensor.from_op(y, (a, b), lambda g: (
        _sum_to(g / b.data, a.shape) if a.requires_grad else None,
        _sum_to(-g * y / b.data, b.shape) if b.requires_grad else None))


def pow(a, b):  # noqa: A001 (F.pow, as torch.pow)
    """a ** b; the gradient for b is a ** b * log(a), NaN where a < 0 (as PyTorch)."""
    a, b, dtype = _operands(a, b, ("a", "b"))
    _host_only("pow", a, b)
    y = _cast(a.data, dtype) ** _cast(b.data, dtype)

    def backward(g):
        da = db = None
        if a.requires_grad:  # b a^(b-1), written so that b = 0 gives 0 at a = 0 rather than 0 * inf
            da = _sum_to(g * np.where(b.data == 0, 0, b.data * a.data ** (b.data - 1)).astype(dtype), a.shape)
        if b.requires_grad:
            with np.errstate(divide="ignore", invalid="ignore"):
                db = _sum_to(g * y * np.log(_cast(a.data, dtype)), b.shape)
        return da, db
    return Tensor.from_op(y, (a, b), backward)


def neg(a):
    a = _as_tensor(a)
    _host_only("neg", a)
    return Tensor.from_op(-a.data, (a,), lambda g: (-g,))


def _reflected(op):
    """The reflected operator of a binary op: other (op) self."""
    def reflected(self, other):
        return op(other, self)
    reflected.__name__ = f"r{op.__name__}"
    return reflected


# Tensor's operators, so models read naturally; a Python scalar operand keeps the tensor's dtype (see above)
Tensor.__add__, Tensor.__radd__ = add, _reflected(add)
Tensor.__sub__, Tensor.__rsub__ = sub, _reflected(sub)
Tensor.__mul__, Tensor.__rmul__ = mul, _reflected(mul)
Tensor.__truediv__, Tensor.__rtruediv__ = div, _reflected(div)
Tensor.__pow__, Tensor.__rpow__ = pow, _reflected(pow)
Tensor.__neg__ = neg
