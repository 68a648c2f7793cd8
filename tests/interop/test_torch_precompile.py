"""kernelgen.torch.precompile: a converted model's training-step kernels planned from one traced forward (the
backward's plans made beside each forward call) and compiled before the first step, the model left as it was."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kernelgen.torch as kt  # noqa: E402
from kernelgen import settings  # noqa: E402
from kernelgen.runtime.cache import KERNELS  # noqa: E402
from test_torch_modules import Net  # noqa: E402


def test_precompile_compiles_the_step_s_kernels_and_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = kt.convert(Net())  # float32, the CPU backend
    model.train()
    x = torch.randn(2, 4, 9, 9)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with settings.scope(cache_dir=str(tmp_path)):
        report = kt.precompile(model, tuple(x.shape), workers=0)
        # the stem: forward and backward-weight (the input needs no gradient); the block's two equal 3x3
        # convolutions: forward, backward-data, backward-weight
        assert (report.kernels, report.compiled, report.errors) == (5, 5, [])
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # running statistics too
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(p.grad is None for p in model.parameters())
        misses = KERNELS.stats.misses
        model(x).sum().backward()  # the step: every kernel it runs was compiled by precompile
        assert KERNELS.stats.misses == misses
        assert all(p.grad is not None for p in model.parameters())
        # again, with the default workers: every kernel is on disk now, so no compile pool starts
        from kernelgen.tuning import compile_pool
        started = []
        pool_class = compile_pool.ProcessPoolExecutor
        monkeypatch.setattr(compile_pool, "ProcessPoolExecutor",
                            lambda *a, **k: started.append(a) or pool_class(*a, **k))
        again = kt.precompile(model, tuple(x.shape))
        assert (again.kernels, again.cached, again.compiled, started) == (5, 5, 0, [])


def test_precompile_refuses_bad_arguments_by_name():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        kt.precompile(object(), (1, 4, 9, 9))
    with pytest.raises(ValueError, match="input_shape"):
        kt.precompile(Net(), (1, 4))
