"""The planner: a validated ConvProblem (plus the caller's algo / config / precision) -> a Plan.

One resolution chain, in this order: an explicit `config=` -> the tuned database's entry for exactly this
problem (or its nearest tuned neighbour, for fp32) -> the untuned tile measured best on average (fp16 on
sm_90) -> the variant's cost-model default.  A Plan knows everything that affects the generated source, so
`Plan.key()` is the kernel cache's key (tinygrad's realize.py keeps one such key the same way).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from . import settings
from .problem import ConvProblem
from .render_cpu import render_cpu
from .render_cuda import render_cuda
from .storage import PRECISIONS, check_dtype_precision, check_split_k
from .templates import candidates, computes, default_config, get_variant, implicit_gemm, implicit_gemm_tc

BACKENDS = ("cuda", "cpu")


def check_precision(precision, name="precision"):
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"{name} must be one of {PRECISIONS}, got {precision!r}")
    return precision


def resolve_precision(precision):
    """A call's precision: its own argument, else the setting in force (kernelgen.set_precision / scope)."""
    return settings.get("precision") if precision is None else check_precision(precision)


@functools.lru_cache(maxsize=None)
def gpu_present() -> bool:
    """A real GPU (the simulator does not count: it is a debugging tool, ~ms per thread)."""
    if settings.get("cuda_simulator"):
        return False
    from .runtime.arena import install_from_env
    install_from_env()  # KERNELGEN_ARENA=1: numba accepts a memory manager only before its context exists
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:
        return False


def device_key(backend):
    if backend != "cuda":
        return "cpu"
    if settings.get("cuda_simulator"):
        return "cudasim"
    from numba import cuda
    return "sm_%d%d" % cuda.get_current_device().compute_capability


@functools.lru_cache(maxsize=None)
def tuned_device():
    from .tuning.tuner import device_name
    return device_name()


def _tuned_db():
    if not gpu_present() or settings.get("no_tuned"):
        return None  # databases are per GPU: rendering for CUDA on a GPU-less machine uses the heuristics
    from .tuning import database
    return database


def tuned_choice(problem, preferred=None):
    """(variant name, TileConfig) from the tuned database for this GPU, or None."""
    db = _tuned_db()
    hit = None if db is None else db.lookup(problem, tuned_device(), preferred)
    return None if hit is None else hit[:2]


def tuned_variant_config(problem, variant):
    """The tuned database's fastest config of a forced variant on exactly this problem, or None."""
    db = _tuned_db()
    return None if db is None else db.tuned_config(problem, tuned_device(), variant)


def tuned_tensor_core_config(problem, precision):
    """The tuned database's fastest tensor-core config for exactly this problem at `precision` (written by
    `python -m kernelgen tune TABLE --precision ...`), or None."""
    db = _tuned_db()
    return None if db is None else db.tuned_config(problem, tuned_device(), implicit_gemm_tc.NAME, precision)


@dataclass(frozen=True)
class Plan:
    problem: ConvProblem
    variant: str
    config: object
    backend: str
    precision: str | None = None  # None: the variant's own (fp32, or tf32 for a tensor-core variant)

    def __post_init__(self):
        own = getattr(get_variant(self.variant), "PRECISIONS", ("fp32",))
        if self.precision is None:
            object.__setattr__(self, "precision", own[0])
        elif self.precision not in own:
            raise ValueError(f"variant {self.variant!r} computes in {own}, not precision={self.precision!r}")

    def key(self):
        """Everything the rendered source depends on: the problem, variant, config, backend and device, the
        variant's own extra (Winograd's state count), the precision and every code-changing setting."""
        extra = getattr(get_variant(self.variant), "key_extra", None)
        return (self.problem, self.variant, self.config, self.backend, device_key(self.backend),
                extra(self.problem) if extra else None, self.precision, settings.code_token())

    def kernel_ir(self):
        if self.precision != "fp32":  # a tensor-core variant: the operand format is a build argument
            return get_variant(self.variant).build(self.problem, self.config, self.precision)
        return get_variant(self.variant).build(self.problem, self.config)

    def render(self):
        k = self.kernel_ir()
        return render_cuda(k) if self.backend == "cuda" else render_cpu(k)


def _hopper_untuned_config(problem, precision):
    """fp16 on an sm_90 GPU with no tuned entry: the TMA tile measured best on average there
    (tuner.untuned_tma_config; the template's mma.sync default is 2-3x slower on those problems), or None."""
    if precision != "fp16" or not gpu_present():
        return None
    from .tuning.tuner import untuned_tma_config
    config = untuned_tma_config(problem, precision)
    return config if config is not None and device_key("cuda") == "sm_90" else None


def _tensor_core_plan(problem, backend, algo, config, precision) -> Plan:
    """The tensor-core implicit GEMM at `precision`: the given config, else (CUDA, a GPU present, tuned
    databases not turned off) the tuned entry for exactly (problem, precision), else (fp16 on sm_90) the untuned
    TMA tile, else the template's default."""
    if algo not in (None, implicit_gemm.NAME, implicit_gemm_tc.NAME):
        raise ValueError(f"precision={precision!r} is implemented by algo={implicit_gemm.NAME!r} only, got "
                         f"algo={algo!r}")
    if config is None and backend == "cuda":
        config = tuned_tensor_core_config(problem, precision) or _hopper_untuned_config(problem, precision)
    if config is None:
        config = implicit_gemm_tc.default_config(problem, backend, precision)
    if not config.tensor_core:
        raise ValueError(f"config must be a tensor-core TileConfig (WM, WN > 0) for precision={precision!r}, "
                         f"got {config}")
    config.validate()
    implicit_gemm_tc.check_config(config, precision)
    check_split_k(problem.dtype, config)
    if backend != "cuda" and config.split_k > 1:
        raise ValueError(f"config.split_k must be 1 on the {backend} backend, got {config.split_k}")
    return Plan(problem, implicit_gemm_tc.NAME, config, backend, precision)


def make_plan(problem, backend, algo=None, config=None, precision="fp32") -> Plan:
    """precision: "fp32" (the fp32 variants) or "tf32" / "fp16" / "bf16" (the tensor-core implicit GEMM); never the global
    setting here: the API functions resolve that."""
    check_dtype_precision(problem.dtype, check_precision(precision))  # float16 tensors: precision="fp16" only
    if precision != "fp32":
        return _tensor_core_plan(problem, backend, algo, config, precision)
    if algo is not None:
        variant = get_variant(algo)
        if not computes(variant, problem):
            raise ValueError(f"algo {algo!r} cannot compute this problem ({problem.key()})")
        if getattr(variant, "PRECISIONS", ("fp32",)) != ("fp32",):
            raise ValueError(f"algo {algo!r} computes in {variant.PRECISIONS[0]}: ask for it with "
                             f"precision={variant.PRECISIONS[0]!r}")
        if config is None and backend == "cuda":
            config = tuned_variant_config(problem, variant.NAME)
    else:
        variant = candidates(problem)[0]
        if config is None and backend == "cuda":
            tuned = tuned_choice(problem, variant.NAME)
            if tuned is not None:
                variant, config = get_variant(tuned[0]), tuned[1]
    if config is None:
        config = default_config(problem, backend, variant)
    if backend != "cuda" and config.split_k > 1:
        raise ValueError(f"config.split_k must be 1 on the {backend} backend, got {config.split_k}")
    return Plan(problem, variant.NAME, config, backend)


def get_launcher(plan: Plan):
    from .runtime.cache import KERNELS
    from .runtime.launch import Launcher
    return KERNELS.get(plan.key(), plan.render, lambda module: Launcher.from_module(module, plan.backend))
