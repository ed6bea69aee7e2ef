"""QLinearConv as an int8 GEMM (:class:`cuvil.kernels.contraction_int8.Int8Contraction`) for the x86
micro-kernels: the im2col panels of the input as unsigned bytes (a stored stage), the weights packed at compile
time in groups of four k's, the requantisation constants per channel. Not a lowering of its own: the
QLinearConv lowering (:mod:`.quant`) asks :func:`int8_conv_gemm` first and keeps its reference form when it
declines (no micro-kernels, weights with a zero point, grouped convolutions, symbolic shapes)."""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...ir.dim import product
from ...ir.dtype import DType
from ..contraction_int8 import MR_I8, Int8Contraction, Int8Pack, pack_int8_weights, panel_positions, requant_constants
from ..texpr import I64, E, binop, call, cast, cmp, const, load, reduce, select
from .core import TensorFn, fconst, nan_max, nan_min, unflat_index
from .windows import padded_window_input, window_params

I32, U8, F32 = DType.INT32, DType.UINT8, DType.FLOAT


def _const(ctx, i: int) -> Optional[np.ndarray]:
    return ctx.const_input(i) if ctx.input(i) is not None else None


def int8_conv_gemm(ctx) -> Optional[TensorFn]:
    """QLinearConv's output as an ``E("qgemm")`` stage, or None where the micro-kernels do not apply."""
    x, w = ctx.input(0), ctx.input(3)
    dt = ctx.out_dtype()
    out = ctx.out_shape()
    # x86 only (its schedule asks for matmul panels; the GPU's does not): the VNNI kernels read these forms
    if (not ctx.gemm_cols or not ctx.matmul_panels or ctx.unpadded_contractions or ctx._weight is None or dt not in (DType.UINT8, DType.INT8)
            or x.dtype not in (DType.UINT8, DType.INT8) or w.dtype != DType.INT8 or ctx.attr("group", 1) != 1
            or not all(isinstance(d, int) for d in list(x.shape) + list(out))):
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
    comp, mult = requant_constants(wq, bias, zx_u, xs, np.broadcast_to(ws.reshape(-1), (m,)), ys)
    if np.any(np.abs(comp) >= 2 ** 31):
        return None
    kern = list(wq.shape[2:])
    spatial = len(kern)
    cin = wq.shape[1]
    K = cin * int(np.prod(kern))
    P = int(product(out[2:]))
    N = x.shape[0]
    strides, dil, begin = window_params(ctx, spatial, kern, x.shape[2:], out[2:])
    xp, _ = padded_window_input(ctx, x, out[2:], kern, strides, dil, begin, zx)   # padding reads x's zero point
    if xp.buf is None:
        xp = ctx.temp(xp.shape, xp.dtype, xp.fn, "in")
    nr = panel_positions(P)
    spec_kg = -(-K // 4)
    pb_count = -(-P // nr)
    pack = Int8Pack(xp.buf, K, tuple(kern), tuple(strides), tuple(dil), tuple(out[2:]), nr, shifted) \
        if spatial == 2 else None

    def im2col(idx):
        n, pb, kg, j, i = idx
        p = pb * nr + j
        p = select(cmp("lt", p, const(P, I64)), p, const(P - 1, I64))   # panel positions past P repeat the last
        k = kg * 4 + i
        k = select(cmp("lt", k, const(K, I64)), k, const(K - 1, I64))   # k past K: its weights are zero
        c, *ks = unflat_index(k, [cin] + kern)
        o = unflat_index(p, list(out[2:]))
        v = xp([n, c] + [oi * s + ki * d for oi, s, ki, d in zip(o, strides, ks, dil)])
        if shifted:
            v = cast(binop("add", cast(v, I32), const(128, I32)), U8)
        else:
            v = cast(v, U8)
        return E("qpack", list(idx) + [v], U8, pack) if pack is not None else v
    b_fn = ctx.temp((N, pb_count, spec_kg, nr, 4), U8, im2col, "im2col")
    w_buf = ctx.weight(pack_int8_weights(wq), "packed_i8")
    comp_buf = ctx.weight(comp.astype(np.int32), "comp")
    mult_buf = ctx.weight(mult, "mult")
    yz = int(yzp.reshape(())) if yzp is not None else 0
    spec = Int8Contraction(b_fn.buf, w_buf, comp_buf, mult_buf, N, m, P, K, nr, MR_I8, yz, dt)

    def f(idx):
        n, mo, o = idx[0], idx[1], idx[2:]
        p = o[0]
        for d, oi in zip(out[3:], o[1:]):
            p = p * d + oi
        pb, j = p // nr, p % nr
        mb, r = mo // MR_I8, mo % MR_I8
        acc = reduce("sum", [spec_kg * 4], lambda k: binop(
            "mul", cast(b_fn([n, pb, k // 4, j, k % 4]), I32), cast(load(w_buf, [mb, k // 4, r, k % 4]), I32)))
        acc = binop("add", acc, load(comp_buf, [mo]))
        v = call("roundeven", binop("mul", cast(acc, F32), load(mult_buf, [mo])))
        v = binop("add", v, const(float(yz), F32))
        lo, hi = dt.int_range
        v = call("roundeven", v)
        v = nan_min(nan_max(v, fconst(float(lo), v)), fconst(float(hi), v))
        return E("qgemm", [n, mo] + list(o) + [cast(v, dt)], dt, spec)
    return TensorFn(out, dt, f, "complex", contraction=True)
