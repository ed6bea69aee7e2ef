"""Semantics of Identity and Dropout (inference: the identity; training: a symbolic mask)."""
from __future__ import annotations

import z3

from .table import _in, sem
from .tensors import _map, _nout, _py_bool, _py_number, _scalar_attr

sem("Identity")(lambda dom, inputs, attrs: [_in(dom, inputs, 0)])


@sem("Dropout")
def _dropout(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    ratio = attrs.get("ratio", inputs[1] if len(inputs) > 1 else None)
    tm = attrs.get("training_mode", inputs[2] if len(inputs) > 2 else None)
    tm = False if tm is None else (_py_bool(tm) if _py_bool(tm) is not None else _scalar_attr(dom, tm))
    if tm is not False:
        ratio = 0.5 if ratio is None else ratio
        if _py_number(ratio) is not None and float(_py_number(ratio)) == 0.0:
            tm = False
    if tm is False:
        y, mask = x, _map(lambda _: z3.BoolVal(True), x)
    else:
        r = _scalar_attr(dom, ratio)
        scale = dom.div(dom.const(1.0), dom.sub(dom.const(1.0), r))
        keep_all = dom.eq(r, dom.const(0.0))
        keeps = _map(lambda _: z3.Or(dom.fresh_bool("dropout_mask"), keep_all), x)
        y = _map(lambda v, k: dom.ite(k, dom.mul(v, scale), dom.const(0.0)), x, keeps)
        mask = keeps
        if tm is not True:  # symbolic training_mode
            y = _map(lambda a, b: dom.ite(tm, a, b), y, x)
            mask = _map(lambda k: z3.Or(z3.Not(tm), k), keeps)
    return [y, mask][:max(1, _nout(attrs))]
