"""Constants of the activations computed both on the host (functional.py, numpy) and on the device
(cuda_elementwise.py, numba.cuda kernels): here, below both and without numba, so that importing
kernelgen.nn does not import numba.cuda and the two paths use the very same values."""
from __future__ import annotations

import numpy as np

# GELU, tanh form: x sigmoid(u), u = GELU_A x + GELU_B x^3.  Python floats, not numpy scalars: they keep float32
# data float32
GELU_A = 2 * float(np.sqrt(2 / np.pi))  # 0.5 (1 + tanh(z)) = sigmoid(2z), z = sqrt(2/pi) (x + 0.044715 x^3)
GELU_B = GELU_A * 0.044715
GELU_CLIP = 30.0  # |u(30)| > 2000: sigmoid is exactly 0 or 1 in float64 already, and x^3 cannot overflow
