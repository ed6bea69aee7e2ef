"""Lowerings of the elementwise math, logic, comparison and bitwise ops (numpy broadcasting)."""
from __future__ import annotations

import math

import numpy as np

from ...ir.dtype import DType
from ..texpr import BOOL, E, binop, call, cast, cmp, const, logic, select, unop
from .core import elementwise, fconst, lowering, nan_max, nan_min


_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}


@lowering("Add", "Sub", "Mul", "Div")
def _arith(ctx):
    op = _BINARY[ctx.node.op]
    return elementwise(ctx, lambda a, b: binop(op, a, b))


@lowering("Pow")
def _pow(ctx):
    def f(a, b):
        if a.dtype.is_float:
            return call("pow", a, cast(b, a.dtype))
        return cast(call("pow", cast(a, DType.DOUBLE), cast(b, DType.DOUBLE)), a.dtype)
    return elementwise(ctx, f)


@lowering("Mod")
def _mod(ctx):
    fmod = ctx.attr("fmod", 0)

    def f(a, b):
        if fmod or not a.dtype.is_float:
            return E("fmod" if fmod else "pymod", (a, b), a.dtype)
        # fmod=0 on floats: numpy's mod (the sign of the divisor), as the reference computes it
        r = E("fmod", (a, b), a.dtype)
        z = fconst(0, r)
        b_neg = cmp("lt", b, z)
        fix = logic("and", cmp("ne", r, z), logic("xor", cmp("lt", r, z), b_neg))
        signed_zero = select(b_neg, fconst(-0.0, r), z)
        return select(fix, binop("add", r, b), select(cmp("eq", r, z), signed_zero, r))
    return elementwise(ctx, f)


@lowering("Max", "Min", "Sum", "Mean")
def _variadic(ctx):
    op = ctx.node.op
    ins = [t for t in ctx.inputs if t is not None]

    def f(*xs):
        acc = xs[0]
        for x in xs[1:]:
            acc = nan_max(acc, x) if op == "Max" else nan_min(acc, x) if op == "Min" else binop("add", acc, x)
        return binop("div", acc, fconst(len(xs), acc)) if op == "Mean" else acc
    return elementwise(ctx, f, ins)


_UNARY_CALLS = {"Sqrt": "sqrt", "Exp": "exp", "Log": "log", "Sin": "sin", "Cos": "cos", "Tan": "tan",
                "Asin": "asin", "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh",
                "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "Erf": "erf", "Floor": "floor",
                "Ceil": "ceil", "Round": "roundeven"}


@lowering(*_UNARY_CALLS)
def _unary_call(ctx):
    fn = _UNARY_CALLS[ctx.node.op]
    return elementwise(ctx, lambda x: call(fn, x))


@lowering("Abs")
def _abs(ctx):
    return elementwise(ctx, lambda x: call("fabs", x) if x.dtype.is_float else select(cmp("lt", x, const(0, x.dtype)), unop("neg", x), x))


@lowering("Neg")
def _neg(ctx):
    return elementwise(ctx, lambda x: unop("neg", x))


@lowering("Reciprocal")
def _recip(ctx):
    return elementwise(ctx, lambda x: binop("div", fconst(1, x), x))


@lowering("Sign")
def _sign(ctx):
    def f(x):
        z = fconst(0, x)
        s = select(cmp("gt", x, z), fconst(1, x), select(cmp("lt", x, z), fconst(-1, x), z))
        return select(cmp("uno", x, x), x, s) if x.dtype.is_float else s
    return elementwise(ctx, f)


_CMP = {"Equal": "eq", "Less": "lt", "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge"}


@lowering(*_CMP)
def _cmp(ctx):
    pred = _CMP[ctx.node.op]
    return elementwise(ctx, lambda a, b: cmp(pred, a, b), dtype=BOOL)


@lowering("And", "Or", "Xor")
def _logic(ctx):
    op = ctx.node.op.lower()
    return elementwise(ctx, lambda a, b: logic(op, a, b), dtype=BOOL)


@lowering("Not")
def _not(ctx):
    return elementwise(ctx, lambda a: logic("not", a), dtype=BOOL)


@lowering("IsNaN")
def _isnan(ctx):
    return elementwise(ctx, lambda a: cmp("uno", a, a), dtype=BOOL)


@lowering("IsInf")
def _isinf(ctx):
    pos, neg = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)

    def f(a):
        conds = []
        if pos:
            conds.append(cmp("eq", a, fconst(math.inf, a)))
        if neg:
            conds.append(cmp("eq", a, fconst(-math.inf, a)))
        if not conds:
            return const(False, BOOL)
        return conds[0] if len(conds) == 1 else logic("or", *conds)
    return elementwise(ctx, f, dtype=BOOL)


@lowering("Where")
def _where(ctx):
    return elementwise(ctx, lambda c, a, b: select(c, a, b))


@lowering("BitwiseAnd", "BitwiseOr", "BitwiseXor")
def _bitwise(ctx):
    op = {"BitwiseAnd": "and", "BitwiseOr": "or", "BitwiseXor": "xor"}[ctx.node.op]
    return elementwise(ctx, lambda a, b: E(op, (a, b), a.dtype))


@lowering("BitwiseNot")
def _bitwise_not(ctx):
    return elementwise(ctx, lambda a: E("not", (a,), a.dtype))


@lowering("BitShift")
def _bitshift(ctx):
    left = ctx.attr("direction") == "LEFT"

    def f(a, b):
        bits = a.dtype.itemsize * 8
        signed = a.dtype.is_int and np.dtype(a.dtype.numpy).kind == "i"
        out_of_range = cmp("ge", b, const(bits, b.dtype))
        if signed:
            out_of_range = logic("or", out_of_range, cmp("lt", b, const(0, b.dtype)))
        if left:
            # every bit is shifted out when the amount reaches the width (or is negative)
            return select(out_of_range, const(0, a.dtype), E("shl", (a, b), a.dtype))
        if signed:  # arithmetic shift: the sign fills in
            return E("ashr", (a, select(out_of_range, const(bits - 1, b.dtype), b)), a.dtype)
        return select(out_of_range, const(0, a.dtype), E("lshr", (a, b), a.dtype))
    return elementwise(ctx, f)
