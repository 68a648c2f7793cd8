"""kernelgen.nn.CapturedStep on a real GPU (marker `gpu`): a ResNet step captured as a CUDA graph and replayed on new
batches ends with the weights, and the last loss, of the same steps run eagerly - fp32 and AMP (fp16 convolutions,
float16 activations, the loss scale on the device).  The fp32 backward-weight kernels split their reduction over
blocks that add into the gradient with atomics (the float16 ones too, through their float32 workspace), so two eager
runs differ in the last bits: the bar is 1e-4 of a tensor's largest value (on the H100 the captured and eager weights
differed by at most 4e-6) or ten times the two eager runs' own spread, which a replay on a stale input or a missing
kernel exceeds by orders of magnitude."""
import numpy as np
import pytest

from kernelgen.nn import ResNet

from graph_steps import trained

pytestmark = pytest.mark.gpu


def _resnet():
    return ResNet((1, 1, 1, 1), 10, width=8, stem="cifar", seed=5)


@pytest.mark.parametrize("amp_on", [False, True], ids=["fp32", "amp"])
def test_a_captured_resnet_step_trains_as_the_eager_one(amp_on, rng):
    batches = [(rng.standard_normal((8, 16, 16, 3)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(4)]
    want, want_loss, _ = trained(_resnet, batches, captured=False, amp_on=amp_on)
    again, again_loss, _ = trained(_resnet, batches, captured=False, amp_on=amp_on)
    got, got_loss, runner = trained(_resnet, batches, captured=True, amp_on=amp_on)
    assert runner.captured, runner.reason
    assert abs(got_loss - want_loss) <= 1e-4 * abs(want_loss) + 10 * abs(again_loss - want_loss)
    for k in want:
        spread = float(np.max(np.abs(again[k] - want[k]), initial=0.0))
        bar = 1e-6 + 1e-4 * float(np.max(np.abs(want[k]), initial=0.0)) + 10 * spread
        err = float(np.max(np.abs(got[k] - want[k]), initial=0.0))
        assert err <= bar, f"{k}: captured differs from eager by {err:.3g}, eager from itself by {spread:.3g}"
