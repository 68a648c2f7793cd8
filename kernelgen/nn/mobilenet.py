"""MobileNetV2 and EfficientNet-B0's MBConv block, channels-last, every depthwise convolution a Conv2d(groups=C)
(the planner runs those on the direct depthwise template, templates/depthwise.py).

MobileNetV2 follows torchvision's mobilenet_v2 (Sandler et al. 2018): the (t, c, n, s) table of inverted residual
blocks (1x1 expansion by t, 3x3 depthwise, linear 1x1 projection, a residual where shape allows), ReLU6, channels
scaled by `width` and rounded to multiples of 8, a 1x1 conv to 1280, average pool, dropout, linear.  stem="cifar"
is the common 32x32 variant: stride 1 in the stem and in the first stride-2 stage (inputs downsampled 8x, not 32x).
MBConv is EfficientNet-B0's block (Tan & Le 2019): expansion, k x k depthwise, squeeze-and-excitation (pooled,
reduced to c_in / 4 channels with SiLU, expanded, sigmoid, scaling the depthwise output), projection, residual;
no stochastic depth (eval-time behaviour of torchvision's).  Weights are channels-last ((K, R, S, C // groups)),
as everywhere in kernelgen.nn; `as_torch` builds the same network in PyTorch with the same weights, for the tests
and the training-step benchmark (it takes the torch module: nothing here imports torch).
"""
from __future__ import annotations

import numpy as np

from kernelgen.nn import functional as F
from kernelgen.nn.modules import BatchNorm2d, Conv2d, Dropout, Linear, Module, Sequential
from kernelgen.nn.tensor import Tensor, as_tensor, device_ops, reshape

# torchvision's inverted residual settings: expansion t, output channels c, repeats n, first block's stride s
MOBILENET_V2_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                         (6, 160, 3, 2), (6, 320, 1, 1))
LAST_CHANNELS = 1280


def make_divisible(v, divisor=8):
    """torchvision's _make_divisible: v rounded to a multiple of divisor, never below 90 % of v."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def relu6(x):
    """min(max(x, 0), 6); its gradient passes where 0 < x < 6 (PyTorch's hardtanh backward)."""
    x = as_tensor(x)
    if ops := device_ops(x):
        y = ops.activation(x.data, "relu6")
        return Tensor.from_op(y, (x,), lambda g: (ops.activation_backward(g, x.data, "relu6"),))
    mask = (x.data > 0) & (x.data < 6)
    return Tensor.from_op(np.clip(x.data, 0, 6), (x,), lambda g: (g * mask,))


def silu(x):
    """x * sigmoid(x) (EfficientNet's swish), built from ops that run on the host and the device."""
    x = as_tensor(x)
    return x * F.sigmoid(x)


class ReLU6(Module):
    def forward(self, x):
        return relu6(x)


class SiLU(Module):
    def forward(self, x):
        return silu(x)


def conv_bn(c_in, c_out, k, rng, backend, *, stride=1, groups=1, act=ReLU6):
    """Conv2d (no bias, 'same' padding for odd k) + BatchNorm2d (+ act, None for a linear layer)."""
    layers = [Conv2d(c_in, c_out, k, stride=stride, padding=(k - 1) // 2, groups=groups, bias=False, rng=rng,
                     backend=backend), BatchNorm2d(c_out)]
    return Sequential(*layers, *([act()] if act else []))


class InvertedResidual(Module):
    """MobileNetV2's block: [1x1 expand + ReLU6] (t > 1), 3x3 depthwise + ReLU6, 1x1 linear projection, + x when
    the stride is 1 and the channels stay."""

    def __init__(self, c_in, c_out, stride, expand, rng, backend):
        hidden = int(round(c_in * expand))
        layers = [conv_bn(c_in, hidden, 1, rng, backend)] if expand != 1 else []
        layers += [conv_bn(hidden, hidden, 3, rng, backend, stride=stride, groups=hidden),
                   conv_bn(hidden, c_out, 1, rng, backend, act=None)]
        self.conv = Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        out = self.conv(x)
        return x + out if self.residual else out


class MobileNetV2(Module):
    """MobileNetV2 (see the module): stem, the settings' inverted residual blocks, 1x1 conv to
    LAST_CHANNELS x max(1, width), pool, dropout, linear.  settings: (t, c, n, s) rows (a shorter table keeps a
    test small)."""

    def __init__(self, classes=1000, *, width=1.0, stem="imagenet", settings=MOBILENET_V2_SETTINGS, dropout=0.2,
                 in_channels=3, seed=0, backend="cpu"):
        if stem not in ("imagenet", "cifar"):
            raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
        if not (isinstance(width, (int, float)) and width > 0):
            raise ValueError(f"width must be a positive number, got {width!r}")
        rng = np.random.default_rng(seed)
        c_in = make_divisible(32 * width)
        blocks = [conv_bn(in_channels, c_in, 3, rng, backend, stride=2 if stem == "imagenet" else 1)]
        first_stride2 = True
        for t, c, n, s in settings:
            c_out = make_divisible(c * width)
            if stem == "cifar" and s == 2 and first_stride2:  # 32x32 inputs: keep the 24-channel stage's maps
                s, first_stride2 = 1, False
            for i in range(n):
                blocks.append(InvertedResidual(c_in, c_out, s if i == 0 else 1, t, rng, backend))
                c_in = c_out
        last = make_divisible(LAST_CHANNELS * max(1.0, width))
        blocks.append(conv_bn(c_in, last, 1, rng, backend))
        self.features = Sequential(*blocks)
        self.dropout = Dropout(dropout, rng)
        self.classifier = Linear(last, classes, rng=rng)

    def forward(self, x):
        return self.classifier(self.dropout(F.global_avg_pool(self.features(x))))


def mobilenet_v2(classes=1000, **kw):
    return MobileNetV2(classes, **kw)


class SqueezeExcite(Module):
    """x * sigmoid(expand(silu(reduce(mean over H, W of x)))), the 1x1 convolutions with bias as EfficientNet's."""

    def __init__(self, channels, squeezed, rng, backend):
        self.reduce = Conv2d(channels, squeezed, 1, rng=rng, backend=backend)
        self.expand = Conv2d(squeezed, channels, 1, rng=rng, backend=backend)

    def forward(self, x):
        n, c = x.shape[0], x.shape[-1]
        s = reshape(F.global_avg_pool(x), (n, 1, 1, c))
        return x * F.sigmoid(self.expand(silu(self.reduce(s))))


class MBConv(Module):
    """EfficientNet-B0's block (see the module): [1x1 expand + SiLU] (expand > 1), k x k depthwise + SiLU,
    squeeze-excite to c_in // 4, 1x1 linear projection, + x when the stride is 1 and the channels stay."""

    def __init__(self, c_in, c_out, k, stride, expand, *, rng=None, backend="cpu", se_ratio=0.25):
        rng = rng or np.random.default_rng(0)
        hidden = c_in * expand
        layers = [conv_bn(c_in, hidden, 1, rng, backend, act=SiLU)] if expand != 1 else []
        layers += [conv_bn(hidden, hidden, k, rng, backend, stride=stride, groups=hidden, act=SiLU),
                   SqueezeExcite(hidden, max(1, int(c_in * se_ratio)), rng, backend),
                   conv_bn(hidden, c_out, 1, rng, backend, act=None)]
        self.block = Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        out = self.block(x)
        return x + out if self.residual else out


ReLU6.__doc__ = relu6.__doc__
SiLU.__doc__ = silu.__doc__


# --- the same networks in PyTorch ------------------------------------------------------------------------------------

def as_torch(torch, module, dtype=None):
    """A torch.nn.Module computing what `module` (MobileNetV2, MBConv or any of their parts) computes, with copies
    of its weights and running statistics, on NCHW tensors (`torch`: the torch module; dtype: its parameters',
    default float32)."""
    nn, dtype = torch.nn, dtype or torch.float32
    param = lambda a: nn.Parameter(torch.tensor(np.asarray(a), dtype=dtype))

    class Lambda(nn.Module):  # a forward of parts: the residual, squeeze-excite and head wiring
        def __init__(self, fn, **parts):
            super().__init__()
            self.fn, self.parts = fn, nn.ModuleDict(parts)

        def forward(self, x):
            return self.fn(self.parts, x)

    def conv(m):
        w = m.weight.numpy().transpose(0, 3, 1, 2)  # (K, R, S, C / g) -> (K, C / g, R, S)
        t = nn.Conv2d(m.in_channels, m.out_channels, w.shape[2:], stride=m.kw["stride"], padding=m.kw["padding"],
                      dilation=m.kw["dilation"], groups=m.kw["groups"], bias=m.bias is not None)
        t.weight = param(w)
        if m.bias is not None:
            t.bias = param(m.bias.numpy())
        return t

    def batch_norm(m):
        t = nn.BatchNorm2d(m.weight.shape[0], eps=m.eps, momentum=m.momentum).to(dtype)
        t.weight, t.bias = param(m.weight.numpy()), param(m.bias.numpy())
        t.running_mean.copy_(torch.tensor(np.asarray(m.running_mean)))
        t.running_var.copy_(torch.tensor(np.asarray(m.running_var)))
        return t

    def convert(m):
        kind = type(m)
        if kind is Conv2d:
            return conv(m)
        if kind is BatchNorm2d:
            return batch_norm(m)
        if kind is Sequential:
            return nn.Sequential(*map(convert, m.layers))
        simple = {ReLU6: nn.ReLU6, SiLU: nn.SiLU}
        if kind in simple:
            return simple[kind]()
        if kind in (InvertedResidual, MBConv):
            body = convert(m.conv if kind is InvertedResidual else m.block)
            return Lambda((lambda p, x: x + p["body"](x)) if m.residual else (lambda p, x: p["body"](x)), body=body)
        if kind is SqueezeExcite:
            return Lambda(lambda p, x: x * torch.sigmoid(p["expand"](nn.functional.silu(p["reduce"](
                x.mean((2, 3), keepdim=True))))), reduce=conv(m.reduce), expand=conv(m.expand))
        if kind is MobileNetV2:
            linear = nn.Linear(*m.classifier.weight.shape[::-1]).to(dtype)
            linear.weight, linear.bias = param(m.classifier.weight.numpy()), param(m.classifier.bias.numpy())
            return Lambda(lambda p, x: p["classifier"](p["dropout"](p["features"](x).mean((2, 3)))),
                          features=convert(m.features), dropout=nn.Dropout(m.dropout.p), classifier=linear)
        raise TypeError(f"as_torch: no PyTorch counterpart for {kind.__name__}")

    return convert(module).train(module.training)


__all__ = ["MobileNetV2", "mobilenet_v2", "MBConv", "InvertedResidual", "SqueezeExcite", "ReLU6", "SiLU", "relu6",
           "silu", "make_divisible", "as_torch", "MOBILENET_V2_SETTINGS"]
