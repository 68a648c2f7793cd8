"""Data-parallel training across processes: the launcher (python -m kernelgen.distributed), the rendezvous and
the communicators (NCCL through CuPy on GPUs, NumPy over TCP on the CPU).  kernelgen.nn.parallel builds
DistributedDataParallel on them.  Nothing here imports numba.cuda or CuPy until a GPU backend is asked for."""
from kernelgen.distributed.comm import Communicator, LoopbackGroup, NumpyCommunicator
from kernelgen.distributed.process_group import (destroy_process_group, get_default, get_rank, get_world_size,
                                                 init_process_group, is_initialized)
from kernelgen.distributed.store import RendezvousError

__all__ = ["Communicator", "LoopbackGroup", "NumpyCommunicator", "RendezvousError", "init_process_group",
           "destroy_process_group", "get_default", "get_rank", "get_world_size", "is_initialized"]
