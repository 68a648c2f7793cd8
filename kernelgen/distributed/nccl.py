"""NcclCommunicator: GPU collectives through NCCL, via CuPy's bindings (cupy.cuda.nccl).

CuPy rather than nccl4py because the GPU machine has CuPy (cupy-cuda13x, which bundles NCCL's bindings) and
not nccl4py; both take raw device pointers and stream handles, so only this module would change.  Arrays
are anything with __cuda_array_interface__ (kernelgen's numba device arrays, CuPy, torch), contiguous.

Streams are CuPy streams: new_stream() is a non-blocking one, so collectives on it overlap with kernels on
the legacy default stream (where kernelgen.nn launches) instead of serialising against them; events join
the two.  "None" as a stream means the compute stream, the legacy default stream.
"""
from __future__ import annotations

try:  # optional: the CPU machine and CPU-only installs have no CuPy
    import cupy
    from cupy.cuda import nccl as _nccl
    _IMPORT_ERROR = None
except Exception as e:  # ImportError, or CuPy present without its NCCL part (a RuntimeError from the loader)
    cupy = _nccl = None
    _IMPORT_ERROR = e

from kernelgen.distributed.comm import Communicator

_DTYPES = {"<f4": "NCCL_FLOAT32", "<f8": "NCCL_FLOAT64", "<f2": "NCCL_FLOAT16", "<i4": "NCCL_INT32",
           "<i8": "NCCL_INT64", "|u1": "NCCL_UINT8", "|i1": "NCCL_INT8", "<u4": "NCCL_UINT32", "<u8": "NCCL_UINT64"}


def available():
    return _nccl is not None


def require():
    """Raise a clear ImportError when NCCL cannot be used here."""
    if _nccl is None:
        raise ImportError("the NCCL backend needs CuPy with its NCCL bindings (cupy.cuda.nccl): install "
                          "cupy-cuda12x or cupy-cuda13x to match the CUDA driver, or use backend='cpu' "
                          f"(import failed: {type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR})")


def unique_id():
    """NCCL's unique id (rank 0 makes it), as a JSON-able list of ints."""
    require()
    return list(_nccl.get_unique_id())


def version():
    return _nccl.get_version() if _nccl is not None else None


def _buffer(array, what):
    """(device pointer, element count, NCCL dtype) of a contiguous CUDA array."""
    cai = getattr(array, "__cuda_array_interface__", None)
    if cai is None:
        raise TypeError(f"{what}: array must be a CUDA array (__cuda_array_interface__) for the NCCL communicator, "
                        f"got {type(array).__name__}")
    shape, typestr, strides = tuple(cai["shape"]), cai["typestr"], cai.get("strides")
    count = 1
    for n in shape:
        count *= n
    if strides is not None:
        itemsize, expect = int(typestr[2:]), []
        step = itemsize
        for n in reversed(shape):
            expect.append(step)
            step *= n
        if tuple(reversed(expect)) != tuple(strides) and count > 1:
            raise ValueError(f"{what}: array must be C-contiguous (it is reduced in place)")
    name = _DTYPES.get(typestr)
    if name is None:
        raise TypeError(f"{what}: NCCL has no dtype for {typestr!r}")
    return cai["data"][0], count, getattr(_nccl, name)


def _stream_ptr(stream):
    """A raw stream handle from None (the legacy default stream, 0), an int, a CuPy stream (.ptr) or a numba
    stream (__cuda_stream__ / int())."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "ptr"):
        return int(stream.ptr)
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    return int(stream)


class NcclCommunicator(Communicator):
    """One rank of an NCCL communicator on device `device_id` (this process's GPU)."""

    device = "cuda"

    def __init__(self, rank, world_size, uid, device_id):
        require()
        self.rank, self.world_size, self.device_id = rank, world_size, device_id
        cupy.cuda.Device(device_id).use()
        try:  # CuPy 13+ takes the id as bytes (get_unique_id's), older CuPy as a tuple of signed chars
            self._comm = _nccl.NcclCommunicator(world_size, bytes(b & 0xFF for b in uid), rank)
        except TypeError:
            self._comm = _nccl.NcclCommunicator(world_size, tuple((b + 128) % 256 - 128 for b in uid), rank)
        self._one = None

    def all_reduce(self, array, stream=None, op="sum"):
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        ptr, count, dtype = _buffer(array, "all_reduce")
        avg = getattr(_nccl, "NCCL_AVG", None)  # NCCL >= 2.10; else the sum, divided after on the same stream
        nccl_op = avg if op == "avg" and avg is not None else _nccl.NCCL_SUM
        self._comm.allReduce(ptr, ptr, count, dtype, nccl_op, _stream_ptr(stream))
        if op == "avg" and avg is None:
            with self._cupy_stream(stream):
                a = cupy.asarray(array)
                a *= 1.0 / self.world_size
        return array

    def broadcast(self, array, root=0, stream=None):
        if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < self.world_size:
            raise ValueError(f"root must be a rank in [0, {self.world_size}), got {root!r}")
        ptr, count, dtype = _buffer(array, "broadcast")
        self._comm.broadcast(ptr, ptr, count, dtype, root, _stream_ptr(stream))
        return array

    def barrier(self):
        if self._one is None:
            self._one = cupy.zeros(1, cupy.float32)
        self.all_reduce(self._one)
        cupy.cuda.Stream.null.synchronize()

    def new_stream(self):
        return cupy.cuda.Stream(non_blocking=True)

    def record_event(self, stream=None, timing=False):
        event = cupy.cuda.Event(disable_timing=not timing)
        event.record(self._cupy_stream(stream))
        return event

    def wait_event(self, event, stream=None):
        self._cupy_stream(stream).wait_event(event)

    @staticmethod
    def _cupy_stream(stream):
        if stream is None:
            return cupy.cuda.Stream.null
        if isinstance(stream, cupy.cuda.Stream):
            return stream
        return cupy.cuda.ExternalStream(_stream_ptr(stream))

    @staticmethod
    def elapsed_ms(start, end):
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end)

    def close(self):
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None
