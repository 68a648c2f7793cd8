"""kernelgen.nn's device path in numba's CUDA simulator (marker `sim`): every device op, forward and
backward, against the NumPy path run in float64 on the same fresh random data; the optimiser updates;
moving models; one training step of a small ResNet against the CPU path.  Shapes are tiny: the simulator
runs one Python thread per CUDA thread.  Host references that convolve use backend="cuda" on host data
(the same simulated kernels): compiling kernelgen's CPU kernels would take minutes, and the convolution
kernels themselves are checked in test_conv_sim.py - here it is everything around them."""
import threading

import numpy as np
import pytest

from kernelgen.nn import (
    SGD,
    Adam,
    BasicBlock,
    BatchNorm2d,
    Conv2d,
    Linear,
    Module,
    ReLU,
    Sequential,
    Tensor,
)
from kernelgen.nn import functional as F
from harness import rel_err

pytestmark = pytest.mark.sim
TOL = 2e-5  # float32 device results against float64 host ones, relative to the largest reference value


def compare(op, arrays, rng, tol=TOL, host_dtype=np.float64):
    """op(tensors, device) on host float64 tensors and on device float32 ones; forward values and every
    input's gradient (of sum(output * a random projection)) must agree."""
    from kernelgen.nn import cuda_ops
    host = [Tensor(a.astype(host_dtype), requires_grad=True) for a in arrays]
    y = op(host, "cpu")
    proj = rng.standard_normal(y.shape)
    y.backward(proj if y.shape else None)
    dev = [Tensor(a.astype(np.float32), requires_grad=True).cuda() for a in arrays]
    yd = op(dev, "cuda")
    assert yd.is_cuda and yd.shape == y.shape and yd.dtype == np.float32
    yd.backward(cuda_ops.to_device(proj.astype(np.float32)) if y.shape else None)
    assert rel_err(yd.numpy(), y.data) <= tol, ("forward", rel_err(yd.numpy(), y.data))
    for i, (h, d) in enumerate(zip(host, dev)):
        assert d.grad is not None and d.grad.dtype == np.float32, f"input {i}: no float32 device gradient"
        err = rel_err(d.grad.copy_to_host(), h.grad)
        assert err <= tol, f"gradient of input {i}: relative error {err:.3g}"


def test_elementwise_ops_and_gradient_accumulation(rng):
    # 135 elements: the simulator's blocks of 32 threads take 128, 4 a thread, and the second block the last 7
    a, b = rng.standard_normal((3, 3, 5, 3)), rng.standard_normal((3, 3, 5, 3))
    compare(lambda t, _: F.relu(t[0]), [a], rng)
    # `a` feeds two ops: its device gradient is accumulated from both
    compare(lambda t, _: F.add_relu(F.add(t[0], t[1]), t[0]), [a, b], rng)


@pytest.mark.parametrize("training,relu", [(True, False), (True, True), (False, False), (False, True)])
def test_batch_norm(training, relu, rng):
    c = 3  # 135 elements: a full block (4 a thread, 32 apart: channels 2 on), and a block of 7
    x = 2 + 3 * rng.standard_normal((3, 3, 5, c))
    rm, rv = rng.standard_normal(c), 0.5 + rng.random(c)
    stats = {}

    def op(t, device):
        m, v = (rm.copy(), rv.copy()) if device == "cpu" else (rm.astype(np.float32), rv.astype(np.float32))
        if device == "cuda":
            m, v = Tensor(m).cuda().data, Tensor(v).cuda().data
        stats[device] = (m, v)
        fn = F.batch_norm_relu if relu else F.batch_norm
        return fn(t[0], t[1], t[2], m, v, training=training, momentum=0.3)
    compare(op, [x, 1 + rng.random(c), rng.standard_normal(c)], rng)
    for host, dev in zip(stats["cpu"], stats["cuda"]):  # running statistics, updated in place
        assert rel_err(dev.copy_to_host(), host) <= TOL


@pytest.mark.parametrize("inplace", [False, True])
def test_batch_norm_add_relu(inplace, rng):
    c = 3  # 135 elements, as test_batch_norm
    x, r = rng.standard_normal((3, 3, 5, c)), rng.standard_normal((3, 3, 5, c))

    def op(t, device):
        m, v = np.zeros(c, t[0].dtype), np.ones(c, t[0].dtype)
        if device == "cuda":
            m, v = Tensor(m).cuda().data, Tensor(v).cuda().data
        res = F.add(t[3], t[3]) if inplace else t[3]  # in place only into an intermediate, as BasicBlock does
        return F.batch_norm_add_relu(t[0], t[1], t[2], m, v, res, training=True, inplace=inplace)
    compare(op, [x, 1 + rng.random(c), rng.standard_normal(c), r], rng)


def test_float16_arrays_get_the_float32_arithmetic_rounded_once(rng):
    """The element-wise and batch-norm kernels on float16 arrays (fp16 training's activations; 4 consecutive elements
    a thread, where float32 arrays take 4 elements BLOCK apart) compute as on float32 arrays of the same values and
    round once: bit for bit float16(the float32 result).  135 elements: 33 full threads and a tail of 3."""
    from kernelgen.nn import cuda_ops as ops
    c = 3
    x, r, g = (rng.standard_normal((3, 3, 5, c)).astype(np.float16) for _ in range(3))
    w, b = (1 + rng.random(c)).astype(np.float32), rng.standard_normal(c).astype(np.float32)

    def run(dtype):
        dev = [ops.to_device(a.astype(np.float32)) for a in (x, r, g)]
        dx_, dr, dg = dev if dtype == np.float32 else [ops.cast(a, np.float16) for a in dev]
        m, v = ops.to_device(np.zeros(c, np.float32)), ops.to_device(np.ones(c, np.float32))
        y, mean, inv_std = ops.batch_norm_forward(dx_, ops.to_device(w), ops.to_device(b), m, v, True, 0.1, 1e-5,
                                                  True, dr)
        mask = ops.to_device(ops.to_host(y).astype(np.float16).astype(np.float32))  # the float16 run's ReLU mask
        mask = mask if dtype == np.float32 else ops.cast(mask, np.float16)
        dx, dw, db = ops.batch_norm_backward(dg, dx_, mask, True, ops.to_device(w), mean, inv_std, True)
        return [ops.to_host(a) for a in (y, dx, ops.add(dg, dr, relu=True), ops.relu_backward(dg, dr))]
    for name, want, got in zip(("y", "dx", "add_relu", "relu_backward"), run(np.float32), run(np.float16)):
        assert got.dtype == np.float16, name
        np.testing.assert_array_equal(got, want.astype(np.float16), err_msg=name)


def test_batch_norm_statistics_stay_accurate_with_a_large_mean(rng):
    # the CPU test's case: 1000 + N(0, 1) in float32; the device sums in float64 around a shift
    x = (1000 + rng.standard_normal((4, 4, 4, 2))).astype(np.float32)
    m, v = Tensor(np.zeros(2, np.float32)).cuda().data, Tensor(np.ones(2, np.float32)).cuda().data
    F.batch_norm(Tensor(x).cuda(), Tensor(np.ones(2, np.float32)).cuda(), Tensor(np.zeros(2, np.float32)).cuda(),
                 m, v, training=True, momentum=1.0)
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(m.copy_to_host(), x64.mean(axis=(0, 1, 2)), rtol=2e-7)
    np.testing.assert_allclose(v.copy_to_host(), x64.var(axis=(0, 1, 2), ddof=1), rtol=1e-5)


def test_pool_linear_loss(rng):
    compare(lambda t, _: F.global_avg_pool(t[0]), [rng.standard_normal((2, 2, 3, 3))], rng)
    compare(lambda t, _: F.linear(t[0], t[1], t[2]), [rng.standard_normal((3, 5)), rng.standard_normal((4, 5)),
                                                      rng.standard_normal(4)], rng)
    labels = rng.integers(0, 4, 3)
    compare(lambda t, _: F.cross_entropy(t[0], labels), [3 * rng.standard_normal((3, 4))], rng)


def test_conv_with_bias_and_flatten(rng):
    # the bias: the convolution's epilogue on the device, a NumPy add on the host; its gradient a channel sum
    compare(lambda t, _: F.flatten(F.conv2d(t[0], t[1], t[2], stride=2, padding=1, backend="cuda")),
            [rng.standard_normal((2, 3, 3, 2)), rng.standard_normal((3, 3, 3, 2)), rng.standard_normal(3)], rng,
            host_dtype=np.float32)


def test_conv_relu_fused_on_the_device(rng):
    # bias + relu in the convolution's epilogue on the device, a NumPy bias add and maximum on the host
    compare(lambda t, _: F.flatten(F.conv2d(t[0], t[1], t[2], padding=1, activation="relu", backend="cuda")),
            [rng.standard_normal((2, 3, 3, 2)), rng.standard_normal((3, 3, 3, 2)), rng.standard_normal(3)], rng,
            host_dtype=np.float32)


def test_conv1d_and_conv_transpose_on_the_device(rng):
    compare(lambda t, _: F.conv1d(t[0], t[1], t[2], stride=2, padding=1, backend="cuda"),
            [rng.standard_normal((2, 5, 2)), rng.standard_normal((3, 3, 2)), rng.standard_normal(3)], rng,
            host_dtype=np.float32)
    compare(lambda t, _: F.conv_transpose2d(t[0], t[1], t[2], stride=2, padding=1, output_padding=1, backend="cuda"),
            [rng.standard_normal((1, 2, 2, 2)), rng.standard_normal((2, 3, 3, 3)), rng.standard_normal(3)], rng,
            host_dtype=np.float32)


@pytest.mark.parametrize("make", [lambda p: SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
                                  lambda p: Adam(p, lr=0.01, weight_decay=0.1),
                                  lambda p: Adam(p, lr=0.01, weight_decay=0.1, decoupled=True)],
                         ids=["sgd", "adam", "adamw"])
def test_optimizer_updates_match_the_host(make, rng):
    # 11 parameters of assorted sizes: SGD updates them 8 a launch (a full group, and one of 3 padded with empty slots)
    sizes = (6, 1, 40, 3, 7, 64, 2, 5, 33, 9, 4)
    p0 = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    host = [Tensor(p.copy(), requires_grad=True) for p in p0]
    dev = [Tensor(p.copy(), requires_grad=True).cuda() for p in p0]
    opt_h, opt_d = make(host), make(dev)
    for _ in range(3):
        for h, d in zip(host, dev):
            g = rng.standard_normal(h.shape).astype(np.float32)
            h.grad, d.grad = g.copy(), Tensor(g).cuda().data
        opt_h.step()
        opt_d.step()
    for i, (h, d) in enumerate(zip(host, dev)):
        assert rel_err(d.numpy(), h.data.astype(np.float64)) <= 1e-6, f"parameter {i}"


def test_module_to_moves_parameters_and_buffers_in_place(rng):
    bn = BatchNorm2d(3)
    weight = bn.weight
    state = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in bn.state_dict().items()}
    bn.load_state_dict(state)
    assert bn.to("cuda") is bn and bn.weight is weight and weight.is_cuda and not isinstance(bn.running_var, np.ndarray)
    for k, v in bn.state_dict().items():
        np.testing.assert_array_equal(v, state[k])
    bn.load_state_dict({k: 2 * v for k, v in state.items()})  # written into the device arrays
    np.testing.assert_array_equal(bn.cpu().running_mean, 2 * state["running_mean"])
    assert isinstance(bn.weight.data, np.ndarray)
    with pytest.raises(ValueError, match="device"):
        bn.to("gpu")


def test_device_errors_name_the_problem(rng):
    x = Tensor(rng.standard_normal((2, 3)).astype(np.float32)).cuda()
    with pytest.raises(TypeError, match="same device"):
        F.add(x, Tensor(np.ones((2, 3), np.float32)))
    with pytest.raises(ValueError, match="channels-last"):
        F.max_pool2d(x, 2)  # a 2-D x: geometry is checked before any kernel runs
    with pytest.raises(ValueError, match="labels"):
        F.cross_entropy(x, np.array([0, 3]))
    with pytest.raises(ValueError, match="shape"):
        F.add(x, Tensor(np.ones((3, 2), np.float32)).cuda())
    layer = Linear(3, 2)
    opt = SGD(layer.parameters(), lr=0.1)
    layer.to("cuda")
    layer.weight.grad = layer.bias.grad = None
    opt.step()  # no gradients: nothing to update
    layer.weight.grad = Tensor(np.ones((2, 3), np.float32)).cuda().data
    with pytest.raises(TypeError, match="after model.to"):
        opt.step()
    with pytest.raises(TypeError, match="float32"):
        Tensor(np.ones(3)).cuda()  # float64: kernelgen's CUDA kernels are float32-only


class TinyResNet(Module):
    """Stem (conv, batch norm + ReLU fused by Sequential), two residual blocks (batch norm + ReLU, add + ReLU,
    projection batch norm + add + ReLU fused), global pool, linear: each kind of op a ResNet-18 step runs."""

    def __init__(self, classes=3, width=2, seed=0):
        rng = np.random.default_rng(seed)
        self.stem = Sequential(Conv2d(1, width, 3, padding=1, bias=False, rng=rng, backend="cuda"),
                               BatchNorm2d(width), ReLU())
        self.block = BasicBlock(width, width, 1, rng, "cuda")
        self.down = BasicBlock(width, 2 * width, 2, rng, "cuda")
        self.head = Linear(2 * width, classes, rng=rng)

    def forward(self, x):
        return self.head(F.global_avg_pool(self.down(self.block(self.stem(x)))))


def test_resnet_training_step_matches_the_host(rng):
    x = rng.random((2, 4, 4, 1)).astype(np.float32)
    labels = rng.integers(0, 3, 2)
    losses, params, grads = {}, {}, {}
    for device in ("cpu", "cuda"):
        model = TinyResNet(seed=1).to(device)
        opt = SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        loss = F.cross_entropy(model(Tensor(x).to(device)), labels)
        opt.zero_grad()
        loss.backward()
        grads[device] = [Tensor(p.grad).numpy() for p in model.parameters()]
        opt.step()
        losses[device], params[device] = loss.item(), model.state_dict()
    assert abs(losses["cuda"] - losses["cpu"]) <= 1e-5 * abs(losses["cpu"]), losses
    # Two float32 summation orders: a gradient that is a small sum of larger, cancelling terms (a conv weight just
    # before a batch norm, on 2 images) differs by ~1e-7 absolute, 2.8e-4 of its own largest value for one seed
    # (9620050595337640951, identical with and without the CUDA renderer's fresh names); a wrong kernel is O(1) off.
    for i, (d, h) in enumerate(zip(grads["cuda"], grads["cpu"])):
        assert rel_err(d, h.astype(np.float64)) <= 1e-3, f"gradient of parameter {i}"
    for k, v in params["cpu"].items():  # weights after the update, running statistics
        assert rel_err(params["cuda"][k], v.astype(np.float64)) <= 1e-4, k


def test_fast_launch_packs_numba_array_and_scalar_arguments(monkeypatch):
    """The cuLaunchKernel route packs what numba's dispatcher would: per 1D array (meminfo, parent, size,
    itemsize, data, shape, stride), int64 and float64 scalars as one 8-byte word each."""
    import ctypes
    import struct

    from kernelgen.nn import cuda_launch

    class FakeArray:  # numba's DeviceNDArray as the route reads it: its memory's address, size and dtype
        def __init__(self, ptr, size, dtype):
            self.gpu_data = type("Memory", (), {"device_pointer_value": ptr})()
            self.size, self.dtype = size, np.dtype(dtype)

    calls = []

    class FakeLib:
        @staticmethod
        def cuLaunchKernel(handle, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            calls.append((handle, (gx, gy, gz), (bx, by, bz), [ctypes.c_int64.from_address(params[i]).value
                                                               for i in range(len(params))]))
            return 0
    monkeypatch.setattr(cuda_launch, "_LIB", FakeLib)
    k = cuda_launch.kernel(lambda a, n, v, b: None)
    args = (FakeArray(0x1000, 7, "float32"), 5, 0.25, FakeArray(0x2000, 3, "int64"))
    n_words = 7 + 1 + 1 + 7
    words = (ctypes.c_int64 * n_words)()
    params = (ctypes.c_void_p * n_words)(*[ctypes.addressof(words) + 8 * i for i in range(n_words)])
    fast = (None, words, params, 1234)
    k._launch(fast, (3, 2), 32, args)
    handle, grid, block, packed = calls[0]
    assert handle == 1234 and grid == (3, 2, 1) and block == (32, 1, 1)
    assert packed == [0, 0, 7, 4, 0x1000, 7, 4, 5, struct.unpack("q", struct.pack("d", 0.25))[0],
                      0, 0, 3, 8, 0x2000, 3, 8]


_VIEW_ADDRESS = """
import ctypes
import numpy as np
from numba.cuda.cudadrv import devicearray, driver
from kernelgen.nn import cuda_launch
packed = []
class FakeLib:
    @staticmethod
    def cuLaunchKernel(handle, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        packed.append([ctypes.c_int64.from_address(params[i]).value for i in range(7)])
        return 0
cuda_launch._LIB = FakeLib
memory = driver.MemoryPointer(None, ctypes.c_void_p(0x10000), 4096).view(256)
a = devicearray.DeviceNDArray((8, 4), (16, 4), np.dtype(np.float32), gpu_data=memory)
words = (ctypes.c_int64 * 7)()
params = (ctypes.c_void_p * 7)(*[ctypes.addressof(words) + 8 * i for i in range(7)])
cuda_launch._Kernel._launch((None, words, params, 1), 1, 32, (a,))
print(packed[0][2:5], a.device_ctypes_pointer.value)
"""


def test_fast_launch_packs_the_address_numba_reports_for_an_array_view():
    """A real numba DeviceNDArray on a view of its memory (256 bytes in): the route packs the address numba's own
    device_ctypes_pointer gives.  In a process of its own, outside the simulator (no GPU needed: a MemoryPointer
    without a context)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", _VIEW_ADDRESS], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == f"[32, 4, {0x10100}] {0x10100}", out.stdout


def test_fast_launch_keeps_one_route_per_array_dtype(monkeypatch):
    """A float16 array needs its own compiled overload: the route a float32 call prepared is not taken by a
    float16 call with the same Python types (which goes to numba's dispatcher, then gets a route of its own)."""
    from kernelgen.nn import cuda_launch

    k = cuda_launch.kernel(lambda a, n: None)
    dispatched, prepared = [], []
    monkeypatch.setattr(cuda_launch, "SIM", False)
    monkeypatch.setattr(cuda_launch, "configure", lambda jit, grid, block, stream=0: lambda *a: dispatched.append(a))
    monkeypatch.setattr(k, "_prepare", lambda jit, key, args, flat: prepared.append((jit, key)) or k.fast.update(
        {key: (threading.get_ident(), None, None, 0)}))
    monkeypatch.setattr(k, "_launch", staticmethod(lambda fast, grid, block, args, stream=0: ("fast", args[0].dtype)))

    class Flat:
        ndim, size = 1, 4

        def __init__(self, dtype):
            self.dtype = np.dtype(dtype)
    f32, f16 = Flat("float32"), Flat("float16")
    assert k(1, 32, f32, 4) is None and len(dispatched) == 1          # compiled, route prepared
    assert k(1, 32, f32, 4) == ("fast", np.float32)                   # the float32 route
    assert k(1, 32, f16, 4) is None and len(dispatched) == 2          # not the float32 route: dispatched
    assert k(1, 32, f16, 4) == ("fast", np.float16)
    # the float16 signature on its own dispatcher (numba cannot cache a kernel that links its fp16 library)
    assert [jit for jit, _ in prepared] == [k.jit, k.jit_half] and prepared[0][1] != prepared[1][1]


def test_bench_step_reports_ratios(monkeypatch, tmp_path, capsys):
    """The benchmark's table and JSON from (stubbed) measurements: the ratios are kernelgen over torch."""
    import json
    import sys
    import types

    from kernelgen.nn import bench_step
    fake = dict(step_ms=12.0, step_ms_min=11.0, warmup_s=40.0, peak_bytes=900 * 2 ** 20, between_steps_bytes=1,
                pool_cached_bytes=2, driver_used_bytes=3, loss_first=2.3, loss_last=2.1)
    monkeypatch.setattr(bench_step, "bench_kernelgen", lambda x, labels, args: dict(fake))
    monkeypatch.setattr(bench_step, "bench_torch", lambda x, labels, args: dict(fake, step_ms=10.0,
                                                                                 peak_bytes=1000 * 2 ** 20))
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    bench_step.main(["--out", str(tmp_path / "r.json"), "--steps", "3"])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["ratio"] == {"step_time": 1.2, "peak_memory": 0.9} and result["steps"] == 3
    assert "step time 1.20x" in capsys.readouterr().out
    with pytest.raises(ValueError, match="steps"):
        bench_step.main(["--steps", "0"])


def test_bench_step_rounds_alternate_the_sides_and_keep_each_one_s_best_round(monkeypatch, tmp_path):
    """--rounds: both sides prepared, then timed in turn each round (kernelgen, torch, kernelgen, torch, ...), and
    each reports its round with the lowest median, not its last; --rounds with --cold is refused."""
    import json
    import sys
    import types

    from kernelgen.nn import bench_step
    order, clock = [], {"kernelgen": iter([3.0, 1.0, 2.0]), "torch": iter([2.0, 2.5, 1.5])}

    def side(name):
        def step():
            order.append(name)
        return bench_step.Side(step, lambda: None, 0.5, lambda times: dict(
            step_ms=1e3 * sorted(times)[len(times) // 2], step_ms_min=1e3 * min(times), warmup_s=0.5,
            peak_bytes=1, between_steps_bytes=1, pool_cached_bytes=1, driver_used_bytes=1, loss_first=1.0,
            loss_last=1.0))
    monkeypatch.setattr(bench_step, "prepare_kernelgen", lambda x, labels, args: side("kernelgen"))
    monkeypatch.setattr(bench_step, "prepare_torch", lambda x, labels, args: side("torch"))

    def median_step(step, warmup, steps, sync):  # each round's steps all take that round's time for the side
        step()
        return 0.0, [next(clock[order[-1]])] * steps
    monkeypatch.setattr(bench_step, "median_step", median_step)
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    bench_step.main(["--out", str(tmp_path / "r.json"), "--steps", "2", "--rounds", "3"])
    result = json.loads((tmp_path / "r.json").read_text())
    assert order == ["kernelgen", "torch"] * 3
    assert result["kernelgen"]["step_ms"] == 1000.0 and result["torch"]["step_ms"] == 1500.0
    assert result["kernelgen"]["rounds"] == 3 and result["rounds"] == 3
    with pytest.raises(ValueError, match="rounds"):
        bench_step.main(["--rounds", "2", "--cold"])


def test_bench_step_kernel_kinds_name_kernelgen_s_convolutions_by_direction():
    from kernelgen.nn.bench_reports import _kernel_kind
    assert _kernel_kind("kernelgen_cache::kg_0::conv_bwd_weight_fp16[abi:v1]") == "conv bwd_weight"
    assert _kernel_kind("kernelgen_cache::kg_1::winograd_bwd_data_a8_s3[abi:v1]") == "conv bwd_data"
    assert _kernel_kind("kernelgen_cache::kg_2::winograd_fwd_a4_s3[abi:v1]") == "conv fwd"
    assert _kernel_kind("kernelgen::nn::cuda_ops::_bn_dx_k[abi:v14]") == "nn ops"
    assert _kernel_kind("sm90_xmma_wgrad_indexed_implicit_gemm_f16f16") == "other"


def test_bench_step_cold_profiles_kernelgen_on_an_empty_cache(monkeypatch, tmp_path, capsys, rng):
    """--cold: kernelgen's run in a fresh cache directory (gone afterwards) under profile_compile, whose report is
    printed and recorded; the stubbed run compiles one CPU convolution there."""
    import json
    import os

    import kernelgen
    from kernelgen import settings
    from kernelgen.nn import bench_step
    seen = {}
    x, w = rng.standard_normal((1, 5, 5, 2)).astype(np.float32), rng.standard_normal((3, 3, 3, 2)).astype(np.float32)

    def run(x_, labels, args):
        seen["cache_dir"] = settings.get("cache_dir")
        kernelgen.conv(x, w, padding=1, backend="cpu")
        return dict(step_ms=1.0, step_ms_min=1.0, warmup_s=1.0, peak_bytes=1, between_steps_bytes=1,
                    pool_cached_bytes=1, driver_used_bytes=1, loss_first=1.0, loss_last=1.0)
    monkeypatch.setattr(bench_step, "bench_kernelgen", run)
    monkeypatch.setattr(bench_step, "bench_torch", None)
    bench_step.main(["--cold", "--no-torch", "--steps", "1", "--out", str(tmp_path / "r.json")])
    profile = json.loads((tmp_path / "r.json").read_text())["kernelgen"]["compile_profile"]
    (kernel, stages), = profile["kernels"].items()
    assert kernel.startswith("fwd_n1_c2_k3") and {"plan", "numba", "cache"} <= set(stages)
    assert seen["cache_dir"] != settings.get("cache_dir") and not os.path.exists(seen["cache_dir"])
    assert "compile profile: 1 kernels" in capsys.readouterr().out


def test_bench_step_new_batch_accounts_every_step_against_the_steady_one():
    """_new_batch_steps: the first step, the next 5, then steps for the given seconds; what the batch cost beyond
    its steady step is the sum over every step of (its time - the median of the last 5)."""
    from kernelgen.nn import bench_reports
    calls = []
    r = bench_reports._new_batch_steps(lambda: calls.append(1), 96, 0.05, lambda: None)
    steps = r["new_batch_steps_ms"]
    assert r["new_batch"] == 96 and len(steps) == len(calls) >= 6
    steady = r["new_batch_steady_step_ms"]
    assert abs(r["new_batch_extra_s"] - sum(t - steady for t in steps) / 1e3) < 1e-4 * len(steps)


def test_bench_step_new_batch_control_counts_the_window_against_the_control_s_mean_step(monkeypatch):
    """With a control window: the window's steps cost beyond as many steps at the control's mean.  On a clock that
    only the steps move (2 ms each for the first 8, 1 ms after), the first 8 cost 8 ms beyond the control."""
    import types
    from kernelgen.nn import bench_reports
    clock, calls = [0.0], []

    def step():
        calls.append(1)
        clock[0] += 0.002 if len(calls) <= 8 else 0.001
    monkeypatch.setattr(bench_reports, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    r = bench_reports._new_batch_steps(step, 96, 0.05, lambda: None, control_seconds=0.05)
    steps = r["new_batch_steps_ms"]
    assert len(steps) + r["new_batch_control_steps"] == len(calls)
    assert r["new_batch_control_steps"] == 50 and abs(r["new_batch_control_step_ms"] - 1.0) < 1e-9
    assert abs(r["new_batch_extra_vs_control_s"] - 0.008) < 1e-9


def _held_bytes(loss):
    """Bytes of the distinct buffers the graph under `loss` holds (a released tensor holds none)."""
    from kernelgen.nn.tensor import Recomputed
    buffers = {}
    for t in loss._graph():
        data = t._data if isinstance(t, Recomputed) else t.data
        if data is not None:
            memory = np.asarray(getattr(data, "_ary", data))  # (the simulator's device array wraps a NumPy one)
            buffers[memory.__array_interface__["data"][0]] = memory.nbytes
    return sum(buffers.values())


def _steps_with_and_without_recompute(make_model, rng, monkeypatch):
    """{nn_recompute: (loss, parameter gradients, bytes the graph holds after the forward pass)} for one step of a
    fresh make_model() on one fresh batch of 2 4x4 images (the convolutions the float64 reference: what is
    recomputed is the batch norms' and sums' work; test_resnet_training_step_matches_the_host runs the simulated
    convolution kernels with it)."""
    from kernelgen import settings
    _reference_convs(monkeypatch)
    x = rng.random((2, 4, 4, 1)).astype(np.float32)
    labels = rng.integers(0, 3, 2)
    runs = {}
    for recompute in (False, True):
        with settings.scope(nn_recompute=recompute):
            model = make_model().to("cuda")
            loss = F.cross_entropy(model(Tensor(x).to("cuda")), labels)
            held = _held_bytes(loss)
            loss.backward()
            runs[recompute] = (loss.item(), [p.grad.copy_to_host() for p in model.parameters()], held)
    return runs


class TinyBottleneckNet(Module):
    """Stem, two bottlenecks (one projected, strided), pool, linear: ResNet-50's block at width 1-2."""

    def __init__(self, classes=3, seed=0):
        from kernelgen.nn import Bottleneck
        rng = np.random.default_rng(seed)
        self.stem = Sequential(Conv2d(1, 4, 3, padding=1, bias=False, rng=rng, backend="cuda"), BatchNorm2d(4), ReLU())
        self.block = Bottleneck(4, 1, 1, rng, "cuda")
        self.down = Bottleneck(4, 2, 2, rng, "cuda")
        self.head = Linear(8, classes, rng=rng)

    def forward(self, x):
        return self.head(F.global_avg_pool(self.down(self.block(self.stem(x)))))


def test_recomputed_bottlenecks_give_the_same_step(rng, monkeypatch):
    """ResNet-50's block releases its batch norms' outputs and its input as the basic block does: the loss and every
    gradient are the same bits with and without settings.nn_recompute, and less is held between the passes."""
    runs = _steps_with_and_without_recompute(lambda: TinyBottleneckNet(seed=2), rng, monkeypatch)
    assert runs[True][0] == runs[False][0]
    for i, (a, b) in enumerate(zip(runs[True][1], runs[False][1])):
        assert np.array_equal(a, b), f"gradient of parameter {i}"
    assert runs[True][2] < runs[False][2], (runs[True][2], runs[False][2])


def test_recomputed_activations_give_the_same_step_holding_less(rng, monkeypatch):
    """settings.nn_recompute: a batch norm's output (its ReLU, its residual sum) is dropped once the forward pass
    has read it and computed again when the backward reads it - the same bits (the same pass on the same
    statistics), so the loss and every gradient are identical; between forward and backward the graph holds
    less (TinyResNet at width 2 on 4x4 images: the stem's output, the blocks' bn1 outputs, the first block's
    sum)."""
    runs = _steps_with_and_without_recompute(lambda: TinyResNet(seed=1), rng, monkeypatch)
    (loss_off, grads_off, held_off), (loss_on, grads_on, held_on) = runs[False], runs[True]
    assert loss_on == loss_off
    for i, (a, b) in enumerate(zip(grads_on, grads_off)):
        assert np.array_equal(a, b), f"gradient of parameter {i}"
    assert held_off - held_on == 4 * (3 * 2 * 4 * 4 * 2 + 2 * 2 * 2 * 4), (held_on, held_off)


def _reference_convs(monkeypatch):
    """kernelgen's three convolution calls replaced by the float64 reference on the host, the result in the
    inputs' dtype on the device: the simulator has no tensor-core stand-in (the kernels' fp16 paths are checked
    on the GPU and in tests/templates); here it is everything around them."""
    import kernelgen
    from kernelgen import reference as ref
    from kernelgen.nn import cuda_ops
    from kernelgen.runtime import arena

    def call(fn, a, b, *rest, kw, bias=None, activation=None):
        geometry = {k: kw[k] for k in ("stride", "padding", "dilation", "groups")}
        host = [cuda_ops.to_host(a).astype(np.float64), cuda_ops.to_host(b).astype(np.float64)]
        out = fn(*host, *rest, **geometry) if bias is None else fn(*host, cuda_ops.to_host(bias), **geometry)
        out = np.maximum(out, 0) if activation == "relu" else out
        return arena.to_device_staged(np.ascontiguousarray(out.astype(a.dtype)))
    monkeypatch.setattr(kernelgen, "conv", lambda x, w, bias=None, activation=None, **kw: call(
        ref.conv_forward, x, w, kw=kw, bias=bias, activation=activation))
    monkeypatch.setattr(kernelgen, "conv_backward_data", lambda g, w, shape, **kw: call(
        ref.conv_backward_data, g, w, shape, kw=kw))
    monkeypatch.setattr(kernelgen, "conv_backward_weight", lambda x, g, shape, **kw: call(
        ref.conv_backward_weight, x, g, shape, kw=kw))


def test_fp16_training_keeps_float16_activations_and_float32_gradients(rng, monkeypatch):
    """At fp16 precision (amp.autocast) the convolutions read and write float16 arrays (settings.nn_half_activations):
    every conv and batch-norm output of TinyResNet is float16 (the batch norms and sums run on float16 arrays), the
    logits and every parameter's gradient float32, and the loss and gradients agree with the same step on float32
    arrays (fp16 rounding of the activations apart: 10 bits).  The convolutions are the float64 reference here."""
    from kernelgen import settings
    from kernelgen.nn import amp
    _reference_convs(monkeypatch)
    # centred data: on [0, 1) images the stem's convolution output has a mean far above its spread, and its batch
    # norm's centring cancels most of fp16's 10 bits (up to 19 % of the largest gradient seen, on 2 seeds of 12);
    # centred, 24 seeds stayed under 0.6 %
    x = rng.standard_normal((2, 4, 4, 1)).astype(np.float32)
    labels = rng.integers(0, 3, 2)
    runs = {}
    for half in (False, True):
        with settings.scope(nn_half_activations=half), amp.autocast("fp16"):
            model = TinyResNet(seed=1).to("cuda")
            stem = model.stem(Tensor(x).to("cuda"))
            block = model.block(stem)
            logits = model.head(F.global_avg_pool(model.down(block)))
            loss = F.cross_entropy(logits, labels)
            loss.backward()
            runs[half] = (loss.item(), [p.grad.copy_to_host() for p in model.parameters()],
                          (stem.dtype, block.dtype, logits.dtype))
    assert runs[False][2] == (np.float32,) * 3
    assert runs[True][2] == (np.float16, np.float16, np.float32)
    assert abs(runs[True][0] - runs[False][0]) <= 1e-2 * abs(runs[False][0])
    assert all(g.dtype == np.float32 for g in runs[True][1])
    # against the largest gradient of all: a weight gradient just before a batch norm is a sum of terms that cancel
    # (its batch norm's backward makes it orthogonal to that weight), on 8 pixels a few of them: rounding the
    # activations and their gradients to 10 bits leaves up to ~20 % of such a small gradient (a wrong kernel
    # moves the large ones by O(1))
    got, want = (np.concatenate([g.ravel() for g in runs[h][1]]) for h in (True, False))
    assert rel_err(got, want.astype(np.float64)) <= 2e-2, rel_err(got, want)
