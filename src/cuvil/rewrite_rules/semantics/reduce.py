"""Semantics of the ReduceX ops: a map, a left-to-right fold over the reduced elements, a finish."""
from __future__ import annotations

import numpy as np

from .table import SEMANTICS, _in
from .tensors import _axis, _fold, _ints, _map, _reduce, _sum

_REDUCERS = {
    # name: (map applied first, fold over the reduced elements, finish(value, count))
    "ReduceSum": (None, "sum", None),
    "ReduceMean": (None, "sum", "mean"),
    "ReduceMax": (None, "max", None),
    "ReduceMin": (None, "min", None),
    "ReduceProd": (None, "prod", None),
    "ReduceSumSquare": ("square", "sum", None),
    "ReduceL1": ("abs", "sum", None),
    "ReduceL2": ("square", "sum", "sqrt"),
    "ReduceLogSum": (None, "sum", "log"),
    "ReduceLogSumExp": ("exp", "sum", "log"),
}


def _reduce_op(name):
    pre, fold, post = _REDUCERS[name]

    def run(dom, inputs, attrs):
        x = _in(dom, inputs, 0)
        if pre is not None:
            f = {"square": lambda v: dom.mul(v, v), "abs": dom.abs, "exp": dom.exp}[pre]
            x = _map(f, x)
        axes = _ints(attrs.get("axes"))
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return [x if post in (None, "mean") else _map(dom.sqrt if post == "sqrt" else dom.log, x)]
            axes = list(range(x.ndim))
        axes = [_axis(a, x.ndim) for a in axes]
        cnt = int(np.prod([x.shape[a] for a in set(axes)]))
        fn = {"sum": lambda v: _sum(dom, v), "max": lambda v: _fold(dom.maximum, v),
              "min": lambda v: _fold(dom.minimum, v), "prod": lambda v: _fold(dom.mul, v)}[fold]
        if post == "mean":
            g = lambda v: dom.div(fn(v), dom.const(float(cnt)))  # noqa: E731
        elif post == "sqrt":
            g = lambda v: dom.sqrt(fn(v))  # noqa: E731
        elif post == "log":
            g = lambda v: dom.log(fn(v))  # noqa: E731
        else:
            g = fn
        return [_reduce(x, axes, bool(attrs.get("keepdims", 1)), g)]
    return run


for _name in _REDUCERS:
    SEMANTICS[_name] = _reduce_op(_name)
