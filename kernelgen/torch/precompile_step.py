"""kernelgen.torch.precompile: every kernel of a converted model's training step compiled side by side before its
first step (issue 27 for torch users).  Without it, a converted ResNet-18's first step compiles its 60 kernels
one after another: 146 s on the H100.

The model's forward runs once on a zero input under kernelgen.precompile.recording(): each kernelgen convolution
is planned, not run, and returns zeros; the rest of the model (batch norm, activations) runs as usual.  Each
convolution also plans the backward torch would ask of it (ops.record_backward), in the forward's own thread: torch
runs a CUDA backward on threads of its own, where the recording is not in force, so the step's backward is never
run.  The plans go to kernelgen's compile pool (compile_plans), and the model is left as it was: its state_dict
(batch norm's running statistics move in a training-mode forward) and torch's random generators.
"""
from __future__ import annotations

import torch

from kernelgen.precompile import PrecompileReport, compile_plans, recording
from kernelgen.torch import native
from kernelgen.tuning.compile_pool import pool_on_demand


def precompile(model, input_shape, dtype=torch.float32, device=None, workers=None) -> PrecompileReport:
    """Compile the kernels of `model`'s training step on an input of `input_shape` (torch's (N, C, *spatial)) and
    `dtype` - forward, and backward for every input and weight that requires grad - in `workers` processes (None:
    one per kernel, at most one per CPU, started at the first traced kernel not on disk) into kernelgen's disk
    cache.  `device`: the input's (default: the model's parameters').  Under torch.autocast, the autocast
    precision's kernels.  Returns the PrecompileReport."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(input_shape, (tuple, list, torch.Size)) or len(input_shape) < 3 or \
            not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in input_shape):
        raise ValueError(f"input_shape must be (N, C, *spatial) positive ints, got {input_shape!r}")
    if device is None:
        device = next(iter(model.parameters()), torch.empty(0)).device
    x = torch.zeros(tuple(input_shape), dtype=dtype, device=device)
    if x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    if x.is_cuda:
        # the native entry point's build, in its own background process beside the kernels' compiles; not waited
        # for: the first steps take the Python path until it is loaded, rather than wait ~45 s for it
        native.start_build()
    if workers is not None:
        return compile_plans(_trace(model, x), workers)
    with pool_on_demand() as demand:  # (workers start at the first traced kernel not on disk, while tracing)
        return compile_plans(_trace(model, x, demand.see), pool=demand.pool)


def _trace(model, x, on_plan=None) -> list:
    """The plans of one training step of `model` on `x`, the model's state and torch's generators put back."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        with recording(on_plan) as plans, torch.enable_grad():
            model(x)
    finally:
        model.load_state_dict(state)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
    return plans
