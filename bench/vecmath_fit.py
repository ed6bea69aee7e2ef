"""Derives the polynomial coefficients of Cuvil's vector math (src/cuvil/targets/llvm/vecmath.py).

Each polynomial is a near-minimax fit in float64 (Lawson's iteratively reweighted least squares on Chebyshev
nodes, minimising the largest relative error), then rounded to float32; the printed error is the fit's, in
float64. The float32 kernels' errors in ULPs are measured by bench/vecmath.py and tests/test_vecmath.py.

    PYTHONPATH=src python bench/vecmath_fit.py
"""
import math

import numpy as np


def _lawson(y, a, scale, iters):
    """Near-minimax coefficients of the columns ``a`` fitting ``y``, the error measured relative to ``scale``."""
    w = np.full(len(y), 1.0 / len(y))
    for _ in range(iters):
        sw = np.sqrt(w) / scale
        c, *_ = np.linalg.lstsq(a * sw[:, None], y * sw, rcond=None)
        err = np.abs(a @ c - y) / scale
        w = w * err
        w /= w.sum()
    return c


def fit(f, powers, lo, hi, iters=80, n=6000):
    """Float32 coefficients c_k of sum c_k * x**powers[k] approximating f on [lo, hi], near minimax in relative
    error, and the largest relative error in float64. The coefficients are rounded to float32 one at a time,
    lowest power first, the others refitted after each (so they absorb its rounding error)."""
    x = (lo + hi) / 2 + (hi - lo) / 2 * np.cos(np.pi * (np.arange(n) + 0.5) / n)
    y = f(x)
    scale = np.abs(y)
    a = np.stack([x ** p for p in powers], 1)
    fixed = []
    for k in range(len(powers)):
        rest = _lawson(y, a[:, k:], scale, iters)
        fixed.append(float(np.float32(rest[0])))
        y = y - fixed[-1] * a[:, k]
    c = np.array(fixed)
    return c, float((np.abs(a @ c - f(x)) / np.abs(f(x))).max())


LN2 = math.log(2.0)
ERF, ERFC = np.vectorize(math.erf), np.vectorize(math.erfc)

POLYNOMIALS = {
    # exp(r) = 1 + r + r^2 * q(r) on the Cody-Waite reduced range |r| <= ln2/2
    "EXP_Q": (lambda r: (np.expm1(r) - r) / (r * r), range(6), -LN2 / 2, LN2 / 2),
    # erf(x) = x + x * p(x^2) for |x| < 1 (2/sqrt(pi) - 1 as p's constant keeps 2/sqrt(pi)'s rounding error
    # out of erf's leading term; splitting at 1.0625 or 1.125 instead measured no better)
    "ERF_SMALL": (lambda x: ERF(x) / x - 1, range(0, 14, 2), 1e-4, 1.0),
    # erfc(x) = exp(-x^2) * r(1/x) for 1 <= x <= 4 (erf rounds to 1 in float32 from x = 3.92; degree 9 measured
    # best: 8 and 10 left larger errors in float32)
    "ERFC_SCALED": (lambda x: ERFC(x) * np.exp(x * x), range(0, -10, -1), 1.0, 4.0),
    # tanh(x) = x + x^3 * p(x^2) for |x| < 0.875 (from there 1 - 2 / (e^2x + 1) cancels little)
    "TANH_SMALL": (lambda x: (np.tanh(x) - x) / x ** 3, range(0, 14, 2), 1e-3, 0.875),
    # log(1 + f) = f - f^2/2 + f^3 * p(f) for f in [sqrt(1/2) - 1, sqrt(2) - 1]
    "LOG1P_P": (lambda f: (np.log1p(f) - f + f * f / 2) / f ** 3, range(10), math.sqrt(0.5) - 1, math.sqrt(2) - 1),
}


def main():
    for name, (f, powers, lo, hi) in POLYNOMIALS.items():
        c, err = fit(f, list(powers), lo, hi)
        print(f"{name} = ({', '.join(repr(float(v)) for v in c)})   # relative error {err:.2e}")


if __name__ == "__main__":
    main()
