"""QLinearConv as an int8 GEMM read in place (:class:`cuvil.kernels.contraction_int8.Int8Contraction`) for the
x86 micro-kernels: the input stored once as phase planes of unsigned bytes (a stage,
:class:`~cuvil.kernels.contraction_int8.Int8Planes`), the weights packed at compile time in groups of four
channels per tap, the requantisation constants per channel. Not a lowering of its own: the QLinearConv
lowering (:mod:`.quant`) asks :func:`int8_conv_gemm` first and keeps its reference form when it declines (no
micro-kernels, weights with a zero point, grouped or 3-D convolutions, dilations whose phases skip one,
symbolic shapes)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...ir.dtype import DType
from ..contraction_int8 import (AMX_INT8_TILES, MR_I8, Int8Contraction, Int8Planes, group_block, pack_int8_weights, plane_positions,
                                requant_constants)
from ..phase_planes import plane_geometry, plane_source
from ..texpr import E, binop, call, cast, const, load, reduce
from .core import TensorFn, fconst, nan_max, nan_min
from .windows import window_params

I32, U8, F32 = DType.INT32, DType.UINT8, DType.FLOAT


def _const(ctx, i: int) -> Optional[np.ndarray]:
    return ctx.const_input(i) if ctx.input(i) is not None else None


def int8_conv_gemm(ctx) -> Optional[TensorFn]:
    """QLinearConv's output as an ``E("qgemm")`` stage, or None where the micro-kernels do not apply."""
    x, w = ctx.input(0), ctx.input(3)
    dt = ctx.out_dtype()
    out = ctx.out_shape()
    # x86 only (its schedule asks for matmul panels; the GPU's does not): the int8 kernels read these forms
    if (not ctx.gemm_cols or not ctx.matmul_panels or ctx.unpadded_contractions or ctx._weight is None or dt not in (DType.UINT8, DType.INT8)
            or x.dtype not in (DType.UINT8, DType.INT8) or w.dtype != DType.INT8 or ctx.attr("group", 1) != 1
            or len(out) not in (3, 4) or not all(isinstance(d, int) for d in list(x.shape) + list(out))):
        return None
    xs, xzp, wq, ws, wzp, ys, yzp = (_const(ctx, i) for i in (1, 2, 3, 4, 5, 6, 7))
    bias = _const(ctx, 8)
    if any(v is None for v in (xs, wq, ws, ys)) or (ctx.input(8) is not None and bias is None):
        return None
    if (xzp is None and ctx.input(2) is not None) or (yzp is None and ctx.input(7) is not None):
        return None
    if wzp is not None and np.any(wzp != 0):
        return None
    if xs.size != 1 or ys.size != 1 or (xzp is not None and xzp.size != 1) or (yzp is not None and yzp.size != 1):
        return None
    m = wq.shape[0]
    if ws.size not in (1, m):
        return None
    zx = int(xzp.reshape(())) if xzp is not None else 0
    shifted = x.dtype == DType.INT8
    zx_u = zx + 128 if shifted else zx
    spatial = len(out) - 2
    strides, dil, begin = window_params(ctx, spatial, list(wq.shape[2:]), x.shape[2:], out[2:])
    if spatial == 1:    # a 1-D convolution as a 2-D one of height 1
        strides, dil, begin = [1] + list(strides), [1] + list(dil), [0] + list(begin)
    (kh_, kw_), (sh, sw), (dh, dw) = ([1] * (2 - spatial) + list(wq.shape[2:])), strides, dil
    in_hw = ([1] * (2 - spatial)) + list(x.shape[2:])
    oh_, ow_ = ([1] * (2 - spatial)) + list(out[2:])
    geo = plane_geometry((kh_, kw_), (sh, sw), (dh, dw), (oh_, ow_))
    if geo is None or min(begin) < 0:
        return None
    (rows, cols), grid, taps = geo.phases, geo.grid, geo.taps
    wq4 = wq.reshape(m, wq.shape[1], kh_, kw_)
    comp, mult = requant_constants(wq4, bias, zx_u, xs, np.broadcast_to(ws.reshape(-1), (m,)), ys)
    if np.any(np.abs(comp) >= 2 ** 31):
        return None
    cin = wq.shape[1]
    gb, G = group_block(-(-cin // 4))
    N = x.shape[0]
    PL = plane_positions(grid, oh_, geo.max_shift)
    if x.buf is None:
        x = ctx.temp(x.shape, x.dtype, x.fn, "in")
    planes = Int8Planes(x.buf, cin, G, tuple(in_hw), tuple(begin), (sh, sw), (rows, cols), grid, PL,
                        zx_u, shifted)
    H, W = in_hw

    def plane_fn(idx):
        n = idx[0]
        c, ih, iw, cond = plane_source(idx, 4, cin, (H, W), begin, (sh, sw), cols, grid)
        v = x.at_or([n, c, ih, iw] if spatial == 2 else [n, c, iw], cond, zx)
        v = cast(binop("add", cast(v, I32), const(128, I32)), U8) if shifted else cast(v, U8)
        return E("qplanes", list(idx) + [v], U8, planes)
    b_fn = ctx.temp((N, G, rows * cols, PL, 4), U8, plane_fn, "planes")
    w_buf = ctx.weight(pack_int8_weights(wq4, G, gb), "packed_i8")
    comp_buf = ctx.weight(comp.astype(np.int32), "comp")
    mult_buf = ctx.weight(mult, "mult")
    yz = int(yzp.reshape(())) if yzp is not None else 0
    spec = Int8Contraction(b_fn.buf, w_buf, comp_buf, mult_buf, N, m, cin * kh_ * kw_, taps, G, gb, grid[1],
                           (oh_, ow_), PL, rows * cols, yz, dt, AMX_INT8_TILES in ctx.narrow_formats)

    def f(idx):
        n, mo, o = idx[0], idx[1], idx[2:]
        p = o[0] * grid[1] + o[1] if spatial == 2 else o[0]
        mb, r = mo // MR_I8, mo % MR_I8

        def term(t, g, i):
            kh, kw = t // kw_, t % kw_
            ph = ((kh * dh) % sh) * cols + (kw * dw) % sw
            off = ((kh * dh) // sh) * grid[1] + (kw * dw) // sw
            bv = b_fn([n, g, ph, p + off, i])
            wv = load(w_buf, [mb, t, g // gb, r, (g % gb) * 4 + i])
            return binop("mul", cast(bv, I32), cast(wv, I32))
        acc = reduce("sum", [kh_ * kw_, G, 4], term)
        acc = binop("add", acc, load(comp_buf, [mo]))
        v = call("roundeven", binop("mul", cast(acc, F32), load(mult_buf, [mo])))
        v = binop("add", v, const(float(yz), F32))
        lo, hi = dt.int_range
        v = call("roundeven", v)
        v = nan_min(nan_max(v, fconst(float(lo), v)), fconst(float(hi), v))
        return E("qgemm", [n, mo] + list(o) + [cast(v, dt)], dt, spec)
    return TensorFn(out, dt, f, "complex", contraction=True)
