"""GPU: the host side of a converted ResNet-18 CIFAR step (kernelgen.torch.bench's, batch 128, MODE fp32 or bf16):
cProfile over a few steps after warm-up, the functions by own and by cumulative time.  Prints both tables and writes
$OUT/host_profile_<mode>.txt."""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

import torch

from kernelgen.torch.bench import batches, models, train


def main(mode="bf16", steps=10):
    torch.backends.cudnn.benchmark = True
    data = batches(4, 128)
    _, model = models()
    train(model, data, 8, mode)
    prof = cProfile.Profile()
    prof.enable()
    _, times = train(model, data, steps, mode, timed_from=0)
    prof.disable()
    text = io.StringIO()
    print(f"kernelgen {mode}: {1e3 * sum(times) / steps:.2f} ms/step under cProfile", file=text)
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(35)
    print(text.getvalue())
    with open(os.path.join(os.environ.get("OUT", "."), f"host_profile_{mode}.txt"), "w") as f:
        f.write(text.getvalue())


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["bf16"]))
