"""Modules: parameters, train/eval, state_dict, and the layers and models built from them."""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from contextvars import ContextVar

import numpy as np

from kernelgen import settings
from kernelgen.api import RECORDING
from kernelgen.nn import functional as F
from kernelgen.nn.precompile_step import precompile_model, precompile_new_input
from kernelgen.nn.tensor import Tensor, _on_device, as_tensor, to_device_array
from kernelgen.planner import check_precision


# the module whose call is running (None outside any): only the outermost call may precompile a step
_OUTERMOST: ContextVar = ContextVar("kernelgen_nn_outermost", default=None)


class Module:
    training = True

    def __call__(self, *args):
        if _OUTERMOST.get() is not None or RECORDING.get() is not None:
            return self.forward(*args)
        token = _OUTERMOST.set(self)
        try:
            precompile_new_input(self, args)
            return self.forward(*args)
        finally:
            _OUTERMOST.reset(token)

    def precompile_target(self):
        """The module whose step the first call on a new input precompiles: this one (DistributedDataParallel:
        none, since its ranks' traces would have to meet in collectives)."""
        return self

    def children(self):
        return [v for v in vars(self).values() if isinstance(v, Module)] + \
               [m for v in vars(self).values() if isinstance(v, (list, tuple)) for m in v if isinstance(m, Module)]

    def named_state(self, prefix=""):
        """(name, array) for every parameter and buffer, in a stable order."""
        for k, v in sorted(vars(self).items()):
            if isinstance(v, Tensor):
                yield prefix + k, v.data
            elif isinstance(v, np.ndarray) or _on_device(v):
                yield prefix + k, v
            elif isinstance(v, Module):
                yield from v.named_state(f"{prefix}{k}.")
            elif isinstance(v, (list, tuple)):
                for i, m in enumerate(v):
                    if isinstance(m, Module):
                        yield from m.named_state(f"{prefix}{k}.{i}.")

    def parameters(self):
        out = [v for _, v in sorted(vars(self).items()) if isinstance(v, Tensor) and v.requires_grad]
        for c in self.children():
            out += c.parameters()
        return out

    def train(self, mode=True):
        self.training = mode
        for c in self.children():
            c.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def to(self, device):
        """Move every parameter and buffer to `device` ("cpu" or "cuda") in place: parameters keep their
        Tensor identity, so build the optimiser after moving the model."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        for k, v in vars(self).items():
            if isinstance(v, Tensor):
                v.data, v.grad = to_device_array(v.data, device), None
            elif isinstance(v, np.ndarray) or _on_device(v):
                setattr(self, k, to_device_array(v, device))
        for c in self.children():
            c.to(device)
        return self

    def cuda(self):
        return self.to("cuda")

    def cpu(self):
        return self.to("cpu")

    def precompile(self, input_shape, dtype="float32", workers=None):
        """Compile every convolution kernel of a training step on inputs of `input_shape` (N, *spatial, C) and
        `dtype` - forward, backward-data and backward-weight - side by side in `workers` processes (None: one
        per kernel, at most one per CPU) into the disk cache, so the first step loads them instead of compiling
        them one by one.  Call it after .to(device).  The model is left as it was.  Returns a
        kernelgen.precompile.PrecompileReport."""
        return precompile_model(self, input_shape, dtype, workers)

    def autotune(self, input_shape, dtype="float32", workers=None):
        """precompile, with first-call autotuning on (kernelgen.set_autotune) while the step is traced: each of
        its convolutions that no tuned entry decides has its candidates compiled, verified against float64 and
        timed, and the fastest recorded in the user's tuned database, which this and later processes then plan
        from (within the autotune_budget setting's seconds a problem).  Returns the PrecompileReport of the
        kernels chosen."""
        with settings.scope(autotune=True):
            return precompile_model(self, input_shape, dtype, workers)

    def state_dict(self):
        """Host copies (NumPy) of every parameter and buffer, wherever the model lives."""
        return {k: to_device_array(v, "cpu").copy() for k, v in self.named_state()}

    def load_state_dict(self, state):
        mine = dict(self.named_state())
        if set(mine) != set(state):
            raise ValueError(f"state must have keys {sorted(mine)}, got {sorted(state)}")
        for k, v in state.items():
            if mine[k].shape != np.shape(v):
                raise ValueError(f"state[{k!r}] must have shape {mine[k].shape}, got {np.shape(v)}")
            if _on_device(mine[k]):
                mine[k].copy_to_device(np.ascontiguousarray(v, mine[k].dtype))
            else:
                mine[k][...] = v  # in place: parameters and buffers keep their identity

    def save(self, path):
        """Write the state_dict to `path` as an .npz: exactly `path` if it ends in .npz, else `path` + ".npz"
        (numpy's rule for a name, which load() follows too).  Atomic: written to a temporary file in the
        same directory, then renamed over the target, so a crash leaves the old checkpoint or the new one,
        never half of one."""
        _atomic_savez(checkpoint_path(path), self.state_dict())

    def load(self, path):
        """Load a checkpoint written by save(path): the same `path`, resolved as save() resolves it."""
        with np.load(checkpoint_path(path), allow_pickle=False) as f:
            self.load_state_dict({k: f[k] for k in f.files})


def checkpoint_path(path):
    """The file save(path) / load(path) use: path itself if it ends in .npz, else path + ".npz"."""
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"path must be a str or os.PathLike of str, got {type(path).__name__}")
    return path if path.endswith(".npz") else path + ".npz"


def _umask():
    mask = os.umask(0)  # the only portable way to read it; set back at once
    os.umask(mask)
    return mask


def _atomic_savez(path, arrays):
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # a file object: numpy appends no suffix
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the checkpoint
        # mkstemp's 0600 would make checkpoints private: keep the replaced file's mode, or np.savez's default
        os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode) if os.path.exists(path) else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself durable (POSIX; directories cannot be opened on Windows)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def kaiming_uniform(shape, fan_in, rng, dtype):
    bound = np.sqrt(6.0 / fan_in)  # He et al.: gain sqrt(2) for ReLU, uniform(-b, b)
    return rng.uniform(-bound, bound, shape).astype(dtype)


class _ConvNd(Module):
    """precision: the convolutions' ("fp32", "tf32", "fp16", "bf16"; None: the global setting when the forward
    runs, see mixed_precision.py).  The weight stays float32 whatever the precision (fp32 master weights)."""
    NDIM = 2

    def __init__(self, c_in, c_out, k, *, stride=1, padding=0, dilation=1, groups=1, bias=True, rng=None,
                 dtype="float32", backend="cpu", precision=None):
        if precision is not None:
            check_precision(precision)  # at construction, not at the first forward
        _check_channels(c_in, c_out, groups)
        rng = np.random.default_rng(rng)  # a seed (0 included), a Generator, or None: fresh
        ks = (k,) * self.NDIM if isinstance(k, int) else tuple(k)
        if len(ks) != self.NDIM or not all(_is_int(n) and n > 0 for n in ks):
            raise ValueError(f"kernel_size must be a positive int or {self.NDIM} of them, got {k!r}")
        self.in_channels, self.out_channels = c_in, c_out
        shape, fan_in = self._weight(c_in, c_out, ks, groups)
        self.weight = Tensor(kaiming_uniform(shape, fan_in, rng, dtype), True)
        self.bias = Tensor(np.zeros(c_out, dtype), True) if bias else None
        self.kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups, backend=backend,
                       precision=precision)

    @staticmethod
    def _weight(c_in, c_out, ks, groups):
        return (c_out, *ks, c_in // groups), c_in // groups * int(np.prod(ks))

    def _check_input(self, x):
        """x (N, *spatial, in_channels), checked here so the message names the layer's channels (the kernel
        API would name the weight's dimensions)."""
        shape = x.shape
        if len(shape) != self.NDIM + 2:
            raise ValueError(f"{type(self).__name__}: expected a {self.NDIM + 2}-D input (N, {self.NDIM} spatial "
                             f"dims, channels last), got shape {shape}")
        if shape[-1] != self.in_channels:
            raise ValueError(f"{type(self).__name__}: expected {self.in_channels} channels (in_channels, the last "
                             f"dimension), got {shape[-1]}")

    def forward(self, x):
        x = as_tensor(x)
        self._check_input(x)
        return F.conv(x, self.weight, self.bias, **self.kw)


def _is_int(v):
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _check_channels(c_in, c_out, groups):
    """PyTorch's checks and messages for a convolution's channels, at construction."""
    for name, v in (("in_channels", c_in), ("out_channels", c_out), ("groups", groups)):
        if not _is_int(v):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if groups <= 0:
        raise ValueError(f"groups must be a positive integer, got {groups}")
    if c_in <= 0 or c_out <= 0:
        raise ValueError(f"in_channels and out_channels must be positive, got {c_in} and {c_out}")
    if c_in % groups:
        raise ValueError(f"in_channels must be divisible by groups (in_channels={c_in}, groups={groups})")
    if c_out % groups:
        raise ValueError(f"out_channels must be divisible by groups (out_channels={c_out}, groups={groups})")


class Conv1d(_ConvNd):
    NDIM = 1


class Conv2d(_ConvNd):
    NDIM = 2


class Conv3d(_ConvNd):
    NDIM = 3


class _ConvTransposeNd(_ConvNd):
    """Weight (c_in, *filter, c_out // groups), as F.conv_transpose (PyTorch's layout, channels-last)."""

    def __init__(self, c_in, c_out, k, *, output_padding=0, **kw):
        super().__init__(c_in, c_out, k, **kw)
        self.kw["output_padding"] = output_padding

    @staticmethod
    def _weight(c_in, c_out, ks, groups):  # PyTorch's fan-in for a transposed weight
        return (c_in, *ks, c_out // groups), c_out // groups * int(np.prod(ks))

    def forward(self, x):
        x = as_tensor(x)
        self._check_input(x)
        return F.conv_transpose(x, self.weight, self.bias, **self.kw)


class ConvTranspose1d(_ConvTransposeNd):
    NDIM = 1


class ConvTranspose2d(_ConvTransposeNd):
    NDIM = 2


class ConvTranspose3d(_ConvTransposeNd):
    NDIM = 3


class Linear(Module):
    """y = x w^T + b over the last dimension of x (any leading dimensions, as PyTorch's)."""

    def __init__(self, f_in, f_out, *, rng=None, dtype="float32"):
        for name, v in (("in_features", f_in), ("out_features", f_out)):
            if not _is_int(v):
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        rng = np.random.default_rng(rng)
        self.weight = Tensor(kaiming_uniform((f_out, f_in), f_in, rng, dtype), True)
        self.bias = Tensor(np.zeros(f_out, dtype), True)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class BatchNorm2d(Module):
    def __init__(self, c, *, momentum=0.1, eps=1e-5, dtype="float32"):
        self.weight = Tensor(np.ones(c, dtype), True)
        self.bias = Tensor(np.zeros(c, dtype), True)
        self.running_mean, self.running_var = np.zeros(c, dtype), np.ones(c, dtype)
        self.momentum, self.eps = momentum, eps

    def _check_input(self, x):
        shape = x.shape
        if len(shape) != 4:
            raise ValueError(f"BatchNorm2d: expected a 4-D input (N, H, W, C), got shape {shape}")
        if shape[-1] != self.weight.shape[0]:
            raise ValueError(f"BatchNorm2d: expected {self.weight.shape[0]} channels, got {shape[-1]}")

    def forward(self, x):
        x = as_tensor(x)
        self._check_input(x)
        return F.batch_norm(x, self.weight, self.bias, self.running_mean, self.running_var,
                            training=self.training, momentum=self.momentum, eps=self.eps)

    def forward_relu(self, x):
        """relu(self(x)), fused on the device."""
        x = as_tensor(x)
        self._check_input(x)
        return F.batch_norm_relu(x, self.weight, self.bias, self.running_mean, self.running_var,
                                 training=self.training, momentum=self.momentum, eps=self.eps)


class ReLU(Module):
    def forward(self, x):
        return F.relu(x)


class LeakyReLU(Module):
    def __init__(self, negative_slope=0.01):
        self.negative_slope = negative_slope

    def forward(self, x):
        return F.leaky_relu(x, self.negative_slope)


class GELU(Module):
    def forward(self, x):
        return F.gelu(x)


class Sigmoid(Module):
    def forward(self, x):
        return F.sigmoid(x)


class Tanh(Module):
    def forward(self, x):
        return F.tanh(x)


class GlobalAvgPool(Module):
    def forward(self, x):
        return F.global_avg_pool(x)


class MaxPool2d(Module):
    def __init__(self, kernel, stride=None, padding=0):
        self.kernel, self.stride, self.padding = kernel, stride, padding

    def forward(self, x):
        return F.max_pool2d(x, self.kernel, self.stride, self.padding)


class AvgPool2d(Module):
    def __init__(self, kernel, stride=None, padding=0, count_include_pad=True):
        self.kernel, self.stride, self.padding, self.count_include_pad = kernel, stride, padding, count_include_pad

    def forward(self, x):
        return F.avg_pool2d(x, self.kernel, self.stride, self.padding, self.count_include_pad)


class AdaptiveAvgPool2d(Module):
    def __init__(self, output_size):
        self.output_size = output_size

    def forward(self, x):
        return F.adaptive_avg_pool2d(x, self.output_size)


class Flatten(Module):
    def forward(self, x):
        return F.flatten(x)


class Dropout(Module):
    """Inverted dropout in training, the identity in eval(); rng (a seed or a Generator) fixes the masks."""

    def __init__(self, p=0.5, rng=None):
        self.p, self.rng = p, np.random.default_rng(rng)

    def forward(self, x):
        return F.dropout(x, self.p, self.training, self.rng)


class Sequential(Module):
    def __init__(self, *layers):
        self.layers = list(layers)

    def forward(self, x):
        i, first = 0, x
        while i < len(self.layers):  # BatchNorm2d then ReLU: one fused op (one pass on the device)
            layer, prev = self.layers[i], x
            if type(layer) is BatchNorm2d and i + 1 < len(self.layers) and type(self.layers[i + 1]) is ReLU:
                x, i = layer.forward_relu(x), i + 2
            else:
                x, i = layer(x), i + 1
            if prev is not first:  # an output of ours that the next layer has read: a backward that reads it again
                prev.release()     # computes it again where it can (Tensor.release, settings.nn_recompute)
        return x
