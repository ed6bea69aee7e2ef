"""The number formats a node may compute in, what each holds, and the margins the policy keeps.

A narrowed node rounds its float inputs to the format and accumulates in float32 (:attr:`Node.precision
<cuvil.ir.graph.Node.precision>`). The policy (:mod:`cuvil.precision.policy`) asks of every value the node
reads, computes inside and writes that its certified range fit the format with a margin:

* fp16: ``|x| <= 65504 / 2`` (half the largest finite half: the sums and products that follow on the value,
  rounded again, keep a factor 2 of headroom);
* bf16: ``|x| <= 3.39e38 / 2`` (float32's exponent range: bf16 can only overflow where float32 nearly does);
* int8: a bounded range, from which the scale ``max|x| / 127`` is taken so that nothing saturates;
* fp8 (E4M3, the GPU's ``e4m3`` tensor cores): a bounded range, from which a power-of-two scale ``2^e`` is
  taken so that ``|x| * 2^-e <= 448 / 2`` (:meth:`Format.exponent`). Scaling by a power of two is exact, so
  the only rounding is to E4M3 itself (3 mantissa bits: relative ``2^-4``, values below ``2^-6 * 2^e`` on its
  subnormal grid); the product's float32 sum is multiplied back by ``2^(e_a + e_b)``. Never chosen by
  ``auto`` (:attr:`Format.auto`): an explicit ``--precision fp8`` only.

A range that is unbounded or not finite is never safe.
"""
from __future__ import annotations

from typing import Dict, Optional

import attrs
import numpy as np

from .interval import Interval

#: ``--precision`` values: one format for every node that can take it, or ``auto`` (the narrowest safe one).
PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "int8", "auto")

FLOAT32_MAX = float(np.finfo(np.float32).max)

#: Margin kept below a format's largest finite value.
MARGIN = 2.0


@attrs.frozen
class Format:
    name: str           # as Node.precision spells it
    max_finite: float   # the largest finite value (int8: None, the scale makes it fit)
    bits: int
    #: ``auto`` tries the formats narrowest first; int8 only where the target consumes it
    order: int
    #: a scaled format: any bounded float32 range fits once scaled (int8, fp8); only the inputs are narrowed
    scaled: bool = False
    #: ``auto`` may pick it (fp8 is an explicit request only: its 3-bit mantissa is a choice, not a default)
    auto: bool = True

    @property
    def limit(self) -> float:
        return self.max_finite / MARGIN

    def check(self, iv: Optional[Interval]) -> Optional[str]:
        """None when ``iv`` fits this format with the margin, else why not."""
        if iv is None:
            return "no range"
        if iv.has_nan:
            return "range may be NaN"
        if not iv.bounded:
            return "range unbounded" + (f" ({iv.why})" if iv.why else "")
        if self.scaled:   # the scale makes any bounded float32 range fit; past float32 it is not one
            if iv.max_abs > FLOAT32_MAX:
                return f"range {iv.text()} exceeds float32"
            if self.name == "fp8" and iv.max_abs > self.limit * 2.0 ** FP8_EXPONENT:
                return f"range {iv.text()} exceeds ±{self.limit * 2.0 ** FP8_EXPONENT:.6g} (fp8's largest scale 2^{FP8_EXPONENT})"
            return None
        if iv.max_abs > self.limit:
            return f"range {iv.text()} exceeds ±{self.limit:.6g} ({self.name} max {self.max_finite:.6g} / {MARGIN:g})"
        return None

    def scale(self, iv: Interval) -> float:
        """int8: the symmetric scale that maps the range onto [-127, 127] without saturation."""
        return max(iv.max_abs, float(np.finfo(np.float32).tiny)) / 127.0

    def exponent(self, iv: Interval) -> int:
        """fp8: the ``e`` of the power-of-two scale for values in ``iv``: the smallest with ``max|x| * 2^-e <=``
        :attr:`limit` (448 / 2), kept within [-FP8_EXPONENT, FP8_EXPONENT] so that ``2^-e`` and the product's
        ``2^(e_a + e_b)`` stay normal float32 (a range below ``2^-FP8_EXPONENT`` then sits lower on E4M3's grid:
        less precision, never an overflow)."""
        m = iv.max_abs
        e = int(np.ceil(np.log2(m / self.limit))) if m > 0 else 0
        while m * 2.0 ** -e > self.limit:     # log2's rounding: the bound must hold exactly
            e += 1
        return max(-FP8_EXPONENT, min(FP8_EXPONENT, e))


#: bound on a fp8 scale exponent: 2^-e and 2^(e_a + e_b) are normal float32 (|e_a + e_b| <= 126)
FP8_EXPONENT = 63

FORMATS: Dict[str, Format] = {
    "int8": Format("int8", float("inf"), 8, 0, scaled=True),
    "fp8": Format("fp8", 448.0, 8, 1, scaled=True, auto=False),
    "fp16": Format("fp16", 65504.0, 16, 2),
    "bf16": Format("bf16", float(np.finfo(np.float32).max) * (1 - 2.0 ** -8), 16, 3),
}
