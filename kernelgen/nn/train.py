"""`python -m kernelgen train digits`: train a small ResNet on the digits set through kernelgen.

Every convolution of the forward and backward passes is a kernelgen kernel; with --device cuda the whole
step runs on the GPU (kernelgen.nn.cuda_ops), the loss coming to the host once per step for the log;
--precision tf32|fp16|bf16 runs the convolutions on tensor cores, parameters staying float32 (mixed_precision.py);
--amp adds dynamic loss scaling to fp16 (kernelgen.nn.amp.GradScaler), as PyTorch AMP trains.
Prints loss and accuracy per epoch (tqdm progress), optionally plots the curves, and returns non-zero when
the final test accuracy misses --min-accuracy.

--gpus N trains data-parallel on N GPUs: the command starts the launcher (python -m kernelgen.distributed),
which runs this same command once per GPU; each rank trains DistributedDataParallel(model) on its shard of
every epoch (DistributedSampler), the global batch (--batch-size) split evenly, so N GPUs follow the one-GPU
recipe.  Rank 0 prints, evaluates and saves (--save).  With --device cpu, N CPU processes over TCP instead.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from kernelgen import settings
from kernelgen.storage import PRECISIONS

from kernelgen.nn import functional as F
from kernelgen.distributed import launch
from kernelgen.distributed.process_group import destroy_process_group, init_process_group
from kernelgen.nn.data import DistributedSampler, Loader, load_digits_split, save_digits
from kernelgen.nn.amp import GradScaler, amp_precision
from kernelgen.nn.mixed_precision import precision as conv_precision
from kernelgen.nn.blocks import SmallResNet
from kernelgen.nn.optim import Adam
from kernelgen.nn.parallel import DistributedDataParallel, save_on_rank0
from kernelgen.nn.tensor import Tensor, no_grad


def evaluate(model, loader, device="cpu"):
    model.eval()
    correct = total = 0
    with no_grad():
        for x, y in loader:
            n = len(y)
            if n < loader.batch_size:  # pad the last batch: the training shapes' kernels are already compiled
                x = np.concatenate([x, np.zeros((loader.batch_size - n,) + x.shape[1:], x.dtype)])
            pred = model(Tensor(x).to(device)).numpy().argmax(axis=1)[:n]
            correct += int((pred == y).sum())
            total += len(y)
    model.train()
    return correct / total


def train_digits(epochs=8, batch_size=64, lr=3e-3, width=16, seed=0, backend="cpu", quick=False, plot=None,
                 device="cpu", data=None, precision="fp32", comm=None, save=None, amp=False):
    """precision: the convolutions' in training and evaluation ("fp32", "tf32", "fp16", "bf16").
    amp: mixed precision as torch.amp's recipe: convolutions in fp16 (unless `precision` names another 16-bit
    format) with dynamic loss scaling (kernelgen.nn.amp.GradScaler; bf16 runs without a scaler).
    comm: a communicator (kernelgen.distributed): train data-parallel, this process one rank of it, each rank
    batch_size // world_size images per step.  save: a checkpoint path, written by rank 0 only.
    Returns (model, history): history has one (mean training loss, test accuracy) per epoch, and for
    epochs=0 the single row (nan, the untrained model's test accuracy), so history[-1] is always the
    returned model's."""
    if not isinstance(epochs, (int, np.integer)) or isinstance(epochs, bool):
        raise TypeError(f"epochs must be an int, got {type(epochs).__name__}")
    if epochs < 0:
        raise ValueError(f"epochs must be >= 0, got {epochs}")
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional (the GPU machine may lack tqdm)
        def tqdm(it, **_):
            return it
    xtr, ytr, xte, yte = load_digits_split(seed=seed, path=data)
    if quick:  # a shortened run for CI: a third of the data, few epochs
        xtr, ytr = xtr[: len(xtr) // 3], ytr[: len(ytr) // 3]
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    model = SmallResNet(width=width, seed=seed, backend=backend).to(device)
    world, rank = (comm.world_size, comm.rank) if comm is not None else (1, 0)
    net = DistributedDataParallel(model, comm) if comm is not None else model
    opt = Adam(model.parameters(), lr=lr, weight_decay=1e-4, decoupled=True)
    sampler = DistributedSampler(len(xtr), world, rank, seed=seed) if comm is not None else None
    train_loader = Loader(xtr, ytr, max(batch_size // world, 1), seed=seed, drop_last=True, sampler=sampler)
    test_loader = Loader(xte, yte, batch_size, shuffle=False)
    say = print if rank == 0 else (lambda *a, **k: None)
    history = []
    precision = amp_precision(precision) if amp else precision
    scaler = GradScaler(enabled=amp and precision == "fp16")
    with conv_precision(precision):
        for epoch in range(1, epochs + 1):
            t0, losses = time.perf_counter(), []
            if sampler is not None:
                sampler.set_epoch(epoch)
            for x, y in tqdm(train_loader, desc=f"epoch {epoch}/{epochs}", leave=False, disable=rank != 0):
                loss = F.cross_entropy(net(Tensor(x).to(device)), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                losses.append(loss.item())
            acc = evaluate(model, test_loader, device)
            history.append((float(np.mean(losses)), acc))
            say(f"epoch {epoch}: loss {np.mean(losses):.4f}  test accuracy {100 * acc:.2f}%  "
                f"({time.perf_counter() - t0:.1f} s)" + (f", rank 0 of {world}" if comm is not None else ""))
        if epochs == 0:  # nothing to train: the untrained model, evaluated
            history.append((float("nan"), evaluate(model, test_loader, device)))
            say(f"no training (0 epochs): test accuracy {100 * history[0][1]:.2f}%")
    if save:
        save_on_rank0(model, save, comm)
    if plot and rank == 0:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
        ax[0].plot([h[0] for h in history]), ax[0].set_title("train loss"), ax[0].set_xlabel("epoch")
        ax[1].plot([100 * h[1] for h in history]), ax[1].set_title("test accuracy %"), ax[1].set_xlabel("epoch")
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
    return model, history


_epochs, _gpus = launch.int_at_least(0), launch.int_at_least(1)  # --epochs; --gpus and --batch-size


def _launched(gpus):
    """True in a process the launcher started for this job (its WORLD_SIZE is --gpus)."""
    return "RANK" in settings.process_environment() and settings.process_environment().get("WORLD_SIZE") == str(gpus)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="python -m kernelgen train", description=__doc__.splitlines()[0])
    ap.add_argument("dataset", choices=["digits"])
    ap.add_argument("--epochs", type=_epochs, default=None,
                    help="training epochs, 0 to only evaluate the untrained model (default 8, 3 with --quick)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="where tensors live: cpu (NumPy, CPU kernels) or cuda (the whole step on the GPU); "
                         "default cpu, or cuda with --gpus")
    ap.add_argument("--gpus", type=_gpus, default=None,
                    help="train data-parallel on N GPUs (one process each; with --device cpu: N CPU processes)")
    ap.add_argument("--batch-size", type=_gpus, default=64, help="images per step, over all GPUs (default 64)")
    ap.add_argument("--save", default=None, metavar="PATH", help="write the trained model's checkpoint (.npz)")
    ap.add_argument("--quick", action="store_true", help="a shortened run (CI)")
    ap.add_argument("--plot", default=None, help="PNG path for the loss/accuracy curves")
    ap.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 below this final test accuracy")
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32",
                    help="the convolutions': fp32, or tensor cores (fp32 accumulation, float32 parameters)")
    ap.add_argument("--amp", action="store_true",
                    help="mixed precision: fp16 convolutions (or --precision bf16) with dynamic loss scaling")
    ap.add_argument("--data", default=None, help="the digits as an .npz (from --save-data) instead of scikit-learn's")
    ap.add_argument("--save-data", default=None, metavar="PATH", help="write the digits to PATH (.npz) and exit")
    args = ap.parse_args(argv)
    if args.save_data:
        save_digits(args.save_data)
        return 0
    device = args.device or ("cuda" if args.gpus else "cpu")
    if args.gpus and not _launched(args.gpus):  # start one process per GPU, each running this same command
        job = launch.parser().parse_args(["--nproc-per-node", str(args.gpus), "-m", "kernelgen", "train"] + argv)
        return launch.launch(job)
    comm = init_process_group("nccl" if device == "cuda" else "cpu") if args.gpus else None
    epochs = args.epochs if args.epochs is not None else 3 if args.quick else 8  # 0 is a choice, not "unset"
    t = time.perf_counter()
    try:
        _, history = train_digits(epochs=epochs, batch_size=args.batch_size, quick=args.quick, plot=args.plot,
                                  device=device, data=args.data, precision=args.precision, comm=comm, save=args.save,
                                  amp=args.amp)
    finally:
        if comm is not None:
            destroy_process_group()
    acc = history[-1][1]
    if comm is not None and comm.rank != 0:
        return 0  # rank 0 reports and decides the exit code
    shown = amp_precision(args.precision) if args.amp else args.precision
    print(f"final test accuracy {100 * acc:.2f}% after {epochs} epochs, precision {shown}"
          f"{' with loss scaling' if args.amp and shown == 'fp16' else ''}, "
          f"{time.perf_counter() - t:.0f} s" + (f", {args.gpus} processes ({device})" if args.gpus else ""))
    return 0 if acc >= args.min_accuracy else 1
