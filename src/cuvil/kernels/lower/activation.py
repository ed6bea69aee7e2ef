"""Lowerings of the activation functions (Relu, Sigmoid, Gelu, ..., Clip)."""
from __future__ import annotations

import math

from ..texpr import E, binop, call, cmp, select, unop
from .core import elementwise, fconst, lowering, nan_max, nan_min


def relu(x: E) -> E:
    return nan_max(x, fconst(0, x))


@lowering("Relu")
def _relu(ctx):
    return elementwise(ctx, relu)


@lowering("LeakyRelu")
def _leaky(ctx):
    alpha = ctx.attr("alpha", 0.01)
    return elementwise(ctx, lambda x: select(cmp("lt", x, fconst(0, x)), binop("mul", x, fconst(alpha, x)), x))


@lowering("PRelu")
def _prelu(ctx):
    return elementwise(ctx, lambda x, s: select(cmp("lt", x, fconst(0, x)), binop("mul", x, s), x))


@lowering("Elu")
def _elu(ctx):
    alpha = ctx.attr("alpha", 1.0)
    return elementwise(ctx, lambda x: select(cmp("lt", x, fconst(0, x)),
                                             binop("mul", fconst(alpha, x), binop("sub", call("exp", x), fconst(1, x))), x))


@lowering("Selu")
def _selu(ctx):
    alpha, gamma = ctx.attr("alpha"), ctx.attr("gamma")
    return elementwise(ctx, lambda x: binop("mul", fconst(gamma, x), select(
        cmp("le", x, fconst(0, x)), binop("sub", binop("mul", fconst(alpha, x), call("exp", x)), fconst(alpha, x)), x)))


@lowering("Celu")
def _celu(ctx):
    alpha = ctx.attr("alpha", 1.0)

    def f(x):
        neg = binop("mul", fconst(alpha, x), binop("sub", call("exp", binop("div", x, fconst(alpha, x))), fconst(1, x)))
        return binop("add", nan_max(fconst(0, x), x), nan_min(fconst(0, x), neg))
    return elementwise(ctx, f)


@lowering("Sigmoid")
def _sigmoid(ctx):
    return elementwise(ctx, lambda x: binop("div", fconst(1, x), binop("add", fconst(1, x), call("exp", unop("neg", x)))))


@lowering("Tanh")
def _tanh(ctx):
    return elementwise(ctx, lambda x: call("tanh", x))


@lowering("HardSigmoid")
def _hsig(ctx):
    a, b = ctx.attr("alpha", 0.2), ctx.attr("beta", 0.5)
    return elementwise(ctx, lambda x: nan_max(fconst(0, x), nan_min(fconst(1, x), binop("add", binop("mul", fconst(a, x), x), fconst(b, x)))))


@lowering("HardSwish")
def _hswish(ctx):
    def f(x):
        hs = nan_max(fconst(0, x), nan_min(fconst(1, x), binop("add", binop("mul", fconst(1 / 6, x), x), fconst(0.5, x))))
        return binop("mul", x, hs)
    return elementwise(ctx, f)


@lowering("Softplus")
def _softplus(ctx):
    return elementwise(ctx, lambda x: call("log", binop("add", call("exp", x), fconst(1, x))))


@lowering("Softsign")
def _softsign(ctx):
    return elementwise(ctx, lambda x: binop("div", x, binop("add", fconst(1, x), call("fabs", x))))


@lowering("Mish")
def _mish(ctx):
    return elementwise(ctx, lambda x: binop("mul", x, call("tanh", call("log", binop("add", call("exp", x), fconst(1, x))))))


@lowering("Gelu")
def _gelu(ctx):
    approx = ctx.attr("approximate", "none")

    def f(x):
        if approx == "tanh":
            inner = binop("mul", fconst(math.sqrt(2 / math.pi), x),
                          binop("add", x, binop("mul", fconst(0.044715, x), binop("mul", x, binop("mul", x, x)))))
            t = call("tanh", inner)
        else:
            t = call("erf", binop("div", x, fconst(math.sqrt(2), x)))
        return binop("mul", binop("mul", fconst(0.5, x), x), binop("add", fconst(1, x), t))
    return elementwise(ctx, f)


@lowering("ThresholdedRelu")
def _trelu(ctx):
    alpha = ctx.attr("alpha", 1.0)
    return elementwise(ctx, lambda x: select(cmp("gt", x, fconst(alpha, x)), x, fconst(0, x)))


@lowering("Shrink")
def _shrink(ctx):
    bias, lambd = ctx.attr("bias", 0.0), ctx.attr("lambd", 0.5)
    return elementwise(ctx, lambda x: select(cmp("lt", x, fconst(-lambd, x)), binop("add", x, fconst(bias, x)),
                                             select(cmp("gt", x, fconst(lambd, x)), binop("sub", x, fconst(bias, x)), fconst(0, x))))


@lowering("Clip")
def _clip(ctx):
    lo, hi = ctx.attr("min"), ctx.attr("max")
    lo_in, hi_in = ctx.input(1), ctx.input(2)

    def f(x, *bounds):
        bounds = list(bounds)
        y = x
        lo_e = bounds.pop(0) if lo_in is not None else (fconst(lo, x) if lo is not None else None)
        hi_e = bounds.pop(0) if hi_in is not None else (fconst(hi, x) if hi is not None else None)
        # numpy clip with scalar bounds: t = lo if x < lo else x; y = hi if t > hi else t; NaN stays NaN
        if lo_e is not None:
            y = select(cmp("lt", y, lo_e), lo_e, y)
        if hi_e is not None:
            y = select(cmp("gt", y, hi_e), hi_e, y)
        return y
    ins = [ctx.input(0)] + [t for t in (lo_in, hi_in) if t is not None]
    return elementwise(ctx, f, ins)
