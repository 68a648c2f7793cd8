"""The dispatch cache and the settings snapshot under threads (issue 27): calls with shared and thread-own
signatures, scopes entered and left, the cache cleared under the callers' feet - every result checked against
the float64 reference, every thread seeing its own scope's settings, no exception anywhere."""
from __future__ import annotations

import threading

import numpy as np

import kernelgen
from kernelgen import api, settings
from kernelgen import reference as ref
from harness import norm_err, random_array

THREADS = 8
KW = dict(padding=1, backend="cpu")


def _run_threads(target, n=THREADS):
    failures, start = [], threading.Barrier(n)

    def run(i):
        start.wait()
        try:
            target(i)
        except Exception as e:  # collected and reported, never swallowed
            failures.append(f"thread {i}: {type(e).__name__}: {e}")
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]


def _cases(rng):
    """Two signatures (a shape of their own), their kernels compiled here first so the threads race on the
    dispatch cache, not on numba."""
    cases = []
    for n in (1, 3):
        x, w = random_array(rng, (n, 6, 5, 3)), random_array(rng, (4, 3, 3, 3))
        kernelgen.conv(x, w, **KW)
        kernelgen.conv_backward_data(random_array(rng, (n, 6, 5, 4)), w, x.shape, **KW)
        cases.append((n, w))
    return cases


def test_threads_share_the_dispatch_cache_with_their_own_scopes_and_clears(rng):
    cases = _cases(rng)
    tokens = {}

    def work(i):
        local = np.random.default_rng(i)
        no_tuned = bool(i % 2)
        with settings.scope(no_tuned=no_tuned):
            tokens[i] = settings.dispatch_token()
            for r in range(40):
                n, w = cases[local.integers(len(cases))]
                x = random_array(local, (n, 6, 5, 3))
                if r % 2:
                    out = np.full((n, 6, 5, 4), np.nan, np.float32)
                    kernelgen.conv(x, w, out=out, **KW)
                    err = norm_err(out, ref.conv_forward(x, w, padding=(1, 1)))
                else:
                    dy = random_array(local, (n, 6, 5, 4))
                    err = norm_err(kernelgen.conv_backward_data(dy, w, x.shape, **KW),
                                   ref.conv_backward_data(dy, w, x.shape, padding=(1, 1)))
                assert err <= 1e-5, (r, err)
                assert settings.get("no_tuned") is no_tuned  # a scope of another thread never reaches this one
                if i == 0 and r % 10 == 9:
                    api.clear_caches()  # under the others' feet: they plan again, never fail
    _run_threads(work)
    assert len({tokens[i] for i in range(0, THREADS, 2)}) == 1 and len({tokens[i] for i in range(1, THREADS, 2)}) == 1
    assert tokens[0] != tokens[1]


def test_each_thread_s_scope_is_its_own_key(rng):
    """Without clears: after the run, the dispatch cache holds the one signature under both threads' tokens."""
    cases = _cases(rng)
    n, w = cases[0]
    api.clear_caches()
    token_of = {}

    def work(i):
        local = np.random.default_rng(100 + i)
        with settings.scope(no_tuned=bool(i % 2)):
            token_of[i % 2] = settings.dispatch_token()
            for _ in range(20):
                x = random_array(local, (n, 6, 5, 3))
                assert norm_err(kernelgen.conv(x, w, **KW), ref.conv_forward(x, w, padding=(1, 1))) <= 1e-5
    _run_threads(work)
    keys = [k for k in api._DISPATCH._routes if k[0] == "conv" and k[2][1] == (n, 6, 5, 3)]
    assert {k[1] for k in keys} == {token_of[0], token_of[1]}


def test_settings_snapshots_follow_each_thread_s_nested_scopes():
    """Many scopes entered and left in 8 threads at once (their dicts made and freed, their ids reused): each
    thread's code_token and dispatch_token are always its own scope's values."""
    base = settings.get("index32")

    def work(i):
        for r in range(300):
            mine = bool((i + r) % 2)
            with settings.scope(index32=mine, winograd_16_states=bool(i % 2)):
                code = dict(zip([s.name for s in settings.CODE_SETTINGS], settings.code_token()))
                assert code["index32"] is mine and code["winograd_16_states"] is bool(i % 2), (r, code)
                with settings.scope(no_tuned=True):
                    assert settings.dispatch_token()[[s.name for s in settings.CALL_SETTINGS].index("no_tuned")]
                    assert settings.code_token() == tuple(code.values())
            assert settings.get("index32") is base
    _run_threads(work)
