"""init_process_group(): join the job the launcher started, from the environment it set.

The launcher (python -m kernelgen.distributed) gives every process RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and KERNELGEN_DIST_TOKEN (torchrun's variables, plus the token).  init_process_group meets the
other ranks at MASTER_ADDR:MASTER_PORT (store.TCPStore), where rank 0 hands out NCCL's unique id, selects
this process's GPU (LOCAL_RANK) for numba and CuPy, and returns the communicator, which also becomes the
default one (get_default()).
"""
from __future__ import annotations

import threading

from kernelgen import settings
from kernelgen.distributed import nccl
from kernelgen.distributed.comm import NumpyCommunicator
from kernelgen.distributed.store import TCPStore

BACKENDS = ("auto", "nccl", "cpu")
DEFAULT_TIMEOUT_S = 300.0

_lock = threading.Lock()
_default = None


def _env_int(name, env, lo=0):
    if name not in env:
        raise RuntimeError(f"{name} is not set: start this script with `python -m kernelgen.distributed "
                           f"--nproc-per-node N script.py` (or torchrun), which sets RANK, LOCAL_RANK, WORLD_SIZE, "
                           f"MASTER_ADDR and MASTER_PORT")
    try:
        v = int(env[name])
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {env[name]!r}") from None
    if v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return v


def read_env(env=None):
    """The job's layout from the environment: dict(rank, local_rank, world_size, addr, port, token)."""
    env = settings.process_environment() if env is None else env
    world = _env_int("WORLD_SIZE", env, 1)
    rank = _env_int("RANK", env)
    if rank >= world:
        raise ValueError(f"RANK must be < WORLD_SIZE ({world}), got {rank}")
    local = _env_int("LOCAL_RANK", env) if "LOCAL_RANK" in env else rank
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = _env_int("MASTER_PORT", env) if world > 1 else int(env.get("MASTER_PORT", 0) or 0)
    if world > 1 and not 0 < port < 65536:
        raise ValueError(f"MASTER_PORT must be a TCP port in 1..65535, got {port}")
    return dict(rank=rank, local_rank=local, world_size=world, addr=addr, port=port,
                token=env.get("KERNELGEN_DIST_TOKEN", ""))


def _select_device(local_rank):
    """This process's GPU for numba (kernelgen's kernels and arena) and, through the communicator, CuPy."""
    from numba import cuda  # here: numba.cuda is slow to import and absent without numba-cuda
    count = len(cuda.gpus)
    if local_rank >= count:
        raise RuntimeError(f"LOCAL_RANK is {local_rank} but this node has {count} visible GPU(s): "
                           f"--nproc-per-node must be at most the GPU count")
    cuda.select_device(local_rank)


def _gpu_present():
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:  # no numba-cuda, no driver: no GPU to use
        return False


def init_process_group(backend="auto", timeout=DEFAULT_TIMEOUT_S, env=None):
    """Join the job: the communicator for this rank ("nccl": GPU arrays through NCCL; "cpu": NumPy arrays
    over TCP; "auto": nccl when a GPU and CuPy's NCCL are here, else cpu).  timeout (s): how long the
    rendezvous and each CPU collective wait before an error naming the missing rank."""
    global _default
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    job = read_env(env)
    if backend == "auto":
        backend = "nccl" if nccl.available() and _gpu_present() else "cpu"
    if backend == "nccl":
        nccl.require()  # before any rank blocks in the rendezvous
        _select_device(job["local_rank"])
    welcome = {"uid": nccl.unique_id()} if backend == "nccl" and job["rank"] == 0 else {}
    store = TCPStore(job["rank"], job["world_size"], job["addr"], job["port"], job["token"], timeout, welcome)
    if backend == "nccl":
        comm = nccl.NcclCommunicator(job["rank"], job["world_size"], store.welcome["uid"], job["local_rank"])
        comm.store = store  # kept: its connections are the host-side barrier and say when a rank went away
    else:
        comm = NumpyCommunicator(store)
    comm.local_rank = job["local_rank"]
    with _lock:
        _default = comm
    return comm


def get_default():
    """The communicator of the last init_process_group(), or None."""
    return _default


def is_initialized():
    return _default is not None


def get_rank():
    return _default.rank if _default is not None else 0


def get_world_size():
    return _default.world_size if _default is not None else 1


def destroy_process_group():
    global _default
    with _lock:
        comm, _default = _default, None
    if comm is not None:
        comm.close()
        store = getattr(comm, "store", None)
        if store is not None:
            store.close()
