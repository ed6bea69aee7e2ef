"""Lowerings of the pools (max, average, Lp, global, MaxUnpool, RoiAlign)."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ...ir.dim import product
from ...ir.dtype import DType
from ..contraction import DepthwiseWindow
from ..contraction_nhwc import is_channels_last
from ..texpr import I64, E, all_of, binop, call, cast, cmp, const, dim_index, in_range, load, logic, reduce, select
from .core import TensorFn, bf16_stored, clamp, fconst, flat_index, lowering, nan_max, unflat_index
from .windows import may_exceed, padded_window_input, window_params


@lowering("MaxPool", "AveragePool", "LpPool")
def _pool(ctx):
    x = ctx.input(0)
    out = ctx.out_shape()
    spatial = len(x.shape) - 2
    kern = ctx.attr("kernel_shape")
    strides, dil, begin = window_params(ctx, spatial, kern, x.shape[2:], out[2:])
    op = ctx.node.op
    count_pad = ctx.attr("count_include_pad", 0)
    p = ctx.attr("p", 2)

    orig_begin = list(begin)
    sizes = list(x.shape[2:])
    if (op == "AveragePool" and not count_pad and ctx.row_kernels and spatial == 2 and x.dtype == DType.FLOAT
            and ctx.out_dtype() == DType.FLOAT and all(d == 1 for d in dil) and strides[1] in (1, 2)
            and all(isinstance(d, int) for d in x.shape[1:])):
        return [_average_pool_window(ctx, x, out, kern, strides, begin)]
    if (op == "MaxPool" and len(ctx.node.outputs) == 1 and ctx.row_kernels and spatial == 2 and x.dtype == DType.FLOAT
            and strides[1] in (1, 2) and all(isinstance(d, int) for d in list(x.shape[1:]) + list(begin))):
        return [_max_pool_window(ctx, x, out, kern, strides, dil, begin)]
    x0 = x
    if op == "MaxPool" and len(ctx.node.outputs) == 1:
        lowest = -math.inf if x.dtype.is_float else np.iinfo(x.dtype.numpy).min
        x, begin = padded_window_input(ctx, x, out[2:], kern, strides, dil, begin, lowest)
    elif op == "AveragePool" and not count_pad and x.dtype.is_float and all(d == 1 for d in dil):
        x, begin = padded_window_input(ctx, x, out[2:], kern, strides, dil, begin, 0.0)
    padded = x is not x0
    # every window position lies inside x (as padded: by construction): reads need no bounds tests
    inside = padded or (not any(b0 != 0 for b0 in begin) and not any(
        may_exceed((o - 1) * s_ + (k - 1) * d + 1, size) for o, s_, k, d, size in
        zip(out[2:], strides, kern, dil, x.shape[2:])))

    # a 2-D float32 max pool over a stored, padded input: rows in vector registers on x86
    window = None
    if (op == "MaxPool" and inside and ctx.gemm_cols and spatial == 2 and x.dtype == DType.FLOAT
            and len(ctx.node.outputs) == 1 and strides[1] in (1, 2)):
        if x.buf is None:
            x = ctx.temp(x.shape, x.dtype, x.fn, "in")
        window = DepthwiseWindow(None, x.buf, tuple(kern), tuple(strides), tuple(dil), tuple(out[2:]), "max")

    def window_count(o) -> E:
        return _window_count(o, strides, orig_begin, kern, sizes, ctx.out_dtype())

    def f(idx):
        n, c, o = idx[0], idx[1], idx[2:]
        pos_of = lambda ks: [oi * s - pb + ki * d for oi, s, pb, ki, d in zip(o, strides, begin, ks, dil)]
        if op == "AveragePool" and padded and not count_pad and inside:
            # the copy is zero-padded: a plain sum, divided by the in-bounds count
            total = reduce("sum", kern, lambda *ks: x([n, c] + pos_of(ks)))
            return binop("div", total, window_count(o))
        if op == "AveragePool" and not padded and inside:
            # every window lies inside the input (no pads, no ceil-mode overhang): a plain sum over a constant
            # count, no bounds tests (DenseNet-121: a 2x2 average pool over 256 channels of 56x56 0.54 -> 0.15 ms)
            total = reduce("sum", kern, lambda *ks: x([n, c] + pos_of(ks)))
            return binop("div", total, fconst(int(np.prod(kern)), total))
        # MaxPool skips NaN like the reference (and onnxruntime): NaN only when the whole window is NaN
        kind = "fmax" if x.dtype.is_float else "max"
        if op == "MaxPool" and inside:
            red = reduce(kind, kern, lambda *ks: x([n, c] + pos_of(ks)))
            return E("window", [n, c] + list(o) + [red], red.dtype, window) if window is not None else red
        if op == "MaxPool":
            def body(*ks):
                pos = pos_of(ks)
                cond = all_of([in_range(pp, 0, size) for pp, size in zip(pos, x.shape[2:])])
                return x.at_or([n, c] + pos, cond, -math.inf if x.dtype.is_float else np.iinfo(x.dtype.numpy).min)
            return reduce(kind, kern, body)
        if op == "LpPool":
            def body(*ks):
                pos = pos_of(ks)
                cond = all_of([in_range(pp, 0, size) for pp, size in zip(pos, x.shape[2:])])
                v = x.at_or([n, c] + pos, cond, 0.0)
                return call("pow", call("fabs", v), fconst(p, v))
            s = reduce("sum", kern, body)
            return call("pow", s, fconst(1.0 / p, s))

        def body(*ks):
            pos = pos_of(ks)
            cond = all_of([in_range(pp, 0, size) for pp, size in zip(pos, x.shape[2:])])
            return x.at_or([n, c] + pos, cond, 0.0)
        total = reduce("sum", kern, body)
        if count_pad:
            # padding counts, but not the part of a ceil-mode window past the padded input
            def cnt(*ks):
                pos = pos_of(ks)
                cond = all_of([in_range(pp, -pb, size + pe) for pp, size, pb, pe in
                               zip(pos, x.shape[2:], begin, _end_pads(ctx, spatial))])
                return select(cond, fconst(1, total), fconst(0, total))
        else:
            def cnt(*ks):
                pos = pos_of(ks)
                cond = all_of([in_range(pp, 0, size) for pp, size in zip(pos, x.shape[2:])])
                return select(cond, fconst(1, total), fconst(0, total))
        return binop("div", total, reduce("sum", kern, cnt))
    outs = [TensorFn(out, ctx.out_dtype(), f, "complex")]
    if op == "MaxPool" and len(ctx.node.outputs) > 1:
        outs.append(_maxpool_indices(ctx, x, out, kern, strides, dil, begin, ctx.temp(out, x.dtype, f, "max")))
    return outs


def _maxpool_indices(ctx, x, out, kern, strides, dil, begin, best) -> TensorFn:
    """MaxPool's Indices: the first window position (in scan order) holding the maximum, as a flat index
    into the input (row-major, or column-major over the spatial dims with storage_order=1)."""
    sizes = list(x.shape[2:])
    col_major = ctx.attr("storage_order", 0)
    n_win = int(np.prod(kern))
    step = int(np.prod(sizes))

    def f(idx):
        n, c, o = idx[0], idx[1], idx[2:]
        m = best(idx)

        def pos_of(ks):
            return [oi * s - pb + ki * d for oi, s, pb, ki, d in zip(o, strides, begin, ks, dil)]

        def body(*ks):
            pos = pos_of(ks)
            cond = all_of([in_range(pp, 0, size) for pp, size in zip(pos, sizes)])
            hit = cmp("eq", x.at_or([n, c] + pos, cond, 0), m)
            if not (cond.op == "const" and cond.attr is True):
                hit = logic("and", cond, hit)
            return select(hit, flat_index(list(ks), kern), const(n_win, I64))
        k = reduce("min", kern, body)
        pos = pos_of(unflat_index(k, kern))
        if col_major:
            spatial = const(0, I64)
            stride = 1
            for pp, size in zip(pos, sizes):
                spatial = spatial + pp * stride
                stride *= size
        else:
            spatial = flat_index(pos, sizes)
        return (n * x.shape[1] + c) * step + spatial
    return TensorFn(out, I64, f, "complex")


def _end_pads(ctx, spatial):
    pads = ctx.attr("pads")
    return list(pads[spatial:]) if pads else [0] * spatial


def _window_count(o, strides, begin, kern, sizes, dtype) -> E:
    """Elements of the window at output position ``o`` inside the input (unit dilation): a product of
    clipped extents, as ``dtype``."""
    total = None
    for oi, s_, pb, k, size in zip(o, strides, begin, kern, sizes):
        lo = oi * s_ - pb
        hi = lo + k
        lo_c = select(cmp("lt", lo, const(0, I64)), const(0, I64), lo)
        hi_c = select(cmp("gt", hi, dim_index(size)), dim_index(size), hi)
        ext = E("sub", (hi_c, lo_c), I64)
        total = ext if total is None else E("mul", (total, ext), I64)
    return cast(total, dtype)


def _average_pool_window(ctx, x, out, kern, strides, begin) -> TensorFn:
    """A 2-D float32 average pool (pads not counted) as a depthwise window of ones over the unpadded input,
    which the x86 backend computes by rows (masked loads read the padding as zeros), divided by each
    window's count of input elements. As a loop nest over a padded copy, ShuffleNet's three 3x3 stride-2
    pools took 0.15 ms of its 2.1."""
    if x.buf is None:
        x = ctx.temp(x.shape, x.dtype, x.fn, "in")
    sizes = x.shape[2:]
    if tuple(kern) == tuple(sizes) and tuple(out[2:]) == (1, 1) and not any(begin):
        mean = channels_last_mean(ctx, x, out)
        if mean is not None:
            return mean
    ones = ctx.weight(np.ones((x.shape[1], 1) + tuple(kern), np.float32), "ones")
    window = DepthwiseWindow(ones, x.buf, tuple(kern), tuple(strides), (1, 1), tuple(out[2:]),
                             pads=(int(begin[0]), int(begin[1])))
    constant = not any(begin) and all((o - 1) * s + k <= size for o, s, k, size in zip(out[2:], strides, kern, sizes))

    def count(o) -> E:
        if constant:
            return const(float(np.prod(kern)), DType.FLOAT)
        return _window_count(o, strides, begin, kern, sizes, DType.FLOAT)

    def f(idx):
        n, c, o = idx[0], idx[1], idx[2:]

        def body(*ks):
            pos = [oi * s_ - pb + ki for oi, s_, pb, ki in zip(o, strides, begin, ks)]
            inside = all_of([in_range(q, 0, size) for q, size in zip(pos, sizes)])
            return binop("mul", x.at_or([n, c] + pos, inside, 0.0), load(ones, [c, const(0, I64)] + list(ks)))
        acc = E("window", [n, c] + list(o) + [reduce("sum", kern, body)], DType.FLOAT, window)
        return binop("div", acc, count(o))
    return TensorFn(out, ctx.out_dtype(), f, "complex", contraction=True)


def channels_last_mean(ctx, x, out) -> Optional[TensorFn]:
    """The mean over the whole map (GlobalAveragePool, or an AveragePool whose window is the map) of a value
    stored channels-last (a classifier's pool after channels-last convolutions,
    :mod:`cuvil.kernels.contraction_nhwc`): a plain sum in window order divided by the count, a ``"sum"``
    window that the x86 backend takes on vectors of 16 channels (``gemm_nhwc.emit_channels_last_mean``; the
    depthwise row kernels read channel-planar rows only, and the loop nest would read one channel at a stride of
    C). None for any other input."""
    if (x.buf is None or not is_channels_last(x.buf) or x.buf.dtype != DType.FLOAT or ctx.out_dtype() != DType.FLOAT
            or not ctx.row_kernels or len(x.shape) != 4 or not all(isinstance(d, int) for d in x.shape[1:])):
        return None
    kern = tuple(x.shape[2:])
    window = DepthwiseWindow(None, x.buf, kern, (1, 1), (1, 1), (1,) * len(kern), "sum")

    def f(idx):
        n, c = idx[0], idx[1]
        acc = E("window", [n, c] + list(idx[2:]) + [reduce("sum", kern, lambda *ks: x([n, c] + list(ks)))],
                DType.FLOAT, window)
        return binop("div", acc, const(float(np.prod(kern)), DType.FLOAT))
    return TensorFn(out, ctx.out_dtype(), f, "complex", contraction=True)


def _max_pool_window(ctx, x, out, kern, strides, dil, begin) -> TensorFn:
    """A 2-D float32 max pool as a "max" window over the unpadded stored input (float32, or the bfloat16 words
    of a value stored so, :mod:`cuvil.kernels.bf16_storage`), which the x86 backend computes by rows: its
    masked loads read the padding, and a ceil-mode window's overhang, as -inf. ResNet-50's stem pool read a
    -inf-padded float32 copy of the stem's 3.2 MB output (0.45 ms of a 20 ms bf16 run). An input that is a
    concatenation of values all stored as bfloat16 is stored so too (its values are bfloat16 already: no rounding),
    so its pieces' producers can write into it in place (:mod:`cuvil.kernels.concat_in_place`; SqueezeNet's fire
    modules before a pool)."""
    if x.buf is None:
        pieces = x.view[2] if x.view is not None and x.view[0] == "concat" else ()
        if pieces and all(t.buf is not None and t.buf.dtype == DType.BFLOAT16 and t.dtype == DType.FLOAT
                          for t in pieces) and x.dtype == DType.FLOAT:
            x = bf16_stored(ctx.temp(x.shape, DType.BFLOAT16, x.fn, "in"))
        else:
            x = ctx.temp(x.shape, x.dtype, x.fn, "in")
    sizes = x.shape[2:]
    window = DepthwiseWindow(None, x.buf, tuple(kern), tuple(strides), tuple(dil), tuple(out[2:]), "max",
                             pads=(int(begin[0]), int(begin[1])))

    def f(idx):
        n, c, o = idx[0], idx[1], idx[2:]

        def body(*ks):
            pos = [oi * s_ - pb + ki * d for oi, s_, pb, ki, d in zip(o, strides, begin, ks, dil)]
            inside = all_of([in_range(q, 0, size) for q, size in zip(pos, sizes)])
            return x.at_or([n, c] + pos, inside, -math.inf)
        red = reduce("fmax", kern, body)
        return E("window", [n, c] + list(o) + [red], red.dtype, window)
    return TensorFn(out, ctx.out_dtype(), f, "complex")


@lowering("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def _global_pool(ctx):
    x = ctx.input(0)
    sp = list(x.shape[2:])
    n_el = product(sp)
    op = ctx.node.op

    def f(idx):
        n, c = idx[0], idx[1]
        if op == "GlobalMaxPool":
            return reduce("max", sp, lambda *ks: x([n, c] + list(ks)))
        if op == "GlobalLpPool":
            p = ctx.attr("p", 2)
            s = reduce("sum", sp, lambda *ks: call("pow", call("fabs", x([n, c] + list(ks))), fconst(p, x([n, c] + list(ks)))))
            return call("pow", s, fconst(1.0 / p, s))
        s = reduce("sum", sp, lambda *ks: x([n, c] + list(ks)))
        return binop("div", s, fconst(n_el, s))
    if op == "GlobalAveragePool" and len(sp) == 2:
        mean = channels_last_mean(ctx, x, ctx.out_shape())
        if mean is not None:
            return [mean]
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "complex")]


@lowering("MaxUnpool")
def _max_unpool(ctx):
    """Each output element searches its (n, c) plane of the input for the position whose index names it
    (the last one wins); elements nobody names are 0."""
    x, ind = ctx.input(0), ctx.input(1)
    out = ctx.out_shape()
    sp = list(x.shape[2:])
    k = len(sp)
    kern = ctx.attr("kernel_shape")
    strides = ctx.attr("strides") or [1] * k
    pads = ctx.attr("pads") or [0] * (2 * k)
    # indices address the default unpooled shape, even when output_shape pads it further (as the reference)
    default = list(out[:2]) + [(d - 1) * s_ - pads[i] - pads[k + i] + kk
                               for i, (d, s_, kk) in enumerate(zip(sp, strides, kern))]

    def f(idx):
        target = flat_index(idx, default)
        inside = all_of([cmp("lt", i, const(d, I64)) for i, d, o in zip(idx[2:], default[2:], out[2:]) if d < o])
        target = select(inside, target, const(-2, I64)) if not (inside.op == "const") else target

        def body(*ks):
            q = [idx[0], idx[1]] + list(ks)
            return select(cmp("eq", cast(ind(q), I64), target), flat_index(list(ks), sp), const(-1, I64))
        last = reduce("max", sp, body)
        q = [idx[0], idx[1]] + unflat_index(clamp(last, int(np.prod(sp))), sp)
        return select(cmp("ge", last, const(0, I64)), x(q), const(0, x.dtype))
    return [TensorFn(out, x.dtype, f, "complex")]


@lowering("RoiAlign")
def _roi_align(ctx):
    """As the ONNX reference, for a fixed sampling_ratio (the adaptive one, 0, makes the number of samples
    depend on the roi values)."""
    x, rois, bidx = ctx.input(0), ctx.input(1), ctx.input(2)
    sr = ctx.attr("sampling_ratio", 0)
    if sr <= 0:
        ctx.unsupported("sampling_ratio=0 (the sample count would depend on the roi values)")
    mode = ctx.attr("mode", "avg")
    scale = float(ctx.attr("spatial_scale", 1.0))
    half = ctx.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    out = ctx.out_shape()
    ph_n, pw_n = out[2], out[3]
    H, W = x.shape[2], x.shape[3]
    F = x.dtype if x.dtype.is_float else DType.FLOAT
    c = lambda v: const(float(v), F)

    def f(idx):
        r, ch, ph, pw = idx
        coord = lambda k: binop("sub", binop("mul", cast(rois([r, const(k, I64)]), F), c(scale)), c(0.5 if half else 0.0))
        sw, sh, ew, eh = coord(0), coord(1), coord(2), coord(3)
        rw, rh = binop("sub", ew, sw), binop("sub", eh, sh)
        if not half:
            rw, rh = nan_max(rw, c(1.0)), nan_max(rh, c(1.0))
        bh, bw = binop("div", rh, c(ph_n)), binop("div", rw, c(pw_n))
        n = cast(bidx([r]), I64)
        samples = []
        for iy in range(sr):
            yy = binop("add", binop("add", sh, binop("mul", cast(ph, F), bh)), binop("div", binop("mul", c(iy + 0.5), bh), c(sr)))
            for ix in range(sr):
                xx = binop("add", binop("add", sw, binop("mul", cast(pw, F), bw)), binop("div", binop("mul", c(ix + 0.5), bw), c(sr)))
                empty = logic("or", logic("or", cmp("lt", yy, c(-1.0)), cmp("gt", yy, c(H))),
                              logic("or", cmp("lt", xx, c(-1.0)), cmp("gt", xx, c(W))))
                y0, x0 = nan_max(yy, c(0.0)), nan_max(xx, c(0.0))
                yl, xl = cast(y0, I64), cast(x0, I64)
                y_edge, x_edge = cmp("ge", yl, const(H - 1, I64)), cmp("ge", xl, const(W - 1, I64))
                yl = select(y_edge, const(H - 1, I64), yl)
                xl = select(x_edge, const(W - 1, I64), xl)
                yh = select(y_edge, const(H - 1, I64), yl + 1)
                xh = select(x_edge, const(W - 1, I64), xl + 1)
                y0 = select(y_edge, cast(yl, F), y0)
                x0 = select(x_edge, cast(xl, F), x0)
                ly, lx = binop("sub", y0, cast(yl, F)), binop("sub", x0, cast(xl, F))
                hy, hx = binop("sub", c(1.0), ly), binop("sub", c(1.0), lx)
                px = lambda yi, xi: cast(x([n, ch, clamp(yi, H), clamp(xi, W)]), F)
                terms = [binop("mul", binop("mul", hy, hx), px(yl, xl)), binop("mul", binop("mul", hy, lx), px(yl, xh)),
                         binop("mul", binop("mul", ly, hx), px(yh, xl)), binop("mul", binop("mul", ly, lx), px(yh, xh))]
                if mode == "avg":
                    v = binop("add", binop("add", terms[0], terms[1]), binop("add", terms[2], terms[3]))
                else:
                    v = nan_max(nan_max(terms[0], terms[1]), nan_max(terms[2], terms[3]))
                samples.append(select(empty, c(0.0), v))
        acc = samples[0]
        for v in samples[1:]:
            acc = binop("add", acc, v) if mode == "avg" else nan_max(acc, v)
        if mode == "avg":
            acc = binop("div", acc, c(sr * sr))
        return cast(acc, x.dtype)
    return [TensorFn(out, x.dtype, f, "complex")]
