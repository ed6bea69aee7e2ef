"""Semantics of Gather, CumSum and CumProd."""
from __future__ import annotations

import numpy as np

from .table import _in, sem
from .tensors import _axis, _empty, _ints, _unsupported

@sem("Gather")
def _gather(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    idx = attrs.get("indices", inputs[1] if len(inputs) > 1 else None)
    if idx is None:
        _unsupported("Gather", "indices are missing")
    arr = idx if isinstance(idx, np.ndarray) else np.asarray(idx, dtype=object)
    shape = arr.shape
    flat = _ints(list(arr.reshape(-1)))
    a = _axis(attrs.get("axis", 0), x.ndim)
    d = x.shape[a]
    flat = [i + d if i < 0 else i for i in flat]
    if any(not 0 <= i < d for i in flat):
        _unsupported("Gather", f"index out of range for axis of size {d}")
    return [np.take(x, np.array(flat, dtype=np.int64).reshape(shape), axis=a)]


@sem("CumSum")
def _cumsum(dom, inputs, attrs):
    return _cumulative(dom, inputs, attrs, 0.0, dom.add)


@sem("CumProd")
def _cumprod(dom, inputs, attrs):
    return _cumulative(dom, inputs, attrs, 1.0, dom.mul)


def _cumulative(dom, inputs, attrs, unit, combine):
    """Left to right (right to left when reversed) along the axis, from the first term."""
    x = _in(dom, inputs, 0)
    a = _axis(_ints(attrs.get("axis"))[0], x.ndim)
    excl, rev = bool(attrs.get("exclusive", 0)), bool(attrs.get("reverse", 0))
    t = np.moveaxis(x, a, -1)
    out = _empty(t.shape)
    for idx in np.ndindex(*t.shape[:-1]):
        row = list(t[idx])
        order = list(range(len(row)))[::-1] if rev else list(range(len(row)))
        acc = None
        for j in order:
            if excl:
                out[idx + (j,)] = dom.const(unit) if acc is None else acc
            acc = row[j] if acc is None else combine(acc, row[j])
            if not excl:
                out[idx + (j,)] = acc
    return [np.moveaxis(out, -1, a).copy()]
