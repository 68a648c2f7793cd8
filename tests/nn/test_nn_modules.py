"""Modules, optimisers and a short training run through kernelgen's CPU kernels."""
import subprocess
import sys

import numpy as np
import pytest

from kernelgen.nn import SGD, Adam, Linear, SmallResNet, Tensor


def test_state_dict_round_trip_through_npz(tmp_path):
    a, b = SmallResNet(width=8, seed=0), SmallResNet(width=8, seed=1)
    a.save(tmp_path / "m.npz")
    b.load(tmp_path / "m.npz")
    for (name, va), (_, vb) in zip(sorted(a.state_dict().items()), sorted(b.state_dict().items())):
        np.testing.assert_array_equal(va, vb, err_msg=name)


def test_optimizers_decrease_a_classification_loss():
    from kernelgen.nn.functional import cross_entropy
    rng = np.random.default_rng(0)
    x, labels = rng.standard_normal((32, 5)), rng.integers(0, 3, 32)
    for make in (lambda p: SGD(p, lr=0.1, momentum=0.9), lambda p: Adam(p, lr=0.05)):
        layer = Linear(5, 3, rng=np.random.default_rng(1), dtype="float64")
        opt = make(layer.parameters())
        losses = []
        for _ in range(30):
            loss = cross_entropy(layer(Tensor(x)), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.data))
        assert losses[-1] < 0.8 * losses[0], losses


def test_quick_training_run_beats_chance():
    out = subprocess.run([sys.executable, "-m", "kernelgen", "train", "digits", "--quick", "--min-accuracy", "0.5"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


def test_digits_from_npz_match_scikit_learn(tmp_path):
    """--save-data / --data: the offline copy is the same split as scikit-learn's (GPU machine has none)."""
    from kernelgen.nn.data import load_digits_split, save_digits
    path = tmp_path / "digits.npz"
    save_digits(path)
    for got, want in zip(load_digits_split(seed=3, path=path), load_digits_split(seed=3)):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    np.savez(tmp_path / "bad.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="'images' and 'labels'"):
        load_digits_split(path=tmp_path / "bad.npz")
