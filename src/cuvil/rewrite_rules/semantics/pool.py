"""Semantics of the pooling ops (padding ignored; MaxPool skips NaNs, AveragePool propagates them)."""
from __future__ import annotations

import numpy as np

from .conv import _window
from .table import _in, sem
from .tensors import _empty, _fold, _ints, _nout, _reduce, _sum, _unsupported

def _pool(dom, x, attrs, kernel, combine):
    outs, begins, ends, strides, dils = _window(x.shape[2:], kernel, attrs, ceil=bool(attrs.get("ceil_mode", 0)))
    y = _empty(x.shape[:2] + tuple(outs))
    for nc in np.ndindex(*x.shape[:2]):
        for o in np.ndindex(*outs):
            inside, padded = [], 0
            for k in np.ndindex(*kernel):
                pos = tuple(oo * s - b + kk * d for oo, s, b, kk, d in zip(o, strides, begins, k, dils))
                if all(0 <= p < h for p, h in zip(pos, x.shape[2:])):
                    inside.append(x[nc + pos])
                if all(-b <= p < h + e for p, b, h, e in zip(pos, begins, x.shape[2:], ends)):
                    padded += 1
            if not inside:
                _unsupported("pool", "a window lies entirely in the padding")
            y[nc + o] = combine(inside, padded)
    return y


@sem("MaxPool")
def _maxpool(dom, inputs, attrs):
    if _nout(attrs) > 1:
        _unsupported("MaxPool", "the Indices output has no Z3 semantics")
    x = _in(dom, inputs, 0)
    return [_pool(dom, x, attrs, _ints(attrs["kernel_shape"]), lambda v, _n: _fold(dom.nan_skipping_max, v))]


@sem("AveragePool")
def _avgpool(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    incl = bool(attrs.get("count_include_pad", 0))
    return [_pool(dom, x, attrs, _ints(attrs["kernel_shape"]),
                  lambda v, npad: dom.div(_sum(dom, v), dom.const(float(npad if incl else len(v)))))]


@sem("GlobalAveragePool")
def _gap(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    cnt = dom.const(float(np.prod(x.shape[2:])))
    return [_reduce(x, range(2, x.ndim), True, lambda v: dom.div(_sum(dom, v), cnt))]


@sem("GlobalMaxPool")
def _gmp(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    return [_reduce(x, range(2, x.ndim), True, lambda v: _fold(dom.maximum, v))]
