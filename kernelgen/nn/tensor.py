"""Tensor: an array with reverse-mode autograd, micrograd-style.

Every op records its inputs and a closure that turns the output's gradient into the inputs'
gradients; backward() walks the graph in reverse topological order.  Data is a NumPy array or, after
.to("cuda"), a numba device array from kernelgen's arena (channels-last float32, like kernelgen); the ops
pick numpy or numba.cuda kernels by where the data is (functional.py), and convolutions run through
kernelgen's kernels either way.

This module is the bottom of kernelgen.nn's own import graph: the ops modules import it, never the other way.
The arithmetic operators (+, -, *, /, **, unary -) are arithmetic.py's functions, bound onto Tensor there; the
device kernels (cuda_ops) are imported on first use, by device_kernels().
"""
from __future__ import annotations

import contextlib
import weakref

import numpy as np

_grad_enabled = True


def _is_torch(a):
    # by module name: kernelgen never imports torch itself (it is optional)
    return type(a).__module__.split(".")[0] == "torch" and hasattr(a, "device")


def _on_device(a):
    # torch.Tensor has __cuda_array_interface__ as a class property even for CPU tensors: ask the tensor
    if _is_torch(a):
        return a.device.type != "cpu"
    return not isinstance(a, np.ndarray) and (hasattr(type(a), "__cuda_array_interface__")
                                              or bool(getattr(a, "__cuda_ndarray__", False)))


def _host_data(data):
    """`data` as a NumPy array: a torch CPU tensor through .numpy() (its memory, no copy; detached first, as
    numpy() refuses a tensor that requires grad), anything else through np.asarray."""
    if isinstance(data, Tensor):
        return data.data
    if _is_torch(data):
        if data.device.type != "cpu":
            raise TypeError(f"data is a torch tensor on {data.device}: pass a CPU tensor (data.cpu()), then "
                            f"move the kernelgen Tensor with .cuda()")
        data = data.detach().resolve_conj().resolve_neg()
        try:
            return data.numpy()
        except TypeError as e:  # bfloat16 and the like: NumPy has no such dtype
            raise TypeError(f"data is a torch {data.dtype} tensor, which has no NumPy dtype: convert it first "
                            f"(data.float())") from e
    a = np.asarray(data)
    if a.dtype.kind in "OUSM":
        raise TypeError(f"data must be numeric, got an array of dtype {a.dtype} from {type(data).__name__}")
    return a


def to_device_array(a, device):
    """`a` (NumPy or device array) as a NumPy array ("cpu") or an arena device array ("cuda")."""
    if device == "cpu":
        return a.copy_to_host() if _on_device(a) else np.asarray(a)
    return a if _on_device(a) else device_kernels().to_device(np.asarray(a))


@contextlib.contextmanager
def no_grad():
    """Build no graph inside (evaluation, optimiser updates)."""
    global _grad_enabled
    prev, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = prev


class _HookHandle:
    """What register_*_hook returns: remove() takes the hook off again."""

    def __init__(self, tensor, attr, fn):
        self.tensor, self.attr, self.fn = tensor, attr, fn

    def remove(self):
        hooks = getattr(self.tensor, self.attr)
        setattr(self.tensor, self.attr, tuple(h for h in hooks if h is not self.fn))


class Tensor:
    # hooks, per instance once one is registered (a tuple, replaced not mutated, so a backward running in another
    # thread iterates a consistent one): data-parallel training starts a gradient's all-reduce from them
    _post_accumulate_hooks = ()
    _backward_end_hooks = ()

    def __init__(self, data, requires_grad=False, _parents=(), _backward=None):
        self.data = data if _on_device(data) and not _is_torch(data) else _host_data(data)
        self.grad = None
        self.requires_grad = requires_grad
        self._parents = _parents
        self._backward = _backward

    @classmethod
    def from_op(cls, data, parents, backward, recompute=None):
        """The result of an op: part of the graph only if some input needs a gradient.  recompute: a function
        that computes `data` again from the parents (then a Recomputed tensor, whose data release() may drop)."""
        track = _grad_enabled and any(p.requires_grad for p in parents)
        if track and recompute is not None:
            return Recomputed(data, parents, backward, recompute)
        return cls(data, track, parents if track else (), backward if track else None)

    def release(self):
        """Drop the data if it can be computed again (a Recomputed tensor); else nothing."""

    shape = property(lambda self: tuple(self.data.shape))
    dtype = property(lambda self: np.dtype(self.data.dtype))
    is_cuda = property(lambda self: not isinstance(self.data, np.ndarray))
    device = property(lambda self: "cuda" if self.is_cuda else "cpu")

    def to(self, device):
        """This tensor's data on `device` ("cpu" or "cuda"): the same Tensor when it is there already,
        else a new leaf (gradients do not flow across the copy)."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == self.device:
            return self
        return Tensor(to_device_array(self.data, device), self.requires_grad)

    def cpu(self):
        return self.to("cpu")

    def cuda(self):
        return self.to("cuda")

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    def numpy(self):
        return to_device_array(self.data, "cpu")

    def item(self):
        return float(self.numpy().reshape(()))  # the one host sync of a device training step

    def _accumulate(self, g):
        if not self.is_cuda and g.dtype != self.data.dtype:
            g = g.astype(self.data.dtype)  # as PyTorch: a leaf's gradient has the leaf's dtype
        self.grad = g if self.grad is None else _sum_grads(self.grad, g)
        for hook in self._post_accumulate_hooks:
            hook(self)

    def register_post_accumulate_grad_hook(self, fn):
        """Call fn(tensor) each time backward() has accumulated this leaf's .grad (PyTorch's hook of that
        name): once per backward, with the gradient complete for that pass."""
        self._post_accumulate_hooks = self._post_accumulate_hooks + (fn,)
        return _HookHandle(self, "_post_accumulate_hooks", fn)

    def register_backward_end_hook(self, fn):
        """Call fn() when a backward() whose graph contains this tensor has finished (every leaf's gradient
        accumulated): where a data-parallel wrapper waits for its last all-reduces."""
        self._backward_end_hooks = self._backward_end_hooks + (fn,)
        return _HookHandle(self, "_backward_end_hooks", fn)

    def _seed(self, grad):
        """backward()'s starting gradient: ones for a scalar, else `grad` checked against self's shape and
        put where self's data is."""
        if grad is None:
            if self.data.size != 1:
                raise ValueError(f"backward() without a gradient needs a scalar tensor, got shape {self.shape}")
            if self.is_cuda:  # filled on the device: a host copy would wait for the whole forward pass
                ops = device_kernels()
                return ops.fill(ops.empty(self.shape, self.dtype), 1.0)
            return np.ones(self.shape, self.dtype)
        grad = grad.data if isinstance(grad, Tensor) else grad
        shape = tuple(grad.shape) if hasattr(grad, "shape") else np.shape(grad)
        if shape != self.shape:
            raise ValueError(f"grad must have the tensor's shape {self.shape}, got {shape}")
        if self.is_cuda and not _on_device(grad):
            grad = np.asarray(grad, self.dtype)
        return to_device_array(grad, self.device)

    def _graph(self):
        """Every tensor self depends on, each after its parents (iteratively: a long chain of ops must not
        hit the recursion limit).  Raises before any gradient moves if part of the graph was freed."""
        order, seen, stack = [], {id(self)}, [(self, iter(self._parents))]
        while stack:
            t, parents = stack[-1]
            if t._backward is _freed:
                _freed(None)
            for p in parents:
                if id(p) not in seen:
                    seen.add(id(p))
                    stack.append((p, iter(p._parents)))
                    break
            else:
                stack.pop()
                order.append(t)
        return order

    def backward(self, grad=None, retain_graph=False):
        """Accumulate d(self)/d(leaf) into every leaf's .grad (once per call, as PyTorch; intermediate
        tensors get no .grad).  Unless retain_graph, the graph is taken apart on the way, as PyTorch does:
        each op's saved arrays go as soon as its backward has run, so memory falls during the backward pass
        instead of peaking with all activations plus all gradients; a later backward through any of those
        ops raises RuntimeError instead of silently computing nothing."""
        if not self.requires_grad:
            raise RuntimeError("backward(): the tensor does not require grad and has no graph (no input "
                               "requires grad, or it was computed under no_grad())")
        order = self._graph()
        grads = {id(self): self._seed(grad)}  # the gradients still to pass on, by tensor; popped when passed
        end_hooks = []
        while order:
            t = order.pop()  # reverse topological order; popped, t no longer lives through this list
            end_hooks.extend(t._backward_end_hooks)
            g = grads.pop(id(t), None)
            if g is not None and t._backward is None:
                t._accumulate(g)  # a leaf
            elif g is not None:
                for parent, pg in zip(t._parents, t._backward(g)):
                    if parent.requires_grad and pg is not None:
                        k = id(parent)
                        grads[k] = pg if k not in grads else _sum_grads(grads[k], pg)
            if not retain_graph and t._backward is not None:
                t._parents, t._backward = (), _freed
        for hook in end_hooks:
            hook()
        return self

    # operators, so models read naturally: __add__, __radd__, ... are arithmetic.py's functions, bound onto Tensor
    # there (arithmetic imports this module, so this module cannot import it)
    __array_ufunc__ = None  # ndarray (op) Tensor: numpy defers to the reflected operator

    def reshape(self, *shape):
        return reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)


class Recomputed(Tensor):
    """An op's result whose data can be dropped once the forward pass has read it, and is computed again from the
    op's inputs the next time it is read (activation recomputation: a backward that reads it, e.g. the next
    convolution's weight gradient).  The recomputed data stays until release() or until the tensor is freed with
    the graph.  The recomputation reads the inputs and parameters as they are when it runs, as
    torch.utils.checkpoint does: an optimizer step between a forward and its backward changes them for both."""

    def __init__(self, data, parents, backward, recompute):
        super().__init__(data, True, parents, backward)
        self._recompute = recompute
        # what a released tensor still answers without computing its data again
        self._meta = (tuple(data.shape), np.dtype(data.dtype), not isinstance(data, np.ndarray))

    shape = property(lambda self: self._meta[0])
    dtype = property(lambda self: self._meta[1])
    is_cuda = property(lambda self: self._meta[2])

    @property
    def data(self):
        d = self._data
        if d is None:
            d = self._data = self._recompute()
        return d

    @data.setter
    def data(self, value):
        self._data = value

    def release(self):
        self._data = None


def output_reader(out, data):
    """A backward's reader of its op's output: the array itself, or for a Recomputed output (whose data may be
    released and computed again) through a weak reference - a closure on the tensor would keep it alive."""
    if isinstance(out, Recomputed):
        ref = weakref.ref(out)
        return lambda: ref().data
    return lambda: data


def _freed(g):
    """The backward of an op whose graph a backward() without retain_graph has freed."""
    raise RuntimeError("Trying to backward through the graph a second time (or through part of a graph that a "
                       "backward() already freed): pass retain_graph=True to the first backward() to keep it")


def _sum_grads(a, b):
    if _on_device(a):
        return device_kernels().add(a, b)  # a new array: b may be another tensor's gradient as well
    return a + b


def as_tensor(x):
    return x if isinstance(x, Tensor) else Tensor(x)


def device_kernels():
    """The device half of kernelgen.nn, the cuda_ops module (it re-exports cuda_elementwise's and cuda_pool's
    kernels too)."""
    # imported here, on the first device op, not at the top: cuda_ops imports numba.cuda (about 0.5 s, and
    # numba-cuda is an optional dependency), which a host-only `import kernelgen.nn` must not pay for
    from kernelgen.nn import cuda_ops
    return cuda_ops


def device_ops(*tensors, names=None):
    """The device ops module (device_kernels()) when any tensor's data is on the GPU (then all must be), else
    None.  names: the tensors' argument names, for the error."""
    present = [(k, t) for k, t in enumerate(tensors) if t is not None]
    if any(t.is_cuda for _, t in present):
        for k, t in present:
            if not t.is_cuda:
                what = names[k] if names else f"argument {k}"
                raise TypeError(f"all tensors must be on the same device: {what} is a {t.device} tensor, "
                                f"others are cuda ones")
        return device_kernels()
    return None


def reshape(x, shape):
    """x's data in a new shape (F.reshape, Tensor.reshape); on the device a view of the same memory."""
    x = as_tensor(x)
    if ops := device_ops(x):
        shape = tuple(shape)
        if -1 in shape:  # numpy's rule: the one -1 takes what the other dimensions leave
            known = int(np.prod([s for s in shape if s != -1]))
            shape = tuple(x.data.size // max(known, 1) if s == -1 else s for s in shape)
        return Tensor.from_op(ops.view(x.data, shape), (x,), lambda g: (ops.view(g, x.shape),))
    return Tensor.from_op(x.data.reshape(shape), (x,), lambda g: (g.reshape(x.shape),))
