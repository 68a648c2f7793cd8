"""kernelgen.nn.graphs and nn's stream in the CUDA simulator (marker `sim`): a step run on a stream of its own and
in graph mode - as a captured step's warm-up and fallback run it - trains the weights the default-stream step
does; CapturedStep's arguments are checked before anything runs.  The capture itself needs a GPU:
test_graphs_gpu.py."""
import numpy as np
import pytest

from kernelgen.nn import BatchNorm2d, CapturedStep, Conv2d, GlobalAvgPool, Linear, ReLU, Sequential, Tensor

from graph_steps import trained, train_step

pytestmark = pytest.mark.sim


def _tiny():
    rng = np.random.default_rng(3)
    return Sequential(Conv2d(3, 4, 3, padding=1, rng=rng), BatchNorm2d(4), ReLU(), GlobalAvgPool(), Linear(4, 3, rng=rng))


def _batches(rng, n):
    return [(rng.standard_normal((2, 4, 4, 3)).astype(np.float32), rng.integers(0, 3, 2)) for _ in range(n)]


def test_a_step_on_its_own_stream_in_graph_mode_trains_as_the_default_stream_step(rng):
    batches = _batches(rng, 2)  # (a warm-up step on the first, a call on the second: the simulator is slow)
    want, want_loss, _ = trained(_tiny, batches, captured=False, warmup=1)
    got, got_loss, runner = trained(_tiny, batches, captured=True, warmup=1)
    assert not runner.captured and "simulator" in runner.reason
    assert got_loss == want_loss
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_captured_step_arguments_are_checked(rng):
    from kernelgen.nn import SGD, amp, cuda_ops
    model = _tiny().to("cuda")
    step = train_step(model, SGD(model.parameters()), amp.GradScaler(), False)
    x, y = Tensor(cuda_ops.to_device(np.zeros((2, 4, 4, 3), np.float32))), cuda_ops.to_device(np.zeros(2, np.int64))
    with pytest.raises(TypeError, match="fn"):
        CapturedStep(None, x, y)
    with pytest.raises(ValueError, match="warmup"):
        CapturedStep(step, x, y, warmup=0)
    with pytest.raises(TypeError, match=r"inputs\[1\]"):
        CapturedStep(step, x, np.zeros(2, np.int64))
    runner = CapturedStep(step, x, y, warmup=1)
    with pytest.raises(ValueError, match=r"inputs\[0\].*shape"):
        runner(Tensor(cuda_ops.to_device(np.zeros((3, 4, 4, 3), np.float32))), y)
    with pytest.raises(TypeError, match="expected 2 inputs"):
        runner(x)
