"""Lowerings of the convolutions (Conv, ConvTranspose, ConvInteger, DeformConv): packed contractions for
the micro-kernels where the schedule asks for them, else reductions over windows."""
from __future__ import annotations

from typing import Optional

import numpy as np

from ...ir.dim import product
from ...ir.dtype import DType
from ..contraction import (AMX_K, AMX_TILE, AMX_TILES, Contraction, DepthwiseWindow, channel_lanes, choose_tile, pack_weights,
                           pack_weights_amx, pack_weights_bf16)
from ..texpr import I64, E, all_of, binop, call, cast, cmp, const, in_range, load, logic, reduce, select
from ..contraction_planes import (BF16_PLANES, CHANNEL_BLOCK, MAX_PLANE_NR, PLANE_MR, PLANE_NR, PairPlanes, PlaneContraction,
                                  pack_plane_weights, pair_groups)
from ..contraction_int8 import panel_positions
from ..contraction_nhwc import (BF16_CHANNELS_LAST, NHWC_MR, CHANNEL_STEP, ChannelsLastContraction, ChannelsLastPart,
                                ChannelsLastRows, channels_last_window, is_channels_last, pack_nhwc_weights,
                                padded_channels)
from ..phase_planes import plane_geometry, plane_length, plane_source
from .core import LOWERINGS, TensorFn, bf16_stored, clamp, lowering, sub_ctx, unflat_index, widened
from .quant import minus_zp
from .windows import may_exceed, padded_window_input, window_params


@lowering("Conv")
def _conv(ctx):
    x, w, b = ctx.input(0), ctx.input(1), ctx.input(2)
    out = ctx.out_shape()
    spatial = len(x.shape) - 2
    group = ctx.attr("group", 1)
    cin_g = w.shape[1]
    m_g = w.shape[0] // group
    kern = w.shape[2:]
    strides, dil, begin = window_params(ctx, spatial, kern, x.shape[2:], out[2:])
    gemm = conv_as_gemm(ctx, x, b, out, group, cin_g, m_g, kern, strides, dil, begin)
    if gemm is not None:
        return [gemm]
    if ctx.narrowed:   # no narrowed contraction for this form: its inputs rounded, computed in float32
        x, w = ctx.narrow_input(0), ctx.narrow_input(1)

    # depthwise 2-D with row-vectorisable strides: a window node the x86 backend computes by rows, reading
    # the unpadded input (its loads are masked to the input: no padded copy is stored)
    depthwise = (ctx.gemm_cols and spatial == 2 and cin_g == 1 and m_g == 1 and w.buf is not None
                 and x.dtype == DType.FLOAT and ctx.out_dtype() == DType.FLOAT and strides[1] in (1, 2)
                 and all(isinstance(d, int) for d in x.shape[2:]))
    if depthwise:
        if x.buf is None:
            x = ctx.temp(x.shape, x.dtype, x.fn, "in")
    else:
        x, begin = padded_window_input(ctx, x, out[2:], kern, strides, dil, begin, 0.0)
    window = DepthwiseWindow(w.buf, x.buf, tuple(kern), tuple(strides), tuple(dil), tuple(out[2:]),
                             pads=(begin[0], begin[1])) if depthwise else None
    bounded = depthwise and (any(begin) or any(may_exceed((o - 1) * s + (k - 1) * d + 1, size) for o, s, k, d, size
                                                in zip(out[2:], strides, kern, dil, x.shape[2:])))

    def f(idx):
        n, m, o = idx[0], idx[1], idx[2:]
        g_off = (m // m_g) * cin_g if group > 1 else const(0, I64)

        def body(c, *ks):
            pos = [oi * s - p + ki * d for oi, s, p, ki, d in zip(o, strides, begin, ks, dil)]
            if bounded:
                inside = all_of([in_range(q, 0, size) for q, size in zip(pos, x.shape[2:])])
                return binop("mul", x.at_or([n, g_off + c] + pos, inside, 0.0), w([m, c] + list(ks)))
            return binop("mul", x([n, g_off + c] + pos), w([m, c] + list(ks)))
        acc = reduce("sum", [cin_g] + list(kern), body)
        if window is not None:
            acc = E("window", [n, m] + list(o) + [acc], DType.FLOAT, window)
        return binop("add", acc, b([m])) if b is not None else acc
    return [TensorFn(out, ctx.out_dtype(), f, "complex", contraction=window is not None)]


def conv_as_gemm(ctx, x, b, out, group, cin_g, m_g, kern, strides, dil, begin, wv=None,
                  interleaved: bool = False) -> Optional[TensorFn]:
    """The convolution as a packed contraction (see :mod:`cuvil.kernels.contraction`), when the target asks for
    them (``ctx.gemm_cols``), it is float32 (or, with the GPU's ``half_contractions``, float16) with
    constant weights and has enough output channels per group to fill a micro-kernel's rows. The input is
    stored, zero-padded when the convolution pads so the x86 kernels pack panels without bounds tests; with
    ``unpadded_contractions`` it stays unpadded and the contraction records the pads (its expression tests
    the bounds, as the GPU kernels do). ``interleaved``: channel c of group g is x's channel c*group + g
    (see :attr:`Contraction.interleaved`)."""
    wv = ctx.const_input(1) if wv is None else wv
    K = cin_g * int(np.prod(kern))
    # a float16 model's convolution on x86 (where the target offers float16 paths): the float32 kernels on its
    # input widened (exactly) as it is stored, weights widened at compile time, float32 sums and epilogue, the
    # output rounded to float16 once (the float16 semantics of tests/test_float16_sums.py, not a loop nest)
    half_model = (not ctx.half_contractions and "fp16" in ctx.narrow_formats and x.dtype == DType.FLOAT16
                  and ctx.out_dtype() == DType.FLOAT16 and not ctx.narrowed)
    dts = (DType.FLOAT, DType.FLOAT16) if ctx.half_contractions or half_model else (DType.FLOAT,)
    # x86 takes reductions from 4 terms: ShuffleNet's first grouped 1x1 convolution (6 input channels per
    # group) ran 0.130 ms as a loop nest and is one of the micro-kernel's cheaper steps (2.25 -> 2.14 ms in all)
    min_k = 4 if ctx.row_kernels else 8
    if (not ctx.gemm_cols or wv is None or ctx.out_dtype() not in dts or x.dtype != ctx.out_dtype() or m_g < 4
            or K < min_k or ctx._weight is None or ctx.narrowed not in ("", "bf16")):
        return None      # (float16 weight panels are MatMul / Gemm only: gemm_fp16.py)
    if half_model:
        x, b = widened(x), widened(b)
    half = x.dtype == DType.FLOAT16
    out_sp = tuple(out[2:])
    pads = ()
    if ctx.unpadded_contractions and all(isinstance(d, int) for d in list(x.shape[2:]) + list(begin)):
        need = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(out_sp, strides, kern, dil)]
        if any(begin) or any(n_ - b0 > size for n_, b0, size in zip(need, begin, x.shape[2:])):
            pads = tuple(int(b0) for b0 in begin)
    narrow = "" if half else ctx.narrowed
    # a bf16 contraction's own copies of its input (zero-padded, or an inlined input stored) as bfloat16: the
    # values it rounds to, half the bytes, packed into pair panels without rounding (gemm.py)
    store = DType.BFLOAT16 if narrow == "bf16" and ctx.bf16_storage else x.dtype
    if (narrow == "bf16" and BF16_CHANNELS_LAST in ctx.narrow_formats and AMX_TILES in ctx.narrow_formats
            and not interleaved and not pads):
        rows = channels_last_conv(ctx, x, b, wv, out, group, kern, strides, dil, begin)
        if rows is not None:
            return rows
    if narrow == "bf16" and BF16_PLANES in ctx.narrow_formats and not interleaved and group == 1 and not pads:
        planes = plane_conv(ctx, x, b, wv, out, kern, strides, dil, begin, store)
        if planes is not None:
            return planes
    if not pads:
        x, _ = padded_window_input(ctx, x, out_sp, kern, strides, dil, begin, 0.0, store)
    if x.buf is None:
        x = ctx.temp(x.shape, store, x.fn, "in")
    if x.dtype == DType.BFLOAT16:
        x = bf16_stored(x)
    tile = choose_tile(m_g, product(out_sp), ctx.gemm_tiles, K, ctx.channel_tile_cost)
    if not interleaved and not half and not narrow:     # measured on the host by --tune (direct float32 only)
        tile = tuple(ctx.tile_choices.get((m_g, product(out_sp), K), tile))
    wdt = np.float16 if half else np.float32
    amx = narrow == "bf16" and AMX_TILES in ctx.narrow_formats
    if amx:                  # 2 x 2 AMX tiles: 32 channels x 32 positions, weights in the A-tile layout
        tile = (2 * AMX_TILE, 2 * AMX_TILE)
    mr, cols = tile[:2]
    if amx:
        a_buf = ctx.weight(pack_weights_amx(wv.astype(np.float32), group, mr), "packed_amx")
        weight_at = lambda g, ml, k: cast(load(a_buf, [g, ml // mr, k // AMX_K, ml % mr, (k // 2) % AMX_TILE, k % 2]),
                                          DType.FLOAT)
        x_term = lambda v: cast(cast(v, DType.BFLOAT16), DType.FLOAT)
    elif narrow == "bf16":     # weights in bfloat16 pairs along K, the input rounded to bfloat16, float32 sums
        a_buf = ctx.weight(pack_weights_bf16(wv.astype(np.float32), group, mr), "packed_bf16")
        weight_at = lambda g, ml, k: cast(load(a_buf, [g, ml // mr, k // 2, ml % mr, k % 2]), DType.FLOAT)
        x_term = lambda v: cast(cast(v, DType.BFLOAT16), DType.FLOAT)
    else:
        a_buf = ctx.weight(pack_weights(wv.astype(wdt), group, mr, wdt), "packed")
        weight_at = lambda g, ml, k: load(a_buf, [g, ml // mr, k, ml % mr])
        x_term = lambda v: v
    spec = Contraction(a_buf, x.buf, x.shape[0], group, m_g, cin_g, tuple(kern), tuple(strides), tuple(dil),
                       out_sp, cols, mr, pads, channel_lanes(tile), interleaved, narrow, amx)
    kshape = [cin_g] + list(kern)

    def f(idx):
        n, m, o = idx[0], idx[1], idx[2:]
        g = m // m_g if group > 1 else const(0, I64)
        ml = m % m_g if group > 1 else m

        def body(k):
            c, *ks = unflat_index(k, kshape)
            ch = c * group + g if interleaved else g * cin_g + c
            if pads:
                pos = [oi * s - p + ki * d for oi, s, p, ki, d in zip(o, strides, pads, ks, dil)]
                inside = all_of([in_range(q, 0, size) for q, size in zip(pos, x.shape[2:])])
                return binop("mul", weight_at(g, ml, k), x_term(x.at_or([n, ch] + pos, inside, 0.0)))
            pos = [oi * s + ki * d for oi, s, ki, d in zip(o, strides, ks, dil)]
            return binop("mul", weight_at(g, ml, k), x_term(x([n, ch] + pos)))
        acc = E("contract", [n, m] + list(o) + [reduce("sum", [K], body)], x.dtype, spec)
        acc = binop("add", acc, b([m])) if b is not None else acc
        return cast(acc, DType.FLOAT16) if half_model else acc
    return TensorFn(out, ctx.out_dtype(), f, "complex", contraction=True)


#: Where the pair planes do not pay (bench/results/xeon-session22/amx-planes-selection.txt: ResNet-50 on AMX,
#: in-kernel ms of each kind of layer with its input's preparation): a stride-1 1x1 convolution reads its input
#: rows as they are in the packed form (direct rows; at 56x56 swept per channel block), where planes add a pass
#: that copies the input (64 -> 256 at 56x56: 1.01 -> 1.58 ms), and a map of fewer than PLANE_MIN_POSITIONS
#: outputs packs little (the 7x7 3x3 layers, which stream 4.7 MB of weights each: 1.53 -> 1.62 ms). Elsewhere
#: the planes won (amx-planes-per-kind-with-prep.txt: the 3x3 layers at 56, 28 and 14 from 1.18 / 1.38 / 2.08 to
#: 0.72 / 1.00 / 1.54 ms, the strided 1x1 projections from 0.35 / 0.33 to 0.27 / 0.25 ms).
PLANE_MIN_POSITIONS = 64


def plane_conv(ctx, x, b, wv, out, kern, strides, dil, begin, store) -> Optional[TensorFn]:
    """A bf16 2-D convolution (AMX tiles, else vdpbf16ps) read in place from pair planes (:mod:`cuvil.kernels.contraction_planes`):
    the input stored once as phase planes of channel pairs (a stage), the weights packed per tap as A tiles. None
    where that form does not apply (symbolic sizes other than the batch, 1-D/3-D windows, negative pads, taps that
    skip a stride phase, a column stride over 4, which the planes pass does not vectorise), where it does not pay
    (a stride-1 1x1 kernel, a map of fewer than PLANE_MIN_POSITIONS outputs) or where it would waste more than a
    quarter of its products on the zero channels that fill the last block of 32 (a 3-channel stem): the
    packed-panel form then. A symbolic batch takes the planes as a fixed one does (the units count it at run time),
    so a batch profile's generic kernels and its opt point's share one packed copy of the weights."""
    if (len(kern) != 2 or not all(isinstance(d, int) for d in list(x.shape[1:]) + list(out[1:]) + list(begin))
            or min(begin) < 0 or strides[1] > 4):
        return None
    cin = x.shape[1]
    if ((all(k == 1 for k in kern) and all(s == 1 for s in strides)) or product(out[2:]) < PLANE_MIN_POSITIONS
            or 4 * pair_groups(cin) * 2 > 5 * cin):
        return None
    geo = plane_geometry(tuple(kern), tuple(strides), tuple(dil), tuple(out[2:]))
    if geo is None:
        return None
    (rows, cols), grid, taps = geo.phases, geo.grid, geo.taps
    (kh_, kw_), (sh, sw), (dh, dw) = kern, strides, dil
    N, M, (H, W), (oh_, ow_) = x.shape[0], out[1], x.shape[2:], out[2:]
    G = pair_groups(cin)
    PL = plane_length(grid, oh_, geo.max_shift, MAX_PLANE_NR)
    if x.buf is None:
        x = ctx.temp(x.shape, store, x.fn, "in")
        if x.dtype == DType.BFLOAT16:
            x = bf16_stored(x)
    amx = AMX_TILES in ctx.narrow_formats      # else vdpbf16ps, its panel as wide as pays (as the int8 VNNI one)
    nr = PLANE_NR if amx else panel_positions((oh_ - 1) * grid[1] + ow_)
    spec_in = PairPlanes(x.buf, cin, G, (H, W), tuple(begin), (sh, sw), (rows, cols), grid, PL, amx)

    def plane_fn(idx):
        c, ih, iw, cond = plane_source(idx, 2, cin, (H, W), begin, (sh, sw), cols, grid)
        return E("pplanes", list(idx) + [x.at_or([idx[0], c, ih, iw], cond, 0.0)], DType.FLOAT, spec_in)
    b_fn = ctx.temp((N, G, rows * cols, PL, 2), DType.BFLOAT16, plane_fn, "planes")
    w_buf = ctx.weight(pack_plane_weights(wv.astype(np.float32)), "packed_planes")
    spec = PlaneContraction(b_fn.buf, w_buf, N, M, cin, taps, G, grid[1], (oh_, ow_), PL, rows * cols, amx, nr)
    half_block = CHANNEL_BLOCK // 2

    def f(idx):
        n, mo, oh, ow = idx
        p = oh * grid[1] + ow
        mb, r = mo // PLANE_MR, mo % PLANE_MR

        def term(t, g, i):
            kh, kw = t // kw_, t % kw_
            ph = ((kh * dh) % sh) * cols + (kw * dw) % sw
            off = ((kh * dh) // sh) * grid[1] + (kw * dw) // sw
            bv = cast(b_fn([n, g, ph, p + off, i]), DType.FLOAT)
            wv_ = cast(load(w_buf, [mb, g // half_block, t, r, g % half_block, i]), DType.FLOAT)
            return binop("mul", wv_, bv)
        acc = E("contract", [n, mo, oh, ow, reduce("sum", [kh_ * kw_, G, 2], term)], DType.FLOAT, spec)
        return binop("add", acc, b([mo])) if b is not None else acc
    return TensorFn(out, ctx.out_dtype(), f, "complex", contraction=True)


def channels_last_conv(ctx, x, b, wv, out, group, kern, strides, dil, begin) -> Optional[TensorFn]:
    """A bf16 2-D convolution on AMX tiles over channels-last rows (:mod:`cuvil.kernels.contraction_nhwc`): the
    input read in place where its producer stored it channels-last with whole blocks of 32 channels and the window
    reads it as it is (a stride-1 1x1 layer), else first copied once into channels-last phase planes (rounded to
    bfloat16, zeros for padding and past the channels); the weights packed per tap as B tiles. A 1x1 convolution
    over a concatenation of channels (``rules/conv_sum.rule``: a sum of two 1x1 convolutions) reads each piece
    where it lies (:func:`_concat_parts`), a strided slice through its own rows copy. None where the form does
    not apply (:func:`cuvil.kernels.contraction_nhwc.channels_last_window`)."""
    if channels_last_window(x.shape, wv.shape, out, strides, dil, begin, group) is not None:
        return None
    geo = plane_geometry(tuple(kern), tuple(strides), tuple(dil), tuple(out[2:]))
    (rows, cols), (Hq, Wq), F = geo.phases, geo.grid, geo.num_phases
    N, C = x.shape[:2]
    M, (OH, OW) = out[1], tuple(out[2:])
    pieces = _concat_parts(x, tuple(kern), strides, begin, (Hq, Wq))
    if pieces is None:
        a_buf, image, row, read = _rows_source(ctx, x, tuple(begin[:2]), tuple(strides), geo)
        parts, bounds = (), [(0, C, read)]
    else:
        srcs = [_rows_source(ctx, t, (0, 0), s, plane_geometry((1, 1), s, (1, 1), (OH, OW))) for t, s in pieces]
        (a_buf, image, row, _), rest = srcs[0], srcs[1:]
        parts = tuple(ChannelsLastPart(a, t.shape[1], im, rw) for (a, im, rw, _), (t, _) in zip(rest, pieces[1:]))
        edges = np.cumsum([0] + [t.shape[1] for t, _ in pieces])
        assert edges[-1] == C == wv.shape[1], (edges, C, wv.shape)     # the pieces are the concatenation
        bounds = [(int(lo), int(hi), src[3]) for lo, hi, src in zip(edges[:-1], edges[1:], srcs)]
    w_buf = ctx.weight(pack_nhwc_weights(wv.astype(np.float32)), "packed_nhwc")
    spec = ChannelsLastContraction(a_buf, w_buf, N, M, bounds[0][1], geo.taps, Wq, (OH, OW), Hq * Wq, image, row,
                                   parts)
    half = CHANNEL_STEP // 2
    (KH, KW), (sh, sw), (dh, dw) = tuple(kern), tuple(strides), tuple(dil)
    Cp = padded_channels(C) if pieces is None else C

    def f(idx):
        n, mo, oh, ow = idx
        p = oh * Wq + ow
        mb, r = mo // NHWC_MR, mo % NHWC_MR

        def term(t, g, i):
            kh, kw = t // KW, t % KW
            ph = ((kh * dh) % sh) * cols + (kw * dw) % sw
            off = ((kh * dh) // sh) * Wq + (kw * dw) // sw
            wt = cast(load(w_buf, [mb, t, g // half, g % half, r, i]), DType.FLOAT)
            c = g * 2 + i
            val = None
            for lo, hi, read in reversed(bounds):       # (the piece that holds channel c; reads clamped inside each)
                at = read(n, ph, p + off, clamp(c - lo, hi - lo) if len(bounds) > 1 else c)
                val = at if val is None else select(cmp("lt", c, const(hi, I64)), at, val)
            return binop("mul", wt, val)
        acc = E("contract", [n, mo, oh, ow, reduce("sum", [KH * KW, Cp // 2, 2], term)], DType.FLOAT, spec)
        return binop("add", acc, b([mo])) if b is not None else acc
    return TensorFn(out, ctx.out_dtype(), f, "complex", contraction=True)


def _rows_source(ctx, x, begin, strides, geo):
    """Where a channels-last convolution reads input ``x`` (a window of phase planes ``geo``, pads ``begin``):
    ``(rows buffer, elements per image, elements per position, read(n, f, q, c))``. ``x`` itself where it is stored
    channels-last in bfloat16 with whole steps of channels and the window reads it as it is (a stride-1 1x1
    window); else its phase planes copied once (shared by every reader of the same geometry)."""
    (rows, cols), (Hq, Wq), F = geo.phases, geo.grid, geo.num_phases
    N, C, H, W = x.shape
    Cp = padded_channels(C)
    if (x.buf is not None and is_channels_last(x.buf) and x.buf.dtype == DType.BFLOAT16 and C == Cp and F == 1
            and (Hq, Wq) == (H, W) and not any(begin) and geo.taps == ((0, 0),)):
        return x.buf, H * W * C, C, lambda n, f, q, c: x([n, c, q // W, q % W])
    if x.buf is None:
        x = ctx.temp(x.shape, DType.BFLOAT16 if ctx.bf16_storage else x.dtype, x.fn, "in")
        if x.dtype == DType.BFLOAT16:
            x = bf16_stored(x)
    spec_in = ChannelsLastRows(x.buf, C, (H, W), tuple(begin), tuple(strides), (rows, cols), (Hq, Wq))

    def rows_fn(idx):
        n, f, q, c = idx
        ch, ih, iw, inside = plane_source((n, c, f, q, const(0, I64)), 1, C, (H, W), begin, strides, cols, (Hq, Wq))
        return E("nhwc_rows", [n, f, q, c, x.at_or([n, ch, ih, iw], inside, 0.0)], DType.FLOAT, spec_in)
    key = ("nhwc_rows", id(x.buf), x.buf.dtype, spec_in.begin, spec_in.strides, spec_in.phases, spec_in.grid, Cp)
    a_fn = ctx.shared_temp(key, (N, F, Hq * Wq, Cp), DType.BFLOAT16, rows_fn, "rows")
    return a_fn.buf, F * Hq * Wq * Cp, Cp, lambda n, f, q, c: cast(a_fn([n, f, q, c]), DType.FLOAT)


def _concat_parts(x, kern, strides, begin, grid) -> Optional[list]:
    """``[(piece, strides)]`` where ``x`` is a concatenation of channels (``rules/conv_sum.rule``) read by a
    stride-1 1x1 window without pads, each piece a whole number of 32-channel steps: a tensor of the output's
    size, or one sliced from the first element with steps (a projection's stride). None otherwise (the
    concatenation is then stored and read like any input)."""
    if x.view is None or x.view[0] != "concat" or x.view[1] != 1 or kern != (1, 1) or tuple(strides) != (1, 1) \
            or any(begin) or len(x.view[2]) < 2:
        return None
    out = []
    for t in x.view[2]:
        step = (1, 1)
        if t.view is not None and t.view[0] == "slice":
            _, src, first, steps = t.view
            if any(not isinstance(v, int) or v != 0 for v in first) or tuple(steps[:2]) != (1, 1) \
                    or not all(isinstance(v, int) and v >= 1 for v in steps[2:]):
                return None
            if tuple(src.shape[:2]) != tuple(t.shape[:2]):
                return None       # (a slice of the batch or of the channels: not a whole piece of the source)
            t, step = src, (int(steps[2]), int(steps[3]))
        if len(t.shape) != 4 or not all(isinstance(d, int) for d in t.shape[1:]) or t.shape[1] % CHANNEL_STEP:
            return None
        if tuple(-(-d // s_) for d, s_ in zip(t.shape[2:], step)) != tuple(grid):
            return None
        out.append((t, step))
    return out


#: ConvTranspose without dilation by the output's phase (:func:`_conv_transpose_by_phase`); False: the gather
#: over every tap (kept for bench/convtranspose.py's A/B)
CONV_TRANSPOSE_BY_PHASE = True


@lowering("ConvTranspose")
def _conv_transpose(ctx):
    x, w, b = ctx.input(0), ctx.input(1), ctx.input(2)
    out = ctx.out_shape()
    spatial = len(x.shape) - 2
    group = ctx.attr("group", 1)
    cin = x.shape[1]
    cin_g = cin // group
    m_g = w.shape[1]
    kern = w.shape[2:]
    strides = ctx.attr("strides") or [1] * spatial
    dil = ctx.attr("dilations") or [1] * spatial
    pads = ctx.attr("pads")
    if ctx.attr("auto_pad", "NOTSET") != "NOTSET" or ctx.attr("output_shape") is not None:
        if pads is None:
            total = [max((x.shape[2 + k] - 1) * strides[k] + ((kern[k] - 1) * dil[k] + 1) - out[2 + k], 0) for k in range(spatial)]
            auto = ctx.attr("auto_pad", "NOTSET")
            pads = [t // 2 if auto != "SAME_LOWER" else t - t // 2 for t in total]
    begin = list(pads[:spatial]) if pads else [0] * spatial
    if (CONV_TRANSPOSE_BY_PHASE and all(d == 1 for d in dil) and all(isinstance(k, int) for k in kern)
            and all(p >= 0 for p in begin)):
        return [_conv_transpose_by_phase(ctx, x, w, b, out, group, cin_g, m_g, kern, strides, begin)]

    def f(idx):
        n, m, o = idx[0], idx[1], idx[2:]
        grp = m // m_g if group > 1 else const(0, I64)
        mm = m % m_g if group > 1 else m

        def body(c, *ks):
            # out[o] gets x[i] * w[k] where o = i*s - p + k*d, i.e. i = (o + p - k*d) / s when divisible
            num = [oi + p - ki * d for oi, p, ki, d in zip(o, begin, ks, dil)]
            pos = [nn // s for nn, s in zip(num, strides)]
            conds = [in_range(pp, 0, size) for pp, size in zip(pos, x.shape[2:])]
            conds += [cmp("ge", nn, const(0, I64)) for nn in num]
            conds += [cmp("eq", nn % s, const(0, I64)) for nn, s in zip(num, strides) if s > 1]
            xv = x.at_or([n, grp * cin_g + c if group > 1 else c] + pos, all_of(conds), 0.0)
            return binop("mul", xv, w([grp * cin_g + c if group > 1 else c, mm] + list(ks)))
        acc = reduce("sum", [cin_g] + list(kern), body)
        return binop("add", acc, b([m])) if b is not None else acc
    return [TensorFn(out, ctx.out_dtype(), f, "complex")]


def _conv_transpose_by_phase(ctx, x, w, b, out, group, cin_g, m_g, kern, strides, begin):
    """ConvTranspose without dilation, by the output's phase: output o (padding p, stride s) takes exactly the
    taps k = r + s*t with r = (o + p) mod s, reading input (o + p - r) / s - t, for t < ceil(K / s) (and
    k < K): per input channel ceil(K/s) taps a dim instead of K, and no divisibility test per term (each
    output's phase is computed once). The same terms as the gather form over all taps, the others being
    zero; a sum's order is not specified by ONNX."""
    taps = [-(-k // s) for k, s in zip(kern, strides)]

    def f(idx):
        n, m, o = idx[0], idx[1], idx[2:]
        grp = m // m_g if group > 1 else const(0, I64)
        mm = m % m_g if group > 1 else m
        num = [oi + p for oi, p in zip(o, begin)]          # >= 0: o >= 0, p >= 0
        phase = [nn % s if s > 1 else const(0, I64) for nn, s in zip(num, strides)]
        base = [nn // s if s > 1 else nn for nn, s in zip(num, strides)]

        def body(c, *ts):
            ks = [r + t * s if s > 1 else t for r, t, s in zip(phase, ts, strides)]
            pos = [bb - t for bb, t in zip(base, ts)]
            conds = [in_range(pp, 0, size) for pp, size in zip(pos, x.shape[2:])]
            conds += [cmp("lt", kk, const(kd, I64)) for kk, kd, s in zip(ks, kern, strides) if kd % s]
            ok = all_of(conds)
            ch = grp * cin_g + c if group > 1 else c
            xv = x([n, ch] + [clamp(pp, size) for pp, size in zip(pos, x.shape[2:])])
            wv = w([ch, mm] + [clamp(kk, kd) for kk, kd in zip(ks, kern)])
            return select(ok, binop("mul", xv, wv), const(0.0, xv.dtype))
        acc = reduce("sum", [cin_g] + taps, body)
        return binop("add", acc, b([m])) if b is not None else acc
    return TensorFn(out, ctx.out_dtype(), f, "complex")


@lowering("ConvInteger")
def _conv_integer(ctx):
    x, w = ctx.input(0), ctx.input(1)
    x2 = minus_zp(x, ctx.input(2), 1)
    w2 = minus_zp(w, ctx.input(3), 0)
    return LOWERINGS["Conv"](sub_ctx(ctx, [x2, w2, None]))


@lowering("DeformConv")
def _deform_conv(ctx):
    """2-D deformable convolution as the ONNX reference: each kernel tap reads the input bilinearly at its
    offset position (zero outside), scaled by the mask."""
    x, w, off, b, mask = (ctx.input(i) for i in range(5))
    if len(x.shape) != 4:
        ctx.unsupported("only 2-D deformable convolution")
    N, C, H, W_ = x.shape
    M, cin_g, kh_n, kw_n = w.shape
    group = ctx.attr("group", 1) or 1
    og_n = ctx.attr("offset_group", 1) or 1
    m_g = M // group
    c_og = C // og_n
    sh, sw = ctx.attr("strides") or [1, 1]
    dh, dw = ctx.attr("dilations") or [1, 1]
    pads = ctx.attr("pads") or [0, 0, 0, 0]
    F = x.dtype
    fc = lambda v: const(float(v), F)

    def f(idx):
        n, m, i, j = idx
        g = m // m_g if group > 1 else const(0, I64)

        def body(c, ki, kj):
            ic = g * cin_g + c if group > 1 else c
            og = ic // c_og if og_n > 1 else const(0, I64)
            tap = (og * kh_n + ki) * kw_n + kj
            oh = off([n, tap * 2, i, j])
            ow = off([n, tap * 2 + 1, i, j])
            ph = binop("add", cast(i * sh + ki * dh - pads[0], F), oh)
            pw = binop("add", cast(j * sw + kj * dw - pads[1], F), ow)
            fh, fw = call("floor", ph), call("floor", pw)
            th, tw = binop("sub", ph, fh), binop("sub", pw, fw)
            h0, w0 = cast(fh, I64), cast(fw, I64)
            total = None
            for dy, wy in ((0, binop("sub", fc(1), th)), (1, th)):
                for dx, wx in ((0, binop("sub", fc(1), tw)), (1, tw)):
                    hh, ww = h0 + dy, w0 + dx
                    inside = logic("and", in_range(hh, 0, H), in_range(ww, 0, W_))
                    v = select(inside, x([n, ic, clamp(hh, H), clamp(ww, W_)]), fc(0))
                    term = binop("mul", binop("mul", wy, wx), v)
                    total = term if total is None else binop("add", total, term)
            val = binop("mul", total, w([m, c, ki, kj]))
            if mask is not None:
                val = binop("mul", val, mask([n, tap, i, j]))
            return val
        acc = reduce("sum", [cin_g, kh_n, kw_n], body)
        return binop("add", acc, b([m])) if b is not None else acc
    return [TensorFn(ctx.out_shape(), x.dtype, f, "complex")]


@lowering("Col2Im")
def _col2im(ctx):
    """Image element (n, c, y...) sums the column entries of every block position and kernel offset that
    cover it: block position b_a = (y_a + pad_a - i_a * dilation_a) / stride_a where that divides exactly and
    falls inside the grid of block positions."""
    x = ctx.input(0)
    out = ctx.out_shape()
    image = list(out[2:])
    block = [int(v) for v in np.asarray(ctx.attr("block_shape")).reshape(-1)]
    n = len(image)
    strides = list(ctx.attr("strides") or [1] * n)
    dilations = list(ctx.attr("dilations") or [1] * n)
    pads = list(ctx.attr("pads") or [0] * (2 * n))
    grid = [(image[a] + pads[a] + pads[n + a] - dilations[a] * (block[a] - 1) - 1) // strides[a] + 1 for a in range(n)]
    kernel = int(np.prod(block))
    zero = const(0, x.dtype)

    def f(idx):
        nb, c, ys = idx[0], idx[1], idx[2:]

        def body(*offs):
            conds, pos = [], []
            for a in range(n):
                t = ys[a] + pads[a] - offs[a] * dilations[a]
                tc = clamp(t, image[a] + pads[a])  # read index only: the conditions below decide
                conds += [cmp("ge", t, const(0, I64)), cmp("lt", t, const(grid[a] * strides[a], I64))]
                if strides[a] > 1:
                    conds.append(cmp("eq", tc % strides[a], const(0, I64)))
                pos.append(clamp(tc // strides[a], grid[a]))
            column = c * kernel
            stride = kernel
            for a in range(n):
                stride //= block[a]
                column = column + offs[a] * stride
            flat = pos[0]
            for a in range(1, n):
                flat = flat * grid[a] + pos[a]
            return select(all_of(conds), x([nb, column, flat]), zero)
        return reduce("sum", block, body)
    return [TensorFn(out, x.dtype, f, "complex")]
