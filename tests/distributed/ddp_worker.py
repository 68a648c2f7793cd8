"""One rank of the 2-process CPU test (test_ddp_cpu.py), started by `python -m kernelgen.distributed`: DDP with
SyncBatchNorm over the NumPy communicator, one SGD step on this rank's half of the batch, the state written
to OUT/rank<R>.npz.  Argument: OUT; with `die`, rank 1 exits with code 3 at once (the dead-rank test)."""
import os
import sys

import numpy as np
from ddp_models import TinyNet, batch, sgd_step

from kernelgen.distributed import destroy_process_group, init_process_group
from kernelgen.nn.parallel import DistributedDataParallel
from kernelgen.nn.sync_batchnorm import convert_sync_batchnorm


def main(out, mode=""):
    if mode == "die" and os.environ["RANK"] == "1":
        sys.exit(3)
    comm = init_process_group(backend="cpu", timeout=60)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    x, y = batch(n=8)
    share = len(x) // comm.world_size
    mine = slice(comm.rank * share, (comm.rank + 1) * share)
    model = DistributedDataParallel(convert_sync_batchnorm(TinyNet(seed=0 if comm.rank == 0 else 100 + comm.rank)), bucket_mb=60 / 2**20)
    sgd_step(model, x[mine], y[mine])
    state = model.module.state_dict()
    if mode == "die":
        comm.barrier()  # rank 1 is gone: the launcher must stop this rank, not let it wait
    np.savez(os.path.join(out, f"rank{comm.rank}.npz"), **state)
    destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
