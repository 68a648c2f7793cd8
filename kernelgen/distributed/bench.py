"""`python -m kernelgen.distributed --nproc-per-node N -m kernelgen.distributed.bench MODE --out DIR`: the
data-parallel checks and numbers on N GPUs (scripts/gpu_ddp.sh runs them all on the 2-GPU machine).

MODE check: one SGD step of ResNet-18 (CIFAR stem, SyncBatchNorm) through DistributedDataParallel on N GPUs,
  each its share of a batch, against rank 0 stepping a twin model on the whole batch alone: the largest
  difference per parameter relative to its scale (<= 1e-5 to pass).  Writes DIR/check_N.json.
MODE speed: ResNet-18 CIFAR at --batch images per GPU, SGD with momentum, local batch norm (PyTorch DDP's
  default); median step time of --steps after --warmup, images/s over all GPUs, and the last step's
  timeline (backward's gradient-ready events, each bucket's all-reduce start/end on the NCCL stream, the end
  of backward) in ms after the forward.  N = 1 runs the plain model (the one-GPU baseline).  DIR/speed_N.json.
MODE torch: the same network and step in PyTorch DistributedDataParallel (NCCL, channels_last, TF32 off), in
  the same run, for comparison.  DIR/torch_N.json.
`python -m kernelgen.distributed.bench summary DIR` prints the scaling table from those files.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics

import numpy as np

from kernelgen import settings
from kernelgen.distributed.process_group import get_default, init_process_group
from kernelgen import nn
from kernelgen.nn import functional as F
from kernelgen.nn.bench_step import median_step
from kernelgen.nn.torch_twins import torch_resnet18
from kernelgen.nn.models import resnet18
from kernelgen.nn.optim import SGD
from kernelgen.nn.parallel import DistributedDataParallel
from kernelgen.nn.sync_batchnorm import convert_sync_batchnorm
from kernelgen.nn.tensor import Tensor, to_device_array


def _data(n, classes, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 32, 32, 3)).astype(np.float32), rng.integers(0, classes, n).astype(np.int64)


def _write(args, name, result):
    if int(settings.process_environment().get("RANK", "0")) == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result)[:2000])


def _precompile(model, comm, *input_shapes):
    """Compile the step's kernels for each input shape in parallel processes (kernelgen.precompile), sharing this
    host's cores among its ranks; one compiled in the calling process, kernel after kernel, costs minutes."""
    world = comm.world_size if comm else 1
    for shape in input_shapes:
        model.precompile(shape, workers=max(1, (os.cpu_count() or 1) // world))
    if comm:
        comm.barrier()


def _model(args):
    """The check's network (seed 0): ResNet-18 (CIFAR stem), or --model small: two convolutions with batch norm,
    pooled, a linear head.  ResNet-18's one step moves by ~1e-3 when its input moves by one float32 rounding (its
    chain of batch norms amplifies), so there 1e-5 is below float32's own floor; the small net's floor is
    lower, so it tells whether the data-parallel arithmetic is the same at 1e-5."""
    if args.model == "small":
        return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, rng=0), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 32, 3, stride=2, padding=1, rng=1), nn.BatchNorm2d(32), nn.ReLU(),
                             nn.GlobalAvgPool(), nn.Linear(32, args.classes, rng=2))
    return resnet18(args.classes, width=args.width, stem="cifar", seed=0)


def _one_gpu_step(args, x, y, with_grads=False):
    """The parameters after one SGD step of a fresh ResNet-18 (seed 0) on the whole batch, on this GPU (its kernels
    precompiled: a second call of the same shape and settings finds them in the disk cache); with_grads: and the
    step's gradients."""
    twin = _model(args).to("cuda")
    _precompile(twin, None, x.shape)
    opt = SGD(twin.parameters(), lr=0.1)
    F.cross_entropy(twin(Tensor(x).to("cuda")), Tensor(y).to("cuda").data).backward()
    grads = _host_grads(twin)
    opt.step()
    return (twin.state_dict(), grads) if with_grads else twin.state_dict()


def _host_grads(model):
    return [to_device_array(p.grad, "cpu").astype(np.float64) for p in model.parameters()]


def _errors(got, want):
    """Each parameter's largest difference, relative to the tensor's largest entry (at least 1e-2)."""
    return {k: float(np.abs(got[k].astype(np.float64) - w).max() / max(float(np.abs(w).max()), 1e-2))
            for k, w in want.items()}


def _max_rel_error(got, want):
    """The largest of _errors, and its parameter's name."""
    errors = _errors(got, want)
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def _grad_error(got, want):
    """The largest gradient difference relative to the largest gradient entry of the model (the CPU tests'
    measure, tests/distributed/ddp_models.assert_grads_close: a bias before a batch norm has a true gradient of
    0, computed on both sides as rounding noise)."""
    scale = max(float(np.abs(w).max()) for w in want)
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want)) / scale


def check(args):
    comm = init_process_group("nccl")
    world, rank = comm.world_size, comm.rank
    x, y = _data(args.batch * world, args.classes)
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    model = convert_sync_batchnorm(_model(args)).to("cuda")
    _precompile(model, comm, (args.batch, 32, 32, 3))
    ddp = DistributedDataParallel(model, bucket_mb=args.bucket_mb)
    opt = SGD(model.parameters(), lr=0.1)
    F.cross_entropy(ddp(Tensor(x[mine]).to("cuda")), Tensor(y[mine]).to("cuda").data).backward()
    got_grads = _host_grads(model)
    opt.step()
    got = model.state_dict()
    if rank != 0:
        comm.barrier()
        return
    want, want_grads = _one_gpu_step(args, x, y, with_grads=True)
    err, worst = _max_rel_error(got, want)
    errors = _errors(got, want)
    # Two floors, for what float32 alone does to one step: the same one-GPU step on an input moved by one
    # rounding (1e-7 relative), and on the same input with Winograd off (an equally valid set of kernels, which
    # round differently).  The 2-GPU run sums in another order and plans other kernels for its half batch.
    nudged = x * (1 + np.float32(1e-7) * np.random.default_rng(1).standard_normal(x.shape).astype(np.float32))
    floor = _max_rel_error(_one_gpu_step(args, nudged, y), want)
    with settings.scope(winograd_states=()):
        algorithm_floor = _max_rel_error(_one_gpu_step(args, x, y), want)
    _write(args, f"check_{args.model}_{world}.json" if args.model != "resnet18" else f"check_{world}.json", {
        "model": args.model, "gpus": world, "batch_per_gpu": args.batch, "max_rel_error": err, "worst": worst, "pass": err <= 1e-5,
        "input_rounding_floor": floor, "winograd_off_floor": algorithm_floor,
        "within_floor": err <= max(1e-5, 2 * max(floor[0], algorithm_floor[0])),
        "tensors": len(errors), "tensors_over_1e-5": sorted(k for k, e in errors.items() if e > 1e-5),
        "largest_errors": sorted(errors.items(), key=lambda kv: -kv[1])[:8],
        "grad_error_vs_largest_grad": _grad_error(got_grads, want_grads)})
    comm.barrier()


def speed(args):
    from numba import cuda  # numba.cuda: slow to import, and only this GPU benchmark needs it
    world = int(settings.process_environment().get("WORLD_SIZE", "1"))
    comm = init_process_group("nccl") if world > 1 else None
    x, y = _data(args.batch, args.classes, seed=int(settings.process_environment().get("RANK", "0")))
    model = resnet18(args.classes, width=args.width, stem="cifar", seed=0).to("cuda")
    _precompile(model, comm, (args.batch, 32, 32, 3))
    net = DistributedDataParallel(model, bucket_mb=args.bucket_mb, timeline=True) if comm else model
    opt = SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    xd, yd = Tensor(x).to("cuda"), Tensor(y).to("cuda").data

    def step():
        opt.zero_grad()
        F.cross_entropy(net(xd), yd).backward()
        opt.step()
    times = median_step(step, args.warmup, args.steps, cuda.synchronize)[1]
    result = {"gpus": world, "batch_per_gpu": args.batch, "step_ms": 1e3 * statistics.median(times),
              "images_per_s": world * args.batch / statistics.median(times), "bucket_mb": args.bucket_mb}
    if comm:
        result["buckets"] = net.bucket_sizes
        result["timeline_ms"] = net.timeline_ms()
        comm.barrier()
    _write(args, f"speed_{world}.json", result)


def torch_ddp(args):
    import torch  # optional: only the comparison needs it
    import torch.distributed as dist
    world, local = int(settings.process_environment().get("WORLD_SIZE", "1")), int(settings.process_environment().get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = torch_resnet18(torch, args.classes, args.width).cuda().to(memory_format=torch.channels_last)
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local], bucket_cap_mb=args.bucket_mb)
    x, y = _data(args.batch, args.classes, seed=int(settings.process_environment().get("RANK", "0")))
    xt, yt = torch.from_numpy(x).cuda().permute(0, 3, 1, 2), torch.from_numpy(y).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(xt), yt).backward()
        opt.step()
    times = median_step(step, args.warmup, args.steps, torch.cuda.synchronize)[1]
    _write(args, f"torch_{world}.json", {"gpus": world, "batch_per_gpu": args.batch, "torch": torch.__version__,
                                         "step_ms": 1e3 * statistics.median(times),
                                         "images_per_s": world * args.batch / statistics.median(times)})
    if world > 1:
        dist.destroy_process_group()


def summary(args):
    rows = {}
    for path in sorted(glob.glob(os.path.join(args.out, "*_*.json"))):
        kind, n = os.path.basename(path)[:-5].rsplit("_", 1)
        if kind not in ("speed", "torch", "check", "check_small") or not n.isdigit():  # (other results share the folder)
            continue
        with open(path) as f:
            rows[(kind, int(n))] = json.load(f)
    base = rows.get(("speed", 1), {}).get("images_per_s")
    print(f"{'GPUs':>5}{'kernelgen img/s':>17}{'scaling':>9}{'torch DDP img/s':>17}{'kernelgen/torch':>17}")
    for n in sorted({n for kind, n in rows if kind == "speed"}):
        k, t = rows[("speed", n)]["images_per_s"], rows.get(("torch", n), {}).get("images_per_s")
        print(f"{n:>5}{k:>17.0f}{k / base if base else float('nan'):>9.2f}"
              f"{t if t else float('nan'):>17.0f}{k / t if t else float('nan'):>17.2f}")
    for (kind, n), r in sorted(rows.items()):
        if kind.startswith("check"):
            print(f"check ({r.get('model', 'resnet18')}) on {n} GPUs: max relative parameter error {r['max_rel_error']:.2e} ({r['worst']}), "
                  f"{'PASS' if r['pass'] else 'FAIL'} (<= 1e-5)")
            if "input_rounding_floor" in r:
                print(f"  float32 floors of one step: input rounding {r['input_rounding_floor'][0]:.2e}, Winograd "
                      f"off {r['winograd_off_floor'][0]:.2e}; within twice the floor: {r['within_floor']}")
            if "tensors_over_1e-5" in r:
                print(f"  {len(r['tensors_over_1e-5'])} of {r['tensors']} parameters over 1e-5: "
                      f"{', '.join(r['tensors_over_1e-5'])}; gradients against the largest gradient: "
                      f"{r['grad_error_vs_largest_grad']:.2e}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kernelgen.distributed.bench", description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["check", "speed", "torch", "summary"])
    ap.add_argument("out", nargs="?", default=None, help="(summary) the results folder")
    ap.add_argument("--out", dest="out_flag", default=None, help="results folder (default ./ddp_results)")
    ap.add_argument("--batch", type=int, default=None, help="images per GPU (default 128; check: 16)")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--model", choices=["resnet18", "small"], default="resnet18", help="(check) the network")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    args = ap.parse_args(argv)
    args.out = args.out_flag or args.out or "ddp_results"
    args.batch = args.batch or (16 if args.mode == "check" else 128)
    if args.batch < 1 or args.steps < 1 or args.warmup < 1:
        ap.error("--batch, --steps and --warmup must be >= 1")
    {"check": check, "speed": speed, "torch": torch_ddp, "summary": summary}[args.mode](args)
    if get_default() is not None:
        get_default().close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
