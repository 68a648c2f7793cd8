"""Autograd tensors, layers, optimisers and training, with every convolution a kernelgen kernel."""
from . import functional
from .modules import BasicBlock, BatchNorm2d, Conv2d, GlobalAvgPool, Linear, Module, ReLU, Sequential, SmallResNet
from .optim import SGD, Adam
from .tensor import Tensor, no_grad

__all__ = ["functional", "Tensor", "no_grad", "Module", "Conv2d", "Linear", "BatchNorm2d", "ReLU", "GlobalAvgPool",
           "Sequential", "BasicBlock", "SmallResNet", "SGD", "Adam"]
