"""kernelgen's torch ops captured into CUDA graphs (torch.cuda.graph), on the GPU (marker `gpu`): a convolution's
forward and both backward passes captured in torch's default (global) capture mode and replayed on fresh data give
what float64 gives; so do replays after eager calls have rewritten every slot of the eager tensor-map ring
(runtime/capture.py: a captured call takes its own copies, workspaces and map slots), and a replay on another
stream.  What cannot be captured (a first call, an output from kernelgen's pool) is refused before anything runs.
On the H100 the 16-bit rows run TMA kernels (tensor maps; backward-data's flipped filter copy; backward-weight's
split-K float32 workspace), the TF32 row its rounded copies."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import kernelgen  # noqa: E402
from kernelgen import settings  # noqa: E402
from kernelgen.torch import functional as KF  # noqa: E402

TOL = {"fp16": 3e-3, "bf16": 2e-2, "tf32": 3e-3}
DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "tf32": torch.float32}


def _data(shape, dtype, gen):
    return torch.randn(*shape, generator=gen).to("cuda", dtype).contiguous(memory_format=torch.channels_last)


def _reference(x, w, dy):
    """y, dx, dw in float64 (torch's CPU convolution)."""
    x64 = x.detach().double().cpu().requires_grad_()
    w64 = w.detach().double().cpu().requires_grad_()
    y = torch.nn.functional.conv2d(x64, w64, padding=1)
    y.backward(dy.detach().double().cpu())
    return y.detach(), x64.grad, w64.grad


def _close(got, want, tol, what):
    got = got.detach().double().cpu()
    assert torch.isfinite(got).all(), what
    err = (got - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), (what, err)


@pytest.mark.parametrize("via", ["functional", "module"])
@pytest.mark.parametrize("precision", ["fp16", "bf16", "tf32"])
def test_captured_conv_and_its_gradients_replay_right(precision, via, monkeypatch):
    """module: a kernelgen.torch.Conv2d, whose calls go through the native entry point (kernelgen/torch/native.cpp):
    its eager calls replay in C++, a capture takes the Python route."""
    from kernelgen.runtime import map_ring
    monkeypatch.setattr(map_ring, "SLOTS", 4)  # the eager rings wrap within a few calls
    monkeypatch.setattr(map_ring, "_RINGS", {})
    gen = torch.Generator().manual_seed(0)
    dtype = DTYPE[precision]
    shape_x, shape_w = (8, 64, 14, 14), (64, 64, 3, 3)
    static_x = _data(shape_x, dtype, gen).requires_grad_()
    w = _data(shape_w, dtype, gen).mul_(0.1).requires_grad_()
    static_dy = _data((8, 64, 14, 14), dtype, gen)
    conv = None
    if via == "module":
        import kernelgen.torch as kt
        from kernelgen.torch import native
        assert native.wait(1200), native.status()
        conv = kt.Conv2d(64, 64, 3, padding=1, bias=False).cuda().to(dtype)
        with torch.no_grad():
            conv.weight.copy_(w)
        w = conv.weight

    def step():
        y = KF.conv2d(static_x, w, padding=1) if conv is None else conv(static_x)
        y.backward(static_dy)
        return y

    with settings.scope(precision="tf32" if precision == "tf32" else "fp32"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: plans, compiles and loads every kernel the step runs
                static_x.grad = w.grad = None
                step()
        torch.cuda.current_stream().wait_stream(side)
        static_x.grad = w.grad = None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # (global capture mode, torch's own capture stream)
            static_y = step()

        def replay_and_check(what, stream=None):
            static_x.detach().copy_(_data(shape_x, dtype, gen))
            static_dy.copy_(_data((8, 64, 14, 14), dtype, gen))
            for t in (static_y, static_x.grad, w.grad):
                t.detach().fill_(float("nan"))  # poisoned: the replay must write every element
            if stream is None:
                graph.replay()
            else:
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    graph.replay()
                torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            want = _reference(static_x, w, static_dy)
            for got, ref, name in zip((static_y, static_x.grad, w.grad), want, ("y", "dx", "dw")):
                _close(got, ref, TOL[precision], f"{what}: {name}")

        replay_and_check("first replay")
        replay_and_check("second replay")
        # eager calls on the capture stream and on another, each on new arrays (new maps): every eager ring slot
        # is rewritten several times; the graph's maps and buffers are its own
        for stream in (graph_stream(), side):
            with torch.cuda.stream(stream):
                for _ in range(6):
                    x = _data(shape_x, dtype, gen).requires_grad_()
                    KF.conv2d(x, w, padding=1).backward(_data((8, 64, 14, 14), dtype, gen))
        # (the eager backward calls added into w.grad, the graph's own tensor: a replay writes it whole again)
        replay_and_check("replay after eager calls")
        replay_and_check("replay on another stream", torch.cuda.Stream())


def graph_stream():
    """The stream torch.cuda.graph captures on when given none."""
    stream = getattr(torch.cuda.graph, "default_capture_stream", None)
    return stream if stream is not None else torch.cuda.current_stream()


def test_a_first_call_is_refused_under_capture():
    x = torch.randn(2, 24, 9, 9, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.randn(40, 24, 3, 3, device="cuda").contiguous(memory_format=torch.channels_last)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="first run .* cannot be captured"):
        with torch.cuda.graph(graph):
            KF.conv2d(x, w, padding=1)
    torch.cuda.synchronize()
    y = KF.conv2d(x, w, padding=1)  # eager afterwards: it runs
    want = torch.nn.functional.conv2d(x.double(), w.double(), padding=1)
    _close(y, want.cpu(), 1e-4, "eager after the refusal")


def test_a_pooled_output_is_refused_under_capture():
    """numba arrays in, no out=: the output would come from kernelgen's pool, which takes a block back when the
    caller drops it while the graph still writes it."""
    from numba import cuda
    rng = np.random.default_rng(0)
    x = cuda.to_device(rng.standard_normal((2, 9, 9, 24)).astype(np.float32))
    w = cuda.to_device(rng.standard_normal((40, 3, 3, 24)).astype(np.float32))
    side = torch.cuda.Stream()
    kernelgen.conv(x, w, padding=1, stream=side)  # warm (the route exists)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="pool cannot be captured"):
        with torch.cuda.graph(graph, stream=side):
            kernelgen.conv(x, w, padding=1, stream=side)


def test_cupy_stream_capture_with_out(rng):
    """Not only torch's: a CuPy stream's capture of the three directions (fp16: on the H100 TMA kernels, a flipped
    filter copy, a split backward-weight's workspace), outputs passed as out=, replayed by CuPy on new data."""
    cupy = pytest.importorskip("cupy")
    from kernelgen import reference as ref
    x_shape, w_shape, y_shape = (4, 12, 12, 64), (64, 3, 3, 64), (4, 12, 12, 64)
    x, dy = cupy.empty(x_shape, cupy.float16), cupy.empty(y_shape, cupy.float16)
    w = cupy.asarray((0.1 * rng.standard_normal(w_shape)).astype(np.float16))
    y, dx, dw = (cupy.empty(s, cupy.float16) for s in (y_shape, x_shape, w_shape))
    stream = cupy.cuda.Stream(non_blocking=True)
    kw = dict(padding=1, precision="fp16", stream=stream)

    def step():
        kernelgen.conv(x, w, out=y, **kw)
        kernelgen.conv_backward_data(dy, w, x_shape, out=dx, **kw)
        kernelgen.conv_backward_weight(x, dy, w_shape, out=dw, **kw)
    step()  # warm-up: plans and compiles
    stream.synchronize()
    stream.begin_capture()
    step()
    graph = stream.end_capture()
    for _ in range(2):
        xh = rng.standard_normal(x_shape).astype(np.float16)
        dyh = rng.standard_normal(y_shape).astype(np.float16)
        x.set(xh), dy.set(dyh)
        for a in (y, dx, dw):
            a.fill(np.nan)
        cupy.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        wh = cupy.asnumpy(w).astype(np.float64)
        wants = (ref.conv_forward(xh.astype(np.float64), wh, padding=1),
                 ref.conv_backward_data(dyh.astype(np.float64), wh, x_shape, padding=1),
                 ref.conv_backward_weight(xh.astype(np.float64), dyh.astype(np.float64), w_shape, padding=1))
        for got, want, name in zip((y, dx, dw), wants, ("y", "dx", "dw")):
            got = cupy.asnumpy(got).astype(np.float64)
            assert np.isfinite(got).all(), name
            assert np.abs(got - want).max() <= 3e-3 * np.abs(want).max(), name
