"""The number formats a node may compute in, what each holds, and the margins the policy keeps.

A narrowed node rounds its float inputs to the format and accumulates in float32 (:attr:`Node.precision
<cuvil.ir.graph.Node.precision>`). The policy (:mod:`cuvil.precision.policy`) asks of every value the node
reads, computes inside and writes that its certified range fit the format with a margin:

* fp16: ``|x| <= 65504 / 2`` (half the largest finite half: the sums and products that follow on the value,
  rounded again, keep a factor 2 of headroom);
* bf16: ``|x| <= 3.39e38 / 2`` (float32's exponent range: bf16 can only overflow where float32 nearly does);
* int8: a bounded range, from which the scale ``max|x| / 127`` is taken so that nothing saturates.

A range that is unbounded or not finite is never safe.
"""
from __future__ import annotations

from typing import Dict, Optional

import attrs
import numpy as np

from .interval import Interval

#: ``--precision`` values: one format for every node that can take it, or ``auto`` (the narrowest safe one).
PRECISIONS = ("fp32", "bf16", "fp16", "int8", "auto")

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
        if self.name == "int8":   # the scale makes any bounded float32 range fit; past float32 it is not one
            return None if iv.max_abs <= FLOAT32_MAX else f"range {iv.text()} exceeds float32"
        if iv.max_abs > self.limit:
            return f"range {iv.text()} exceeds ±{self.limit:.6g} ({self.name} max {self.max_finite:.6g} / {MARGIN:g})"
        return None

    def scale(self, iv: Interval) -> float:
        """int8: the symmetric scale that maps the range onto [-127, 127] without saturation."""
        return max(iv.max_abs, float(np.finfo(np.float32).tiny)) / 127.0


FORMATS: Dict[str, Format] = {
    "int8": Format("int8", float("inf"), 8, 0),
    "fp16": Format("fp16", 65504.0, 16, 1),
    "bf16": Format("bf16", float(np.finfo(np.float32).max) * (1 - 2.0 ** -8), 16, 2),
}
