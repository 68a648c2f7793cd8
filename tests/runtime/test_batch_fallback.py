"""runtime.batch_fallback: a new batch size runs on a larger batch's kernel while its own compiles (issue 27).

The simulator compiles nothing, so there the fallback is off by itself; these tests say "not compiled yet" for it
and stand in for the background compile, then check each direction's result against float64 on fresh data."""
from __future__ import annotations

import numpy as np
import pytest

import kernelgen
from kernelgen import settings
from kernelgen.runtime import batch_fallback
from harness import conv_tensors, poisoned, reference

KW = dict(stride=2, padding=1)
W_SHAPE = (4, 3, 3, 5)
OPS = {"fwd": lambda x, w, dy, **k: kernelgen.conv(x, w, **KW, **k),
       "bwd_data": lambda x, w, dy, **k: kernelgen.conv_backward_data(dy, w, x.shape, **KW, **k),
       "bwd_weight": lambda x, w, dy, **k: kernelgen.conv_backward_weight(x, dy, W_SHAPE, **KW, **k)}


class _Compiling:
    """A background compile that has not finished."""
    def done(self):
        return False


class Fallback(list):
    """The background compiles started (their plans), and the batch sizes that ran on a larger batch's kernel."""
    borrowed: list


@pytest.fixture
def fallback(monkeypatch):
    """The fallback as on a GPU where nothing is compiled yet: the background compiles it starts, recorded, and
    each run on a larger batch's kernel that completed (a failing one would be hidden by the call's own run)."""
    started = Fallback()
    started.borrowed = []
    run_on_larger_batch = batch_fallback.run_on_larger_batch

    def spy(prep, *args, **kwargs):
        result = run_on_larger_batch(prep, *args, **kwargs)
        started.borrowed.append(prep.problem.N)
        return result
    monkeypatch.setattr(batch_fallback, "_RAN", {})
    monkeypatch.setattr(batch_fallback, "_PENDING", {})
    monkeypatch.setattr(batch_fallback, "_needs_compile", lambda plan: True)
    monkeypatch.setattr(batch_fallback, "compile_in_background", lambda plan: started.append(plan) or _Compiling())
    monkeypatch.setattr(batch_fallback, "run_on_larger_batch", spy)
    return started


def _on_device(n, rng):
    from numba import cuda
    host = conv_tensors(rng, (n, 9, 8, 5), W_SHAPE, KW)
    return host, [cuda.to_device(a) for a in host]


@pytest.mark.sim
@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_weight"])
def test_a_smaller_batch_runs_on_the_larger_batch_s_kernel(fallback, rng, direction):
    _, big = _on_device(3, rng)
    OPS[direction](*big)
    assert fallback == []  # nothing larger had run: the call ran its own kernel
    for _ in range(2):  # (no route is kept while the fallback is taken: the second call takes it again)
        host, dev = _on_device(2, rng)
        got = OPS[direction](*dev).copy_to_host()
        want = reference(direction, *host, KW)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert [p.problem.N for p in fallback] == [2]  # its own kernel: one background compile
    assert fallback[0].problem.direction == direction and fallback.borrowed == [2, 2]


@pytest.mark.sim
def test_out_bias_and_deconv_take_the_fallback_too(fallback, rng):
    from numba import cuda
    (_, w, _), (dx3, dw, _) = _on_device(3, rng)
    bias = rng.standard_normal(4).astype(np.float32)
    wt = rng.standard_normal((4, 3, 3, 6)).astype(np.float32)  # deconv's w: (C_in, R, S, C_out)
    kernelgen.conv(dx3, dw, cuda.to_device(bias), **KW)
    kernelgen.deconv(cuda.to_device(rng.standard_normal((3, 5, 4, 4)).astype(np.float32)), cuda.to_device(wt), **KW)
    (x, _, _), (dx, _, _) = _on_device(2, rng)
    out = cuda.to_device(poisoned((2, 5, 4, 4)))
    assert kernelgen.conv(dx, dw, cuda.to_device(bias), out=out, **KW) is out
    want = reference("fwd", x, w, None, KW, bias)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    xt = rng.standard_normal((2, 5, 4, 4)).astype(np.float32)
    got = kernelgen.deconv(cuda.to_device(xt), cuda.to_device(wt), **KW).copy_to_host()
    want = kernelgen.deconv(xt, wt, **KW, backend="cpu")
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert [p.problem.N for p in fallback] == [2, 2] and fallback.borrowed == [2, 2]


@pytest.mark.sim
def test_the_setting_a_larger_batch_and_device_arrays_are_needed(fallback, rng):
    host3, dev3 = _on_device(3, rng)
    kernelgen.conv(*dev3[:2], **KW)
    host2, dev2 = _on_device(2, rng)
    with settings.scope(batch_fallback=False):
        kernelgen.conv(*dev2[:2], **KW)
    kernelgen.conv(*host2[:2], **KW)  # host arrays: no fallback
    _, dev4 = _on_device(4, rng)
    kernelgen.conv(*dev4[:2], **KW)  # larger than anything that ran
    assert fallback == [] and fallback.borrowed == []


@pytest.mark.sim
def test_the_simulator_and_a_finished_compile_end_the_fallback(monkeypatch):
    """Unpatched: the simulator compiles nothing, so nothing waits; a finished background compile (or a
    failed one: the call then compiles and raises for itself) ends the fallback; otherwise the disk decides."""
    class Done:
        def done(self):
            return True
    plan = kernelgen.api.make_plan(kernelgen.problem.make_problem("fwd", (2, 6, 6, 3), (4, 3, 3, 3)), "cuda")
    assert batch_fallback._needs_compile(plan) is False  # the simulator
    monkeypatch.setattr(batch_fallback.settings, "get",
                        lambda name, _get=settings.get: False if name == "cuda_simulator" else _get(name))
    digest = batch_fallback.key_digest(plan.key())
    monkeypatch.setattr(batch_fallback, "_PENDING", {digest: _Compiling()})
    assert batch_fallback._needs_compile(plan) is True
    batch_fallback._PENDING[digest] = Done()
    assert batch_fallback._needs_compile(plan) is False
    batch_fallback._PENDING.clear()
    monkeypatch.setattr(batch_fallback.KERNELS, "compiled_on_disk", lambda d: d == digest)
    assert batch_fallback._needs_compile(plan) is False
    monkeypatch.setattr(batch_fallback.KERNELS, "compiled_on_disk", lambda d: False)
    assert batch_fallback._needs_compile(plan) is True


@pytest.mark.sim
def test_a_failing_fallback_leaves_the_call_to_its_own_kernel(fallback, monkeypatch, rng):
    """The fallback is a head start: where it fails, the call runs as it would without it (and keeps its route)."""
    def broken(*args, **kwargs):
        raise RuntimeError("no fallback")
    monkeypatch.setattr(batch_fallback, "run_on_larger_batch", broken)
    _, big = _on_device(3, rng)
    OPS["fwd"](*big)
    host, dev = _on_device(2, rng)
    want = reference("fwd", *host, KW)
    np.testing.assert_allclose(OPS["fwd"](*dev).copy_to_host(), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.gpu
def test_on_the_gpu_a_smaller_batch_borrows_a_larger_batch_s_kernel(fallback, rng):
    """The fallback's copies and fills through the driver (the simulator copies through numba), every direction."""
    for direction in ("fwd", "bwd_data", "bwd_weight"):
        OPS[direction](*_on_device(3, rng)[1])
        host, dev = _on_device(2, rng)
        got = OPS[direction](*dev).copy_to_host()
        want = reference(direction, *host, KW)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert fallback.borrowed == [2, 2, 2] and [p.problem.direction for p in fallback] == list(OPS)


ALIGNED = dict(stride=1, padding=1)  # 8x8 maps: 64 rows an image, whole blocks of the planner's tiles here
ALIGNED_OPS = {"fwd": lambda x, w, dy: kernelgen.conv(x, w, **ALIGNED),
               "bwd_data": lambda x, w, dy: kernelgen.conv_backward_data(dy, w, x.shape, **ALIGNED),
               "bwd_weight": lambda x, w, dy: kernelgen.conv_backward_weight(x, dy, W_SHAPE, **ALIGNED)}


@pytest.mark.sim
@pytest.mark.parametrize("direction", list(ALIGNED_OPS))
def test_a_batch_that_fills_whole_blocks_adopts_the_larger_batch_s_kernel(fallback, rng, direction):
    """Nothing compiles and nothing is copied: the larger batch's kernel on fewer blocks is the call's from then on
    (its route kept), and the next smaller batch adopts it in turn."""
    from numba import cuda
    def run(n):
        host = conv_tensors(rng, (n, 8, 8, 5), W_SHAPE, ALIGNED)
        got = ALIGNED_OPS[direction](*[cuda.to_device(a) for a in host]).copy_to_host()
        want = reference(direction, *host, ALIGNED)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    run(4)
    (ran,) = batch_fallback._RAN.values()
    assert ran[4].launcher.on_images(2)[1] == 2, "the planner's tile no longer fills whole blocks at 2 images"
    for n in (2, 2, 1):
        run(n)
    assert fallback == [] and fallback.borrowed == []
    assert sorted(ran) == [1, 2, 4] and ran[1].launcher.kernel is ran[2].launcher.kernel is ran[4].launcher.kernel
    axis = ran[4].launcher.batch_grid[0]
    assert ran[1].launcher.grid[axis] < ran[2].launcher.grid[axis] < ran[4].launcher.grid[axis]


@pytest.mark.sim
def test_a_batch_that_does_not_fill_whole_blocks_is_extended_only_to_the_images_they_read(fallback, monkeypatch,
                                                                                        rng):
    """5x5 maps at 25 rows an image, 32 a block: 1 image of a batch of 4 runs 1 block, which reads 2 images."""
    extended_to = []
    zero_extended = batch_fallback._zero_extended
    monkeypatch.setattr(batch_fallback, "_zero_extended",
                        lambda a, name, batch, nstream: extended_to.append(batch) or zero_extended(a, name, batch,
                                                                                                 nstream))
    from numba import cuda
    shapes = [conv_tensors(rng, (n, 5, 5, 5), W_SHAPE, ALIGNED) for n in (4, 1)]
    kernelgen.conv(*[cuda.to_device(a) for a in shapes[0][:2]], **ALIGNED)
    (ran,) = batch_fallback._RAN.values()
    assert ran[4].launcher.on_images(1)[1] == 2, "the planner's tile is no longer 32 rows here"
    got = kernelgen.conv(*[cuda.to_device(a) for a in shapes[1][:2]], **ALIGNED).copy_to_host()
    want = reference("fwd", *shapes[1], ALIGNED)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert extended_to == [2] and fallback.borrowed == [1] and [p.problem.N for p in fallback] == [1]


@pytest.mark.sim
def test_a_borrow_that_reads_few_extra_images_is_kept_and_nothing_compiles(fallback, monkeypatch, rng):
    """Where the fewer blocks read at most KEEP_PADDED more images than the call's (here 2 for 1, so the share is
    raised to allow it), the call stays on the larger batch's kernel: no background compile, every call borrowed
    and right."""
    monkeypatch.setattr(batch_fallback, "KEEP_PADDED", 1.0)
    kernelgen.api.clear_caches()  # (an earlier test's calls of these shapes keep routes that skip the fallback)
    from numba import cuda
    big = conv_tensors(rng, (4, 5, 5, 5), W_SHAPE, ALIGNED)
    kernelgen.conv(*[cuda.to_device(a) for a in big[:2]], **ALIGNED)
    (ran,) = batch_fallback._RAN.values()
    assert ran[4].launcher.on_images(1)[1] == 2, "the planner's tile is no longer 32 rows here"
    for _ in range(3):
        host = conv_tensors(rng, (1, 5, 5, 5), W_SHAPE, ALIGNED)
        got = kernelgen.conv(*[cuda.to_device(a) for a in host[:2]], **ALIGNED).copy_to_host()
        want = reference("fwd", *host, ALIGNED)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    assert fallback == [] and fallback.borrowed == [1, 1, 1]


@pytest.mark.gpu
def test_on_the_gpu_a_smaller_batch_runs_the_larger_kernel_s_fewer_blocks(fallback, rng):
    """The larger kernel on fewer blocks through the prepacked launch (a route's second call), every direction:
    adopted where the images fill whole blocks of the tile the GPU's planner picks, else borrowed, extended only to
    the images those blocks read."""
    from numba import cuda
    for direction, op in ALIGNED_OPS.items():
        batch_fallback._RAN.clear()
        op(*[cuda.to_device(a) for a in conv_tensors(rng, (8, 8, 8, 5), W_SHAPE, ALIGNED)])
        (ran,) = batch_fallback._RAN.values()
        fewer, before = ran[8].launcher.on_images(4), len(fallback.borrowed)
        for _ in range(2):
            host = conv_tensors(rng, (4, 8, 8, 5), W_SHAPE, ALIGNED)
            got = op(*[cuda.to_device(a) for a in host]).copy_to_host()
            want = reference(direction, *host, ALIGNED)
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        adopted = fewer is not None and fewer[1] == 4
        assert fallback.borrowed[before:] == ([] if adopted else [4, 4]), direction
