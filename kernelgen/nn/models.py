"""Standard image models, channels-last: ResNet-18/34 (basic blocks), ResNet-50 (bottlenecks) and VGG-16 with
batch norm; MobileNetV2 and EfficientNet-B0's MBConv block live in mobilenet.py and are re-exported here.

Layer names follow torchvision (conv1, layer1..layer4, fc; features, classifier), but the weights are
channels-last ((K, R, S, C) filters) and flatten() is taken in NHWC order, so they are not
interchangeable with torchvision's checkpoints.  `width` scales every channel count (64 = the paper's),
which keeps tests small without changing the structure.
"""
from __future__ import annotations

import numpy as np

from kernelgen.nn import functional as F
from kernelgen.nn.mobilenet import MBConv, MobileNetV2, mobilenet_v2  # noqa: F401 (re-exported: the image models)
from kernelgen.nn.blocks import BasicBlock, Bottleneck
from kernelgen.nn.modules import (AdaptiveAvgPool2d, BatchNorm2d, Conv2d, Dropout, Linear, MaxPool2d, Module, ReLU,
                                  Sequential)


class ResNet(Module):
    """stem="imagenet": 7x7/2 convolution then 3x3/2 max-pool (input downsampled 4x before layer1);
    stem="cifar": one 3x3/1 convolution, no pooling, for 32x32 (or smaller) images."""

    def __init__(self, blocks, classes=1000, *, in_channels=3, width=64, stem="imagenet", seed=0, backend="cpu",
                 block=BasicBlock):
        rng = np.random.default_rng(seed)
        if stem == "imagenet":
            self.stem = Sequential(Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False, rng=rng,
                                          backend=backend), BatchNorm2d(width), ReLU(), MaxPool2d(3, 2, 1))
        elif stem == "cifar":
            self.stem = Sequential(Conv2d(in_channels, width, 3, padding=1, bias=False, rng=rng, backend=backend),
                                   BatchNorm2d(width), ReLU())
        else:
            raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
        c_in, stages = width, []
        for i, n in enumerate(blocks):  # a block of width c makes c * block.expansion channels
            c = width * 2 ** i
            stages.append(Sequential(*[block(c_in if b == 0 else c * block.expansion, c, 2 if i and b == 0 else 1,
                                             rng, backend) for b in range(n)]))
            c_in = c * block.expansion
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = Linear(c_in, classes, rng=rng)

    def forward(self, x):
        x = self.stem(x)
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            x = stage(x)
        return self.fc(F.global_avg_pool(x))


def resnet18(classes=1000, **kw):
    return ResNet((2, 2, 2, 2), classes, **kw)


def resnet34(classes=1000, **kw):
    return ResNet((3, 4, 6, 3), classes, **kw)


def resnet50(classes=1000, **kw):
    return ResNet((3, 4, 6, 3), classes, block=Bottleneck, **kw)


VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(Module):
    """VGG with batch norm after every convolution: features, adaptive average pool to pool_size,
    then a three-layer classifier with dropout.  Five 2x2 max-pools: inputs of 32x32 or more."""

    def __init__(self, config=VGG16, classes=1000, *, in_channels=3, width=64, hidden=4096, pool_size=7, dropout=0.5,
                 seed=0, backend="cpu"):
        rng = np.random.default_rng(seed)
        layers, c_in = [], in_channels
        for v in config:
            if v == "M":
                layers.append(MaxPool2d(2, 2))
            else:
                c_out = v * width // 64
                layers += [Conv2d(c_in, c_out, 3, padding=1, rng=rng, backend=backend), BatchNorm2d(c_out), ReLU()]
                c_in = c_out
        self.features = Sequential(*layers)
        self.avgpool = AdaptiveAvgPool2d(pool_size)
        ph, pw = (pool_size, pool_size) if np.isscalar(pool_size) else pool_size
        self.classifier = Sequential(Linear(c_in * ph * pw, hidden, rng=rng), ReLU(), Dropout(dropout, rng),
                                     Linear(hidden, hidden, rng=rng), ReLU(), Dropout(dropout, rng),
                                     Linear(hidden, classes, rng=rng))

    def forward(self, x):
        return self.classifier(F.flatten(self.avgpool(self.features(x))))


def vgg16_bn(classes=1000, **kw):
    return VGG(VGG16, classes, **kw)
