"""Winograd transforms (exact rational generation) against direct correlation."""
from fractions import Fraction as Fr

import numpy as np
import pytest

from kernelgen.templates.winograd_transforms import STATES, winograd_matrices, supported

COMBOS = [(a, r) for a in STATES for r in range(2, 10) if supported(a, r)]


def _as_float(m):
    return np.array([[float(v) for v in row] for row in m], dtype=np.float64)


def test_f23_matches_lavin_gray_up_to_row_scaling():
    AT, G, BT = winograd_matrices(2, 3)
    lavin_AT = [[1, 1, 1, 0], [0, 1, -1, -1]]
    lavin_G = [[1, 0, 0], [Fr(1, 2), Fr(1, 2), Fr(1, 2)], [Fr(1, 2), Fr(-1, 2), Fr(1, 2)], [0, 0, 1]]
    lavin_BT = [[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]
    # Equivalent up to per-state scalings (AT columns, G rows, BT rows whose product is 1):
    # for every state i, the rank-1 term AT[:, i] x G[i] x BT[i] must be identical.
    for i in range(4):
        ours = [[[AT[o][i] * G[i][j] * BT[i][k] for k in range(4)] for j in range(3)] for o in range(2)]
        theirs = [[[Fr(lavin_AT[o][i]) * Fr(lavin_G[i][j]) * Fr(lavin_BT[i][k]) for k in range(4)]
                   for j in range(3)] for o in range(2)]
        assert ours == theirs, i
    # Same points (0, 1, -1, inf): the finite G rows agree with Lavin's up to sign only.
    for i in range(4):
        assert [abs(v) for v in G[i]] == [abs(Fr(v)) for v in lavin_G[i]]


def test_combos_cover_issue_range():
    assert len(COMBOS) == 2 + 6 + 8  # alpha 4: r 2,3; alpha 8: r 2..7; alpha 16: r 2..9
    assert (4, 3) in COMBOS and (16, 9) in COMBOS and (8, 8) not in COMBOS


@pytest.mark.parametrize("alpha,r", COMBOS)
def test_transform_equals_direct_correlation(alpha, r):
    n = alpha - r + 1
    AT, G, BT = (_as_float(m) for m in winograd_matrices(n, r))
    assert AT.shape == (n, alpha) and G.shape == (alpha, r) and BT.shape == (alpha, alpha)
    rng = np.random.default_rng(alpha * 100 + r)
    for _ in range(5):
        g = rng.standard_normal(r)
        d = rng.standard_normal(alpha)
        direct = np.array([g @ d[i:i + r] for i in range(n)])
        wino = AT @ ((G @ g) * (BT @ d))
        np.testing.assert_allclose(wino, direct, rtol=1e-9, atol=1e-9 * np.abs(d).sum() * np.abs(g).sum())
    # Exactness: the rational product reproduces correlation exactly on integer data.
    AT_f, G_f, BT_f = winograd_matrices(n, r)
    g = [Fr(int(v)) for v in rng.integers(-5, 6, r)]
    d = [Fr(int(v)) for v in rng.integers(-5, 6, alpha)]
    gg = [sum(G_f[i][j] * g[j] for j in range(r)) for i in range(alpha)]
    dd = [sum(BT_f[i][j] * d[j] for j in range(alpha)) for i in range(alpha)]
    y = [sum(AT_f[o][i] * gg[i] * dd[i] for i in range(alpha)) for o in range(n)]
    assert y == [sum(g[j] * d[o + j] for j in range(r)) for o in range(n)]
