"""A torchvision-style ResNet-18 for CIFAR, trained with torch's convolutions (cuDNN) and converted to kernelgen's
(kernelgen.torch.convert), in the same process: the step times in fp32 and under bf16 autocast, and both loss
curves from the same seeds.  Needs a CUDA GPU.

    python -m kernelgen.torch.bench --out $OUT/torch_interop.json [--batch 128] [--steps 30] [--modes fp32,bf16]

Both models are channels-last (torch's fast layout for cuDNN too), on the same synthetic CIFAR batches; cuDNN's
TF32 is switched off for the fp32 rows so that both sides compute in fp32.  The first steps of the kernelgen model
compile its kernels (kept in the kernel cache: set KERNELGEN_CACHE_DIR to reuse them across runs); warm-up steps
are not timed and their time is reported apart.
"""
from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import time

import torch
from torch import nn

import kernelgen
import kernelgen.torch as kt
from kernelgen.torch import convert, native


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs (a 3x3 stem, no max-pool), as in the common CIFAR recipes."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


def models(seed=0, device="cuda"):
    """(torch's model, the same weights converted to kernelgen), channels-last, on `device`."""
    torch.manual_seed(seed)
    theirs = ResNet18().to(device).to(memory_format=torch.channels_last)
    ours = convert(copy.deepcopy(theirs))
    return theirs, ours


def batches(n, batch, seed=1, device="cuda"):
    """n fixed synthetic CIFAR batches (images, labels)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.randn(batch, 3, 32, 32, generator=g).to(device).contiguous(memory_format=torch.channels_last),
             torch.randint(0, 10, (batch,), generator=g).to(device)) for _ in range(n)]


def _timed_steps(data, steps, one_step, timed_from):
    """one_step(x, labels) -> the loss tensor, `steps` times cycling over data, each timed between two device
    synchronisations; (losses, per-step seconds of the steps from timed_from on)."""
    losses, times = [], []
    for i in range(steps):
        x, labels = data[i % len(data)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = one_step(x, labels)
        torch.cuda.synchronize()
        if timed_from is not None and i >= timed_from:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, times


def _sgd_step(model, opt, mode):
    """One training step's forward (bf16 autocast for mode "bf16"), backward and SGD update of x, labels."""
    def step(x, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
            loss = nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        opt.step()
        return loss
    return step


def train(model, data, steps, mode="fp32", lr=0.02, timed_from=None):
    """Train `steps` SGD steps cycling over data; (losses, per-step seconds of the steps from timed_from on)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    step = _sgd_step(model, opt, mode)

    def one_step(x, labels):
        opt.zero_grad(set_to_none=True)
        return step(x, labels)
    return _timed_steps(data, steps, one_step, timed_from)


def train_graphed(model, data, steps, mode="fp32", lr=0.02, timed_from=None, warmup=3):
    """train's steps as one captured CUDA graph replayed (torch's whole-network capture recipe: `warmup` steps on a
    side stream, then the step captured by torch.cuda.graph on static tensors): each step copies its batch into
    the static inputs and replays.  The warm-up steps train on data[0] (they are steps too: both models take
    them)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    static_x, static_labels = data[0][0].clone(), data[0][1].clone()
    step = _sgd_step(model, opt, mode)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.zero_grad(set_to_none=True)
            step(static_x, static_labels)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step(static_x, static_labels)

    def replay(x, labels):
        static_x.copy_(x)
        static_labels.copy_(labels)
        graph.replay()
        return static_loss
    return _timed_steps(data, steps, replay, timed_from)


def compare(mode, batch, steps, warmup, precompile=True, rounds=3, graph=False):
    """One mode's row: both models from the same seed, trained on the same batches.  precompile: kernelgen's
    warm-up starts with kernelgen.torch.precompile (its step's kernels side by side), as a user's would.  The
    timed steps alternate between the two models in `rounds` rounds (the loss curves are the first round's, from
    fresh models); each keeps its best round's median, as the convolution bench does: the GPU machine's host is
    shared, and one round in several runs slow for either side.  Each round also records kernelgen's live worker
    processes and the host's 1-minute load average (slow to move: it tells what the last minute ran, not the
    round).  graph: each model's steps captured once and replayed (train_graphed), both sides."""
    run = train_graphed if graph else train
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    data = batches(4, batch)
    row = {"mode": mode, "batch": batch, "steps": steps, "warmup": warmup, "graph": graph, "rounds": []}
    for name, model in zip(("torch", "kernelgen"), models()):
        start = time.perf_counter()
        if name == "kernelgen" and precompile:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "bf16"):
                kt.precompile(model, (batch, 3, 32, 32))
            row["kernelgen_precompile_s"] = time.perf_counter() - start
        if name == "kernelgen":
            native.wait(NATIVE_BUILD_WAIT)  # (its steps measured through the native entry point, where it builds)
        run(model, data, warmup, mode)  # compiles (kernelgen) / autotunes (cuDNN); not the loss curve's steps
        row[f"{name}_warmup_s"] = time.perf_counter() - start
    fresh = dict(zip(("torch", "kernelgen"), models()))
    _wait_for_workers(120)
    for r in range(rounds):
        for name, model in fresh.items():
            host = {"load_avg_1min": os.getloadavg()[0], "worker_processes": len(multiprocessing.active_children())}
            handed_back = native.fallbacks()
            losses, times = run(model, data, steps + warmup if r == 0 else steps, mode,
                                timed_from=warmup if r == 0 else 0)
            if name == "kernelgen":  # (C++'s calls back into Python over the round's steps: none in a steady state)
                host["native_calls_back"] = {k: v - handed_back[k] for k, v in native.fallbacks().items()}
            if r == 0:
                row[f"{name}_losses"] = losses
            row["rounds"].append({"round": r, "model": name, "step_ms": 1e3 * statistics.median(times), **host})
    for name in fresh:
        row[f"{name}_step_ms"] = min(x["step_ms"] for x in row["rounds"] if x["model"] == name)
    row["step_ratio_kernelgen_over_torch"] = row["kernelgen_step_ms"] / row["torch_step_ms"]
    row["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(row["kernelgen_losses"], row["torch_losses"]))
    return row


NATIVE_BUILD_WAIT = 600  # seconds the bench waits for the native entry point's first build (then: the Python path)


def _wait_for_workers(timeout):
    """Let the precompile's worker processes exit (its pool is shut down without waiting) before anything is timed:
    16 interpreters leaving took the host's CPUs through the first timed rounds (fifteenth session)."""
    deadline = time.perf_counter() + timeout
    while multiprocessing.active_children() and time.perf_counter() < deadline:
        time.sleep(0.2)


def _commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--modes", default="fp32,bf16")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, alternating torch and kernelgen")
    p.add_argument("--graph", action="store_true",
                   help="each model's training step captured as a CUDA graph (torch.cuda.graph) and replayed")
    p.add_argument("--no-precompile", action="store_true", help="kernelgen's warm-up without kernelgen.torch.precompile")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (torch.cuda.is_available() is False)")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "kernelgen": kernelgen.__version__,
              "commit": _commit(), "python": platform.python_version(), "rows": []}
    for mode in args.modes.split(","):
        row = compare(mode, args.batch, args.steps, args.warmup, precompile=not args.no_precompile,
                      rounds=args.rounds, graph=args.graph)
        result["rows"].append(row)
        print(f"{mode}{' captured' if args.graph else ''}: torch {row['torch_step_ms']:.2f} ms, kernelgen {row['kernelgen_step_ms']:.2f} ms "
              f"({row['step_ratio_kernelgen_over_torch']:.3f}x), max relative loss difference "
              f"{row['max_rel_loss_diff']:.2e}, kernelgen warm-up {row['kernelgen_warmup_s']:.1f} s; rounds (ms): "
              + ", ".join(f"{x['model']} {x['step_ms']:.2f} (load {x['load_avg_1min']:.1f}, "
                          f"{x['worker_processes']} workers"
                          + (f", native calls back {x['native_calls_back']}" if "native_calls_back" in x else "")
                          + ")"
                          for x in row["rounds"]) + f"; native entry point {native.status()}, calls back to Python "
              f"{native.fallbacks()}", flush=True)
        with open(args.out, "w") as f:  # after every mode: a run cut short keeps what it measured
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
