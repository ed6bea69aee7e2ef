"""Lowerings of gathers, scatters, one-hot, triangles, scans and selections (TopK, NonZero, Unique,
NonMaxSuppression)."""
from __future__ import annotations

import numpy as np

from ...ir.dim import product
from ..sequential import Assign, Sequential, sequential
from ..texpr import (I64, Buf, E, all_of, binop, cast, cmp, const, dim_index, identity_value, load, logic, reduce,
                     select, var)
from .core import (ARENA, TensorFn, clamp, flat_index, lowering, nan_max, nan_min, selected_positions, shape_param,
                   unflat_index)


@lowering("Gather")
def _gather(ctx):
    x, ind = ctx.input(0), ctx.input(1)
    axis = ctx.attr("axis", 0) % len(x.shape)
    r = len(ind.shape)

    def f(idx):
        j = cast(ind(idx[axis:axis + r]), I64)
        j = select(cmp("lt", j, const(0, I64)), j + x.shape[axis], j)
        return x(idx[:axis] + [clamp(j, x.shape[axis])] + idx[axis + r:])
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


def _scalar_attr(v, default=None):
    """A lifted scalar attribute (given as a scalar, a one-element list or array)."""
    if v is None:
        return default
    arr = np.asarray(v).reshape(-1)
    return arr[0].item() if arr.size else default


@lowering("Trilu")
def _trilu(ctx):
    x = ctx.input(0)
    k = int(_scalar_attr(ctx.attr("k"), 0))
    upper = ctx.attr("upper", 1)

    def f(idx):
        d = idx[-1] - idx[-2]
        keep = cmp("ge", d, const(k, I64)) if upper else cmp("le", d, const(k, I64))
        return select(keep, x(idx), const(0, x.dtype))
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


def _norm_index(j: E, size: int) -> E:
    j = cast(j, I64)
    return select(cmp("lt", j, const(0, I64)), j + size, j)


@lowering("GatherElements")
def _gather_elements(ctx):
    x, ind = ctx.input(0), ctx.input(1)
    axis = ctx.attr("axis", 0) % len(x.shape)

    def f(idx):
        sub = list(idx)
        sub[axis] = clamp(_norm_index(ind(idx), x.shape[axis]), x.shape[axis])
        return x(sub)
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


@lowering("GatherND")
def _gather_nd(ctx):
    x, ind = ctx.input(0), ctx.input(1)
    b = ctx.attr("batch_dims", 0)
    q = list(ind.shape)
    k = q[-1]
    nq = len(q) - 1

    def f(idx):
        lead = idx[:nq]
        coords = [clamp(_norm_index(ind(lead + [const(j, I64)]), x.shape[b + j]), x.shape[b + j]) for j in range(k)]
        return x(idx[:b] + coords + idx[nq:])
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


def _combine(kind: str, old: E, new: E) -> E:
    if kind == "add":
        return binop("add", old, new)
    if kind == "mul":
        return binop("mul", old, new)
    if kind == "max":
        return nan_max(old, new)
    return nan_min(old, new)


@lowering("ScatterElements")
def _scatter_elements(ctx):
    """Each output element searches the update positions that target it (the last one wins, or all are
    combined by ``reduction``): quadratic in the axis length, no sequential writes."""
    x, ind, upd = ctx.input(0), ctx.input(1), ctx.input(2)
    axis = ctx.attr("axis", 0) % len(x.shape)
    kind = ctx.attr("reduction", "none")
    q = list(ind.shape)
    n = q[axis]

    def f(idx):
        others = all_of([cmp("lt", i, const(d, I64)) for a, (i, d) in enumerate(zip(idx, q)) if a != axis and d < x.shape[a]])

        def at(kk):
            sub = list(idx)
            sub[axis] = kk
            return [clamp(s_, d) for s_, d in zip(sub, q)]

        def match(kk):
            m = cmp("eq", _norm_index(ind(at(kk)), x.shape[axis]), idx[axis])
            return m if others.op == "const" and others.attr is True else logic("and", others, m)
        if kind == "none":
            last = reduce("max", [n], lambda kk: select(match(kk), kk, const(-1, I64)))
            return select(cmp("ge", last, const(0, I64)), upd(at(clamp(last, n))), x(idx))
        red = {"add": "sum", "mul": "prod", "max": "max", "min": "min"}[kind]
        ident = const(identity_value(kind, x.dtype), x.dtype)
        acc = reduce(red, [n], lambda kk: select(match(kk), upd(at(kk)), ident))
        if kind in ("max", "min"):
            hit = reduce("max", [n], lambda kk: select(match(kk), const(1, I64), const(0, I64)))
            return select(cmp("gt", hit, const(0, I64)), _combine(kind, x(idx), acc), x(idx))
        return _combine(kind, x(idx), acc)
    return [TensorFn(ctx.out_shape(), x.dtype, f, "complex")]


@lowering("ScatterND")
def _scatter_nd(ctx):
    x, ind, upd = ctx.input(0), ctx.input(1), ctx.input(2)
    kind = ctx.attr("reduction", "none")
    q = list(ind.shape)
    k = q[-1]
    lead = q[:-1]

    def f(idx):
        def match(*us):
            conds = [cmp("eq", _norm_index(ind(list(us) + [const(j, I64)]), x.shape[j]), idx[j]) for j in range(k)]
            return all_of(conds)

        def upd_at(us):
            return upd(list(us) + idx[k:])
        if not lead:
            return select(match(), upd_at([]), x(idx)) if kind == "none" else \
                select(match(), _combine(kind, x(idx), upd_at([])), x(idx))
        if kind == "none":
            last = reduce("max", lead, lambda *us: select(match(*us), flat_index(list(us), lead), const(-1, I64)))
            us = unflat_index(clamp(last, int(np.prod(lead))), lead)
            return select(cmp("ge", last, const(0, I64)), upd_at(us), x(idx))
        red = {"add": "sum", "mul": "prod", "max": "max", "min": "min"}[kind]
        ident = const(identity_value(kind, x.dtype), x.dtype)
        acc = reduce(red, lead, lambda *us: select(match(*us), upd_at(us), ident))
        if kind in ("max", "min"):
            hit = reduce("max", lead, lambda *us: select(match(*us), const(1, I64), const(0, I64)))
            return select(cmp("gt", hit, const(0, I64)), _combine(kind, x(idx), acc), x(idx))
        return _combine(kind, x(idx), acc)
    return [TensorFn(ctx.out_shape(), x.dtype, f, "complex")]


@lowering("OneHot")
def _onehot(ctx):
    ind, vals = ctx.input(0), ctx.input(2)
    depth = ctx.attr("depth")
    if depth is None:
        ctx.unsupported("non-constant depth")
    depth = int(_scalar_attr(depth))
    out = ctx.out_shape()
    axis = ctx.attr("axis", -1) % len(out)
    dt = ctx.out_dtype()

    def f(idx):
        j = cast(ind(idx[:axis] + idx[axis + 1:]), I64)  # float indices truncate
        j = select(cmp("lt", j, const(0, I64)), j + depth, j)
        on = vals([const(1, I64)])
        off = vals([const(0, I64)])
        return select(cmp("eq", j, idx[axis]), on, off)
    return [TensorFn(out, dt, f, "injective")]


@lowering("ReverseSequence")
def _reverse_sequence(ctx):
    x, lens = ctx.input(0), ctx.input(1)
    ba, ta = ctx.attr("batch_axis", 1), ctx.attr("time_axis", 0)

    def f(idx):
        n = cast(lens([idx[ba]]), I64)
        t = idx[ta]
        sub = list(idx)
        sub[ta] = clamp(n - t - 1, x.shape[ta])
        return select(cmp("lt", t, n), x(sub), x(idx))
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


@lowering("CumSum", "CumProd")
def _cumulative(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis")
    if axis is None:
        ctx.unsupported("non-constant axis")
    axis = int(_scalar_attr(axis)) % len(x.shape)
    excl, rev = ctx.attr("exclusive", 0), ctx.attr("reverse", 0)
    n = x.shape[axis]
    pred = {(0, 0): "le", (1, 0): "lt", (0, 1): "ge", (1, 1): "gt"}[(int(bool(excl)), int(bool(rev)))]

    kind, unit = ("prod", 1) if ctx.node.op == "CumProd" else ("sum", 0)

    def f(idx):
        def body(kk):
            sub = list(idx)
            sub[axis] = kk
            return select(cmp(pred, kk, idx[axis]), x(sub), const(unit, x.dtype))
        return reduce(kind, [n], body)
    return [TensorFn(ctx.out_shape(), x.dtype, f, "complex")]


@lowering("TensorScatter")
def _tensor_scatter(ctx):
    """Cache position s of batch row b holds update[s - w_b] when that falls in the update (w_b: the row's
    write index; circular mode wraps s - w_b modulo the cache length), else past_cache[s]."""
    past, upd, write = ctx.input(0), ctx.input(1), ctx.input(2)
    axis = ctx.attr("axis", -2) % len(past.shape)
    circular = ctx.attr("mode", "linear") == "circular"
    m, n = past.shape[axis], upd.shape[axis]

    def f(idx):
        w = cast(write([idx[0]]), I64) if write is not None else const(0, I64)
        j = idx[axis] - w
        if circular:
            j = E("pymod", (j, const(m, I64)), I64)
        inside = logic("and", cmp("ge", j, const(0, I64)), cmp("lt", j, const(n, I64)))
        sub = list(idx)
        sub[axis] = clamp(j, n)
        return select(inside, upd(sub), past(idx))
    return [TensorFn(ctx.out_shape(), past.dtype, f, "injective")]


@lowering("TopK")
def _topk(ctx):
    """Ranks by counting (element i's rank = how many elements beat it, ties to the lower index), then
    output r is the element whose rank is r: quadratic in the axis length."""
    x = ctx.input(0)
    k = shape_param(ctx, "k", 1)   # k only sizes the outputs (a dim computed from shapes, min(S, 10), is fine)
    axis = ctx.attr("axis", -1) % len(x.shape)
    if k is None:   # read from tensor data: a run-time size; one outside [0, axis length] is stored as -1,
        kv = cast(ctx.input(1)([const(0, I64)] * len(ctx.input(1).shape)), I64)   # which the runtime refuses
        ok = logic("and", cmp("ge", kv, const(0, I64)), cmp("le", kv, dim_index(x.shape[axis])))
        if not ctx.set_size(select(ok, kv, const(-1, I64))):
            ctx.unsupported("k computed from tensor data (the output size would depend on it)")
    largest = ctx.attr("largest", 1)
    n = x.shape[axis]
    better = "gt" if largest else "lt"

    def rank_fn(idx):
        xi = x(idx)

        def body(j):
            sub = list(idx)
            sub[axis] = j
            xj = x(sub)
            beats = logic("or", cmp(better, xj, xi), logic("and", cmp("eq", xj, xi), cmp("lt", j, idx[axis])))
            return select(beats, const(1, I64), const(0, I64))
        return reduce("sum", [n], body)
    rank = ctx.temp(x.shape, I64, rank_fn, "rank")

    def index_fn(idx):
        def body(i):
            sub = list(idx)
            sub[axis] = i
            return select(cmp("eq", rank(sub), idx[axis]), i, const(0, I64))
        return reduce("sum", [n], body)
    out_shape = ctx.out_shape()
    pos = ctx.temp(out_shape, I64, index_fn, "index")

    def values(idx):
        sub = list(idx)
        sub[axis] = clamp(pos(idx), n)
        return x(sub)
    outs = [TensorFn(out_shape, x.dtype, values, "injective")]
    if len(ctx.node.outputs) > 1:
        outs.append(TensorFn(out_shape, ctx.out_dtype(1), lambda idx: cast(pos(idx), ctx.out_dtype(1)), "elementwise"))
    return outs


@lowering("NonZero")
def _nonzero(ctx):
    """The indices of the non-zero elements, in row-major order: its count is a run-time size."""
    x = ctx.input(0)
    if not x.shape:
        ctx.unsupported("a scalar input")
    n = product(x.shape)
    nz = lambda i: cmp("ne", x(unflat_index(i, x.shape)), const(0, x.dtype))   # noqa: E731
    pick = selected_positions(ctx, nz, n, "nonzero")
    return [TensorFn(ctx.out_shape(), I64, lambda idx: _component(unflat_index(pick(idx[1]), x.shape), idx[0]),
                     "injective")]


def _component(parts, k: E) -> E:
    """``parts[k]`` for a run-time index ``k`` in ``[0, len(parts))``."""
    out = parts[-1]
    for d in range(len(parts) - 2, -1, -1):
        out = select(cmp("eq", k, const(d, I64)), parts[d], out)
    return out


@lowering("Unique")
def _unique(ctx):
    """Distinct elements (or slices along ``axis``) by counting, quadratic in their number: element i is a
    first occurrence when no earlier one equals it; its class is its rank among the first occurrences (by
    value, lexicographic for slices, when ``sorted``; else by position); the count of first occurrences is
    the run-time size. NaN inputs are not checked against onnxruntime yet."""
    x = ctx.input(0)
    axis = ctx.attr("axis")
    one, zero = const(1, I64), const(0, I64)
    if axis is None:
        n, rest = product(x.shape), []
        at = lambda i, k: x(unflat_index(i, x.shape))   # noqa: E731
    else:
        axis %= len(x.shape)
        n, rest = x.shape[axis], list(x.shape[:axis]) + list(x.shape[axis + 1:])

        def at(i, k):   # element k (flat over the other axes) of slice i
            sub = unflat_index(k, rest)
            return x(sub[:axis] + [i] + sub[axis:])
    m = product(rest) if rest else 1
    k0 = const(0, I64)
    # differ[i, j]: the first flat position where slices i and j differ (m when equal)
    if axis is None:
        differ = lambda i, j: select(cmp("eq", at(i, k0), at(j, k0)), dim_index(m), k0)   # noqa: E731
    else:
        d = ctx.temp([n, n], I64, lambda idx: reduce("min", [m], lambda k: select(
            cmp("ne", at(idx[0], k), at(idx[1], k)), k, dim_index(m))), "differ")
        differ = lambda i, j: d([i, j])   # noqa: E731
    same = lambda i, j: cmp("eq", differ(i, j), dim_index(m))   # noqa: E731
    first_of = ctx.temp([n], I64, lambda idx: reduce("min", [n], lambda j: select(same(j, idx[0]), j, idx[0])),
                        "first")
    is_first = lambda i: cmp("eq", first_of([i]), i)   # noqa: E731
    if ctx.attr("sorted", 1):
        def before(j, i):   # slice j sorts before slice i
            k = differ(j, i)
            kc = clamp(k, m)
            return logic("and", cmp("lt", k, dim_index(m)), cmp("lt", at(j, kc), at(i, kc)))
    else:
        before = lambda j, i: cmp("lt", j, first_of([i]))   # noqa: E731
    cls = ctx.temp([n], I64, lambda idx: reduce("sum", [n], lambda j: select(
        logic("and", is_first(j), before(j, idx[0])), one, zero)), "class")
    ctx.set_size(reduce("sum", [n], lambda i: select(is_first(i), one, zero)))
    pos = ctx.temp([n], I64, lambda idx: reduce("sum", [n], lambda i: select(
        logic("and", is_first(i), cmp("eq", cls([i]), idx[0])), i, zero)), "at")
    out = ctx.out_shape()
    if axis is None:
        y = TensorFn(out, x.dtype, lambda idx: at(clamp(pos([idx[0]]), n), k0), "injective")
    else:
        def y_fn(idx):
            sub = list(idx)
            sub[axis] = clamp(pos([idx[axis]]), n)
            return x(sub)
        y = TensorFn(out, x.dtype, y_fn, "injective")
    u = ctx.out_shape(1) if len(ctx.node.outputs) > 1 else None
    outs = [y]
    if len(ctx.node.outputs) > 1:
        outs.append(TensorFn(u, I64, lambda idx: pos([idx[0]]), "injective"))
    if len(ctx.node.outputs) > 2:
        outs.append(TensorFn(ctx.out_shape(2), I64, lambda idx: cls([idx[0]]), "injective"))
    if len(ctx.node.outputs) > 3:
        outs.append(TensorFn(ctx.out_shape(3), I64, lambda idx: reduce("sum", [n], lambda i: select(
            cmp("eq", cls([i]), idx[0]), one, zero)), "complex"))
    return outs


@lowering("NonMaxSuppression")
def _non_max_suppression(ctx):
    """Per (batch, class): boxes ranked by score (higher first, ties to the lower index; by counting, as
    TopK), then one sequential scan over the ranks keeps a box when it passes the score threshold, fewer
    than ``max_output_boxes_per_class`` are kept, and no kept box overlaps it by more than the IoU threshold
    (onnx's reference arithmetic); the kept total is the run-time size, rows in (batch, class, kept) order."""
    boxes, scores = ctx.input(0), ctx.input(1)
    B, N = boxes.shape[0], boxes.shape[1]
    C = scores.shape[1]
    dt = boxes.dtype
    one, zero = const(1, I64), const(0, I64)
    first = lambda t: t([const(0, I64)] * len(t.shape))   # noqa: E731
    max_out = cast(first(ctx.input(2)), I64) if ctx.input(2) is not None and 0 not in ctx.input(2).shape else zero
    iou_thr = cast(first(ctx.input(3)), dt) if ctx.input(3) is not None and 0 not in ctx.input(3).shape \
        else const(0.0, dt)
    score_thr = cast(first(ctx.input(4)), dt) if ctx.input(4) is not None and 0 not in ctx.input(4).shape \
        else None
    center = ctx.attr("center_point_box", 0)

    def rank_fn(idx):
        b, c, i = idx
        si = scores([b, c, i])
        return reduce("sum", [N], lambda j: select(logic("or", cmp("gt", scores([b, c, j]), si), logic(
            "and", cmp("eq", scores([b, c, j]), si), cmp("lt", j, i))), one, zero))
    rank = ctx.temp([B, C, N], I64, rank_fn, "rank")
    order = ctx.temp([B, C, N], I64, lambda idx: reduce("sum", [N], lambda i: select(
        cmp("eq", rank([idx[0], idx[1], i]), idx[2]), i, zero)), "order")

    def lo_hi(a, b_):
        return select(cmp("ge", a, b_), b_, a), select(cmp("ge", a, b_), a, b_)

    def extent(b, i):
        """(x_min, x_max, y_min, y_max) of box i in batch b."""
        v = [boxes([b, i, const(k, I64)]) for k in range(4)]
        if center == 0:
            (x0, x1), (y0, y1) = lo_hi(v[1], v[3]), lo_hi(v[0], v[2])
            return x0, x1, y0, y1
        two = const(2.0, dt)
        w, h = binop("div", v[2], two), binop("div", v[3], two)
        return binop("sub", v[0], w), binop("add", v[0], w), binop("sub", v[1], h), binop("add", v[1], h)

    def overlaps(b, i, j):
        """IoU(box i, box j) > threshold, as onnx's reference decides it."""
        ax0, ax1, ay0, ay1 = extent(b, i)
        bx0, bx1, by0, by1 = extent(b, j)
        fmax = lambda p, q: select(cmp("gt", p, q), p, q)   # noqa: E731
        fmin = lambda p, q: select(cmp("lt", p, q), p, q)   # noqa: E731
        ix0, ix1, iy0, iy1 = fmax(ax0, bx0), fmin(ax1, bx1), fmax(ay0, by0), fmin(ay1, by1)
        inter = binop("mul", binop("sub", ix1, ix0), binop("sub", iy1, iy0))
        area_a = binop("mul", binop("sub", ax1, ax0), binop("sub", ay1, ay0))
        area_b = binop("mul", binop("sub", bx1, bx0), binop("sub", by1, by0))
        union = binop("sub", binop("add", area_a, area_b), inter)
        z = const(0.0, dt)
        return all_of([cmp("gt", ix1, ix0), cmp("gt", iy1, iy0), cmp("gt", inter, z), cmp("gt", area_a, z),
                       cmp("gt", area_b, z), cmp("gt", union, z), cmp("gt", binop("div", inter, union), iou_thr)])

    count = Buf(f"{ctx.node.name}_count", I64, (B, C), ARENA, 0)
    kept = Buf(f"{ctx.node.name}_kept", I64, (B, C, N + 1), ARENA, 0)   # a spare slot, as selected_positions
    b, c, t = var("b"), var("c"), var("t")
    running = load(count, [b, c])
    cand = clamp(order([b, c, t]), N)
    hit = reduce("max", [N], lambda k: select(logic("and", cmp("lt", k, running), overlaps(
        b, clamp(load(kept, [b, c, k]), N), cand)), one, zero))
    ok = [cmp("lt", running, max_out), cmp("eq", hit, zero)]
    if score_thr is not None:
        ok.append(cmp("gt", scores([b, c, cand]), score_thr))
    program = Sequential([b, c], [Assign(count, [b, c], zero)], t, N,
                         [Assign(kept, [b, c, clamp(running, N + 1)], cand),
                          Assign(count, [b, c], running + select(all_of(ok), one, zero))])
    ctx.temp([B, C], I64, lambda idx: sequential(idx, program, I64), "scan")
    rows = product([B, C])
    per_row = lambda r: load(count, unflat_index(r, [B, C]))   # noqa: E731
    ctx.set_size(reduce("sum", [rows], per_row))
    start = ctx.temp([rows], I64, lambda idx: reduce("sum", [rows], lambda r: select(
        cmp("lt", r, idx[0]), per_row(r), zero)), "start")

    def out_fn(idx):
        j, col = idx
        row = reduce("sum", [rows], lambda r: select(cmp("le", start([r]) + per_row(r), j), one, zero))
        row = clamp(row, rows)
        bc = unflat_index(row, [B, C])
        box = load(kept, bc + [clamp(j - start([row]), N)])
        return select(cmp("eq", col, zero), bc[0], select(cmp("eq", col, one), bc[1], box))
    return [TensorFn(ctx.out_shape(), I64, out_fn, "complex")]
