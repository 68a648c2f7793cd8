"""Helpers for the tests that compare kernelgen.nn with PyTorch on the GPU (test_nn_gpu.py,
test_nn_torch_parity.py): layout permutes, and a forward + gradient comparison on fresh random data (errors
measured by harness.rel_err)."""
import numpy as np
from harness import rel_err


def nchw(t):
    return t.permute(0, 3, 1, 2)


def nhwc(t):
    return t.permute(0, 2, 3, 1)


def compare_with_torch(torch, ours, theirs, arrays, rng, tol, place, seed_grad, grad_of, torch_dtype=None):
    """ours(Tensors placed by `place`) against theirs(torch CUDA tensors, same NHWC layout): forward and
    the gradients of sum(output * random projection).  seed_grad turns the projection into ours' seed
    gradient; grad_of(tensor) gives an input's gradient on the host.  torch_dtype=torch.float64 makes
    PyTorch the float64 reference (same inputs, same projection)."""
    dt = torch_dtype or torch.float32
    tt = [torch.tensor(a, device="cuda", dtype=dt, requires_grad=True) for a in arrays]
    want = theirs(*tt)
    # a scalar output's seed gradient is 1 (ours: seed_grad may return None for it)
    proj = rng.standard_normal(tuple(want.shape)).astype(np.float32) if want.dim() else np.ones((), np.float32)
    (want * torch.tensor(proj, device="cuda", dtype=dt)).sum().backward()
    mine = [place(a) for a in arrays]
    got = ours(*mine)
    got.backward(seed_grad(proj))
    assert got.shape == tuple(want.shape)
    err = rel_err(got.numpy(), want.detach().cpu().numpy())
    assert err <= tol, f"forward: relative error {err:.3g}"
    for i, (m, t) in enumerate(zip(mine, tt)):
        err = rel_err(grad_of(m), t.grad.cpu().numpy())
        assert err <= tol, f"gradient of input {i}: relative error {err:.3g}"
