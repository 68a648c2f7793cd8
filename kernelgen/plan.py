"""A Plan: what the planner (kernelgen.planner) hands on - a problem's variant, config, backend, precision and Target -
with its kernel cache key (everything that affects the generated source, as tinygrad's realize.py keeps one) and its
rendered source (the last few kept: explain() asks for it on every call)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from kernelgen import compile_profile, settings
from kernelgen.problem import ConvProblem
from kernelgen.render_cpu import render_cpu
from kernelgen.render_cuda import render_cuda
from kernelgen.target import Target, target_for
from kernelgen.templates import get_variant


def device_key(backend, target: Target | None = None):
    """What a kernel's key holds of the device: "cpu", or the CUDA Target itself (every fact of it: a device-read
    target keys its own facts, an offline one its table entry), marked "cudasim" under numba's simulator."""
    if backend != "cuda":
        return "cpu"
    target = target or target_for(backend)
    return ("cudasim", target) if settings.get("cuda_simulator") else target


@dataclass(frozen=True)
class Plan:
    problem: ConvProblem
    variant: str
    config: object
    backend: str
    precision: str | None = None  # None: the variant's own (fp32, or tf32 for a tensor-core variant)
    target: Target | None = None  # None: the target in effect for the backend (target_for)
    # which link of the resolution chain chose the config, and why (not part of key() or of equality: the same
    # source is the same kernel, however it was chosen)
    decided_by: str = field(default="", compare=False)
    reason: str = field(default="", compare=False)

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
        """The kernel's module source, from the last few rendered (a large tile's takes seconds to build and print,
        and explain() asks for it on every call)."""
        key = self.key()
        with _RENDERED_LOCK:
            source = _RENDERED.get(key)
            if source is not None:
                _RENDERED.move_to_end(key)
                return source
        with compile_profile.stage("ir"):
            k = self.kernel_ir()
        with compile_profile.stage("print"):  # (less its passes, stages of their own)
            source = render_cuda(k, target=self.target) if self.backend == "cuda" else render_cpu(k)
        with _RENDERED_LOCK:
            _RENDERED[key] = source
            while len(_RENDERED) > _RENDERED_KEEP:
                _RENDERED.popitem(last=False)
        return source


_RENDERED: OrderedDict = OrderedDict()  # Plan.key() -> source, least recently used first
_RENDERED_LOCK = threading.Lock()
_RENDERED_KEEP = 16  # sources of large tiles are ~200 KB


def forget_rendered():
    """Drop the rendered sources kept here (Plan.render's): the next render builds the IR and prints again."""
    with _RENDERED_LOCK:
        _RENDERED.clear()
