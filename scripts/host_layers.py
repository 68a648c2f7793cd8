"""GPU: host µs per call of each layer of a converted convolution's path, innermost to outermost, beside torch's own
convolution and the torch calls the path makes (issue 31).  One layer, a small batch (the GPU never holds the loop
back: each number is the host's), bf16 autocast as a converted ResNet-18 step runs it.  The difference between two
adjacent rows is what that layer adds.  `python scripts/host_layers.py [--calls 2000] [--out host_layers.json]`."""
from __future__ import annotations

import argparse
import json
import time

import torch


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return round(best, 2)


class _Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.new_empty(())

    @staticmethod
    def backward(ctx, dy):
        return None, None


def cases(c, k, h, batch):
    from kernelgen.runtime.driver import as_numba_stream

    import kernelgen.torch as kt
    from kernelgen.torch import native
    from kernelgen.torch import direct, functional, ops
    print("native entry point:", "ready" if native.wait(900) else native.status(), flush=True)
    theirs = torch.nn.Conv2d(c, k, 3, padding=1, bias=False).cuda().to(memory_format=torch.channels_last)
    ours = kt.convert(torch.nn.Conv2d(c, k, 3, padding=1, bias=False).cuda())
    x = torch.randn(batch, c, h, h, device="cuda").to(memory_format=torch.channels_last).bfloat16()
    dy = torch.randn(batch, k, h, h, device="cuda").to(memory_format=torch.channels_last).bfloat16()
    w16 = ours.weight.detach().bfloat16()
    hyper = ([1, 1], [1, 1], [1, 1], 1)
    auto = torch.autocast("cuda", dtype=torch.bfloat16)
    auto.__enter__()
    for _ in range(3):  # compile, then keep the direct routes
        ours(x).backward(dy)
        ops.conv_impl(x, w16, None, *hyper, "bf16")
    stream = ops._current_stream(x)
    call_key = direct.key("conv", (x, w16, None), ((1, 1), (1, 1), (1, 1), 1), "bf16")
    route = direct._ROUTES.get(call_key)
    nstream = as_numba_stream(stream)
    like = route.like if route is not None else None
    y = route.make(like) if route is not None else None
    addresses = [y.data_ptr() if i < 0 else (x, w16)[i].data_ptr() for i in route.order] if route is not None else None
    xg = x.detach().requires_grad_()
    out = {
        "torch module forward": lambda: theirs(x),
        "torch module forward + backward": lambda: theirs(xg).backward(dy),
        "kernelgen module forward": lambda: ours(x),
        "kernelgen module forward + backward": lambda: ours(xg).backward(dy),
        "functional.conv2d (bf16 weight)": lambda: functional.conv2d(x, w16, None, 1, 1, 1, 1),
        "ops.apply_conv": lambda: ops.apply_conv(x, w16, None, *hyper, "bf16"),
        "ops.conv_impl (no autograd node)": lambda: ops.conv_impl(x, w16, None, *hyper, "bf16"),
        "ops.conv_backward_data_impl": lambda: ops.conv_backward_data_impl(dy, w16, [batch, c, h, h], *hyper, "bf16"),
        "ops.conv_backward_weight_impl": lambda: ops.conv_backward_weight_impl(x, dy, [k, c, 3, 3], *hyper, "bf16"),
        "direct.key": lambda: direct.key("conv", (x, w16, None), ((1, 1), (1, 1), (1, 1), 1), "bf16"),
        "direct.run": lambda: direct.run(call_key, (x, w16, None), stream),
        "route.cuda.launch": (lambda: route.cuda.launch(addresses, nstream)) if route is not None else None,
        "route.make (output)": (lambda: route.make(like)) if route is not None else None,
        "ops._current_stream": lambda: ops._current_stream(x),
        "as_numba_stream": lambda: as_numba_stream(stream),
        "3 x data_ptr": lambda: (x.data_ptr(), w16.data_ptr(), dy.data_ptr()),
        "torch.autograd.Function (save 2, new_empty)": lambda: _Noop.apply(x, ours.weight),
        "weight.to(bfloat16)": lambda: ours.weight.to(torch.bfloat16),
        "is_autocast_enabled + get_autocast_dtype": lambda: (torch.is_autocast_enabled("cuda"),
                                                             torch.get_autocast_dtype("cuda")),
        "torch.compiler.is_compiling": torch.compiler.is_compiling,
        "x.movedim(-1, 1)": lambda: x.movedim(-1, 1),
    }
    return {name: fn for name, fn in out.items() if fn is not None}, auto


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--layer", default="64,64,32,2", help="C,K,H,batch")
    ap.add_argument("--out", default="host_layers.json")
    args = ap.parse_args(argv)
    torch.backends.cudnn.benchmark = True
    fns, auto = cases(*map(int, args.layer.split(",")))
    rows = {}
    for name, fn in fns.items():
        rows[name] = per_call_us(fn, args.calls)
        print(f"{rows[name]:9.2f} us  {name}", flush=True)
    auto.__exit__(None, None, None)
    with open(args.out, "w") as f:
        json.dump({"layer": args.layer, "calls": args.calls, "us_per_call": rows}, f, indent=1)


if __name__ == "__main__":
    main()
