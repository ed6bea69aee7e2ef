"""Lowerings of the normalisations (batch, instance, layer, group, RMS, Lp, LRN, mean-variance)."""
from __future__ import annotations

from typing import Sequence

from ...ir.dim import product
from ..texpr import I64, E, binop, call, cast, cmp, const, in_range, reduce, select, var
from .core import Index, TensorFn, broadcast_fn, fconst, lowering


@lowering("BatchNormalization")
def _batchnorm(ctx):
    if ctx.attr("training_mode", 0):
        return _batchnorm_training(ctx)
    x, sc, bi, mean, var = ctx.inputs[:5]
    eps = ctx.attr("epsilon", 1e-5)
    out = ctx.out_shape()

    def f(idx):
        c = [idx[1]]
        xv = x(idx)
        inv = call("sqrt", binop("add", var(c), fconst(eps, xv)))
        return binop("add", binop("mul", binop("div", binop("sub", xv, mean(c)), inv), sc(c)), bi(c))
    return [TensorFn(out, ctx.out_dtype(), f, "elementwise", (0,))]


def _batchnorm_training(ctx):
    """Training form: normalised by the batch's own statistics (mean and biased variance over every axis but
    the channel), and the running statistics updated with ``momentum``, as ONNX defines it."""
    x, sc, bi, mean_in, var_in = ctx.inputs[:5]
    eps, momentum = ctx.attr("epsilon", 1e-5), ctx.attr("momentum", 0.9)
    shape = list(x.shape)
    others = [shape[0]] + shape[2:]
    cnt = product(others)

    def at(c, ks):
        return [ks[0], c] + list(ks[1:])
    mean = ctx.temp([shape[1]], x.dtype, lambda idx: binop("div", reduce("sum", others, lambda *ks: x(at(idx[0], ks))),
                                                          const(cnt, x.dtype)), "mean")
    var = ctx.temp([shape[1]], x.dtype, lambda idx: binop("div", reduce("sum", others, lambda *ks: _sq(binop(
        "sub", x(at(idx[0], ks)), mean(idx)))), const(cnt, x.dtype)), "var")

    def y(idx):
        c = [idx[1]]
        inv = call("sqrt", binop("add", var(c), fconst(eps, var(c))))
        return binop("add", binop("mul", binop("div", binop("sub", x(idx), mean(c)), inv), sc(c)), bi(c))

    def running(stat, given):
        def f(idx):
            g = given(idx)
            return binop("add", binop("mul", g, fconst(momentum, g)), binop("mul", cast(stat(idx), g.dtype), fconst(1 - momentum, g)))
        return f
    outs = [TensorFn(ctx.out_shape(), ctx.out_dtype(), y, "complex")]
    for k, (stat, given) in enumerate(((mean, mean_in), (var, var_in)), 1):
        if k < len(ctx.node.outputs):
            outs.append(TensorFn(ctx.out_shape(k), ctx.out_dtype(k), running(stat, given), "elementwise"))
    return outs


@lowering("InstanceNormalization")
def _instancenorm(ctx):
    x, sc, bi = ctx.inputs[:3]
    eps = ctx.attr("epsilon", 1e-5)
    shape = list(x.shape)
    sp = shape[2:]
    cnt = product(sp)
    stat_shape = shape[:2] + [1] * len(sp)
    zeros = [const(0, I64)] * len(sp)
    mean = ctx.temp(stat_shape, x.dtype, lambda idx: binop("div", reduce("sum", sp, lambda *ks: x(idx[:2] + list(ks))), const(cnt, x.dtype)), "mean")
    var = ctx.temp(stat_shape, x.dtype, lambda idx: binop("div", reduce("sum", sp, lambda *ks: _sq(binop(
        "sub", x(idx[:2] + list(ks)), mean(idx[:2] + zeros)))), const(cnt, x.dtype)), "var")

    def f(idx):
        st = idx[:2] + zeros
        xv = x(idx)
        return binop("add", binop("div", binop("mul", binop("sub", xv, mean(st)), sc([idx[1]])),
                                  call("sqrt", binop("add", var(st), fconst(eps, xv)))), bi([idx[1]]))
    return [TensorFn(tuple(shape), ctx.out_dtype(), f, "elementwise", (0,))]


def _sq(v):
    return binop("mul", v, v)


@lowering("LayerNormalization")
def _layernorm(ctx):
    x, sc, bi = ctx.input(0), ctx.input(1), ctx.input(2)
    axis = ctx.attr("axis", -1) % len(x.shape)
    eps = ctx.attr("epsilon", 1e-5)
    shape = list(x.shape)
    norm = shape[axis:]
    cnt = product(norm)
    stat_shape = shape[:axis] + [1] * len(norm)
    zeros = [const(0, I64)] * len(norm)
    mean = ctx.temp(stat_shape, x.dtype, lambda idx: binop("div", reduce("sum", norm, lambda *ks: x(idx[:axis] + list(ks))), const(cnt, x.dtype)), "mean")
    var = ctx.temp(stat_shape, x.dtype, lambda idx: binop("div", reduce("sum", norm, lambda *ks: _sq(binop(
        "sub", x(idx[:axis] + list(ks)), mean(idx[:axis] + zeros)))), const(cnt, x.dtype)), "var")
    scf, bif = broadcast_fn(sc, shape), (broadcast_fn(bi, shape) if bi is not None else None)

    def f(idx):
        # ONNX's function body: D * Reciprocal(Sqrt(Var + eps)), then * Scale, + B. The reciprocal is the row's
        # (hoisted out of the loop over the normalised axes), so an element costs a multiply, not a divide
        # (a vdivps a vector: LayerNorm's normalising pass was 57% of its time in BERT-base)
        st = idx[:axis] + zeros
        xv = x(idx)
        inv = binop("div", fconst(1, xv), call("sqrt", binop("add", var(st), fconst(eps, xv))))
        y = binop("mul", binop("mul", binop("sub", xv, mean(st)), inv), scf(idx))
        return binop("add", y, bif(idx)) if bif else y
    outs = [TensorFn(tuple(shape), ctx.out_dtype(), f, "elementwise", (0,))]
    if len(ctx.node.outputs) > 1:  # Mean and InvStdDev (keepdims shape)
        outs.append(TensorFn(tuple(stat_shape), ctx.out_dtype(1), lambda idx: cast(mean(idx), ctx.out_dtype(1)), "elementwise"))
    if len(ctx.node.outputs) > 2:
        def inv_std(idx):
            v = var(idx)
            return cast(binop("div", fconst(1, v), call("sqrt", binop("add", v, fconst(eps, v)))), ctx.out_dtype(2))
        outs.append(TensorFn(tuple(stat_shape), ctx.out_dtype(2), inv_std, "elementwise"))
    return outs


@lowering("LRN")
def _lrn(ctx):
    x = ctx.input(0)
    size = ctx.attr("size")
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    C = x.shape[1]
    lo = (size - 1) // 2

    def f(idx):
        n, c, rest = idx[0], idx[1], idx[2:]

        def body(k):
            cc = c - lo + k
            return _sq(x.at_or([n, cc] + rest, in_range(cc, 0, C), 0.0))
        s = reduce("sum", [size], body)
        xv = x(idx)
        den = pow_const(binop("add", fconst(bias, xv), binop("mul", fconst(alpha / size, xv), s)), beta)
        return binop("div", xv, den)
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "complex")]


def pow_const(b: E, beta: float) -> E:
    """``b ** beta`` for a constant exponent. The exponents LRN uses become square roots, which vectorise
    (a scalar powf call per element cost AlexNet/Inception-style LRN 10 ns per element): b^0.75 =
    sqrt(b) * sqrt(sqrt(b)) and b^0.5 = sqrt(b) for b >= 0 (equal over the reals; about one more ulp of
    rounding than powf), and NaN for b < 0 like pow."""
    if beta == 1.0:
        return b
    if beta == 0.5:
        return call("sqrt", b)
    if beta == 0.75:
        r = call("sqrt", b)
        return binop("mul", r, call("sqrt", r))
    return call("pow", b, fconst(beta, b))


def _stat(ctx, x: TensorFn, axes: Sequence[int], body, name: str, dtype=None) -> TensorFn:
    """A materialised reduction (sum of ``body(full index)``) over ``axes`` with keepdims."""
    shape = list(x.shape)
    ext = [shape[a] for a in axes]
    for a in axes:
        shape[a] = 1

    def f(idx):
        def src(*ks):
            full = list(idx)
            for a, kk in zip(axes, ks):
                full[a] = kk
            return body(full)
        return reduce("sum", ext, src)
    return ctx.temp(shape, dtype or x.dtype, f, name)


def _at_stat(t: TensorFn, idx: Index, axes: Sequence[int]) -> E:
    sub = list(idx)
    for a in axes:
        sub[a] = const(0, I64)
    return t(sub)


@lowering("RMSNormalization")
def _rmsnorm(ctx):
    x, sc = ctx.input(0), ctx.input(1)
    rank = len(x.shape)
    axis = ctx.attr("axis", -1) % rank
    eps = ctx.attr("epsilon", 1e-5)
    axes = list(range(axis, rank))
    cnt = product([x.shape[a] for a in axes])
    ss = _stat(ctx, x, axes, lambda full: _sq(x(full)), "sumsq")
    scf = broadcast_fn(sc, x.shape)

    def f(idx):
        xv = x(idx)
        rms = call("sqrt", binop("add", binop("div", _at_stat(ss, idx, axes), fconst(cnt, xv)), fconst(eps, xv)))
        return binop("mul", binop("div", xv, rms), scf(idx))
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "elementwise", (0,))]


@lowering("LpNormalization")
def _lpnorm(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis", -1) % len(x.shape)
    p = ctx.attr("p", 2)
    if p not in (1, 2):
        ctx.unsupported(f"p={p}")
    norm = _stat(ctx, x, [axis], lambda full: _sq(x(full)) if p == 2 else call("fabs", x(full)), "norm")

    def f(idx):
        nv = _at_stat(norm, idx, [axis])
        nv = call("sqrt", nv) if p == 2 else nv
        xv = x(idx)
        return select(cmp("eq", nv, fconst(0, nv)), fconst(0, xv), binop("div", xv, nv))
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "elementwise", (0,))]


@lowering("MeanVarianceNormalization")
def _mvn(ctx):
    x = ctx.input(0)
    rank = len(x.shape)
    axes = sorted(a % rank for a in (ctx.attr("axes") or [0, 2, 3]))
    cnt = product([x.shape[a] for a in axes])
    s1 = _stat(ctx, x, axes, lambda full: x(full), "sum")
    s2 = _stat(ctx, x, axes, lambda full: _sq(x(full)), "sumsq")

    def f(idx):
        xv = x(idx)
        mean = binop("div", _at_stat(s1, idx, axes), fconst(cnt, xv))
        var = binop("sub", binop("div", _at_stat(s2, idx, axes), fconst(cnt, xv)), _sq(mean))
        return binop("div", binop("sub", xv, mean), binop("add", call("sqrt", var), fconst(1e-9, xv)))
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "elementwise", (0,))]


@lowering("GroupNormalization")
def _groupnorm(ctx):
    x, sc, bi = ctx.input(0), ctx.input(1), ctx.input(2)
    groups = ctx.attr("num_groups")
    eps = ctx.attr("epsilon", 1e-5)
    N, C = x.shape[0], x.shape[1]
    sp = list(x.shape[2:])
    cg = C // groups
    cnt = cg * product(sp)
    xg = lambda n, g, c, ks: x([n, g * cg + c] + list(ks))
    mean = ctx.temp([N, groups], x.dtype, lambda idx: binop("div", reduce(
        "sum", [cg] + sp, lambda c, *ks: xg(idx[0], idx[1], c, ks)), const(cnt, x.dtype)), "mean")
    var = ctx.temp([N, groups], x.dtype, lambda idx: binop("div", reduce(
        "sum", [cg] + sp, lambda c, *ks: _sq(binop("sub", xg(idx[0], idx[1], c, ks), mean(idx)))), const(cnt, x.dtype)), "var")
    per_channel = sc.shape[0] == C

    def f(idx):
        n, c = idx[0], idx[1]
        g = [n, c // cg]
        xv = x(idx)
        y = binop("div", binop("sub", xv, mean(g)), call("sqrt", binop("add", var(g), fconst(eps, xv))))
        p = [c] if per_channel else [c // cg]
        return binop("add", binop("mul", y, sc(p)), bi(p))
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "elementwise", (0,))]
