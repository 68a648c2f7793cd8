"""`python -m kernelgen train digits`: train a small ResNet on the digits set through kernelgen.

Every convolution of the forward and backward passes is a kernelgen kernel; with --device cuda the whole
step runs on the GPU (kernelgen.nn.cuda_ops), the loss coming to the host once per step for the log;
--precision tf32|fp16|bf16 runs the convolutions on tensor cores, parameters staying float32 (mixed_precision.py).
Prints loss and accuracy per epoch (tqdm progress), optionally plots the curves, and returns non-zero when
the final test accuracy misses --min-accuracy.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kernelgen.storage import PRECISIONS

from kernelgen.nn import functional as F
from kernelgen.nn.data import Loader, load_digits_split, save_digits
from kernelgen.nn.mixed_precision import precision as conv_precision
from kernelgen.nn.modules import SmallResNet
from kernelgen.nn.optim import Adam
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
                 device="cpu", data=None, precision="fp32"):
    """precision: the convolutions' in training and evaluation ("fp32", "tf32", "fp16", "bf16").
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
    opt = Adam(model.parameters(), lr=lr, weight_decay=1e-4, decoupled=True)
    train_loader = Loader(xtr, ytr, batch_size, seed=seed, drop_last=True)
    test_loader = Loader(xte, yte, batch_size, shuffle=False)
    history = []
    with conv_precision(precision):
        for epoch in range(1, epochs + 1):
            t0, losses = time.perf_counter(), []
            for x, y in tqdm(train_loader, desc=f"epoch {epoch}/{epochs}", leave=False):
                loss = F.cross_entropy(model(Tensor(x).to(device)), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            acc = evaluate(model, test_loader, device)
            history.append((float(np.mean(losses)), acc))
            print(f"epoch {epoch}: loss {np.mean(losses):.4f}  test accuracy {100 * acc:.2f}%  "
                  f"({time.perf_counter() - t0:.1f} s)")
        if epochs == 0:  # nothing to train: the untrained model, evaluated
            history.append((float("nan"), evaluate(model, test_loader, device)))
            print(f"no training (0 epochs): test accuracy {100 * history[0][1]:.2f}%")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
        ax[0].plot([h[0] for h in history]), ax[0].set_title("train loss"), ax[0].set_xlabel("epoch")
        ax[1].plot([100 * h[1] for h in history]), ax[1].set_title("test accuracy %"), ax[1].set_xlabel("epoch")
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
    return model, history


def _epochs(text):
    """--epochs: an int >= 0 (argparse turns the ArgumentTypeError into a usage error naming --epochs)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kernelgen train", description=__doc__.splitlines()[0])
    ap.add_argument("dataset", choices=["digits"])
    ap.add_argument("--epochs", type=_epochs, default=None,
                    help="training epochs, 0 to only evaluate the untrained model (default 8, 3 with --quick)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where tensors live: cpu (NumPy, CPU kernels) or cuda (the whole step on the GPU)")
    ap.add_argument("--quick", action="store_true", help="a shortened run (CI)")
    ap.add_argument("--plot", default=None, help="PNG path for the loss/accuracy curves")
    ap.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 below this final test accuracy")
    ap.add_argument("--precision", choices=PRECISIONS, default="fp32",
                    help="the convolutions': fp32, or tensor cores (fp32 accumulation, float32 parameters)")
    ap.add_argument("--data", default=None, help="the digits as an .npz (from --save-data) instead of scikit-learn's")
    ap.add_argument("--save-data", default=None, metavar="PATH", help="write the digits to PATH (.npz) and exit")
    args = ap.parse_args(argv)
    if args.save_data:
        save_digits(args.save_data)
        return 0
    epochs = args.epochs if args.epochs is not None else 3 if args.quick else 8  # 0 is a choice, not "unset"
    t = time.perf_counter()
    _, history = train_digits(epochs=epochs, quick=args.quick, plot=args.plot, device=args.device,
                              data=args.data, precision=args.precision)
    acc = history[-1][1]
    print(f"final test accuracy {100 * acc:.2f}% after {epochs} epochs, precision {args.precision}, "
          f"{time.perf_counter() - t:.0f} s")
    return 0 if acc >= args.min_accuracy else 1
