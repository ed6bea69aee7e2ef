"""Lowerings of Resize and GridSample (nearest, linear, cubic; antialiased downsampling)."""
from __future__ import annotations

import math
from typing import List, Tuple

import attrs
import numpy as np

from ...ir.dtype import DType
from ..texpr import BOOL, I64, E, binop, call, cast, cmp, const, in_range, logic, select
from .core import TensorFn, clamp, lowering, nan_max, nan_min


def _cubic_coeffs(r: E, A: float) -> List[E]:
    """The four cubic-convolution weights of taps floor-1 .. floor+2 at fraction ``r`` (as the reference)."""
    c = lambda v: const(v, r.dtype)
    one_r = binop("sub", c(1.0), r)

    def far(t):  # ((A*t - 5A)*t + 8A)*t - 4A with t = ratio + 1 or (1 - ratio) + 1
        return binop("sub", binop("mul", binop("add", binop("mul", binop("sub", binop("mul", c(A), t), c(5 * A)), t), c(8 * A)), t), c(4 * A))

    def near(t):  # ((A+2)*t - (A+3))*t*t + 1
        return binop("add", binop("mul", binop("mul", binop("sub", binop("mul", c(A + 2), t), c(A + 3)), t), t), c(1.0))
    return [far(binop("add", r, c(1.0))), near(r), near(one_r), far(binop("add", one_r, c(1.0)))]


def _aa_coeffs(r: E, scale: float, cubic: bool, A: float) -> List[E]:
    """Antialiasing weights (downsampling): the kernel stretched by 1/scale, normalised to sum 1."""
    c = lambda v: const(v, r.dtype)
    scale = min(scale, 1.0)
    if cubic:
        start = int(np.floor(-2 / scale) + 1)
        taps = range(start, 2 - start)
    else:
        start = int(np.floor(-1 / scale) + 1)
        taps = range(start, start + 2 - 2 * start)
    ws = []
    for i in taps:
        t = call("fabs", binop("mul", c(scale), binop("sub", c(float(i)), r)))
        if cubic:
            t2 = binop("mul", t, t)
            t3 = binop("mul", t2, t)
            inner = binop("add", binop("sub", binop("mul", c(A + 2), t3), binop("mul", c(A + 3), t2)), c(1.0))
            outer = binop("sub", binop("add", binop("sub", binop("mul", c(A), t3), binop("mul", c(5 * A), t2)),
                                       binop("mul", c(8 * A), t)), c(4 * A))
            w = select(cmp("le", t, c(1.0)), inner, select(cmp("lt", t, c(2.0)), outer, c(0.0)))
        else:
            w = nan_max(c(0.0), nan_min(c(1.0), binop("sub", c(1.0), t)))
        ws.append(w)
    total = ws[0]
    for w in ws[1:]:
        total = binop("add", total, w)
    return [binop("div", w, total) for w in ws]


@attrs.define
class _ResizeSpec:
    """A Resize node's attributes, resolved per axis of its input ``x``."""
    x: TensorFn
    out: Tuple[int, ...]
    mode: str
    ctm: str                  # coordinate_transformation_mode
    nearest_mode: str
    A: float                  # cubic_coeff_a
    exclude: int              # exclude_outside
    extrap: float             # extrapolation_value
    antialias: int
    scale_of: List[float]
    roi_of: List[Tuple[float, float]]
    work: List[int]           # the axes that resample (the others map through unchanged)


def _dconst(v) -> E:
    return const(float(v), DType.DOUBLE)


@lowering("Resize")
def _resize(ctx):
    """Separable resampling as the ONNX reference computes it: per resized axis, the source coordinate of
    the output index (coordinate_transformation_mode), then the taps around it with their weights
    (nearest, linear or cubic, edge-clamped); the output is the weighted sum over all tap combinations."""
    s = _resize_spec(ctx)
    n_terms = 1
    for a in s.work:
        n_terms *= 1 if s.mode == "nearest" else (4 if s.mode == "cubic" else 2) * (int(1 / min(s.scale_of[a], 1.0)) + 1 if s.antialias else 1)
    if n_terms > 4096:
        ctx.unsupported(f"{n_terms} interpolation taps per output element")
    return [TensorFn(s.out, s.x.dtype, lambda idx: _resize_element(ctx, s, idx), "complex")]


def _resize_spec(ctx) -> _ResizeSpec:
    """The attributes of ``ctx``'s Resize, each axis's scale and region of interest, and the axes that resample;
    refuses scales or sizes known only at run time."""
    x = ctx.input(0)
    out = ctx.out_shape()
    rank = len(x.shape)
    mode = ctx.attr("mode", "nearest")
    ctm = ctx.attr("coordinate_transformation_mode", "half_pixel")
    nearest_mode = ctx.attr("nearest_mode", "round_prefer_floor")
    A = float(ctx.attr("cubic_coeff_a", -0.75))
    exclude = ctx.attr("exclude_outside", 0)
    extrap = float(ctx.attr("extrapolation_value", 0.0))
    antialias = ctx.attr("antialias", 0)
    policy = ctx.attr("keep_aspect_ratio_policy", "stretch")
    axes = ctx.attr("axes")
    axes = list(range(rank)) if axes is None else [a % rank for a in axes]
    scales, sizes, roi = ctx.attr("scales"), ctx.attr("sizes"), ctx.attr("roi")
    scales = None if scales is None or np.asarray(scales).size == 0 else [float(v) for v in np.asarray(scales).reshape(-1)]
    sizes = None if sizes is None or np.asarray(sizes).size == 0 else [int(v) for v in np.asarray(sizes).reshape(-1)]
    roi = None if roi is None or np.asarray(roi).size == 0 else [float(v) for v in np.asarray(roi).reshape(-1)]
    if scales is None and sizes is None:
        ctx.unsupported("scales or sizes computed at run time")
    if mode == "nearest" and antialias:
        ctx.unsupported("antialias with mode nearest")
    scale_of = [1.0] * rank
    if scales is not None:
        for a, s_ in zip(axes, scales):
            scale_of[a] = s_
    else:
        ratios = [n / x.shape[a] for a, n in zip(axes, sizes)]
        if policy != "stretch":
            common = min(ratios) if policy == "not_larger" else max(ratios)
            ratios = [common] * len(axes)
        for a, r in zip(axes, ratios):
            scale_of[a] = r
    roi_of = [(0.0, 1.0)] * rank
    if roi is not None:
        n = len(roi) // 2
        ax = axes if n == len(axes) else list(range(rank))
        for k, a in enumerate(ax):
            roi_of[a] = (roi[k], roi[n + k])
    work = [a for a in range(rank)
            if not (math.isclose(scale_of[a], 1.0) and out[a] == x.shape[a]
                    and (ctm != "tf_crop_and_resize" or (math.isclose(roi_of[a][0], 0.0) and math.isclose(roi_of[a][1], 1.0))))]
    return _ResizeSpec(x, out, mode, ctm, nearest_mode, A, exclude, extrap, antialias, scale_of, roi_of, work)


def _resize_source(ctx, s: _ResizeSpec, a: int, i: E) -> E:
    """The source coordinate (float64) of output index ``i`` along axis ``a``."""
    dc = _dconst
    ctm, out = s.ctm, s.out
    y = cast(i, DType.DOUBLE)
    length, scale = s.x.shape[a], s.scale_of[a]
    if ctm in ("align_corners", "tf_crop_and_resize", "pytorch_half_pixel", "half_pixel_symmetric") \
            and not isinstance(length, int):   # asymmetric and half_pixel read only the scale
        ctx.unsupported(f"coordinate_transformation_mode {ctm} over a symbolic size ({length}); fix the symbol")
    out_w = scale * length if isinstance(length, int) else None
    if ctm == "align_corners":
        return dc(0.0) if out_w == 1 else binop("div", binop("mul", y, dc(length - 1)), dc(out_w - 1))
    if ctm == "asymmetric":
        return binop("div", y, dc(scale))
    if ctm == "tf_crop_and_resize":
        r0, r1 = s.roi_of[a]
        base = dc((r1 - r0) * (length - 1) / 2) if out_w == 1 else \
            binop("div", binop("mul", binop("mul", y, dc(r1 - r0)), dc(length - 1)), dc(out_w - 1))
        return binop("add", base, dc(r0 * (length - 1)))
    hp = binop("sub", binop("div", binop("add", y, dc(0.5)), dc(scale)), dc(0.5))
    if ctm == "pytorch_half_pixel":
        return dc(-0.5) if out_w == 1 else hp
    if ctm == "half_pixel":
        return hp
    if ctm == "half_pixel_symmetric":
        adjustment = out[a] / out_w
        offset = length / 2 * (1 - adjustment)
        return binop("add", dc(offset), hp)
    ctx.unsupported(f"coordinate_transformation_mode {ctm}")


def _resize_taps(ctx, s: _ResizeSpec, a: int, i: E):
    """[(index, weight or None)] for output index ``i`` along axis ``a``, and an extrapolation test."""
    dc = _dconst
    mode = s.mode
    length = s.x.shape[a]
    xo = _resize_source(ctx, s, a, i)
    fl = call("floor", xo)
    frac = binop("sub", xo, fl)
    is_int = cmp("eq", frac, dc(0.0))
    fl_i = cast(fl, I64)
    outside = None
    if s.ctm == "tf_crop_and_resize":
        outside = logic("or", cmp("lt", xo, dc(0.0)), cmp("gt", xo, dc(length - 1)))
    if mode == "nearest":
        if s.nearest_mode == "round_prefer_floor":
            up = cmp("gt", frac, dc(0.5))
        elif s.nearest_mode == "round_prefer_ceil":
            up = cmp("ge", frac, dc(0.5))
        elif s.nearest_mode == "floor":
            up = const(False, BOOL)
        else:
            up = const(True, BOOL)
        j = select(logic("and", up, logic("not", is_int)), fl_i + 1, fl_i)
        return [(clamp(j, length), None)], outside
    ratio = select(is_int, dc(1.0), frac)
    if s.antialias:
        ws = _aa_coeffs(ratio, s.scale_of[a], mode == "cubic", s.A)
    elif mode == "cubic":
        ws = _cubic_coeffs(ratio, s.A)
    else:
        ws = [binop("sub", dc(1.0), ratio), ratio]
    n = len(ws)
    first = fl_i + select(is_int, const(-(n // 2), I64), const(-(n // 2) + 1, I64))
    idxs = [first + k for k in range(n)]
    if s.exclude:
        ws = [select(in_range(j, 0, length), w, dc(0.0)) for j, w in zip(idxs, ws)]
        total = ws[0]
        for w in ws[1:]:
            total = binop("add", total, w)
        total = select(cmp("eq", total, dc(0.0)), dc(1.0), total)
        ws = [binop("div", w, total) for w in ws]
    return [(clamp(j, length), w) for j, w in zip(idxs, ws)], outside


def _resize_element(ctx, s: _ResizeSpec, idx) -> E:
    """One output element: the weighted sum over every combination of the resampled axes' taps."""
    dc = _dconst
    x, mode, work = s.x, s.mode, s.work
    per_axis = {a: _resize_taps(ctx, s, a, idx[a]) for a in work}
    combos = [([], None)]
    for a in work:
        combos = [(picks + [(a, j)], w if wa is None else (wa if w is None else binop("mul", w, wa)))
                  for picks, w in combos for j, wa in per_axis[a][0]]
    total = None
    for picks, w in combos:
        sub = list(idx)
        for a, j in picks:
            sub[a] = j
        v = x(sub)
        if mode == "nearest":
            total = v
            break
        term = binop("mul", cast(v, DType.DOUBLE), w)
        total = term if total is None else binop("add", total, term)
    if mode != "nearest":
        if not x.dtype.is_float:  # saturate, then truncate, like the reference's saturate_cast
            info = np.iinfo(x.dtype.numpy)
            total = nan_min(nan_max(total, dc(info.min)), dc(info.max))
        total = cast(total, x.dtype)
    outs = [per_axis[a][1] for a in work if per_axis[a][1] is not None]
    if outs:
        cond = outs[0]
        for o in outs[1:]:
            cond = logic("or", cond, o)
        total = select(cond, const(s.extrap, x.dtype), total)
    return total


@lowering("GridSample")
def _grid_sample(ctx):
    """As the ONNX reference: per spatial dim, the grid coordinate denormalised, out-of-border coordinates
    clamped or reflected (padding_mode), then nearest / linear / cubic taps whose out-of-range reads are 0
    (zeros), clamped (border) or reflected (reflection)."""
    x, grid = ctx.input(0), ctx.input(1)
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(ctx.attr("mode", "linear"), ctx.attr("mode", "linear"))
    pad = ctx.attr("padding_mode", "zeros")
    align = ctx.attr("align_corners", 0)
    dims = list(x.shape[2:])
    k = len(dims)
    if mode not in ("nearest", "linear", "cubic") or pad not in ("zeros", "border", "reflection"):
        ctx.unsupported(f"mode {mode} with padding_mode {pad}")
    W = grid.dtype if grid.dtype.is_float else DType.FLOAT
    c = lambda v: const(float(v), W)
    lo = [0.0 if align else -0.5 for _ in dims]
    hi = [d - 1.0 if align else d - 0.5 for d in dims]

    def reflect_f(v, a, b):
        rng = c(b - a)

        def side(dx, near, far):
            n = call("floor", binop("div", dx, rng))
            r = binop("sub", dx, binop("mul", n, rng))
            even = cmp("eq", binop("sub", n, binop("mul", c(2.0), call("floor", binop("div", n, c(2.0))))), c(0.0))
            return select(even, binop(near[0], c(near[1]), r), binop(far[0], c(far[1]), r))
        below = side(binop("sub", c(a), v), ("add", a), ("sub", b))
        above = side(binop("sub", v, c(b)), ("sub", b), ("add", a))
        return select(cmp("lt", v, c(a)), below, select(cmp("gt", v, c(b)), above, v))

    def pixel_index(i: E, d: int, axis: int):
        """(index to read, in-range condition or None) for integer tap ``i``."""
        if pad == "zeros":
            return clamp(i, d), in_range(i, 0, d)
        if pad == "border":
            return clamp(i, d), None
        return clamp(cast(reflect_f(cast(i, W), lo[axis], hi[axis]), I64), d), None

    def f(idx):
        n, ch, o = idx[0], idx[1], idx[2:]
        per_dim = []
        for i, d in enumerate(dims):
            g = cast(grid([n] + list(o) + [const(k - 1 - i, I64)]), W)
            if align:
                v = binop("mul", binop("div", binop("add", g, c(1.0)), c(2.0)), c(d - 1))
            else:
                v = binop("div", binop("sub", binop("mul", binop("add", g, c(1.0)), c(d)), c(1.0)), c(2.0))
            if mode == "nearest":
                v = call("roundeven", v)
            outside = logic("or", cmp("lt", v, c(lo[i])), cmp("gt", v, c(hi[i])))
            if pad == "border":
                v = select(outside, nan_min(nan_max(v, c(0.0)), c(d - 1.0)), v)
            elif pad == "reflection":
                v = select(outside, reflect_f(v, lo[i], hi[i]), v)
            if mode == "nearest":
                per_dim.append([(pixel_index(cast(v, I64), d, i), None)])
                continue
            fl = call("floor", v)
            t = binop("sub", v, fl)
            base = cast(fl, I64)
            if mode == "linear":
                taps = [(base, binop("sub", c(1.0), t)), (base + 1, t)]
            else:
                taps = list(zip([base - 1, base, base + 1, base + 2], _cubic_coeffs(t, -0.75)))
            per_dim.append([(pixel_index(j, d, i), w) for j, w in taps])
        combos = [([], None, None)]
        for taps in per_dim:
            new = []
            for sub, w, cond in combos:
                for (j, ok), wj in taps:
                    w2 = wj if w is None else (w if wj is None else binop("mul", w, wj))
                    c2 = ok if cond is None else (cond if ok is None else logic("and", cond, ok))
                    new.append((sub + [j], w2, c2))
            combos = new
        total = None
        for sub, w, cond in combos:
            v = cast(x([n, ch] + sub), W)
            if cond is not None:
                v = select(cond, v, c(0.0))
            term = v if w is None else binop("mul", w, v)
            total = term if total is None else binop("add", total, term)
        return cast(total, x.dtype)
    return [TensorFn(ctx.out_shape(), x.dtype, f, "complex")]


@lowering("AffineGrid")
def _affine_grid(ctx):
    """grid[n, ..., k] = sum_j theta[n, k, j] * p_j + theta[n, k, last], p the output position normalised to
    [-1, 1] per axis (x from the last axis, then y, then z), at pixel centres unless align_corners."""
    theta = ctx.input(0)
    out = ctx.out_shape()
    spatial = out[1:-1]
    k = len(spatial)
    align = ctx.attr("align_corners", 0)
    dt = theta.dtype

    def coord(i: E, n: int) -> E:
        f = cast(i, dt)
        minus_one = const(-1.0, dt)
        if align:  # -1 + i * 2 / (n - 1); a single position is -1
            return minus_one if n == 1 else binop("add", binop("mul", f, const(2.0 / (n - 1), dt)), minus_one)
        centre = binop("add", binop("mul", f, const(2.0, dt)), const(1.0, dt))  # (2i + 1) / n - 1
        return binop("add", binop("div", centre, const(float(n), dt)), minus_one)

    def f(idx):
        n, pos, row = idx[0], idx[1:-1], idx[-1]
        acc = theta([n, row, const(k, I64)])
        for j in range(k):  # p_j: x reads the last spatial axis, y the one before, ...
            axis = k - 1 - j
            acc = binop("add", binop("mul", theta([n, row, const(j, I64)]), coord(pos[axis], spatial[axis])), acc)
        return acc
    return [TensorFn(out, dt, f, "complex")]
