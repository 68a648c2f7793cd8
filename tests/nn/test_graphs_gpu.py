"""kernelgen.nn.CapturedStep on a real GPU (marker `gpu`): a ResNet step captured as a CUDA graph and replayed on new
batches ends with the weights, and the last loss, of the same steps run eagerly - fp32 and AMP (fp16 convolutions,
float16 activations, the loss scale on the device)."""
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
    got, got_loss, runner = trained(_resnet, batches, captured=True, amp_on=amp_on)
    assert runner.captured, runner.reason
    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
