"""kernelgen: a JIT kernel-generation compiler for convolution layers."""
__version__ = "0.1.0"

from .api import (bind, conv, conv_backward_data, conv_backward_weight, deconv, explain,  # noqa: E402
                  get_precision, set_precision)
from .problem import ConvProblem, make_problem  # noqa: E402

__all__ = ["bind", "conv", "conv_backward_data", "conv_backward_weight", "deconv", "explain", "set_precision",
           "get_precision", "ConvProblem",
           "make_problem", "__version__"]
