"""Semantics of Softmax and LogSoftmax (function bodies in float32; exp / sum over the reals)."""
from __future__ import annotations

from .domains import RealDomain
from .table import SEMANTICS, _in
from .tensors import _axis, _fold, _map, _reduce, _sum

def _softmax_op(log: bool):
    def run(dom, inputs, attrs):
        x = _in(dom, inputs, 0)
        a = _axis(attrs.get("axis", -1), x.ndim)
        if isinstance(dom, RealDomain):
            # Mathematically the same as the function body's max-shifted form: exp(x) / sum(exp(x)); and
            # LogSoftmax is, by definition, Log(Softmax(x)).
            e = _map(dom.exp, x)
            y = _map(dom.div, e, _reduce(e, [a], True, lambda v: _sum(dom, v)))
            return [_map(dom.log, y) if log else y]
        # the ONNX function body, in float32
        xs = _map(dom.sub, x, _reduce(x, [a], True, lambda v: _fold(dom.maximum, v)))
        e = _map(dom.exp, xs)
        s = _reduce(e, [a], True, lambda v: _sum(dom, v))
        if log:
            return [_map(dom.sub, xs, _map(dom.log, s))]
        return [_map(dom.div, e, s)]
    return run


SEMANTICS["Softmax"] = _softmax_op(False)
SEMANTICS["LogSoftmax"] = _softmax_op(True)
