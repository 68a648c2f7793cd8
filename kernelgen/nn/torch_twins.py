"""kernelgen.nn's ResNets in PyTorch (torch passed in: kernelgen never imports it itself), their layers registered
in kernelgen.nn's order, so a test can copy weights layer by layer and a benchmark compares like with like."""
from __future__ import annotations

import numpy as np

from kernelgen.nn.modules import BatchNorm2d, Conv2d, Linear


def _stem(nn, width, stem):
    if stem == "cifar":
        return [nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
    return [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1)]


def _resnet(nn, block, blocks, classes, width, stem):
    layers, c_in = _stem(nn, width, stem), width
    for i, n in enumerate(blocks):
        c = width * 2 ** i
        layers += [block(c_in if b == 0 else c * block.expansion, c, 2 if i and b == 0 else 1) for b in range(n)]
        c_in = c * block.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes)]
    return nn.Sequential(*layers)


def torch_resnet18(torch, classes, width, blocks=(2, 2, 2, 2), stem="cifar"):
    """kernelgen.nn's ResNet-18 (basic blocks) in PyTorch."""
    nn = torch.nn

    class Block(nn.Module):
        expansion = 1

        def __init__(self, c_in, c_out, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(c_out)
            self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(c_out)
            self.relu = nn.ReLU(inplace=True)
            self.shortcut = None
            if stride != 1 or c_in != c_out:
                self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

        def forward(self, x):  # torchvision's BasicBlock: in-place ReLUs and residual add
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            out += x if self.shortcut is None else self.shortcut(x)
            return self.relu(out)
    return _resnet(nn, Block, blocks, classes, width, stem)


def torch_resnet50(torch, classes, width=64, blocks=(3, 4, 6, 3), stem="imagenet"):
    """kernelgen.nn's ResNet-50 (bottlenecks, the stride on the 3x3: torchvision's v1.5) in PyTorch."""
    nn = torch.nn

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, c_in, mid, stride):
            super().__init__()
            c_out = mid * self.expansion
            self.conv1 = nn.Conv2d(c_in, mid, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(mid)
            self.conv2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(mid)
            self.conv3 = nn.Conv2d(mid, c_out, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(c_out)
            self.relu = nn.ReLU(inplace=True)
            self.shortcut = None
            if stride != 1 or c_in != c_out:
                self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            out += x if self.shortcut is None else self.shortcut(x)
            return self.relu(out)
    return _resnet(nn, Bottleneck, blocks, classes, width, stem)


def weighted_layers(module, kinds) -> list:
    """module's layers of the given kinds, depth first in registration order (the twins register theirs alike)."""
    found = [module] if isinstance(module, kinds) else []
    for child in module.children():
        found += weighted_layers(child, kinds)
    return found


def copy_weights(torch, model, twin):
    """Give `twin` (torch) `model`'s (kernelgen.nn) weights, layer by layer: convolution filters from channels-last
    (K, R, S, C) to (K, C, R, S), batch norms' weights, biases and running statistics, linear layers'."""
    ours = weighted_layers(model, (Conv2d, BatchNorm2d, Linear))
    theirs = [m for m in twin.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d, torch.nn.Linear))]
    if [type(m).__name__ for m in ours] != [type(m).__name__ for m in theirs]:
        raise ValueError("model and twin have different layers")

    def tensor(a, like):
        return torch.as_tensor(np.asarray(a.copy_to_host() if hasattr(a, "copy_to_host") else a), device=like.device)
    with torch.no_grad():
        for o, t in zip(ours, theirs):
            w = tensor(o.weight.numpy(), t.weight)
            t.weight.copy_(w.permute(0, 3, 1, 2) if isinstance(t, torch.nn.Conv2d) else w)
            if getattr(t, "bias", None) is not None:
                t.bias.copy_(tensor(o.bias.numpy(), t.bias))
            if isinstance(t, torch.nn.BatchNorm2d):
                t.running_mean.copy_(tensor(o.running_mean, t.running_mean))
                t.running_var.copy_(tensor(o.running_var, t.running_var))
