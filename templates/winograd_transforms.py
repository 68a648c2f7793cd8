"""Exact Toom-Cook transforms for 1D Winograd correlation F(n, r).

y = AT @ ((G @ g) * (BT @ d)) computes the n outputs y[i] = sum_j g[j] d[i + j]
of a width-r filter g over alpha = n + r - 1 input items d.

Construction (transposition principle): the polynomial product c = g * h with
deg h = n - 1 is c = V^-1 [(Vg g) * (Vh h)], V the alpha x alpha evaluation
matrix at the points (infinity = leading coefficient). Correlation is the
transpose of that map in h, so AT = Vh^T and BT = (V^-1)^T. The diagonal
scaling is moved into G (rows divided by f_i = prod_{k != i}(a_i - a_k), as
Lavin & Gray do) with BT multiplied back, so BT keeps small integer-like
entries; any such per-row rescaling D (G -> D G, BT -> D^-1 BT) gives the
same result, which is the equivalence the F(2,3) test checks.
All arithmetic is in fractions.Fraction, so the matrices are exact.
"""
from __future__ import annotations

from fractions import Fraction as Fr
from functools import lru_cache

INF = None  # the point at infinity

# Small-magnitude points first: the conditioning of V grows fast with alpha.
POINTS = (Fr(0), Fr(1), Fr(-1), Fr(1, 2), Fr(-1, 2), Fr(2), Fr(-2), Fr(1, 4), Fr(-1, 4),
          Fr(4), Fr(-4), Fr(3, 4), Fr(-3, 4), Fr(4, 3), Fr(-4, 3))

STATES = (4, 8, 16)


def _invert(m):
    """Exact Gauss-Jordan inverse of a square Fraction matrix."""
    size = len(m)
    aug = [list(row) + [Fr(int(i == j)) for j in range(size)] for i, row in enumerate(m)]
    for col in range(size):
        pivot = next(r for r in range(col, size) if aug[r][col] != 0)
        aug[col], aug[pivot] = aug[pivot], aug[col]
        inv = 1 / aug[col][col]
        aug[col] = [v * inv for v in aug[col]]
        for r in range(size):
            if r != col and aug[r][col] != 0:
                f = aug[r][col]
                aug[r] = [a - f * b for a, b in zip(aug[r], aug[col])]
    return [row[size:] for row in aug]


def _eval_rows(points, width):
    """Rows evaluating a polynomial with `width` coefficients at each point."""
    rows = [[p ** k for k in range(width)] for p in points[:-1]]
    rows.append([Fr(int(k == width - 1)) for k in range(width)])  # infinity
    return rows


@lru_cache(maxsize=None)
def winograd_matrices(n: int, r: int):
    """(AT, G, BT) for F(n, r) as tuples of tuples of Fraction.

    AT is n x alpha, G is alpha x r, BT is alpha x alpha, alpha = n + r - 1."""
    if not (isinstance(n, int) and isinstance(r, int)) or n < 1 or r < 1:
        raise ValueError(f"n and r must be positive ints, got n={n!r}, r={r!r}")
    alpha = n + r - 1
    if alpha - 1 > len(POINTS):
        raise ValueError(f"alpha = n + r - 1 must be <= {len(POINTS) + 1}, got {alpha}")
    points = list(POINTS[:alpha - 1]) + [INF]
    finite = points[:-1]
    scale = []
    for i, a in enumerate(finite):
        f = Fr(1)
        for k, b in enumerate(finite):
            if k != i:
                f *= a - b
        scale.append(f)
    scale.append(Fr(1))
    g_rows = _eval_rows(points, r)
    h_rows = _eval_rows(points, n)
    v_inv = _invert(_eval_rows(points, alpha))
    G = tuple(tuple(v / scale[i] for v in row) for i, row in enumerate(g_rows))
    AT = tuple(tuple(h_rows[i][j] for i in range(alpha)) for j in range(n))
    BT = tuple(tuple(v_inv[j][i] * scale[i] for j in range(alpha)) for i in range(alpha))
    return AT, G, BT


@lru_cache(maxsize=None)
def row_pairs(m):
    """Rows i < j of a transform with m[j] = lam * (E - O) where m[i] = E + O, E and O the parts of row i on
    complementary columns: the rows of the points p and -p, whose powers agree on even exponents and differ in
    sign on odd ones (BT's and G's rows, AT's columns).  E and O are then computed once for both rows, about
    halving the multiply-adds of a transform.  Returns ((i, j, lam, odd columns), ...); only pairs that save."""
    nz = [tuple(c for c, v in enumerate(row) if v != 0) for row in m]
    out, used = [], set()
    for i, a in enumerate(m):
        if i in used or not nz[i]:
            continue
        for j in range(i + 1, len(m)):
            b = m[j]
            if j in used or nz[j] != nz[i]:
                continue
            lam = b[nz[i][0]] / a[nz[i][0]]
            odd = tuple(c for c in nz[i] if b[c] == -lam * a[c])
            if len(odd) in (0, len(nz[i])) or any(b[c] != lam * a[c] for c in nz[i] if c not in odd):
                continue
            # two rows of k terms: 2 (k - 1) operations alone; paired E and O, their sum and difference and
            # the scale: k + (|lam| != 1)
            if len(nz[i]) - 2 - (abs(lam) != 1) <= 0:
                continue
            out.append((i, j, lam, odd))
            used |= {i, j}
            break
    return tuple(out)


def tile_width(alpha: int, r: int) -> int:
    """Outputs per tile n for a state count alpha and filter width r."""
    return alpha - r + 1


def supported(alpha: int, r: int) -> bool:
    return alpha in STATES and 2 <= r <= 9 and tile_width(alpha, r) >= 2
