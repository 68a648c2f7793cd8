"""GPU: the host cost of one convolution through kernelgen.torch against torch's own (issue 31): µs per call of a
forward without autograd, a forward under autograd and a forward + backward, on a tiny batch so that the GPU never
holds the loop back (the loop's time is the host's).  `--profile` adds cProfile of kernelgen's forward + backward
loop, by own time.  Prints one JSON line per mode and layer; writes --out."""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch

LAYERS = {  # name: (C, K, H, stride) - ResNet-18 CIFAR's shapes at batch 1
    "c64_32": (64, 64, 32, 1),
    "c128_16_s2": (64, 128, 32, 2),
    "c512_4": (512, 512, 4, 1),
}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _per_call_us(fn, calls):
    for _ in range(5):
        fn()
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync()
    return (time.perf_counter() - start) / calls * 1e6


def _cases(conv, x, dy):
    def no_grad():
        with torch.no_grad():
            conv(x)

    def forward():
        conv(x)

    def forward_backward():
        conv(x).backward(dy)
    return {"forward, no_grad": no_grad, "forward, autograd": forward, "forward + backward": forward_backward}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--modes", default="bf16,fp32")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu (the CPU backend: a check of the script)")
    ap.add_argument("--out", default="torch_call_cost.json")
    args = ap.parse_args(argv)
    import kernelgen.torch as kt
    torch.backends.cudnn.benchmark = True
    rows, profiles = [], []
    for mode in args.modes.split(","):
        dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        for name, (c, k, h, s) in LAYERS.items():
            ref = torch.nn.Conv2d(c, k, 3, s, 1, bias=False).to(args.device)
            ref = ref.to(memory_format=torch.channels_last).to(dtype)
            mine = kt.convert(torch.nn.Sequential(torch.nn.Conv2d(c, k, 3, s, 1, bias=False))).to(args.device)
            mine[0].load_state_dict(ref.state_dict())
            mine = mine.to(memory_format=torch.channels_last).to(dtype)
            x = torch.randn(args.batch, c, h, h, device=args.device, dtype=dtype).to(memory_format=torch.channels_last)
            x.requires_grad_(True)
            dy = torch.randn_like(ref(x)).contiguous(memory_format=torch.channels_last)
            for who, conv in (("torch", ref), ("kernelgen", mine)):
                for case, fn in _cases(conv, x, dy).items():
                    row = {"mode": mode, "layer": name, "who": who, "case": case,
                           "us_per_call": round(_per_call_us(fn, args.calls), 1)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            if args.profile:
                fn = _cases(mine, x, dy)["forward + backward"]
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    fn()
                prof.disable()
                text = io.StringIO()
                print(f"--- {mode} {name}: kernelgen forward + backward x {args.calls}", file=text)
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
                profiles.append(text.getvalue())
                print(text.getvalue(), flush=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "profiles": profiles}, f, indent=1)


if __name__ == "__main__":
    main()
