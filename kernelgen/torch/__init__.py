"""kernelgen from PyTorch (`pip install kernelgen[torch]`; nothing else in kernelgen imports torch).

    import kernelgen.torch
    model = kernelgen.torch.convert(model)        # every nn.Conv*d / nn.ConvTranspose*d now runs on kernelgen
    loss = criterion(model(x), labels); loss.backward()

- `conv1d/2d/3d`, `conv_transpose1d/2d/3d`: torch.nn.functional's signatures, differentiable, autocast-aware
  (kernelgen.torch.functional);
- `Conv1d/2d/3d`, `ConvTranspose1d/2d/3d`: drop-in modules loading torch's state_dicts (kernelgen.torch.modules);
- `convert(model)`: swaps every torch convolution of a model in place;
- `precompile(model, input_shape)`: its training step's kernels compiled side by side before the first step
  (kernelgen.torch.precompile_step);
- the operators underneath, `torch.ops.kernelgen.*`, for torch.compile (kernelgen.torch.ops).
docs/interop.md has the details: layouts and copies, streams, precisions, bfloat16.
"""
from kernelgen.torch.functional import (conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d,  # noqa: F401
                                        conv_transpose3d)
from kernelgen.torch.modules import (Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d,  # noqa: F401
                                     ConvTranspose3d, convert)
from kernelgen.torch.precompile_step import precompile  # noqa: F401
