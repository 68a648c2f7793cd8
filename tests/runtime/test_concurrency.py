"""Threads sharing one process: conv, the backward ops, deconv, explain, bind and cache info side by side, each
result checked against a float64 reference.  No public call may change state that another call reads, so
nothing here may ever see a wrong answer, a None or an exception.  (Processes sharing one cache directory:
test_cache_processes.py.)"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import kernelgen
from kernelgen import reference as ref
from kernelgen import settings
from kernelgen.runtime.cache import KERNELS
from harness import norm_err

THREADS = 8


def _cases(rng):
    """A few small problems of their own (so that the first calls race to compile them), with references."""
    cases = []
    for hw, c, k, stride in ((7, 3, 5, 1), (6, 2, 4, 2)):
        x = rng.standard_normal((2, hw, hw, c)).astype(np.float32)
        w = rng.standard_normal((k, 3, 3, c)).astype(np.float32)
        y = ref.conv_forward(x, w, padding=(1, 1), stride=(stride, stride))
        dy = rng.standard_normal(y.shape).astype(np.float32)
        cases.append(dict(x=x, w=w, stride=stride, y=y, dy=dy,
                          dx=ref.conv_backward_data(dy, w, x.shape, padding=(1, 1), stride=(stride, stride)),
                          dw=ref.conv_backward_weight(x, dy, w.shape, padding=(1, 1), stride=(stride, stride))))
    return cases


def _close(got, want):
    return np.shape(got) == want.shape and norm_err(got, want) <= 1e-4


def _worker(index, cases, rounds, failures, start):
    rng = np.random.default_rng(index)
    start.wait()
    for r in range(rounds):
        c = cases[rng.integers(len(cases))]
        kw = dict(padding=1, stride=c["stride"], backend="cpu")
        op = (index + r) % 5
        try:
            if op == 0:
                ok = _close(kernelgen.conv(c["x"], c["w"], **kw), c["y"])
            elif op == 1:
                ok = _close(kernelgen.conv_backward_data(c["dy"], c["w"], c["x"].shape, **kw), c["dx"])
            elif op == 2:
                ok = _close(kernelgen.conv_backward_weight(c["x"], c["dy"], c["w"].shape, **kw), c["dw"])
            elif op == 3:
                with settings.scope(precision="fp32"):  # a scope in one thread never reaches the others
                    e = kernelgen.explain(kernelgen.conv, c["x"], c["w"], **kw)
                ok = e.problem.x_shape == c["x"].shape and "def " in e.source
            else:
                info = KERNELS.info()
                ok = info["entries"] >= 0 and info["memory_entries"] >= 0
        except Exception as e:  # every failure is collected and reported, never swallowed
            failures.append((index, r, op, repr(e)))
            continue
        if not ok:
            failures.append((index, r, op, "wrong result"))


def _run_threads(target, *args):
    failures, start = [], threading.Barrier(THREADS)
    threads = [threading.Thread(target=target, args=(i, *args, failures, start)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return failures


def test_eight_threads_mixing_every_public_call(rng):
    failures = _run_threads(_worker, _cases(rng), 40)
    assert not failures, failures[:10]


def test_precision_set_in_one_thread_scope_is_not_seen_by_others(rng):
    """set_precision is process-wide by design (like torch's allow_tf32); a settings.scope is not."""
    seen, start = [], threading.Barrier(2)

    def scoped():
        with settings.scope(precision="bf16"):
            start.wait()
            start.wait()

    def reader():
        start.wait()
        seen.append(kernelgen.get_precision())
        start.wait()
    ts = [threading.Thread(target=scoped), threading.Thread(target=reader)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert seen == ["fp32"]


def _bind_worker(index, x, w, want, rounds, failures, start):
    from numba import cuda
    dx, dw = cuda.to_device(x), cuda.to_device(w)
    out = cuda.device_array(want.shape, np.float32)
    start.wait()
    try:
        step = kernelgen.bind(kernelgen.conv, dx, dw, padding=1, out=out)
        for r in range(rounds):
            if r % 2:
                got = step()
            else:
                got = kernelgen.conv(dx, dw, padding=1)
            if not _close(got.copy_to_host(), want):
                failures.append((index, r, "wrong result"))
            kernelgen.explain(kernelgen.conv, dx, dw, padding=1)
    except Exception as e:
        failures.append((index, repr(e)))


@pytest.mark.gpu
def test_eight_threads_bind_conv_and_explain_on_the_gpu(rng):
    x = rng.standard_normal((4, 12, 12, 16)).astype(np.float32)
    w = rng.standard_normal((32, 3, 3, 16)).astype(np.float32)
    failures = _run_threads(_bind_worker, x, w, ref.conv_forward(x, w, padding=(1, 1)), 200)
    assert not failures, failures[:10]
