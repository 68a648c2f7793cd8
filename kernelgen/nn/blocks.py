"""Residual blocks: ResNet's basic block and bottleneck, and the small ResNet the digits set trains.  Each block
ends in one fused pass (batch norm, sum, ReLU), and releases the batch norms' outputs and its input once its
forward has read them: a backward that reads them again computes them again (settings.nn_recompute; nn.md)."""
from __future__ import annotations

import numpy as np

from kernelgen.nn import functional as F
from kernelgen.nn.modules import BatchNorm2d, Conv2d, Linear, Module, ReLU, Sequential


def _residual_end(bn, y, shortcut, x):
    """relu(bn(y) + shortcut(x)), a residual block's end: the batch norm, the sum and the ReLU in one pass (the
    projection's batch norm too), or, for a subclass (SyncBatchNorm) that normalises its own way, its forward and
    then the sum into its output (read by no backward)."""
    if shortcut is None:
        if type(bn) is not BatchNorm2d:
            return F.add_relu(bn(y), x, inplace=True)
        return F.batch_norm_add_relu(y, bn.weight, bn.bias, bn.running_mean, bn.running_var, x,
                                     training=bn.training, momentum=bn.momentum, eps=bn.eps)
    conv, proj_bn = shortcut.layers
    out = bn(y)
    if type(proj_bn) is not BatchNorm2d:
        return F.add_relu(proj_bn(conv(x)), out)
    return F.batch_norm_add_relu(conv(x), proj_bn.weight, proj_bn.bias, proj_bn.running_mean, proj_bn.running_var,
                                 out, training=proj_bn.training, momentum=proj_bn.momentum, eps=proj_bn.eps,
                                 inplace=True)  # (into bn's output)


def _projection(c_in, c_out, stride, rng, backend):
    """The shortcut's 1x1 convolution and batch norm where the block changes the shape, else None (the identity)."""
    if stride == 1 and c_in == c_out:
        return None
    return Sequential(Conv2d(c_in, c_out, 1, stride=stride, bias=False, rng=rng, backend=backend), BatchNorm2d(c_out))


class BasicBlock(Module):
    """ResNet basic block: conv-bn-relu-conv-bn, plus the (projected) input, then relu."""
    expansion = 1

    def __init__(self, c_in, c_out, stride, rng, backend):
        self.conv1 = Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False, rng=rng, backend=backend)
        self.bn1 = BatchNorm2d(c_out)
        self.conv2 = Conv2d(c_out, c_out, 3, padding=1, bias=False, rng=rng, backend=backend)
        self.bn2 = BatchNorm2d(c_out)
        self.shortcut = _projection(c_in, c_out, stride, rng, backend)

    def forward(self, x):
        out = self.bn1.forward_relu(self.conv1(x))
        y = self.conv2(out)
        out.release()  # read again by conv2's weight gradient only: computed again there (settings.nn_recompute)
        out = _residual_end(self.bn2, y, self.shortcut, x)
        x.release()  # the block's input: read again only by conv1's (and the projection's) weight gradients
        return out


class Bottleneck(Module):
    """ResNet-50's block (torchvision's v1.5: the stride on the 3x3): 1x1 down to `mid`, 3x3, 1x1 up to 4 * mid,
    each with a batch norm, plus the (projected) input, then relu.  Its batch norms' outputs are released and
    recomputed as BasicBlock's are (settings.nn_recompute)."""
    expansion = 4

    def __init__(self, c_in, mid, stride, rng, backend):
        c_out = mid * self.expansion
        self.conv1 = Conv2d(c_in, mid, 1, bias=False, rng=rng, backend=backend)
        self.bn1 = BatchNorm2d(mid)
        self.conv2 = Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False, rng=rng, backend=backend)
        self.bn2 = BatchNorm2d(mid)
        self.conv3 = Conv2d(mid, c_out, 1, bias=False, rng=rng, backend=backend)
        self.bn3 = BatchNorm2d(c_out)
        self.shortcut = _projection(c_in, c_out, stride, rng, backend)

    def forward(self, x):
        out = self.bn1.forward_relu(self.conv1(x))
        y = self.conv2(out)
        out.release()  # (as in BasicBlock)
        out = self.bn2.forward_relu(y)
        y = self.conv3(out)
        out.release()
        out = _residual_end(self.bn3, y, self.shortcut, x)
        x.release()
        return out


class SmallResNet(Module):
    """A ResNet for 8x8 single-channel images (the digits set): stem, two stages, pool, linear."""

    def __init__(self, classes=10, width=16, seed=0, backend="cpu"):
        rng = np.random.default_rng(seed)
        self.stem = Sequential(Conv2d(1, width, 3, padding=1, bias=False, rng=rng, backend=backend),
                               BatchNorm2d(width), ReLU())
        self.stage1 = BasicBlock(width, width, 1, rng, backend)
        self.stage2 = BasicBlock(width, 2 * width, 2, rng, backend)
        self.head = Linear(2 * width, classes, rng=rng)

    def forward(self, x):
        return self.head(F.global_avg_pool(self.stage2(self.stage1(self.stem(x)))))
