"""Lowering of WinogradConv: input and output transforms around a packed contraction."""
from __future__ import annotations

import numpy as np

from ...ir.dtype import DType
from ...ir.ops.winograd import matrices_f64, tiles_of
from ..contraction import Contraction, WinogradInput, WinogradOutput, winograd_interleaved, winograd_m_row
from ..texpr import Buf, E, all_of, binop, cast, in_range, load, nodes, reduce, var
from .conv import conv_as_gemm
from .core import TensorFn, bf16_stored, lowering


@lowering("WinogradConv")
def _winograd_conv(ctx):
    """Three stages (:mod:`cuvil.ir.ops.winograd`): the input transform V (``wino_in``), one grouped 1x1
    contraction per tile element (the packed GEMM micro-kernels, ``U`` packed like any weight), and the
    output transform (``wino_out``) with the bias, where the stage's epilogue (activation, residual) fuses.
    The output transform also carries the direct convolution (from x, and W recovered from U's panels),
    which the x86 kernel computes instead for any tile whose Winograd values are not finite."""
    x, b = ctx.input(0), ctx.input(2)
    uv = ctx.const_input(1)
    m = int(ctx.attr("tile", 4))
    a = m + 2
    pads = list(ctx.attr("pads") or [0, 0, 0, 0])
    out = ctx.out_shape()
    n_, c_ = x.shape[:2]
    oh, ow = out[2:]
    k_ = out[1]
    if uv is None or not ctx.gemm_cols or ctx._weight is None or not all(isinstance(d, int) for d in (oh, ow, c_)):
        ctx.unsupported("WinogradConv needs a constant kernel, static spatial dims and the x86 target")
    th_, tw_ = tiles_of(oh, m), tiles_of(ow, m)
    t_ = th_ * tw_
    if x.buf is None:   # the transform reads the stored, unpadded input (its loads are masked to it)
        x = ctx.temp(x.shape, x.dtype, x.fn, "in")
    bt, g, at = matrices_f64(m)
    bt_buf = ctx.weight(bt.astype(np.float32), "bt")
    at_buf = ctx.weight(at.astype(np.float32), "at")
    # G's pseudo-inverse (G has full column rank, so W = G+ U G+^T): the direct convolution that the output
    # transform computes instead for a tile whose Winograd values overflowed (inputs near 1e37 overflow Bt d B
    # where the direct sum stays finite) reads W from U's packed panels this way, so no copy of W is stored
    # (a float32 copy made ResNet-50-size libraries up to 56% larger: 512x512 7x7 layer 17.0 -> 26.4 MB).
    gi_buf = ctx.weight(np.linalg.pinv(g).astype(np.float32), "ginv")
    inter = winograd_interleaved(c_, t_, m)
    ispec = WinogradInput(x.buf, m, c_, (th_, tw_), (int(pads[0]), int(pads[1])), inter)
    xh, xw = x.shape[2:]

    def xp(idx):
        n, c, h, w = idx
        h, w = h - pads[0], w - pads[1]
        return x.at_or([n, c, h, w], all_of([in_range(h, 0, xh), in_range(w, 0, xw)]), 0.0)

    def v_fn(idx):
        n, ce, t = idx
        c, e = (ce // (a * a), ce % (a * a)) if inter else (ce % c_, ce // c_)
        i, j = e // a, e % a
        h0, w0 = (t // tw_) * m, (t % tw_) * m

        def body(p, q):
            coef = binop("mul", load(bt_buf, [i, p]), load(bt_buf, [j, q]))
            return binop("mul", coef, xp([n, c, h0 + p, w0 + q]))
        return E("wino_in", [n, ce, t, reduce("sum", [a, a], body)], DType.FLOAT, ispec)
    # bf16: V stored as bfloat16 (the values the GEMM rounds anyway: rounded once as the transform stores them,
    # half the bytes; the GEMM packs its pair panels from the 16-bit words)
    v16 = ctx.narrowed == "bf16" and ctx.bf16_storage
    v = ctx.temp((n_, a * a * c_, t_), DType.BFLOAT16 if v16 else DType.FLOAT, v_fn, "wino_v")
    if v16:
        v = bf16_stored(v)
    gemm = conv_as_gemm(ctx, v, None, (n_, a * a * k_, t_), a * a, c_, k_, (1,), (1,), (1,), [0],
                         wv=uv.reshape(a * a * k_, c_, 1), interleaved=inter)
    if gemm is None:
        ctx.unsupported(f"WinogradConv with {c_} input and {k_} output channels has no GEMM micro-kernel")
    packed = next(e.attr for e in nodes(gemm([var("n"), var("ek"), var("t")]))
                  if e.op == "contract" and isinstance(e.attr, Contraction))   # U[e, k, c] = a[e, k/mr, c, k%mr]
    if packed.amx:       # (AMX tiles' weight layouts: the x86 target keeps bf16 Winograd off AMX, choose.py)
        ctx.unsupported("WinogradConv on AMX tiles: the fallback cannot rebuild W from the tile layout")
    if packed.precision == "bf16":      # U[e, k, c] = a[e, k/mr, c/2, k%mr, c%2] in bfloat16 pairs
        u_at = lambda e, k, c: cast(load(packed.a, [e, k // packed.mr, c // 2, k % packed.mr, c % 2]), DType.FLOAT)
    else:
        u_at = lambda e, k, c: load(packed.a, [e, k // packed.mr, c, k % packed.mr])
    mt = ctx.temp(gemm.shape, DType.FLOAT, gemm.fn, "wino_m")
    row = winograd_m_row(k_, t_, m)
    if row != t_:      # M's rows `row` floats apart (a pitched view of a buffer of such rows): its planes spread
        mb = mt.buf
        mb.root = Buf(f"{mb.name}_rows", mb.dtype, (n_, a * a * k_, row), mb.base, 0)
        mb.pitch = (a * a * k_ * row, row, 1)
    ospec = WinogradOutput(mt.buf, m, k_, (th_, tw_), (oh, ow))

    def y_fn(idx):
        n, k, h, w = idx
        r, q = h % m, w % m
        t = (h // m) * tw_ + w // m

        def body(i, j):
            coef = binop("mul", load(at_buf, [r, i]), load(at_buf, [q, j]))
            return binop("mul", coef, mt([n, (i * a + j) * k_ + k, t]))

        def w_direct(c, p, q):             # W[k, c, p, q] = sum over i, j of G+[p, i] G+[q, j] U[i*a + j, k, c]
            def term(i, j):
                coef = binop("mul", load(gi_buf, [p, i]), load(gi_buf, [q, j]))
                return binop("mul", coef, u_at(i * a + j, k, c))
            return reduce("sum", [a, a], term)

        def direct(c, p, q):
            return binop("mul", w_direct(c, p, q), xp([n, c, h + p, w + q]))
        # args[-2]: the direct convolution at this output (the x86 fallback; it also keeps x live until here)
        acc = E("wino_out", [n, k, h, w, reduce("sum", [c_, 3, 3], direct), reduce("sum", [a, a], body)],
                DType.FLOAT, ospec)
        return binop("add", acc, b([k])) if b is not None else acc
    return [TensorFn(out, ctx.out_dtype(), y_fn, "complex", contraction=True)]
