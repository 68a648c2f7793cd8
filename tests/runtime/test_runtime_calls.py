"""The call path: prepared-call memo, `out=`, `stream=`, pooled outputs, the fast launch route.

CPU and simulator tests check behaviour; the `gpu` tests check that the fast route (second and later
calls, no numba dispatcher) computes the same as the reference, on streams and with torch interop.
"""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen import api
from kernelgen import reference as ref
from harness import poisoned


def _case(rng):
    x = rng.standard_normal((2, 5, 6, 4)).astype(np.float32)
    w = rng.standard_normal((3, 3, 3, 4)).astype(np.float32)
    return x, w


def test_repeated_call_is_planned_once(rng, assert_close, monkeypatch):
    x, w = _case(rng)
    api.clear_caches()
    calls = []
    real = api.make_plan
    monkeypatch.setattr(api, "make_plan", lambda *a, **k: calls.append(a) or real(*a, **k))
    for _ in range(3):
        assert_close(kernelgen.conv(x, w, padding=1, backend="cpu"), ref.conv_forward(x, w, padding=(1, 1)))
    assert len(calls) == 1
    kernelgen.conv(x, w, padding=2, backend="cpu")       # another signature: planned anew
    assert len(calls) == 2


def test_variant_settings_are_part_of_the_prepared_key():
    from kernelgen import settings
    before = settings.code_token()
    with settings.scope(winograd_states=(4, 16)):
        assert settings.code_token() != before


def test_unhashable_arguments_still_validate_and_run(rng, assert_close):
    x, w = _case(rng)
    got = kernelgen.conv(x, w, padding=[1, 1], backend="cpu")
    assert_close(got, ref.conv_forward(x, w, padding=(1, 1)))
    with pytest.raises(ValueError, match="padding"):
        kernelgen.conv(x, w, padding=[1, 1, 1], backend="cpu")


def test_memo_does_not_skip_validation_of_a_new_signature(rng):
    x, w = _case(rng)
    kernelgen.conv(x, w, padding=1, backend="cpu")
    with pytest.raises(ValueError, match="in-channels"):
        kernelgen.conv(x[..., :3], w, padding=1, backend="cpu")


def test_out_argument_cpu(rng, assert_close):
    x, w = _case(rng)
    out = poisoned((2, 5, 6, 3))
    got = kernelgen.conv(x, w, padding=1, backend="cpu", out=out)
    assert got is out
    assert_close(out, ref.conv_forward(x, w, padding=(1, 1)))


@pytest.mark.parametrize("bad, err, match", [
    (np.zeros((2, 5, 6, 4), np.float32), ValueError, "out must have shape"),
    (np.zeros((2, 5, 6, 3), np.float64), TypeError, "out must have dtype float32"),
    (np.zeros((2, 5, 3, 6), np.float32).transpose(0, 1, 3, 2), ValueError, "C-contiguous"),
])
def test_bad_out_is_rejected_before_running(rng, bad, err, match):
    x, w = _case(rng)
    before = bad.copy()
    with pytest.raises(err, match=match):
        kernelgen.conv(x, w, padding=1, backend="cpu", out=bad)
    assert np.array_equal(bad, before)


def test_stream_on_cpu_backend_is_rejected(rng):
    x, w = _case(rng)
    with pytest.raises(ValueError, match="stream must be None on the cpu backend"):
        kernelgen.conv(x, w, backend="cpu", stream=object())


@pytest.mark.sim
def test_stream_and_out_in_simulator(rng, assert_close):
    from numba import cuda
    x = rng.standard_normal((1, 3, 3, 2)).astype(np.float32)
    w = rng.standard_normal((2, 3, 3, 2)).astype(np.float32)
    want = ref.conv_forward(x, w, padding=(1, 1))
    stream = cuda.stream()
    dx, dw = cuda.to_device(x), cuda.to_device(w)
    out = cuda.to_device(poisoned((1, 3, 3, 2)))
    got = kernelgen.conv(dx, dw, padding=1, backend="cuda", stream=stream, out=out)
    stream.synchronize()
    assert got is out
    assert_close(out.copy_to_host(), want)
    # host inputs on the cuda backend: staged copies on the stream, a complete NumPy result back
    assert_close(kernelgen.conv(x, w, padding=1, backend="cuda", stream=stream), want)
    with pytest.raises(TypeError, match="stream must be"):
        kernelgen.conv(dx, dw, padding=1, backend="cuda", stream="fast")


def test_bind_needs_cuda_arrays(rng):
    x = rng.standard_normal((1, 4, 4, 2)).astype(np.float32)
    w = rng.standard_normal((2, 3, 3, 2)).astype(np.float32)
    with pytest.raises(ValueError, match="bind needs CUDA arrays"):
        kernelgen.bind(kernelgen.conv, x, w, padding=1, backend="cpu")
    with pytest.raises(ValueError, match="op must be one of"):
        kernelgen.bind(kernelgen.deconv, x, w)


def _rebind_check(fn_name, make_args, want_of, assert_close, new_data, tol=None):
    """bind(op)(): same output object each call, reading the bound buffers' current contents."""
    args, bufs, kw = make_args()
    call = kernelgen.bind(getattr(kernelgen, fn_name), *args, **kw)
    from numba import cuda
    for round_ in range(2):
        if round_:
            for buf, host in zip(bufs, new_data()):  # new values, same device buffers
                buf.copy_to_device(host)
        got = call()
        cuda.synchronize()
        assert got is call()
        cuda.synchronize()
        kwargs = {} if tol is None else {"tol": tol}
        assert_close(got.copy_to_host(), want_of([b.copy_to_host() for b in bufs]), **kwargs)


@pytest.mark.sim
def test_bind_in_simulator(rng, assert_close):
    from numba import cuda
    x = rng.standard_normal((1, 3, 3, 2)).astype(np.float32)
    w = rng.standard_normal((2, 3, 3, 2)).astype(np.float32)
    dx, dw = cuda.to_device(x), cuda.to_device(w)
    _rebind_check("conv", lambda: ((dx, dw), (dx, dw), dict(padding=1, backend="cuda")),
                  lambda h: ref.conv_forward(h[0], h[1], padding=(1, 1)), assert_close,
                  lambda: (rng.standard_normal(x.shape).astype(np.float32), w))


# --- real GPU ----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("op", ["conv", "conv_backward_data", "conv_backward_weight"])
def test_fast_route_matches_reference(op, rng, assert_close):
    from numba import cuda
    x = rng.standard_normal((4, 12, 12, 16)).astype(np.float32)
    w = rng.standard_normal((24, 3, 3, 16)).astype(np.float32)
    kw = dict(stride=2, padding=1)
    y_shape = kernelgen.problem.make_problem("fwd", x.shape, w.shape, **kw).output_shape
    dy = rng.standard_normal(y_shape).astype(np.float32)
    if op == "conv":
        args, want = (cuda.to_device(x), cuda.to_device(w)), ref.conv_forward(x, w, stride=(2, 2), padding=(1, 1))
    elif op == "conv_backward_data":
        args = (cuda.to_device(dy), cuda.to_device(w), x.shape)
        want = ref.conv_backward_data(dy, w, x.shape, stride=(2, 2), padding=(1, 1))
    else:
        args = (cuda.to_device(x), cuda.to_device(dy), w.shape)
        want = ref.conv_backward_weight(x, dy, w.shape, stride=(2, 2), padding=(1, 1))
    fn = getattr(kernelgen, op)
    fn(*args, **kw)                                            # compiles; later calls take the fast route
    stream = cuda.stream()
    for s in (None, stream):
        out = cuda.to_device(poisoned(want.shape))
        fn(*args, **kw, out=out, stream=s)
        if s is not None:
            s.synchronize()
        assert_close(out.copy_to_host(), want, tol=2e-5)
        got = fn(*args, **kw, stream=s)                          # pooled output
        cuda.synchronize()
        assert_close(got.copy_to_host(), want, tol=2e-5)


@pytest.mark.gpu
def test_fast_route_is_taken_and_outputs_are_pooled(rng):
    from numba import cuda

    from kernelgen.runtime import arena
    x, w = _case(rng)
    dx, dw = cuda.to_device(x), cuda.to_device(w)
    kernelgen.conv(dx, dw, padding=1)
    launcher = [p for p in api._PREPARED.values() if p.problem.x_shape == x.shape][-1].launcher
    assert launcher.fast
    before = arena.device_pool().stats()["served_from_pool"]
    for _ in range(5):
        kernelgen.conv(dx, dw, padding=1)
    cuda.synchronize()
    assert arena.device_pool().stats()["served_from_pool"] >= before + 4


@pytest.mark.gpu
def test_two_streams_ordered_by_an_event(rng, assert_close):
    # two independent branches on their own streams; the join waits on an event, not on the device
    from numba import cuda
    x = rng.standard_normal((4, 12, 12, 16)).astype(np.float32)
    w1, w2 = (rng.standard_normal((16, 3, 3, 16)).astype(np.float32) for _ in range(2))
    s1, s2 = cuda.stream(), cuda.stream()
    dx, dw1, dw2 = cuda.to_device(x), cuda.to_device(w1), cuda.to_device(w2)
    y1 = cuda.to_device(poisoned(x.shape))
    y2 = cuda.to_device(poisoned(x.shape))
    kernelgen.conv(dx, dw1, padding=1, stream=s1, out=y1)
    kernelgen.conv(dx, dw2, padding=1, stream=s2, out=y2)
    y1_done = cuda.event(timing=False)
    y1_done.record(s1)
    y1_done.wait(s2)
    gw = kernelgen.conv_backward_weight(y1, y2, w1.shape, padding=1, stream=s2)  # reads both branches
    s2.synchronize()
    a, b = ref.conv_forward(x, w1, padding=(1, 1)), ref.conv_forward(x, w2, padding=(1, 1))
    assert_close(gw.copy_to_host(), ref.conv_backward_weight(a, b, w1.shape, padding=(1, 1)))


@pytest.mark.gpu
def test_torch_stream_and_tensors(rng, assert_close):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    x, w = _case(rng)
    tx, tw = torch.from_numpy(x).cuda(), torch.from_numpy(w).cuda()
    s = torch.cuda.Stream()
    kernelgen.conv(tx, tw, padding=1)
    with torch.cuda.stream(s):
        got = kernelgen.conv(tx, tw, padding=1, stream=s)
    s.synchronize()
    assert isinstance(got, torch.Tensor)
    assert_close(got.cpu().numpy(), ref.conv_forward(x, w, padding=(1, 1)), tol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["conv", "conv_backward_data", "conv_backward_weight"])
def test_bind_on_gpu(op, rng, assert_close):
    """The prepacked relaunch: new data in the bound buffers gives the new result (split-K
    backward-weight re-zeroes its output on every call)."""
    from numba import cuda
    kw = dict(stride=2, padding=1)
    x_shape, w_shape = (4, 12, 12, 16), (24, 3, 3, 16)
    y_shape = kernelgen.problem.make_problem("fwd", x_shape, w_shape, **kw).output_shape
    first, second = ({"x": rng.standard_normal(x_shape), "w": rng.standard_normal(w_shape),
                      "dy": rng.standard_normal(y_shape)} for _ in range(2))
    names = {"conv": ("x", "w"), "conv_backward_data": ("dy", "w"), "conv_backward_weight": ("x", "dy")}[op]
    bufs = [cuda.to_device(first[n].astype(np.float32)) for n in names]
    extra = {"conv": (), "conv_backward_data": (x_shape,), "conv_backward_weight": (w_shape,)}[op]
    refs = {"conv": lambda h: ref.conv_forward(h[0], h[1], stride=(2, 2), padding=(1, 1)),
            "conv_backward_data": lambda h: ref.conv_backward_data(h[0], h[1], x_shape, stride=(2, 2), padding=(1, 1)),
            "conv_backward_weight": lambda h: ref.conv_backward_weight(h[0], h[1], w_shape, stride=(2, 2),
                                                                       padding=(1, 1))}
    _rebind_check(op, lambda: (tuple(bufs) + extra, bufs, kw), refs[op], assert_close,
                  lambda: [second[n].astype(np.float32) for n in names], tol=2e-5)


def test_numba_cuda_s_block_order_needs_no_raised_recursion_limit():
    """numba-cuda 0.30.4 orders a kernel's blocks by a recursive walk (one frame per block of the longest chain):
    the 16-state 12-wide Winograd epilogue in state groups has > 1000 blocks and raised RecursionError on the GPU
    machine.  kernelgen.numba_speedups walks them on an explicit stack, in the same order, so loading a kernel
    leaves the recursion limit alone; only without that replacement is the limit raised."""
    import sys
    from numba.cuda.core.controlflow import CFGraph
    from kernelgen import numba_speedups
    from kernelgen.runtime.driver import CFG_RECURSION_LIMIT, allow_deep_cfg_walks

    def chain_order(n):
        g = CFGraph()
        for i in range(n):
            g.add_node(i)
        for i in range(n - 1):
            g.add_edge(i, i + 1)
        g.set_entry_point(0)
        g.process()
        return g.topo_order()

    old, was = sys.getrecursionlimit(), numba_speedups.installed_names()
    try:
        sys.setrecursionlimit(1000)
        numba_speedups.install()
        assert "_find_topo_order" in numba_speedups.installed_names()
        assert chain_order(1500) == list(range(1500))
        allow_deep_cfg_walks("cuda")
        assert sys.getrecursionlimit() == 1000
        numba_speedups.uninstall(["_find_topo_order"])
        with pytest.raises(RecursionError):
            chain_order(1500)
        allow_deep_cfg_walks("cuda")
        assert sys.getrecursionlimit() >= CFG_RECURSION_LIMIT
        assert chain_order(1500) == list(range(1500))
    finally:  # the speedups as they were: all (the test took one out), or none (under the simulator, where numba's
        if was:  # CPU typing must stay numba's own: one of them assumes the CUDA target)
            numba_speedups.install()
        else:
            numba_speedups.uninstall()
        sys.setrecursionlimit(old)
