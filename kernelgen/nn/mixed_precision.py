"""Mixed-precision training: the convolutions on tensor cores, everything else in fp32.

The precision of a convolution ("fp32", "tf32", "fp16" or "bf16") is chosen explicitly, never silently:
per layer (`Conv2d(..., precision="fp16")`, `F.conv(..., precision=...)`), or for a block of code with
`kernelgen.nn.precision("bf16")` (a `kernelgen.settings.scope(precision=...)`: this thread only, restored on
exit - like PyTorch's autocast).  A layer's own argument wins over the block's setting.

The precision is fixed when the forward runs: the backward's two convolutions (input and weight
gradients) use that same precision, even if the setting changes before backward() is called.

fp32 master weights: the tensor-core kernels take and return float32 arrays and round the operands to
tf32/fp16/bf16 only inside the kernel (fp32 accumulation), so parameters, gradients, optimizer state and
every non-convolution op stay float32.  There is no loss scaling: with "fp16", gradients below fp16's
normal range (~6e-5) lose bits in the backward convolutions; "bf16" has fp32's range.  Linear layers
are NumPy matrix products (fp32) on the host and 1x1 kernelgen convolutions on the device, where they
follow the global setting.
"""
from __future__ import annotations

import contextlib

from kernelgen import settings
from kernelgen.planner import check_precision


@contextlib.contextmanager
def precision(value):
    """`with kernelgen.nn.precision("fp16"): ...`: every convolution in the block, in this thread, that is given
    no precision of its own runs in `value` (other threads keep theirs: it is a settings scope, not the
    process-wide kernelgen.set_precision)."""
    with settings.scope(precision=check_precision(value)):  # ValueError naming "precision"
        yield value
