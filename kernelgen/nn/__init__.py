"""Autograd tensors, layers, optimisers and training through kernelgen kernels."""
