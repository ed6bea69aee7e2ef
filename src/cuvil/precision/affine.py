"""Relational tightenings where plain intervals lose the correlation between two operands of one op.

Interval arithmetic treats ``x - m`` as if ``x`` and ``m`` were independent; when ``m`` is computed from ``x``
that over-approximates. The affine view (each operand a linear form over the same elements of ``x``) gives:

* ``x - ReduceMax(x)`` lies in ``[lo - hi, 0]`` (Softmax's stabilising shift, then ``Exp`` in ``(0, 1]``);
* ``x - x`` is 0.

:func:`tighten` returns the tighter interval for such a node (the caller intersects it with the plain one), or
None when no pattern applies.
"""
from __future__ import annotations

from typing import Optional

from ..ir.graph import Graph, Node
from .interval import Interval


def tighten(graph: Graph, n: Node, r) -> Optional[Interval]:
    if n.op != "Sub" or len(n.inputs) != 2 or n.inputs[0] is None or n.inputs[1] is None:
        return None
    x, m = n.inputs
    if x is m:
        return Interval.of(0.0, 0.0)
    p = m.producer
    if p is None or not p.inputs or p.inputs[0] is not x or id(x) not in r:
        return None
    if p.attrs.get("keepdims", 1) == 0:
        return None
    xr = r[id(x)].hull()
    span = xr.max - xr.min
    if p.op == "ReduceMax":
        return Interval.of(-span, 0.0)
    return None
