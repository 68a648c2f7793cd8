"""The device kernels are planned for, as data: a frozen `Target` of the facts that cost models, tile filters and
the TMA / wgmma gates read (SM count, shared memory, registers, tensor-core kinds).

`target_for(backend)` gives the target in effect: on a machine with a GPU, the current device's facts, read once
(`Target.from_device`) and kept; without one (rendering or explaining for CUDA offline, the simulator), the
KNOWN_TARGETS entry the `target` setting names (default the H100).  The planner passes it to the variants, so
nothing below the planner reads a device or a global.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from kernelgen import settings
from kernelgen.runtime.arena import install_from_env

# numba's static shared arrays: the most shared memory a block has without opting in, on every CUDA GPU
STATIC_SHARED_BYTES = 48 * 1024
# the most registers one thread may hold, on every CUDA architecture since sm_35
MAX_REGISTERS_PER_THREAD = 255
# tensor-core instruction kinds the kernels use: mma.sync per operand format, Hopper's warpgroup MMA and TMA
TENSOR_CORE_KINDS = ("mma_tf32", "mma_fp16", "mma_bf16", "wgmma", "tma")


@dataclass(frozen=True)
class Target:
    """One device's facts.  backend: "cuda" or "cpu"; name: the device's own name ("NVIDIA H100 80GB HBM3")."""
    backend: str
    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    shared_per_sm: int
    optin_shared_per_block: int                       # with the opt-in (dynamic shared memory): 227 KiB on sm_90
    static_shared_per_block: int = STATIC_SHARED_BYTES
    registers_per_sm: int = 65536
    max_registers_per_thread: int = MAX_REGISTERS_PER_THREAD
    max_threads_per_block: int = 1024
    warp_size: int = 32
    tensor_cores: tuple[str, ...] = ()                # of TENSOR_CORE_KINDS

    def __post_init__(self):
        if self.backend not in ("cuda", "cpu"):
            raise ValueError(f"backend must be 'cuda' or 'cpu', got {self.backend!r}")
        unknown = set(self.tensor_cores) - set(TENSOR_CORE_KINDS)
        if unknown:
            raise ValueError(f"tensor_cores must be of {TENSOR_CORE_KINDS}, got {sorted(unknown)}")

    @property
    def arch(self) -> str:
        """"sm_90" (CUDA), or "cpu"."""
        return "sm_%d%d" % self.compute_capability if self.backend == "cuda" else "cpu"

    @property
    def device_name(self) -> str:
        """The key the tuned databases file entries under: "sm_90_NVIDIA H100 80GB HBM3"."""
        return _device_name(self.compute_capability, self.name)

    def has(self, kind: str) -> bool:
        """Does the device run this tensor-core kind ("mma_tf32", "wgmma", "tma", ...)?"""
        if kind not in TENSOR_CORE_KINDS:
            raise ValueError(f"kind must be one of {TENSOR_CORE_KINDS}, got {kind!r}")
        return kind in self.tensor_cores

    @classmethod
    def from_device(cls, device) -> Target:
        """The facts of a numba.cuda device (cuda.get_current_device(): its attributes are the driver's
        CU_DEVICE_ATTRIBUTE_* values, read when first asked)."""
        cc = tuple(device.compute_capability)
        return cls("cuda", _text(device.name), cc, sm_count=device.MULTIPROCESSOR_COUNT,
                   shared_per_sm=device.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                   optin_shared_per_block=device.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                   static_shared_per_block=device.MAX_SHARED_MEMORY_PER_BLOCK,
                   registers_per_sm=device.MAX_REGISTERS_PER_MULTIPROCESSOR,
                   max_threads_per_block=device.MAX_THREADS_PER_BLOCK, warp_size=device.WARP_SIZE,
                   tensor_cores=tensor_core_kinds(cc))


def tensor_core_kinds(compute_capability) -> tuple[str, ...]:
    """The tensor-core kinds of an architecture: fp16 mma.sync from sm_75 (m16n8k16), TF32 and bf16 from sm_80,
    warpgroup MMAs and TMA on sm_90 (wgmma is sm_90a's alone)."""
    cc = tuple(compute_capability)
    kinds = ("mma_fp16",) if cc >= (7, 5) else ()
    kinds += ("mma_tf32", "mma_bf16") if cc >= (8, 0) else ()
    kinds += ("wgmma", "tma") if cc[0] == 9 else ()
    return tuple(k for k in TENSOR_CORE_KINDS if k in kinds)


def _text(name) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


def _device_name(compute_capability, name) -> str:
    return "sm_%d%d" % tuple(compute_capability) + "_" + name


_KIB = 1024
# A few GPUs' facts (NVIDIA's tuning guides; the H100's as its driver reports them), for planning and rendering
# offline: the `target` setting names one.
KNOWN_TARGETS = {
    "h100": Target("cuda", "NVIDIA H100 80GB HBM3", (9, 0), sm_count=132, shared_per_sm=228 * _KIB,
                   optin_shared_per_block=227 * _KIB, tensor_cores=tensor_core_kinds((9, 0))),
    "h200": Target("cuda", "NVIDIA H200", (9, 0), sm_count=132, shared_per_sm=228 * _KIB,
                   optin_shared_per_block=227 * _KIB, tensor_cores=tensor_core_kinds((9, 0))),
    "a100": Target("cuda", "NVIDIA A100-SXM4-80GB", (8, 0), sm_count=108, shared_per_sm=164 * _KIB,
                   optin_shared_per_block=163 * _KIB, registers_per_sm=65536, max_threads_per_block=1024,
                   tensor_cores=tensor_core_kinds((8, 0))),
    "l40s": Target("cuda", "NVIDIA L40S", (8, 9), sm_count=142, shared_per_sm=100 * _KIB,
                   optin_shared_per_block=99 * _KIB, max_threads_per_block=1024,
                   tensor_cores=tensor_core_kinds((8, 9))),
}
# The CPU backend: a "block" is a prange iteration, so none of the GPU limits bind
CPU_TARGET = Target("cpu", "cpu", (0, 0), sm_count=1, shared_per_sm=0, optin_shared_per_block=STATIC_SHARED_BYTES)


def known_target(name: str) -> Target:
    """The KNOWN_TARGETS entry `name` (the `target` setting's value)."""
    try:
        return KNOWN_TARGETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"setting target (KERNELGEN_TARGET) must be one of {sorted(KNOWN_TARGETS)}, "
                         f"got {name!r}") from None


@functools.lru_cache(maxsize=None)
def gpu_present() -> bool:
    """A real GPU (the simulator does not count: it is a debugging tool, ~ms per thread)."""
    if settings.get("cuda_simulator"):
        return False
    if not _driver_loadable():  # (before importing numba.cuda: 0.3-0.7 s that a machine without a GPU never needs)
        return False
    install_from_env()  # KERNELGEN_ARENA=1: numba accepts a memory manager only before its context exists
    try:
        from numba import cuda  # optional: numba-cuda
        return cuda.is_available()
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def _driver_loadable() -> bool:
    """Whether the CUDA driver library loads here (what numba-cuda loads first, from NUMBA_CUDA_DRIVER if set): a
    GPU needs it, so without it there is none, and numba.cuda need not be imported to say so."""
    import ctypes
    import sys
    given = settings.process_environment().get("NUMBA_CUDA_DRIVER")  # (numba-cuda's own variable)
    names = [given] if given else ["nvcuda.dll"] if sys.platform == "win32" else ["libcuda.so.1", "libcuda.so"]
    for name in names:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            continue
    return sys.platform not in ("linux", "win32")  # (elsewhere: let numba-cuda decide)


@functools.lru_cache(maxsize=None)
def device_target() -> Target:
    """The current CUDA device's Target, read once: a process plans for one device."""
    from numba import cuda  # optional: numba-cuda, and only where a GPU is present
    return Target.from_device(cuda.get_current_device())


def device_name() -> str:
    """The current CUDA device as the tuned databases key it ("sm_90_NVIDIA H100 80GB HBM3"; under the
    simulator, its stand-in device's)."""
    from numba import cuda  # optional: numba-cuda
    d = cuda.get_current_device()
    return _device_name(d.compute_capability, _text(getattr(d, "name", "simulator")))


def target_for(backend: str) -> Target:
    """The target in effect for a backend: CPU_TARGET; for CUDA the current device's where a GPU is present,
    else the KNOWN_TARGETS entry of the `target` setting."""
    if backend == "cpu":
        return CPU_TARGET
    if backend != "cuda":
        raise ValueError(f"backend must be 'cuda' or 'cpu', got {backend!r}")
    return device_target() if gpu_present() else known_target(settings.get("target"))


def as_target(target) -> Target:
    """A Target as given, or a backend name ("cuda" / "cpu") as the target in effect for it."""
    return target if isinstance(target, Target) else target_for(target)
