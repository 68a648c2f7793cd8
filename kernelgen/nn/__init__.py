"""Autograd tensors, layers, optimisers and training, with every convolution a kernelgen kernel."""
from kernelgen.nn import arithmetic  # noqa: F401 (binds Tensor's operators: +, -, *, /, **, unary -)
from kernelgen.nn import amp, functional
from kernelgen.nn.blocks import BasicBlock, Bottleneck, SmallResNet
from kernelgen.nn.graphs import CapturedStep
from kernelgen.nn.mixed_precision import precision
from kernelgen.nn.models import (VGG, MBConv, MobileNetV2, ResNet, mobilenet_v2, resnet18, resnet34, resnet50,
                                 vgg16_bn)
from kernelgen.nn.modules import (GELU, AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, Conv1d, Conv2d, Conv3d,
                                  ConvTranspose1d, ConvTranspose2d, ConvTranspose3d, Dropout, Flatten, GlobalAvgPool,
                                  LeakyReLU, Linear, MaxPool2d, Module, ReLU, Sequential, Sigmoid, Tanh)
from kernelgen.nn.optim import SGD, Adam, RAdam, RMSprop
from kernelgen.nn.tensor import Tensor, no_grad

__all__ = ["amp", "functional", "Tensor", "no_grad", "precision", "Module", "Conv1d", "Conv2d", "Conv3d",
           "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "Linear", "BatchNorm2d", "ReLU", "LeakyReLU",
           "GELU", "Sigmoid", "Tanh", "GlobalAvgPool", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d", "Flatten",
           "Dropout", "Sequential", "BasicBlock", "Bottleneck", "SmallResNet", "ResNet", "resnet18", "resnet34",
           "resnet50", "VGG", "vgg16_bn",
           "MobileNetV2", "mobilenet_v2", "MBConv",
           "SGD", "Adam", "RMSprop", "RAdam", "CapturedStep"]
