"""kernelgen: a JIT kernel-generation compiler for convolution layers."""
from .api import (bind, conv, conv_backward_data, conv_backward_weight, deconv, explain, get_precision,
                  set_autotune, set_precision)
# the function (kernelgen.precompile(calls, workers=None)) shadows its module's name on the package; the module's
# other names are imported from it (`from kernelgen.precompile import recording`)
from .precompile import precompile
from .compile_profile import profile_compile
from .problem import ConvProblem, make_problem
from .version import __version__

__all__ = ["bind", "conv", "conv_backward_data", "conv_backward_weight", "deconv", "explain", "set_precision", "set_autotune",
           "get_precision", "precompile", "profile_compile", "ConvProblem",
           "make_problem", "__version__"]
