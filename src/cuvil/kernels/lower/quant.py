"""Lowerings of the quantisation ops (QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul,
QLinearConv) and the zero-point subtraction the integer products share."""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...ir.dtype import DType
from ..texpr import E, binop, call, cast, cmp, const, reduce, select
from .qgemm import int8_conv_gemm
from .core import LOWERINGS, Index, TensorFn, broadcast_index, fconst, lowering, nan_max, nan_min, scalar_of, sub_ctx


def _per_axis(t: Optional[TensorFn], idx: Index, axis: int, rank: int, block: int = 0) -> Optional[E]:
    """A quantisation parameter at output index ``idx``: per tensor (one element), per ``axis`` (1-D) or
    blocked along ``axis`` (same rank as the data, ``block`` elements per entry)."""
    if t is None:
        return None
    if int(np.prod(t.shape)) == 1:
        return scalar_of(t)
    if block:
        sub = list(idx)
        sub[axis] = idx[axis] // block
        return t(sub)
    if len(t.shape) == 1:
        return t([idx[axis]])
    return t(broadcast_index(idx, t.shape, [0] * rank))


def _saturate_round(v: E, dt: DType) -> E:
    """round-half-to-even of a float, clamped to ``dt``'s range, converted to ``dt``."""
    lo, hi = dt.int_range
    r = call("roundeven", v)
    r = nan_max(r, fconst(float(lo), r))
    r = nan_min(r, fconst(float(hi), r))
    return cast(r, dt)


_QUANT_INTS = (DType.UINT8, DType.INT8, DType.UINT16, DType.INT16, DType.UINT4, DType.INT4, DType.UINT2, DType.INT2)


def _quant_dtype(ctx, dt: DType):
    if dt not in _QUANT_INTS and not (dt.is_minifloat and dt != DType.FLOAT8E8M0):
        ctx.unsupported(f"quantisation to {dt.name}")


@lowering("QuantizeLinear")
def _quantize(ctx):
    x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
    dt = ctx.out_dtype()
    _quant_dtype(ctx, dt)
    rank = len(x.shape)
    axis = ctx.attr("axis", 1) % max(rank, 1)
    block = ctx.attr("block_size", 0) or 0
    work = DType.DOUBLE if x.dtype == DType.DOUBLE else DType.FLOAT

    saturate = bool(ctx.attr("saturate", 1))

    def f(idx):
        s = cast(_per_axis(scale, idx, axis, rank, block), work)
        v = binop("div", cast(x(idx), work), s)
        if dt.is_minifloat:   # float8/float4: the cast rounds (to nearest even) and saturates (or not)
            if zp is not None:
                v = binop("add", v, cast(_per_axis(zp, idx, axis, rank, block), work))
            return cast(v, dt, saturate)
        v = call("roundeven", v)
        if zp is not None:
            v = binop("add", v, cast(_per_axis(zp, idx, axis, rank, block), work))
        return _saturate_round(v, dt)
    return [TensorFn(ctx.out_shape(), dt, f, "elementwise", (0,))]


@lowering("DequantizeLinear")
def _dequantize(ctx):
    x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
    dt = ctx.out_dtype()
    if x.dtype not in _QUANT_INTS + (DType.INT32,) and not (x.dtype.is_minifloat and x.dtype != DType.FLOAT8E8M0):
        ctx.unsupported(f"dequantisation of {x.dtype.name}")
    rank = len(x.shape)
    axis = ctx.attr("axis", 1) % max(rank, 1)
    block = ctx.attr("block_size", 0) or 0

    def f(idx):
        v = cast(x(idx), DType.FLOAT)
        if zp is not None:
            v = binop("sub", v, cast(_per_axis(zp, idx, axis, rank, block), DType.FLOAT))
        return cast(binop("mul", v, cast(_per_axis(scale, idx, axis, rank, block), DType.FLOAT)), dt)
    return [TensorFn(ctx.out_shape(), dt, f, "elementwise", (0,))]


@lowering("DynamicQuantizeLinear")
def _dyn_quantize(ctx):
    x = ctx.input(0)
    ext = list(x.shape)
    f32 = DType.FLOAT
    lo = ctx.temp((), f32, lambda idx: nan_min(reduce("min", ext, lambda *ks: x(list(ks))), const(0.0, f32)), "min")
    hi = ctx.temp((), f32, lambda idx: nan_max(reduce("max", ext, lambda *ks: x(list(ks))), const(0.0, f32)), "max")

    def scale_fn(idx):
        mn, mx = lo([]), hi([])
        rng = select(cmp("eq", mx, mn), const(1.0, f32), binop("sub", mx, mn))
        return binop("div", rng, const(255.0, f32))
    scale = ctx.temp((), f32, scale_fn, "scale")

    def zp_fn(idx):
        z = binop("sub", const(0.0, f32), binop("div", lo([]), scale([])))
        z = nan_min(nan_max(z, const(0.0, f32)), const(255.0, f32))
        return cast(call("roundeven", z), DType.UINT8)
    zp = ctx.temp((), DType.UINT8, zp_fn, "zp")

    def y(idx):
        v = binop("add", call("roundeven", binop("div", x(idx), scale([]))), cast(zp([]), f32))
        return _saturate_round(v, DType.UINT8)
    return [TensorFn(ctx.out_shape(0), DType.UINT8, y, "elementwise", (0,)),
            TensorFn((), f32, lambda idx: scale([]), "elementwise"),
            TensorFn((), DType.UINT8, lambda idx: zp([]), "elementwise")]


def minus_zp(t: TensorFn, zp: Optional[TensorFn], zp_axis: Optional[int]) -> TensorFn:
    """int32(t) - int32(zero point); the zero point is per tensor, or indexed by ``zp_axis`` of ``t``."""
    i32 = DType.INT32

    def f(idx):
        v = cast(t(idx), i32)
        if zp is None:
            return v
        if int(np.prod(zp.shape)) == 1:
            z = scalar_of(zp)
        else:
            z = zp([idx[zp_axis]] if len(zp.shape) == 1 else broadcast_index(idx, zp.shape, t.shape))
        return binop("sub", v, cast(z, i32))
    return TensorFn(t.shape, i32, f, "elementwise")


def _requantize(acc: TensorFn, mult, yzp: Optional[TensorFn], dt: DType, axis: int) -> TensorFn:
    """saturate(rint(acc * mult) + y_zero_point) as ``dt``; ``mult`` maps an index to a float multiplier."""
    def f(idx):
        v = binop("mul", cast(acc(idx), DType.FLOAT), mult(idx))
        v = call("roundeven", v)
        if yzp is not None:
            v = binop("add", v, cast(_per_axis(yzp, idx, axis, len(acc.shape)), DType.FLOAT))
        return _saturate_round(v, dt)
    return TensorFn(acc.shape, dt, f, "complex")


@lowering("QLinearMatMul")
def _qlinear_matmul(ctx):
    a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp = (ctx.input(i) for i in range(8))
    dt = ctx.out_dtype()
    _quant_dtype(ctx, dt)
    ra, rb = len(a.shape), len(b.shape)
    a2 = minus_zp(a, a_zp, ra - 2)
    b2 = minus_zp(b, b_zp, rb - 1)
    mctx = sub_ctx(ctx, [a2, b2])
    mctx.out_dtype = lambda j=0: DType.INT32
    acc = LOWERINGS["MatMul"](mctx)[0]
    out = ctx.out_shape()

    def mult(idx):
        sa = cast(scalar_of(a_s) if int(np.prod(a_s.shape)) == 1 else a_s([idx[-2]]), DType.FLOAT)
        sb = cast(scalar_of(b_s) if int(np.prod(b_s.shape)) == 1 else b_s([idx[-1]]), DType.FLOAT)
        sy = cast(scalar_of(y_s), DType.FLOAT)
        return binop("div", binop("mul", sa, sb), sy)
    return [_requantize(acc, mult, y_zp, dt, len(out) - 1)]


@lowering("QLinearConv")
def _qlinear_conv(ctx):
    x, x_s, x_zp, w, w_s, w_zp, y_s, y_zp = (ctx.input(i) for i in range(8))
    bias = ctx.input(8)
    dt = ctx.out_dtype()
    _quant_dtype(ctx, dt)
    gemm = int8_conv_gemm(ctx)   # the x86 int8 micro-kernels' form, where it applies (same bits)
    if gemm is not None:
        return [gemm]
    x2 = minus_zp(x, x_zp, 1)
    w2 = minus_zp(w, w_zp, 0)
    cctx = sub_ctx(ctx, [x2, w2, bias])
    cctx.out_dtype = lambda j=0: DType.INT32
    acc = LOWERINGS["Conv"](cctx)[0]

    def mult(idx):
        sw = cast(scalar_of(w_s) if int(np.prod(w_s.shape)) == 1 else w_s([idx[1]]), DType.FLOAT)
        return binop("div", binop("mul", cast(scalar_of(x_s), DType.FLOAT), sw), cast(scalar_of(y_s), DType.FLOAT))
    return [_requantize(acc, mult, y_zp, dt, 1)]
