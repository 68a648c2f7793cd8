"""The dispatch cache (issue 27): a repeated call with the same signature is one lookup to its route; the first
call of every signature is validated and planned; a settings change, a new value or a new array kind misses.

Every result is checked against the float64 reference on fresh random data, into outputs poisoned with NaN.
The CUDA route's argument binding is checked on any machine with stand-in device arrays and the launch stubbed
(runtime.bench_launch's --python-only pieces); the `gpu` tests run it for real.
"""
from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import kernelgen
from kernelgen import api, dispatch, settings
from kernelgen import reference as ref
from kernelgen.planner import make_plan
from kernelgen.runtime import bench_launch
from harness import poisoned, random_array

KW = dict(padding=1, backend="cpu")


def _case(rng, n=2):
    return random_array(rng, (n, 5, 6, 4)), random_array(rng, (3, 3, 3, 4))


def _hits_misses():
    s = api._DISPATCH.stats()
    return s["hits"], s["misses"]


def test_repeated_calls_hit_and_stay_correct(rng, assert_close):
    x, w = _case(rng)
    kernelgen.conv(x, w, **KW)  # the first call of this signature (a miss, or a hit left by another test)
    hits, _ = _hits_misses()
    for _ in range(3):
        x, w = _case(rng)  # fresh values, same signature
        out = poisoned((2, 5, 6, 3))
        assert kernelgen.conv(x, w, out=out, **KW) is out
        assert_close(out, ref.conv_forward(x, w, padding=(1, 1)))
        assert_close(kernelgen.conv(x, w, **KW), ref.conv_forward(x, w, padding=(1, 1)))
    assert _hits_misses()[0] >= hits + 5  # (the first out= call of the loop is a new signature)


def test_backward_ops_and_deconv_hit_and_stay_correct(rng, assert_close):
    x, w = _case(rng)
    dy = random_array(rng, (2, 5, 6, 3))
    for _ in range(2):
        assert_close(kernelgen.conv_backward_data(dy, w, x.shape, **KW),
                     ref.conv_backward_data(dy, w, x.shape, padding=(1, 1)))
        assert_close(kernelgen.conv_backward_weight(x, dy, w.shape, **KW),
                     ref.conv_backward_weight(x, dy, w.shape, padding=(1, 1)))
        wd = random_array(rng, (3, 3, 3, 4))  # deconv's w: (C_in, R, S, C_out); its bias after the kernel
        bias = random_array(rng, (4,))
        want = ref.conv_backward_data(dy, wd, (2, 5, 6, 4), padding=(1, 1)) + bias.astype(np.float64)
        assert_close(kernelgen.deconv(dy, wd, bias, **KW), want)
        dy = random_array(rng, (2, 5, 6, 3))


def test_a_value_of_another_type_is_validated_after_a_hit(rng):
    x, w = _case(rng)
    kernelgen.conv(x, w, stride=1, **KW)
    kernelgen.conv(x, w, stride=1, **KW)
    with pytest.raises(TypeError, match="stride"):
        kernelgen.conv(x, w, stride=1.0, **KW)
    with pytest.raises(TypeError, match="stride"):
        kernelgen.conv(x, w, stride=True, **KW)


def test_bad_arguments_after_hits_are_refused_by_name(rng):
    x, w = _case(rng)
    out = np.zeros((2, 5, 6, 3), np.float32)
    for _ in range(2):
        kernelgen.conv(x, w, out=out, **KW)
    with pytest.raises(ValueError, match="out must have shape"):
        kernelgen.conv(x, w, out=np.zeros((2, 5, 6, 4), np.float32), **KW)
    with pytest.raises(TypeError, match="out must have dtype"):
        kernelgen.conv(x, w, out=np.zeros((2, 5, 6, 3), np.float64), **KW)
    read_only = out.copy()
    read_only.flags.writeable = False  # same shape, dtype and strides as `out`: the route still checks it
    with pytest.raises(ValueError, match="out must be writeable"):
        kernelgen.conv(x, w, out=read_only, **KW)
    with pytest.raises(ValueError, match="stream must be None on the cpu backend"):
        kernelgen.conv(x, w, stream=object(), **KW)
    with pytest.raises(ValueError, match="w"):
        kernelgen.conv(x, random_array(np.random.default_rng(0), (3, 3, 3, 5)), **KW)
    with pytest.raises(TypeError, match="padding"):
        kernelgen.conv(x, w, padding={"h": 1}, backend="cpu")  # unhashable: no key, validated every time


@pytest.mark.parametrize("change", ["scope", "set", "environment"])
def test_a_settings_change_misses(rng, assert_close, monkeypatch, change):
    """no_tuned steers planning without changing code: a new key, a new plan, the same kernel (no compile)."""
    x, w = _case(rng)
    api.clear_caches()  # (the kernel stays loaded: no compile)
    kernelgen.conv(x, w, **KW)
    planned = []
    real = api.make_plan
    monkeypatch.setattr(api, "make_plan", lambda *a, **k: planned.append(a) or real(*a, **k))
    kernelgen.conv(x, w, **KW)
    assert not planned  # a hit
    before = settings.dispatch_token()
    if change == "scope":
        with settings.scope(no_tuned=not settings.get("no_tuned")):
            assert settings.dispatch_token() != before
            assert_close(kernelgen.conv(x, w, **KW), ref.conv_forward(x, w, padding=(1, 1)))
    elif change == "set":
        was_set = settings._process.get("no_tuned")  # (None: not set for the process; set(None) unsets)
        settings.set("no_tuned", not settings.get("no_tuned"))
        try:
            assert settings.dispatch_token() != before
            assert_close(kernelgen.conv(x, w, **KW), ref.conv_forward(x, w, padding=(1, 1)))
        finally:
            settings.set("no_tuned", was_set)
    else:
        monkeypatch.setenv("KERNELGEN_NO_TUNED", "0" if settings.get("no_tuned") else "1")
        assert settings.dispatch_token() != before
        assert_close(kernelgen.conv(x, w, **KW), ref.conv_forward(x, w, padding=(1, 1)))
    assert len(planned) == 1 and api._DISPATCH.stats()["entries"] == 2
    assert settings.dispatch_token() == before or change == "environment"


def test_code_token_follows_scope_set_environment_and_a_replaced_process_dict(monkeypatch):
    base = settings.code_token()
    assert settings.code_token() is base  # cached: the same tuple until something changes
    with settings.scope(index32=not settings.get("index32")):
        scoped = settings.code_token()
        assert scoped != base
        with settings.scope(index32=settings.get("index32")):
            assert settings.code_token() == scoped
    assert settings.code_token() == base
    monkeypatch.setenv("KERNELGEN_WINOGRAD_16", "0" if settings.get("winograd_16_states") else "1")
    assert settings.code_token() != base
    monkeypatch.undo()
    assert settings.code_token() == base
    monkeypatch.setattr(settings, "_process", {**settings._process, "index32": not settings.get("index32")})
    assert settings.code_token() != base


def test_a_bad_environment_value_of_a_code_setting_is_refused_by_name(rng, monkeypatch):
    x, w = _case(rng)
    kernelgen.conv(x, w, **KW)
    monkeypatch.setenv("KERNELGEN_INDEX32", "maybe")
    with pytest.raises(ValueError, match="KERNELGEN_INDEX32"):
        kernelgen.conv(x, w, **KW)


def test_settings_that_do_not_change_calls_do_not_miss(rng, monkeypatch):
    x, w = _case(rng)
    kernelgen.conv(x, w, **KW)
    token = settings.dispatch_token()
    monkeypatch.setenv("KERNELGEN_FUZZ", "not a number")  # (a bad value of a setting no call reads)
    monkeypatch.setenv("KERNELGEN_COMMIT", "abc123")
    assert settings.dispatch_token() == token
    kernelgen.conv(x, w, **KW)


def test_routes_hold_no_caller_arrays(rng):
    x, w = _case(rng)
    kernelgen.conv(x, w, **KW)
    x2, w2 = _case(rng)
    refs = [weakref.ref(x2), weakref.ref(w2)]
    kernelgen.conv(x2, w2, **KW)
    del x2, w2
    gc.collect()
    assert all(r() is None for r in refs)


def test_signature_keys_types_layouts_and_refuses_unknown_objects():
    a = np.zeros((2, 3), np.float32)
    sig = lambda *args, **kw: dispatch.signature("conv", args, kw)  # noqa: E731
    assert sig(a, stride=1) != sig(a, stride=1.0) != sig(a, stride=True)
    assert sig(a) != sig(np.asfortranarray(a)) != sig(a.astype(np.float64))
    assert sig(a) != sig(a[:, :2])
    assert sig(a, stream=None) != sig(a, stream=object())
    assert sig(a, padding=(1, 1)) != sig(a, padding=[1, 1])
    assert sig(a, padding=object()) is None
    assert sig(a, bias=[1.0, 2.0]) is None  # an array argument that is not an array: the full route
    assert sig(a, padding=np.int64(1)) == sig(a, padding=np.int64(1)) != sig(a, padding=1)
    cache = dispatch.DispatchCache(max_entries=2)
    cache.put(sig(a, padding={"h": 1}), "never")  # (None: nothing kept)
    cache.put(("k", [1]), "unhashable")  # refused quietly
    assert len(cache) == 0 and cache.get(("k", [1])) is None
    for i in range(3):
        cache.put(("k", i), i)
    assert len(cache) <= 2 and cache.get(("k", 2)) == 2


def test_a_torch_tensor_that_requires_grad_takes_the_full_route(rng, assert_close):
    """torch refuses the CUDA array interface of a tensor that requires grad: such a call is never keyed, and the
    full route reads the tensor through a detached view (the GPU's failure of 2026-11-26 on the converted
    ResNet-18)."""
    torch = pytest.importorskip("torch")
    x, w = torch.from_numpy(random_array(rng, (2, 5, 5, 3))), torch.from_numpy(random_array(rng, (4, 3, 3, 3)))
    w.requires_grad_()
    assert dispatch.signature("conv", (x, w), {}) is None
    assert dispatch.signature("conv", (x, w.detach()), {}) is not None
    for _ in range(2):
        got = kernelgen.conv(x, w, padding=1)
        assert not got.requires_grad
        assert_close(got.numpy(), ref.conv_forward(x.numpy(), w.detach().numpy(), padding=(1, 1)))


@pytest.fixture
def stand_in_gpu():
    """kernelgen's dispatch believing in a GPU (bench_launch.stubbed_launch) whose launches record their
    arguments; the stubbed launcher is put back afterwards, so no other test meets it."""
    x, w = np.zeros((1, 7, 7, 2), np.float32), np.zeros((5, 3, 3, 2), np.float32)  # a shape no other test uses
    launched = []
    with bench_launch.stubbed_launch():
        problem = api.conv.plan_call(x, w, padding=1, backend="cuda").prep.problem
        launcher = api.get_launcher(make_plan(problem, "cuda"))
        bench_launch._stub_fast_launch(launcher)
        real = launcher.launch_pointers
        launcher.launch_pointers = lambda ptrs, itemsize, stream=None: launched.append((list(ptrs), itemsize, "checked"))
        # a route's later calls launch by address alone, their layout (elements, itemsize) kept from its first
        launcher._fast.launch_addresses = lambda addresses, layout, stream: launched.append(
            ([(a, n) for a, (n, _) in zip(addresses, layout)], layout[0][1], "by address"))
        try:
            yield x.shape, w.shape, launched
        finally:
            launcher._fast = None
            launcher.launch_pointers = real
            api.clear_caches()


def test_cuda_route_binds_each_call_s_arrays_in_parameter_order(stand_in_gpu):
    """Stand-in device arrays, the launch stubbed: each call launches with its own x, w and output, in the
    kernel's parameter order; a new output each call unless out= is given; bad out refused by name."""
    x_shape, w_shape, launched = stand_in_gpu
    y_shape = (1, 7, 7, 5)
    for _ in range(4):  # the first call plans, the second makes the route, later ones launch by address
        dx, dw = bench_launch.StandInDeviceArray(x_shape), bench_launch.StandInDeviceArray(w_shape)
        y = kernelgen.conv(dx, dw, padding=1)
        assert isinstance(y, bench_launch.StandInDeviceArray) and y.shape == y_shape
        ptrs, itemsize, _ = launched[-1]
        assert itemsize == 4
        assert [p for p, _ in ptrs] == [a.__cuda_array_interface__["data"][0] for a in (dx, dw, y)]
        assert [n for _, n in ptrs] == [dx.size, dw.size, y.size]
    assert [how for *_, how in launched] == ["checked", "checked", "by address", "by address"]
    out = bench_launch.StandInDeviceArray(y_shape)
    for _ in range(3):
        assert kernelgen.conv(dx, dw, padding=1, out=out) is out
        assert launched[-1][0][2][0] == out.__cuda_array_interface__["data"][0]
    assert api._DISPATCH.stats()["hits"] >= 3
    with pytest.raises(ValueError, match="out must have shape"):
        kernelgen.conv(dx, dw, padding=1, out=bench_launch.StandInDeviceArray((1, 7, 7, 4)))
    with pytest.raises(TypeError, match="out must be a CUDA array"):
        kernelgen.conv(dx, dw, padding=1, out=np.zeros(y_shape, np.float32))
    with pytest.raises(TypeError, match="stride"):
        kernelgen.conv(dx, dw, padding=1, stride=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["numba", "torch"])
def test_fast_route_on_the_gpu_is_correct_call_after_call(rng, assert_close, kind):
    from numba import cuda
    if kind == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch has no CUDA here")
        to_dev, to_host = (lambda a: torch.from_numpy(a).cuda()), (lambda t: t.cpu().numpy())
        out = torch.empty((2, 5, 6, 3), device="cuda")
        poison = lambda: out.fill_(float("nan"))  # noqa: E731
    else:
        to_dev, to_host = cuda.to_device, (lambda a: a.copy_to_host())
        out = cuda.device_array((2, 5, 6, 3), np.float32)
        poison = lambda: out.copy_to_device(poisoned((2, 5, 6, 3)))  # noqa: E731
    for i in range(4):
        x, w = _case(rng)
        want = ref.conv_forward(x, w, padding=(1, 1))
        poison()  # every call's out= starts as NaN: an element it misses shows
        assert_close(to_host(kernelgen.conv(to_dev(x), to_dev(w), padding=1)), want)
        assert kernelgen.conv(to_dev(x), to_dev(w), padding=1, out=out) is out
        assert_close(to_host(out), want)
    cuda.synchronize()
