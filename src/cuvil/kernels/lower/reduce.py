"""Lowerings of the reductions (ReduceSum, ..., ArgMax, ArgMin)."""
from __future__ import annotations

from ...ir.dim import product
from ..texpr import I64, E, binop, call, cmp, const, reduce, select, unop
from .core import TensorFn, fconst, lowering


def _reduce_axes(ctx, rank):
    axes = ctx.attr("axes")
    if axes is None and ctx.input(1) is not None:
        ctx.unsupported("non-constant axes")
    if not axes:
        return [] if ctx.attr("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a % rank for a in axes)


_REDUCE = {"ReduceSum": "sum", "ReduceMean": "sum", "ReduceMax": "max", "ReduceMin": "min", "ReduceProd": "prod",
           "ReduceL1": "sum", "ReduceL2": "sum", "ReduceSumSquare": "sum", "ReduceLogSum": "sum", "ReduceLogSumExp": "sum"}


@lowering(*_REDUCE)
def _reduce(ctx):
    x = ctx.input(0)
    rank = len(x.shape)
    axes = _reduce_axes(ctx, rank)
    keep = ctx.attr("keepdims", 1)
    op = ctx.node.op
    ext = [x.shape[a] for a in axes]
    count = product(ext) if ext else 1

    def f(idx):
        if not axes:
            return x(idx)

        def src(*ks):
            full, it, kk = [], iter(idx), iter(ks)
            for d in range(rank):
                if d in axes:
                    full.append(next(kk))
                    if keep:
                        next(it)
                else:
                    full.append(next(it))
            v = x(full)
            if op == "ReduceL1":
                return call("fabs", v) if v.dtype.is_float else select(cmp("lt", v, const(0, v.dtype)), unop("neg", v), v)
            if op in ("ReduceL2", "ReduceSumSquare"):
                return binop("mul", v, v)
            if op == "ReduceLogSumExp":
                return call("exp", v)
            return v
        r = reduce(_REDUCE[op], ext, src)
        if op == "ReduceMean":
            return binop("div", r, fconst(count, r))
        if op == "ReduceL2":
            return call("sqrt", r)
        if op in ("ReduceLogSum", "ReduceLogSumExp"):
            return call("log", r)
        return r
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "complex")]


@lowering("ArgMax", "ArgMin")
def _argmax(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis", 0) % len(x.shape)
    keep = ctx.attr("keepdims", 1)
    last = ctx.attr("select_last_index", 0)
    n = x.shape[axis]
    better = "gt" if ctx.node.op == "ArgMax" else "lt"

    def f(idx):
        base = list(idx) if keep else idx[:axis] + [const(0, I64)] + idx[axis:]
        # a sequential scan: (best value, best index) pairs folded left
        return E("argscan", (), I64, (x, base, axis, n, better, bool(last)))
    return [TensorFn(ctx.out_shape(), I64, f, "complex")]
