"""Semantics of Cast (float32 to float32 only)."""
from __future__ import annotations

import z3

from .table import _in, sem
from .tensors import _unsupported

@sem("Cast")
def _cast(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    if int(attrs.get("to", 0)) != 1 or any(not isinstance(v, z3.ExprRef) or v.sort() != dom.sort
                                          for v in x.reshape(-1)):
        _unsupported("Cast", "only float32 -> float32 has Z3 semantics")
    return [x]
