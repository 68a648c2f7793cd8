"""The planner: a validated ConvProblem (plus the caller's algo / config / precision) -> a Plan.

One resolution chain, in this order: an explicit `config=` -> the tuned database's entry for exactly this
problem (or its nearest tuned neighbour, for fp32) -> the untuned tile measured best on average (fp16 on
sm_90) -> the variant's cost-model default.  Every choice is made for the Target in effect (kernelgen.target:
the GPU's own facts, or the `target` setting's table entry offline), passed to the variants through the Variant
protocol (templates/variant.py).  A Plan knows everything that affects the generated source, so
`Plan.key()` is the kernel cache's key (tinygrad's realize.py keeps one such key the same way).
"""
from __future__ import annotations

from dataclasses import dataclass

from kernelgen import settings
from kernelgen.problem import ConvProblem
from kernelgen.render_cpu import render_cpu
from kernelgen.render_cuda import render_cuda
from kernelgen.runtime.cache import KERNELS
from kernelgen.runtime.launch import Launcher
from kernelgen.storage import PRECISIONS, check_dtype_precision, check_precision, check_split_k  # noqa: F401
from kernelgen.target import Target, device_name, gpu_present, target_for  # noqa: F401 (re-exported)
from kernelgen.templates import candidates, depthwise, get_variant, implicit_gemm, implicit_gemm_tc
from kernelgen.tuning import database

BACKENDS = ("cuda", "cpu")


def resolve_precision(precision):
    """A call's precision: its own argument, else the setting in force (kernelgen.set_precision / scope)."""
    return settings.get("precision") if precision is None else check_precision(precision)


def device_key(backend, target: Target | None = None):
    """What a kernel's key holds of the device: "cpu", or the CUDA Target itself (every fact of it: a device-read
    target keys its own facts, an offline one its table entry), marked "cudasim" under numba's simulator."""
    if backend != "cuda":
        return "cpu"
    target = target or target_for(backend)
    return ("cudasim", target) if settings.get("cuda_simulator") else target


def tuned_device():
    """The tuned databases' name of the GPU planned for ("sm_90_NVIDIA H100 80GB HBM3")."""
    return target_for("cuda").device_name


def _tuned_db():
    if not gpu_present() or settings.get("no_tuned"):
        return None  # databases are per GPU: rendering for CUDA on a GPU-less machine uses the heuristics
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
    target: Target | None = None  # None: the target in effect for the backend (target_for)

    def __post_init__(self):
        own = get_variant(self.variant).precisions
        if self.precision is None:
            object.__setattr__(self, "precision", own[0])
        elif self.precision not in own:
            raise ValueError(f"variant {self.variant!r} computes in {own}, not precision={self.precision!r}")
        if self.target is None:
            object.__setattr__(self, "target", target_for(self.backend))

    def key(self):
        """Everything the rendered source depends on: the problem, variant, config, backend and device (the
        Target), the variant's own extra (Winograd's state count), the precision and every code-changing setting."""
        return (self.problem, self.variant, self.config, self.backend, device_key(self.backend, self.target),
                get_variant(self.variant).key_extra(self.problem), self.precision, settings.code_token())

    def kernel_ir(self):
        return get_variant(self.variant).build(self.problem, self.config, self.precision)

    def render(self):
        k = self.kernel_ir()
        return render_cuda(k, target=self.target) if self.backend == "cuda" else render_cpu(k)


def _hopper_untuned_config(problem, precision, target: Target):
    """fp16 on a GPU with TMA and warpgroup MMAs (sm_90) and no tuned entry: the TMA tile measured best on average
    there (implicit_gemm_tc.untuned_tma_config; the template's mma.sync default is 2-3x slower on those problems),
    or None."""
    if precision != "fp16" or not gpu_present():
        return None
    return implicit_gemm_tc.untuned_tma_config(problem, precision, target)


def _tensor_core_plan(problem, backend, algo, config, precision, target: Target) -> Plan:
    """The tensor-core implicit GEMM at `precision`: the given config, else (CUDA, a GPU present, tuned
    databases not turned off) the tuned entry for exactly (problem, precision), else (fp16 on sm_90) the untuned
    TMA tile, else the template's default."""
    variant = implicit_gemm_tc.VARIANT
    if algo not in (None, implicit_gemm.NAME, variant.name):
        raise ValueError(f"precision={precision!r} is implemented by algo={implicit_gemm.NAME!r} only, got "
                         f"algo={algo!r}")
    if config is None and backend == "cuda":
        config = tuned_tensor_core_config(problem, precision) or _hopper_untuned_config(problem, precision, target)
    if config is None:
        config = variant.default_config(problem, target, precision)
    if not config.tensor_core:
        raise ValueError(f"config must be a tensor-core TileConfig (WM, WN > 0) for precision={precision!r}, "
                         f"got {config}")
    config.validate()
    implicit_gemm_tc.check_config(config, precision)
    check_split_k(problem.dtype, config)
    missing = [kind for kind, used in (("wgmma", config.wgmma), ("tma", config.tma)) if used and not target.has(kind)]
    if backend == "cuda" and missing:  # (the CPU backend emulates both)
        raise ValueError(f"config: {' and '.join(missing)} tiles need a GPU that has them (sm_90), and the target is "
                         f"{target.name} ({target.arch}); got {config}")
    if backend != "cuda" and config.split_k > 1:
        raise ValueError(f"config.split_k must be 1 on the {backend} backend, got {config.split_k}")
    return Plan(problem, variant.name, config, backend, precision, target)


def _depthwise_plan(problem, backend, config, precision, target: Target) -> Plan:
    """The direct depthwise template (groups == C) at any precision: fp32 arithmetic for "fp32" and "tf32" (no
    tensor cores), 16-bit operands with fp32 accumulation for "fp16" / "bf16".  The given config, else (CUDA) the
    tuned database's fastest depthwise config for exactly this problem at this precision ("tf32" also reads the
    fp32 entry: the same fp32 FMAs), else its cost model's.  No nearest neighbour: a depthwise block's shape
    follows its channels and rows too closely to borrow another layer's, and a GEMM entry never decides."""
    variant = depthwise.VARIANT
    db = _tuned_db() if config is None and backend == "cuda" else None
    if db is not None:
        # tf32 runs the very fp32 kernel (no tensor cores here), so an fp32 tune's entry serves it too
        for tuned_at in (precision, "fp32") if precision == "tf32" else (precision,):
            config = config or db.tuned_config(problem, tuned_device(), variant.name, tuned_at)
    if config is None:
        config = variant.default_config(problem, target, precision)
    if not variant.accepts(problem, config, precision):
        raise ValueError(f"config must be a DepthwiseConfig that fits {problem.key()} for algo='depthwise', "
                         f"got {config}")
    if backend != "cuda" and config.split_k > 1:
        raise ValueError(f"config.split_k must be 1 on the {backend} backend, got {config.split_k}")
    return Plan(problem, variant.name, config, backend, precision, target)


def make_plan(problem, backend, algo=None, config=None, precision="fp32") -> Plan:
    """precision: "fp32" (the fp32 variants) or "tf32" / "fp16" / "bf16" (the tensor-core implicit GEMM); never the global
    setting here: the API functions resolve that."""
    check_dtype_precision(problem.dtype, check_precision(precision))  # float16 tensors: precision="fp16" only
    target = target_for(backend)
    automatic_depthwise = algo is None and problem.groups > 1  # (C = 1, groups = 1 is an ordinary convolution)
    if (automatic_depthwise or algo == depthwise.NAME) and depthwise.VARIANT.applies(problem, precision):
        return _depthwise_plan(problem, backend, config, precision, target)
    if precision != "fp32":
        return _tensor_core_plan(problem, backend, algo, config, precision, target)
    if algo is not None:
        variant = get_variant(algo)
        if not variant.applies(problem, variant.precisions[0]):
            raise ValueError(f"algo {algo!r} cannot compute this problem ({problem.key()})")
        if variant.precisions[0] != "fp32":
            raise ValueError(f"algo {algo!r} computes in {variant.precisions[0]}: ask for it with "
                             f"precision={variant.precisions[0]!r}")
        if config is None and backend == "cuda":
            config = tuned_variant_config(problem, variant.name)
    else:
        variant = candidates(problem)[0]
        if config is None and backend == "cuda":
            tuned = tuned_choice(problem, variant.name)
            if tuned is not None:
                variant, config = get_variant(tuned[0]), tuned[1]
    if config is None:
        config = variant.default_config(problem, target, "fp32")
    if backend != "cuda" and config.split_k > 1:
        raise ValueError(f"config.split_k must be 1 on the {backend} backend, got {config.split_k}")
    return Plan(problem, variant.name, config, backend, target=target)


def get_launcher(plan: Plan):
    return KERNELS.get(plan.key(), plan.render, lambda module: Launcher.from_module(module, plan.backend))
