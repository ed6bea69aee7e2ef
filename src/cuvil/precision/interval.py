"""Intervals over tensors: the abstract values of the range analysis (:mod:`cuvil.precision.ranges`).

An :class:`Interval` bounds every element of one tensor: ``lo`` and ``hi`` are float64 arrays that broadcast to
the tensor's shape the way ONNX broadcasts (scalars, or the tensor's rank with each dim 1 or the tensor's own),
so a per-channel range of a ``f32[N,C,H,W]`` tensor is held as ``[1,C,1,1]`` arrays, a constant's exactly as
its values. ``origin`` says how the bounds were obtained: ``"certified"`` (derived from declared input ranges by
sound rules: every value the model can compute from inputs in the box lies inside), ``"measured"`` (some
input's range came from calibration data: the bounds hold for those inputs, nothing more). ``why`` explains an
unbounded side (an op without a rule, an input without a declared range).
"""
from __future__ import annotations

from typing import Iterable, Optional

import attrs
import numpy as np

CERTIFIED, MEASURED = "certified", "measured"

#: Relative outward widening applied to bounds computed in float64 so that they stay sound for the float32
#: computation they describe (each op's own rounding): 2^-20, many float32 ulps.
SLACK = 2.0 ** -20


@attrs.frozen(eq=False)
class Interval:
    lo: np.ndarray
    hi: np.ndarray
    origin: str = CERTIFIED
    why: str = ""
    #: "affine" when a relational rule (:mod:`cuvil.precision.affine`) tightened this interval
    method: str = ""

    @staticmethod
    def of(lo, hi, origin: str = CERTIFIED, why: str = "") -> "Interval":
        lo = np.asarray(lo, dtype=np.float64)
        hi = np.asarray(hi, dtype=np.float64)
        lo, hi = np.broadcast_arrays(lo, hi) if lo.shape != hi.shape else (lo, hi)
        return Interval(np.array(lo), np.array(hi), origin, why)

    @staticmethod
    def unbounded(why: str, origin: str = CERTIFIED) -> "Interval":
        return Interval.of(-np.inf, np.inf, origin, why)

    @staticmethod
    def exact(values) -> "Interval":
        v = np.asarray(values, dtype=np.float64)
        return Interval.of(v, v)

    # --- queries ---------------------------------------------------------------------------------------
    @property
    def min(self) -> float:
        return float(np.min(self.lo)) if self.lo.size else 0.0

    @property
    def max(self) -> float:
        return float(np.max(self.hi)) if self.hi.size else 0.0

    @property
    def max_abs(self) -> float:
        return max(abs(self.min), abs(self.max))

    @property
    def has_nan(self) -> bool:
        return bool(np.isnan(self.lo).any() or np.isnan(self.hi).any())

    @property
    def bounded(self) -> bool:
        return not self.has_nan and bool(np.isfinite(self.lo).all() and np.isfinite(self.hi).all())

    def hull(self) -> "Interval":
        """One scalar interval holding every element's."""
        return Interval.of(self.min, self.max, self.origin, self.why)

    def contains(self, values, rtol: float = 0.0) -> np.ndarray:
        """Which elements of ``values`` (a tensor of the bounded shape) lie inside."""
        v = np.asarray(values, dtype=np.float64)
        lo, hi = np.broadcast_to(self.lo, v.shape), np.broadcast_to(self.hi, v.shape)
        return (v >= lo - rtol * np.abs(lo)) & (v <= hi + rtol * np.abs(hi))

    def text(self) -> str:
        return f"[{_num(self.min)}, {_num(self.max)}]"

    def with_origin(self, origin: str, why: str = "") -> "Interval":
        return Interval(self.lo, self.hi, origin, why or self.why)

    def widened(self, rel: float = SLACK) -> "Interval":
        """Widened outward by ``rel`` of the bounds' magnitude (rounding of the computation described)."""
        m = np.maximum(np.abs(self.lo), np.abs(self.hi))
        with np.errstate(invalid="ignore"):
            pad = np.where(np.isfinite(m), m * rel, 0.0) + np.finfo(np.float32).tiny
        with np.errstate(over="ignore", invalid="ignore"):
            return Interval(self.lo - pad, self.hi + pad, self.origin, self.why, self.method)


def join_origin(items: Iterable[Optional[Interval]]) -> str:
    """``measured`` when any of ``items`` is, else ``certified``."""
    return MEASURED if any(i is not None and i.origin == MEASURED for i in items) else CERTIFIED


def join_why(items: Iterable[Optional[Interval]]) -> str:
    return next((i.why for i in items if i is not None and i.why), "")


def union(items: Iterable[Interval]) -> Interval:
    """The hull of several intervals (a scalar interval)."""
    items = list(items)
    return Interval.of(min(i.min for i in items), max(i.max for i in items), join_origin(items), join_why(items))


def _num(x: float) -> str:
    if np.isnan(x):
        return "nan"
    if np.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.6g}"
