"""Correct rounding (to nearest, ties to even) of exact sums to float32, float16 and bfloat16, with a proof.

The merged weight of a LoRA merge is ``W + (a ∘ s)·b``, a sum of products of binary floating-point numbers:
a rational number. :func:`round_exact_sum` returns, for every element, that number rounded once to the
weight's format. It computes in float64 with a rigorous error bound; wherever the interval
``[v - bound, v + bound]`` rounds to one value in the target format (rounding is monotone, so every number in
it does), that value is the answer; elsewhere (an interval that straddles a rounding boundary: in practice the
exact midpoints and near-midpoints) the element is recomputed exactly in rational arithmetic and rounded
exactly. The result is therefore the correctly rounded value of the exact sum, for every element, not a sample.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Tuple

import numpy as np

#: (mantissa bits p including the implicit one, emin, emax) of each format.
FORMATS = {"float32": (24, -126, 127), "float16": (11, -14, 15), "bfloat16": (8, -126, 127)}
_U = 2.0 ** -53   # float64's unit roundoff


def max_finite(fmt: str) -> float:
    p, _, emax = FORMATS[fmt]
    return float((2 - 2.0 ** (1 - p)) * 2.0 ** emax)


def round_array(v: np.ndarray, fmt: str) -> np.ndarray:
    """float64 values rounded to ``fmt`` (nearest, ties to even, overflow to ±inf), returned as float64 (each
    result is exactly representable in ``fmt``). Monotone: ``x <= y`` gives ``round(x) <= round(y)``."""
    p, emin, emax = FORMATS[fmt]
    v = np.asarray(v, np.float64)
    if fmt == "float32":   # the IEEE conversion itself: round to nearest, ties to even, overflow to ±inf
        with np.errstate(over="ignore"):
            return v.astype(np.float32).astype(np.float64)
    _, e = np.frexp(v)                       # v = m * 2**e, 0.5 <= |m| < 1: the leading bit is 2**(e - 1)
    ex = np.maximum(e - 1, emin)
    q = np.ldexp(1.0, (ex - (p - 1)).astype(np.int32))
    r = np.round(v / q) * q                  # v / q is exact (a power-of-two scaling); np.round: ties to even
    big = np.abs(r) > max_finite(fmt)
    r = np.where(big, np.copysign(np.inf, v), r)
    return np.where(np.isfinite(v), r, v)


def round_fraction(x: Fraction, fmt: str) -> float:
    """The exact rational ``x`` rounded to ``fmt`` (nearest, ties to even), as a Python float."""
    p, emin, emax = FORMATS[fmt]
    if x == 0:
        return 0.0
    ax = abs(x)
    e = ax.numerator.bit_length() - ax.denominator.bit_length()
    if _pow2(e) > ax:
        e -= 1
    elif _pow2(e + 1) <= ax:
        e += 1
    q = _pow2(max(e, emin) - (p - 1))
    r = round(ax / q) * q                    # Fraction.__round__: ties to even
    out = float("inf") if r > Fraction(max_finite(fmt)) else float(r)
    return out if x > 0 else -out


def _pow2(e: int) -> Fraction:
    return Fraction(1 << e) if e >= 0 else Fraction(1, 1 << -e)


def round_exact_sum(w: np.ndarray, a: np.ndarray, s: np.ndarray, b: np.ndarray, fmt: str
                    ) -> Tuple[np.ndarray, int]:
    """``w + (a * s) @ b`` (``w`` [m, n], ``a`` [m, R], ``s`` [R], ``b`` [R, n], all binary floats) correctly
    rounded to ``fmt``, as float64 values exactly representable in ``fmt``; and how many elements were decided
    in exact rational arithmetic."""
    w64, a64, s64, b64 = (np.asarray(t, np.float64) for t in (w, a, s, b))
    R = a64.shape[1]
    # a * s is exact in float64 (two <= 24-bit mantissas); the dot products of R terms then carry at most
    # gamma_R * sum|terms|, the final addition of w one more rounding of the result.
    a_s = a64 * s64
    v = w64 + a_s @ b64
    g = (R + 2) * _U / (1 - (R + 2) * _U)
    mag = np.abs(a_s) @ np.abs(b64)          # itself rounded: within (1 + gamma_R) of the true magnitude
    bound = 2.0 * (g * mag * (1 + g) + 2 * _U * np.abs(v)) + np.finfo(np.float64).tiny
    lo = np.nextafter(v - bound, -np.inf)
    hi = np.nextafter(v + bound, np.inf)
    r_lo, r_hi = round_array(lo, fmt), round_array(hi, fmt)
    out = round_array(v, fmt)
    exact = mag == 0                          # every term is 0 (b = 0: a PEFT-initialised adapter): w itself
    out = np.where(exact, w64, out)
    unsure = np.argwhere((r_lo != r_hi) & ~exact)
    for i, j in unsure:
        x = Fraction(float(w64[i, j])) + sum(Fraction(float(a_s[i, t])) * Fraction(float(b64[t, j]))
                                             for t in range(R))
        out[i, j] = round_fraction(x, fmt)
    return out, len(unsure)
