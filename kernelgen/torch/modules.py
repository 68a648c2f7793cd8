"""Drop-in nn.Modules: kernelgen.torch.Conv1d/2d/3d and ConvTranspose1d/2d/3d, and convert(model).

Each is a subclass of torch's own module that computes with kernelgen (kernelgen.torch.functional), so its
constructor, parameters, state_dict, repr and hooks are torch's.  The one difference is where the weight lives:
the Parameter keeps torch's shape, (K, C / groups, *filter) (so state_dict and load_state_dict round-trip with
torch's modules), but its memory is channels-last, which is kernelgen's (K, *filter, C / groups) layout, so the
kernels read it without a copy.  Optimisers update it in place and load_state_dict copies into it, both of which
keep that layout; it is converted once, when the module is built or converted.
"""
from __future__ import annotations

import torch
from torch import nn

from kernelgen.torch import functional, native


def store_channels_last(param):
    """Lay param's memory out channels-last in place (the same Parameter object, its shape unchanged)."""
    t = param.data
    perm = (0, *range(2, t.dim()), 1)
    inverse = (0, t.dim() - 1, *range(1, t.dim() - 1))
    param.data = t.permute(perm).contiguous().permute(inverse)
    return param


class _KernelgenConv:
    """What the kernelgen modules add to torch's: the weight stored channels-last."""

    def _kernelgen_init(self):
        store_channels_last(self.weight)
        return self


class _Conv(_KernelgenConv):
    _functional = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kernelgen_init()

    def _conv_forward(self, input, weight, bias):
        y = native.forward(self, input, weight, bias)  # (None where the native path does not take the call)
        if y is not None:
            return y
        conv = type(self)._functional
        if self.padding_mode != "zeros":  # torch's modes other than zeros: x padded first, as torch does
            input = torch.nn.functional.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            return conv(input, weight, bias, self.stride, 0, self.dilation, self.groups)
        return conv(input, weight, bias, self.stride, self.padding, self.dilation, self.groups)


class _ConvTranspose(_KernelgenConv):
    _functional = None
    _nd = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._kernelgen_init()

    def forward(self, input, output_size=None):
        if self.padding_mode != "zeros":
            raise ValueError(f"padding_mode must be 'zeros' for {type(self).__name__}, got {self.padding_mode!r}")
        output_padding = self._output_padding(input, output_size, self.stride, self.padding, self.kernel_size,
                                              self._nd, self.dilation)
        return type(self)._functional(input, self.weight, self.bias, self.stride, self.padding, output_padding,
                                      self.groups, self.dilation)


class Conv1d(_Conv, nn.Conv1d):
    """torch.nn.Conv1d on kernelgen."""
    _functional = staticmethod(functional.conv1d)


class Conv2d(_Conv, nn.Conv2d):
    """torch.nn.Conv2d on kernelgen."""
    _functional = staticmethod(functional.conv2d)


class Conv3d(_Conv, nn.Conv3d):
    """torch.nn.Conv3d on kernelgen."""
    _functional = staticmethod(functional.conv3d)


class ConvTranspose1d(_ConvTranspose, nn.ConvTranspose1d):
    """torch.nn.ConvTranspose1d on kernelgen."""
    _functional, _nd = staticmethod(functional.conv_transpose1d), 1


class ConvTranspose2d(_ConvTranspose, nn.ConvTranspose2d):
    """torch.nn.ConvTranspose2d on kernelgen."""
    _functional, _nd = staticmethod(functional.conv_transpose2d), 2


class ConvTranspose3d(_ConvTranspose, nn.ConvTranspose3d):
    """torch.nn.ConvTranspose3d on kernelgen."""
    _functional, _nd = staticmethod(functional.conv_transpose3d), 3


# torch's module type -> kernelgen's (exact types only: a subclass of nn.Conv2d may compute something else)
KERNELGEN_OF = {nn.Conv1d: Conv1d, nn.Conv2d: Conv2d, nn.Conv3d: Conv3d, nn.ConvTranspose1d: ConvTranspose1d,
                nn.ConvTranspose2d: ConvTranspose2d, nn.ConvTranspose3d: ConvTranspose3d}


def convert(model):
    """Make every torch.nn.Conv1d/2d/3d and ConvTranspose1d/2d/3d of `model` (itself included) compute with
    kernelgen, in place, and return model.  Each module keeps its identity, Parameters (an optimiser built
    before still holds them), buffers and hooks: its class becomes kernelgen's subclass of its own, and its
    weight's memory is laid out channels-last once.  Subclasses of torch's convolutions are left alone."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for module in model.modules():
        kernelgen_type = KERNELGEN_OF.get(type(module))
        if kernelgen_type is not None:
            module.__class__ = kernelgen_type
            module._kernelgen_init()
    return model
