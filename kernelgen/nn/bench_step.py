"""`python -m kernelgen.nn.bench_step`: one ResNet-18 (CIFAR stem) training step on the GPU through
kernelgen.nn, against the same network in PyTorch fp32 eager (channels_last, TF32 off), same process.

Synthetic 32x32x3 batches already on the device, SGD with momentum.  Per framework: `--warmup` steps
(kernelgen compiles its kernels in the first), then the median of `--steps` steps, each timed between
two device synchronisations; peak memory over the timed steps (kernelgen: the arena's peak bytes in use;
PyTorch: torch.cuda.max_memory_allocated), both after a reset at the first timed step.  --rounds N: both
prepared and warmed first, then N rounds in which they alternate, each side's best round reported (the same
minutes of a noisy host for both).  Prints a table and writes JSON (--out).  torch is optional: without it only
kernelgen's numbers are reported.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time

import numpy as np

from kernelgen import settings
from kernelgen.compile_profile import profile_compile
from kernelgen.nn import amp, graphs
from kernelgen.nn import functional as F
from kernelgen.nn.bench_reports import _new_batch_steps, _print_kernels, kernel_profile, median_step
from kernelgen.nn.mobilenet import as_torch
from kernelgen.nn.models import mobilenet_v2, resnet18, resnet50
from kernelgen.nn.optim import SGD
from kernelgen.nn.tensor import Tensor, device_kernels
from kernelgen.nn.torch_twins import copy_weights, torch_resnet18, torch_resnet50
from kernelgen.runtime import arena, map_ring


def build_model(args):
    """--model's network in kernelgen.nn, seeded: ResNet-18 (CIFAR stem, --width) or MobileNetV2 (width 1.0; the
    CIFAR stem for --image 64 or less, torchvision's ImageNet stem above)."""
    model, stem = getattr(args, "model", "resnet18"), _stem(args)
    if model == "mobilenet_v2":
        return mobilenet_v2(args.classes, stem=stem, seed=0)
    if model == "resnet50":
        return resnet50(args.classes, width=args.width, stem=stem, seed=0)
    return resnet18(args.classes, width=args.width, stem="cifar", seed=0)


def _stem(args):
    """The stem for --image: CIFAR's (one 3x3 convolution) up to 64x64, ImageNet's above."""
    return "cifar" if args.image <= 64 else "imagenet"


def torch_model(torch, args):
    """build_model's network in PyTorch (on the host, layers in kernelgen.nn's order)."""
    name = getattr(args, "model", "resnet18")
    if name == "mobilenet_v2":
        return as_torch(torch, build_model(args))
    if name == "resnet50":
        return torch_resnet50(torch, args.classes, args.width, stem=_stem(args))
    return torch_resnet18(torch, args.classes, args.width)


def kernelgen_step(model, opt, scaler, amp_on, x, labels):
    """One kernelgen.nn training step (--amp: fp16 convolutions, float32 master weights); its loss Tensor."""
    opt.zero_grad()  # first: last step's gradients are gone before this forward pass
    with amp.autocast("fp16") if amp_on else contextlib.nullcontext():
        loss = F.cross_entropy(model(x), labels)
    scaler.scale(loss).backward()  # (a pass-through without --amp)
    scaler.step(opt)
    scaler.update()
    return loss


def torch_step(torch, model, opt, scaler, amp_on, x, labels):
    """The same step in PyTorch (--amp: torch.autocast float16 with its GradScaler); its loss tensor."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16, enabled=amp_on):
        loss = torch.nn.functional.cross_entropy(model(x), labels)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    return loss


def _torch_fp32(torch):
    """PyTorch as the fp32 comparisons run it: TF32 off, cuDNN's own algorithm search on."""
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True


def describe(args):
    stem = {"cifar": "CIFAR", "imagenet": "ImageNet"}[_stem(args)]
    if getattr(args, "model", "resnet18") == "mobilenet_v2":
        return f"MobileNetV2 (width 1.0, {stem} stem)"
    if getattr(args, "model", "resnet18") == "resnet50":
        return f"ResNet-50 ({stem} stem, width {args.width})"
    return f"ResNet-18 (CIFAR stem, width {args.width})"


class Side:
    """One framework's prepared, warmed-up training step: step() and sync() to time it, finish(times) for its
    result row (what it measures after the timed steps: peak memory, losses, --kernels, --new-batch)."""

    def __init__(self, step, sync, warm_s, finish):
        self.step, self.sync, self.warm_s, self.finish = step, sync, warm_s, finish


def timed_alone(side, args):
    """`side`'s result over one run of --steps steps."""
    _, times = median_step(side.step, 0, args.steps, side.sync)
    return side.finish(times)


def timed_in_rounds(sides, args):
    """Every side's result over --rounds rounds of --steps steps, the sides alternating within each round, each
    keeping its best round (the lowest median): the same minutes of the host for all of them."""
    best = [None] * len(sides)
    for _ in range(args.rounds):
        for i, side in enumerate(sides):
            _, times = median_step(side.step, 0, args.steps, side.sync)
            if best[i] is None or statistics.median(times) < statistics.median(best[i]):
                best[i] = times
    return [side.finish(times) | {"rounds": args.rounds} for side, times in zip(sides, best)]


def bench_kernelgen(x, labels, args):
    return timed_alone(prepare_kernelgen(x, labels, args), args)


def prepare_kernelgen(x, labels, args):
    from numba import cuda  # here, not at the top: numba.cuda is slow to import, and absent without numba-cuda
    model = build_model(args).to("cuda")
    compiled = {}
    amp_on = getattr(args, "amp", False)
    scaler = amp.GradScaler(enabled=amp_on)
    tune = getattr(args, "autotune", False)
    if getattr(args, "precompile", False) or tune:  # every conv kernel of the step compiled side by side, before it
        t = time.perf_counter()
        with amp.autocast("fp16") if amp_on else contextlib.nullcontext():  # (the step's precision: its kernels)
            report = (model.autotune if tune else model.precompile)(x.shape, x.dtype, workers=args.precompile_workers)
        compiled = {"precompile_s": time.perf_counter() - t, "precompile_kernels": report.kernels,
                    "precompile_cached": report.cached, "precompile_compiled": report.compiled,
                    "precompile_workers": report.workers, "precompile_errors": report.errors}
    opt = SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
    xd, yd = Tensor(x).to("cuda"), Tensor(labels).to("cuda").data
    losses = []
    pool = arena.device_pool()
    if getattr(args, "capture", False):  # the step captured once (after --warmup steps) and replayed
        pool.peak = pool.in_use  # (the graph keeps every block its step used: the peak is the captured step's)
        t = time.perf_counter()
        runner = graphs.CapturedStep(lambda a, b: kernelgen_step(model, opt, scaler, amp_on, a, b), xd, yd,
                                     warmup=args.warmup)
        cuda.synchronize()
        warm = time.perf_counter() - t
        compiled.update(captured=runner.captured, capture_failure=runner.reason)

        def step(xd=xd, yd=yd):  # (the loss array is the graph's: copied, to read every step's after the timing)
            losses.append(device_kernels().cast(runner(xd, yd).data, np.float32))
    else:
        def step(xd=xd, yd=yd):
            loss = kernelgen_step(model, opt, scaler, amp_on, xd, yd)
            losses.append(loss.data)  # the device scalar, read back after the timing (the Tensor would keep the graph)

        warm, _ = median_step(step, args.warmup, 0, cuda.synchronize)
        pool.peak = pool.in_use  # peak over the timed steps, from what lives between steps (model, optimiser)
    losses.clear()
    uploads = _map_uploads()

    def finish(times):
        first, last = float(losses[0].copy_to_host()), float(losses[-1].copy_to_host())  # (not the new batch's)
        # TMA tensor maps encoded and uploaded a step: arrays at addresses the ring has not seen (host work)
        compiled["map_uploads_per_step"] = (_map_uploads() - uploads) / len(losses)
        if getattr(args, "kernels", 0):
            compiled["kernels"] = kernel_profile(step, cuda.synchronize, args.kernels)
        if getattr(args, "new_batch", None):  # then a batch size this process has not run
            n = args.new_batch
            xn, yn = Tensor(x[:n] if n <= len(x) else np.resize(x, (n,) + x.shape[1:])).to("cuda"), \
                Tensor(np.resize(labels, n)).to("cuda").data
            compiled.update(_new_batch_steps(lambda: step(xn, yn), n, args.new_batch_seconds, cuda.synchronize,
                                             profile=getattr(args, "profile", False),
                                             control_seconds=getattr(args, "new_batch_control_seconds", 0.0)))
        free, total = cuda.current_context().get_memory_info()
        return {"step_ms": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
                "warmup_s": warm, "peak_bytes": pool.peak, "between_steps_bytes": pool.in_use,
                "pool_cached_bytes": pool.cached, "driver_used_bytes": total - free,
                "loss_first": first, "loss_last": last, **compiled}
    return Side(step, cuda.synchronize, warm, finish)


def _map_uploads():
    """TMA tensor maps uploaded so far in this process, over every stream's ring (runtime/map_ring.py)."""
    return sum(ring.uploads for ring in list(map_ring._RINGS.values()))


def bench_torch(x, labels, args):
    return timed_alone(prepare_torch(x, labels, args), args)


def prepare_torch(x, labels, args):
    import torch
    _torch_fp32(torch)
    torch.manual_seed(0)
    model = torch_model(torch, args).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
    xt = torch.from_numpy(x).cuda().permute(0, 3, 1, 2)  # NHWC memory seen as NCHW: channels_last
    yt = torch.from_numpy(labels).cuda()
    losses = []
    amp_on = getattr(args, "amp", False)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_on)

    def step():
        losses.append(torch_step(torch, model, opt, scaler, amp_on, xt, yt).detach())

    warm, _ = median_step(step, args.warmup, 0, torch.cuda.synchronize)
    losses.clear()
    torch.cuda.reset_peak_memory_stats()

    def finish(times):
        first, last = float(losses[0]), float(losses[-1])
        peak, between = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        extra = {"kernels": kernel_profile(step, torch.cuda.synchronize, args.kernels)} \
            if getattr(args, "kernels", 0) else {}
        return {**extra, "step_ms": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times),
                "warmup_s": warm, "peak_bytes": peak, "between_steps_bytes": between, "loss_first": first,
                "loss_last": last, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    return Side(step, torch.cuda.synchronize, warm, finish)


def loss_curves(args, batches=8):
    """--curve N: N steps of kernelgen.nn and of its PyTorch twin given the same weights, on the same `batches`
    batches of random images and labels (cycled), and a second PyTorch run from the same start: the per-step losses,
    and how far kernelgen's curve is from PyTorch's beside how far PyTorch's two runs are from each other (cuDNN's
    own run-to-run noise: its algorithms and atomics)."""
    import torch
    from numba import cuda
    rng = np.random.default_rng(1)
    data = [(rng.standard_normal((args.batch, args.image, args.image, 3)).astype(np.float32),
             rng.integers(0, args.classes, args.batch).astype(np.int64)) for _ in range(batches)]
    model = build_model(args).to("cuda")
    _torch_fp32(torch)
    amp_on = getattr(args, "amp", False)
    curves = {}
    torch_data = [(torch.from_numpy(xb).cuda().permute(0, 3, 1, 2), torch.from_numpy(yb).cuda()) for xb, yb in data]
    for name in ("torch", "torch again"):
        twin = torch_model(torch, args).cuda()
        copy_weights(torch, model, twin)
        twin = twin.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(twin.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
        scaler = torch.amp.GradScaler("cuda", enabled=amp_on)
        losses = [torch_step(torch, twin, opt, scaler, amp_on, *torch_data[i % batches]).detach()
                  for i in range(args.curve)]
        curves[name] = [float(v) for v in losses]
    opt = SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.wd)
    scaler = amp.GradScaler(enabled=amp_on)
    device_data = [(Tensor(xb).to("cuda"), Tensor(yb).to("cuda").data) for xb, yb in data]
    losses = [kernelgen_step(model, opt, scaler, amp_on, *device_data[i % batches]).data for i in range(args.curve)]
    cuda.synchronize()
    curves["kernelgen"] = [float(v.copy_to_host()) for v in losses]

    def apart(a, b):  # the mean |ln(loss ratio)| over the steps: the typical factor between two curves (a largest
        # relative difference is set by the late steps, where losses near 1e-4 differ by whole multiples run to run)
        return float(np.mean(np.abs(np.log(np.maximum(a, 1e-30)) - np.log(np.maximum(b, 1e-30)))))
    return {"steps": args.curve, "batches": batches, "losses": curves, "measure": "mean |ln(loss ratio)| a step",
            "kernelgen_vs_torch": apart(curves["kernelgen"], curves["torch"]),
            "kernelgen_vs_torch_again": apart(curves["kernelgen"], curves["torch again"]),
            "torch_vs_torch": apart(curves["torch again"], curves["torch"])}


@contextlib.contextmanager
def _cold(args):
    """--cold: kernelgen's run on an empty kernel cache (a fresh directory, numba's cache inside it), under
    kernelgen.profile_compile (the report, or None without --cold); --profile: on the cache in force, profiled."""
    if not getattr(args, "cold", False):
        if getattr(args, "profile", False):
            with profile_compile() as profile:
                yield profile
            return
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="kernelgen_cold_") as directory, \
            settings.scope(cache_dir=directory), profile_compile() as profile:
        yield profile


def _bars(args):
    """Issue 30's bars for this run: (step-time ratio, peak-memory ratio); None where it sets none."""
    if args.model == "resnet50":
        return 1.1, None
    if args.amp:
        return 1.0, 0.8
    return (0.9, 0.6) if args.batch >= 128 else (1.0, None)


def _has_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not installed: PyTorch comparison skipped")
        return False
    return True


def _print_runs(result, args):
    """Each side's row (step, peak memory, warm-up, losses), then kernelgen's extras: the new batch, precompile, TMA
    maps a step, and each side's kernels (--kernels)."""
    mode = "amp" if args.amp else "fp32"
    rows = [(f"kernelgen {mode}{' graph' if args.capture else ''}", result["kernelgen"])] + \
        ([(f"torch {mode}", result["torch"])] if "torch" in result else [])
    if args.capture and not result["kernelgen"]["captured"]:
        print(f"kernelgen's step was not captured (it ran uncaptured): {result['kernelgen']['capture_failure']}")
    print(f"{describe(args)}, batch {args.batch}, {args.image}x{args.image}x3, SGD momentum, "
          f"median of {args.steps} steps after {args.warmup} warm-up"
          f"{f', best of {args.rounds} alternating rounds' if args.rounds > 1 else ''}, {result['device']}")
    print(f"{'':18}{'step ms':>10}{'min ms':>10}{'peak MiB':>10}{'warm-up s':>11}{'loss first->last':>20}")
    for name, r in rows:
        print(f"{name:18}{r['step_ms']:10.2f}{r['step_ms_min']:10.2f}{r['peak_bytes'] / 2**20:10.1f}"
              f"{r['warmup_s']:11.1f}{r['loss_first']:11.4f}->{r['loss_last']:.4f}")
    if "new_batch" in result["kernelgen"]:
        k = result["kernelgen"]
        print(f"kernelgen, then batch {k['new_batch']}: first step {k['new_batch_first_step_s']:.2f} s, next 5 steps "
              f"{k['new_batch_step_ms']:.2f} ms (median); {len(k['new_batch_steps_ms'])} steps: steady "
              f"{k['new_batch_steady_step_ms']:.2f} ms, {k['new_batch_extra_s']:.2f} s beyond it in all")
        if "new_batch_extra_vs_control_s" in k:
            print(f"  control: {k['new_batch_control_steps']} more steps at {k['new_batch_control_step_ms']:.2f} ms "
                  f"(mean): the window cost {k['new_batch_extra_vs_control_s']:.2f} s beyond them")
    if "precompile_s" in result["kernelgen"]:
        k = result["kernelgen"]
        print(f"kernelgen precompile: {k['precompile_kernels']} kernels ({k['precompile_cached']} from the disk cache, "
              f"{k['precompile_compiled']} compiled in {k['precompile_workers']} processes) in {k['precompile_s']:.1f} s"
              f"{'; errors: ' + '; '.join(k['precompile_errors']) if k['precompile_errors'] else ''}")
    if "map_uploads_per_step" in result["kernelgen"]:
        print(f"kernelgen: {result['kernelgen']['map_uploads_per_step']:.1f} TMA tensor maps encoded and uploaded a "
              f"step (arrays at addresses the map ring has not seen)")
    for name, r in rows:
        if "kernels" in r:
            _print_kernels(name, r["kernels"])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kernelgen.nn.bench_step", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--width", type=int, default=64, help="ResNet-18's base width (64 = the paper's)")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--wd", type=float, default=5e-4)
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    ap.add_argument("--model", default="resnet18", choices=["resnet18", "resnet50", "mobilenet_v2"],
                    help="the network (resnet50: bottlenecks, e.g. --image 224 --batch 64; mobilenet_v2: width 1.0, "
                    "its depthwise layers on the depthwise template)")
    ap.add_argument("--image", type=int, default=32, help="input height and width (mobilenet_v2: 224 for the "
                    "ImageNet stem)")
    ap.add_argument("--cold", action="store_true", help="kernelgen's run from an empty kernel cache, with "
                    "kernelgen.profile_compile's report: where the first step's time goes, per stage and kernel")
    ap.add_argument("--profile", action="store_true", help="kernelgen.profile_compile's report on the kernel cache "
                    "in force (a warm first step's stages)")
    ap.add_argument("--precompile", action="store_true",
                    help="model.precompile(...) before the first step: its conv kernels compiled in a process pool "
                    "(timed apart: precompile_s; warmup_s is then the steps that load them)")
    ap.add_argument("--autotune", action="store_true",
                    help="model.autotune(...) instead of --precompile: first-call autotuning of each convolution no "
                    "tuned entry decides (as cudnn.benchmark, which PyTorch's side runs with)")
    ap.add_argument("--precompile-workers", type=int, default=None, help="processes for --precompile (default: "
                    "one per kernel, at most one per CPU)")
    ap.add_argument("--new-batch", type=int, default=None,
                    help="after the timed steps, steps on this batch size (e.g. 96 after 128): the first one's seconds "
                    "and the median of the next 5 (new_batch_first_step_s, new_batch_step_ms)")
    ap.add_argument("--new-batch-seconds", type=float, default=0.0,
                    help="then steps on the new batch for this long: each one's ms, and what the batch cost beyond "
                    "its steady step (new_batch_extra_s)")
    ap.add_argument("--new-batch-control-seconds", type=float, default=0.0,
                    help="then steps on it for this long more, a control: what the --new-batch-seconds window cost "
                    "beyond the control's mean step (new_batch_extra_vs_control_s)")
    ap.add_argument("--amp", action="store_true",
                    help="mixed precision on both sides: kernelgen.nn.amp (fp16 convolutions, GradScaler) against "
                    "torch.autocast fp16 with torch.amp.GradScaler")
    ap.add_argument("--capture", action="store_true",
                    help="kernelgen's step captured as a CUDA graph after the warm-up and replayed "
                    "(kernelgen.nn.CapturedStep), against PyTorch's eager step")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with torch: both sides prepared, then this many rounds of --steps steps, the sides "
                    "alternating, each keeping its best round (not with --cold or --profile)")
    ap.add_argument("--curve", type=int, default=0, metavar="STEPS",
                    help="then the loss curves of this many steps: kernelgen and PyTorch from the same weights on the "
                    "same batches, beside PyTorch run twice (needs torch)")
    ap.add_argument("--kernels", type=int, default=0, metavar="STEPS",
                    help="then torch.profiler over this many more steps of each side: kernel time a step, by kernel "
                    "(needs torch)")
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args(argv)
    if args.rounds < 1 or (args.rounds > 1 and (args.cold or args.profile)):
        raise ValueError(f"--rounds must be >= 1, and 1 with --cold or --profile, got {args.rounds}")
    if args.batch < 1 or args.steps < 1 or args.warmup < 1 or (args.new_batch is not None and args.new_batch < 1):
        raise ValueError(f"--batch, --steps, --warmup and --new-batch must be >= 1, got {args.batch}, {args.steps}, "
                         f"{args.warmup}, {args.new_batch}")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.image, args.image, 3)).astype(np.float32)
    labels = rng.integers(0, args.classes, args.batch).astype(np.int64)
    from numba import cuda
    name = getattr(cuda.get_current_device(), "name", "simulator")
    result = {"model": describe(args), "batch": args.batch, "warmup": args.warmup, "amp": args.amp,
              "capture": args.capture, "autotune": args.autotune,
              "steps": args.steps, "rounds": args.rounds,
              "device": name.decode() if isinstance(name, bytes) else str(name)}
    torch_on = not args.no_torch and _has_torch()
    if args.rounds > 1 and torch_on:  # both prepared, then timed in alternating rounds
        sides = [prepare_kernelgen(x, labels, args), prepare_torch(x, labels, args)]
        result["kernelgen"], result["torch"] = timed_in_rounds(sides, args)
    else:
        with _cold(args) as profile:
            result["kernelgen"] = bench_kernelgen(x, labels, args)
        if profile is not None:
            result["kernelgen"]["compile_profile"] = profile.as_dict()
            print(profile.table())
        if torch_on:
            result["torch"] = bench_torch(x, labels, args)
    _print_runs(result, args)
    if args.curve and torch_on:
        result["curve"] = c = loss_curves(args)
        print(f"loss curves over {c['steps']} steps ({c['batches']} batches cycled), mean |ln(loss ratio)| a step: "
              f"kernelgen vs torch {c['kernelgen_vs_torch']:.3f} (vs its second run {c['kernelgen_vs_torch_again']:.3f}), "
              f"torch vs torch {c['torch_vs_torch']:.3f}; first steps {c['losses']['kernelgen'][:3]} / "
              f"{c['losses']['torch'][:3]}")
    if "torch" in result:
        k, t = result["kernelgen"], result["torch"]
        result["ratio"] = {"step_time": k["step_ms"] / t["step_ms"], "peak_memory": k["peak_bytes"] / t["peak_bytes"]}
        step_bar, memory_bar = _bars(args)
        print(f"kernelgen / torch: step time {result['ratio']['step_time']:.2f}x (issue 30's bar <= {step_bar}x), "
              f"peak memory {result['ratio']['peak_memory']:.2f}x{f' (<= {memory_bar}x)' if memory_bar else ''}")
    print(f"kernelgen driver-level device memory in use after its run: "
          f"{result['kernelgen']['driver_used_bytes'] / 2**20:.0f} MiB (context, modules, arena pool)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
