"""Semantics of Cuvil's Winograd ops (exact rational transform matrices)."""
from __future__ import annotations

from fractions import Fraction

import z3

from ...ir.ops.winograd import MATRICES
from .domains import Domain, RealDomain
from .table import _in, sem
from .tensors import _empty, _ints, _sum

def _exact(dom: Domain, v: Fraction):
    """An exact rational constant: exact over the reals, rounded to float32 in the IEEE domain."""
    return z3.RealVal(v) if isinstance(dom, RealDomain) else dom.const(float(v))


def _combine(dom: Domain, coeffs, terms):
    """sum_i coeffs[i] * terms[i] over the non-zero coefficients, left to right (1 and -1 not multiplied)."""
    out = []
    for c, t in zip(coeffs, terms):
        if c == 0:
            continue
        out.append(t if c == 1 else dom.neg(t) if c == -1 else dom.mul(_exact(dom, c), t))
    return _sum(dom, out)


def _sandwich(dom: Domain, left, tile, right):
    """left @ tile @ right.T for matrices of Fractions and a 2-D object array."""
    rows = [[_combine(dom, lr, [tile[a][b] for a in range(len(lr))]) for b in range(len(tile[0]))] for lr in left]
    return [[_combine(dom, rr, row) for rr in right] for row in rows]


@sem("WinogradKernel")
def _winograd_kernel(dom, inputs, attrs):
    w = _in(dom, inputs, 0)
    m = int(attrs.get("tile", 4))
    _, g, _ = MATRICES[m]
    k, c = w.shape[:2]
    u = _empty(((m + 2) ** 2, k, c))
    for ki in range(k):
        for ci in range(c):
            t = _sandwich(dom, g, w[ki, ci], g)
            for i, row in enumerate(t):
                for j, v in enumerate(row):
                    u[i * (m + 2) + j, ki, ci] = v
    return [u]


@sem("WinogradConv")
def _winograd_conv(dom, inputs, attrs):
    """The algorithm itself: zero-padded input tiles d, V = Bt d B, M = sum_c U * V, Y = At M A, cropped."""
    x, u, bias = _in(dom, inputs, 0), _in(dom, inputs, 1), _in(dom, inputs, 2)
    m = int(attrs.get("tile", 4))
    pads = _ints(attrs.get("pads")) or [0, 0, 0, 0]
    bt, _, at = MATRICES[m]
    a = m + 2
    n, c, h, w = x.shape
    k = u.shape[1]
    oh, ow = h + pads[0] + pads[2] - 2, w + pads[1] + pads[3] - 2
    zero = dom.const(0.0)

    def px(ni, ci, r, q):
        r, q = r - pads[0], q - pads[1]
        return x[ni, ci, r, q] if 0 <= r < h and 0 <= q < w else zero
    y = _empty((n, k, oh, ow))
    for ni in range(n):
        for th in range(0, oh, m):
            for tw in range(0, ow, m):
                v = [_sandwich(dom, bt, [[px(ni, ci, th + i, tw + j) for j in range(a)] for i in range(a)], bt)
                     for ci in range(c)]
                for ki in range(k):
                    mm = [[_sum(dom, [dom.mul(u[i * a + j, ki, ci], v[ci][i][j]) for ci in range(c)])
                           for j in range(a)] for i in range(a)]
                    out = _sandwich(dom, at, mm, at)
                    for r in range(min(m, oh - th)):
                        for q in range(min(m, ow - tw)):
                            val = out[r][q]
                            y[ni, ki, th + r, tw + q] = val if bias is None else dom.add(val, bias[ki])
    return [y]
