"""Lowerings of Softmax, LogSoftmax and Hardmax."""
from __future__ import annotations

from ..texpr import I64, E, binop, call, cmp, const, reduce, select
from .core import TensorFn, lowering


def _row_temp(ctx, x: TensorFn, axis: int, kind: str, body=None, name="row"):
    """A materialised reduction of ``x`` over ``axis`` with keepdims (shape[axis] = 1)."""
    shape = list(x.shape)
    n = shape[axis]
    shape[axis] = 1

    def f(idx):
        def src(k):
            full = list(idx)
            full[axis] = k
            return body(full) if body else x(full)
        return reduce(kind, [n], src)
    return ctx.temp(shape, x.dtype, f, name)


@lowering("Softmax", "LogSoftmax")
def _softmax(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis", -1) % len(x.shape)
    m = _row_temp(ctx, x, axis, "max", name="max")

    def at_row(t, idx):
        full = list(idx)
        full[axis] = const(0, I64)
        return t(full)
    s = _row_temp(ctx, x, axis, "sum", body=lambda full: call("exp", binop("sub", x(full), at_row(m, full))), name="sum")
    if ctx.node.op == "Softmax":
        f = lambda idx: binop("div", call("exp", binop("sub", x(idx), at_row(m, idx))), at_row(s, idx))
    else:
        f = lambda idx: binop("sub", binop("sub", x(idx), at_row(m, idx)), call("log", at_row(s, idx)))
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "elementwise", (0,))]


@lowering("Hardmax")
def _hardmax(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis", -1) % len(x.shape)
    n = x.shape[axis]
    shape = list(x.shape)
    shape[axis] = 1
    arg = ctx.temp(shape, I64, lambda idx: E("argscan", (), I64, (x, list(idx), axis, n, "gt", False)), "argmax")

    def f(idx):
        sub = list(idx)
        sub[axis] = const(0, I64)
        return select(cmp("eq", arg(sub), idx[axis]), const(1, x.dtype), const(0, x.dtype))
    return [TensorFn(ctx.out_shape(), x.dtype, f, "elementwise", (0,))]
