"""kernelgen.profile_compile: where a cold start's time goes, per kernel and per stage (issue 27).

    with kernelgen.profile_compile() as report:
        kernelgen.conv(x, w, padding=1)        # or a model's first training step
    print(report.table())

The stages, in the order a kernel meets them:
- plan: the planner's resolution chain;
- autotune: first-call autotuning, where it is on;
- ir: the template builds the kernel's IR;
- pass:NAME: each pass of the lowering pipeline (kernelgen.passes.lower);
- print: the printers and the fresh names;
- cache: the disk cache: reading, writing and importing the kernel's module;
- numba: numba's compile of the kernel for its arguments: typing, SSA, lowering to LLVM (or a load from numba's
  own cache);
- load: the rest of the first launch. On a GPU that is NVVM, ptxas and the driver's module load; on the CPU,
  next to nothing.
- workers:STAGE: the stages above as a compile-pool worker ran them for the kernel (precompile, autotune), and
  workers: the rest of its time there (settings, the key check).  Workers run side by side, so these add up to
  more than the wall time;
- wait: this process waiting for the kernel's worker after it had nothing else to do.

A stage's time is its own. The render inside the cache's miss is counted in ir, passes and print, not again in
cache. Kernels are named by their problem's key. Nothing is recorded outside a `profile_compile()` block: every
hook is one ContextVar read. The report holds this thread's (and this task's) calls only.
"""
from __future__ import annotations

import contextlib
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field

_PROFILE: ContextVar = ContextVar("kernelgen_compile_profile", default=None)
_KERNEL: ContextVar = ContextVar("kernelgen_compile_profile_kernel", default=None)
UNATTRIBUTED = "(no kernel)"


@dataclass
class CompileProfile:
    """Seconds per kernel and stage, the block's wall time, and the stages' order of first appearance."""
    seconds: dict = field(default_factory=dict)  # kernel -> {stage: seconds}
    wall: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _open: list = field(default_factory=list, repr=False)  # per open stage: its nested stages' seconds

    def add(self, kernel: str, stage: str, seconds: float):
        with self._lock:
            row = self.seconds.setdefault(kernel, {})
            row[stage] = row.get(stage, 0.0) + seconds

    def stages(self) -> dict:
        """Total seconds of each stage over every kernel."""
        totals = {}
        for row in self.seconds.values():
            for stage, s in row.items():
                totals[stage] = totals.get(stage, 0.0) + s
        return totals

    def as_dict(self) -> dict:
        return {"wall_s": self.wall, "stages_s": self.stages(), "kernels": self.seconds}

    def table(self, top: int = 20) -> str:
        """The stages' totals, then the `top` slowest kernels with their largest stages."""
        totals = self.stages()
        lines = [f"compile profile: {len(self.seconds)} kernels, {self.wall:.2f} s wall",
                 f"{'stage':<34} {'seconds':>9}"]
        lines += [f"{stage:<34} {s:9.3f}" for stage, s in sorted(totals.items(), key=lambda kv: -kv[1])]
        if self.wall:  # (imports, numba's own set-up, the calls themselves; workers' seconds run beside the wall)
            outside = self.wall - sum(s for stage, s in totals.items() if not _in_worker(stage))
            lines.append(f"{'(outside the stages)':<34} {outside:9.3f}")
        ranked = sorted(self.seconds.items(), key=lambda kv: -sum(kv[1].values()))[:top]
        if ranked:
            lines.append(f"\n{'kernel':<64} {'seconds':>9}  largest stages")
        for kernel, row in ranked:
            big = ", ".join(f"{k} {v:.2f}" for k, v in sorted(row.items(), key=lambda kv: -kv[1])[:3])
            lines.append(f"{kernel[:64]:<64} {sum(row.values()):9.3f}  {big}")
        return "\n".join(lines)


def _in_worker(stage: str) -> bool:
    return stage == "workers" or stage.startswith("workers:")


@contextlib.contextmanager
def profile_compile():
    """Record where compiling goes, per kernel and stage, for the calls made in the block (see the module)."""
    report = CompileProfile()
    token = _PROFILE.set(report)
    start = time.perf_counter()
    try:
        yield report
    finally:
        report.wall = time.perf_counter() - start
        _PROFILE.reset(token)


def active() -> bool:
    return _PROFILE.get() is not None


@contextlib.contextmanager
def kernel_scope(label: str):
    """Stages inside are the kernel `label`'s (when a profile is active)."""
    if _PROFILE.get() is None:
        yield
        return
    token = _KERNEL.set(label)
    try:
        yield
    finally:
        _KERNEL.reset(token)


@contextlib.contextmanager
def stage(name: str, kernel: str | None = None):
    """Time the block as stage `name` of `kernel` (default: the current kernel_scope's), less the stages nested
    inside it."""
    report = _PROFILE.get()
    if report is None:
        yield
        return
    report._open.append(0.0)
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        nested = report._open.pop()
        report.add(kernel or _KERNEL.get() or UNATTRIBUTED, name, elapsed - nested)
        if report._open:
            report._open[-1] += elapsed


def record(kernel: str, name: str, seconds: float):
    """Seconds measured elsewhere (a compile-pool worker's) for `kernel`'s stage `name`."""
    report = _PROFILE.get()
    if report is not None:
        report.add(kernel, name, seconds)
