"""Lowerings of the data-movement ops: reshapes, transposes, concatenations, slices, pads, shapes."""
from __future__ import annotations

import itertools

import numpy as np

from ...ir.dim import SymExpr, dmax, dmin, is_static, product
from ...ir.ops.shape import symbolic_slice_index
from ..texpr import I64, E, all_of, binop, cast, cmp, const, dim_index, in_range, logic, select
from .core import (TensorFn, broadcast_fn, clamp, lowering, reshape_index, scalar_of, selected_positions, shape_param,
                   unflat_index)


@lowering("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(ctx):
    x = ctx.input(0)
    shape = ctx.out_shape()
    return [TensorFn(shape, x.dtype, lambda idx: x(reshape_index(idx, shape, x.shape)), "alias")]


@lowering("Transpose")
def _transpose(ctx):
    x = ctx.input(0)
    perm = ctx.attr("perm") or list(reversed(range(len(x.shape))))
    inv = np.argsort(perm)

    def f(idx):
        return x([idx[int(inv[k])] for k in range(len(perm))])
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


@lowering("Expand")
def _expand(ctx):
    x = ctx.input(0)
    return [TensorFn(ctx.out_shape(), x.dtype, broadcast_fn(x, ctx.out_shape()), "injective")]


@lowering("Tile")
def _tile(ctx):
    x = ctx.input(0)
    return [TensorFn(ctx.out_shape(), x.dtype, lambda idx: x([i % d for i, d in zip(idx, x.shape)]), "injective")]


@lowering("Concat")
def _concat(ctx):
    ins = [t for t in ctx.inputs if t is not None]
    shape = ctx.out_shape()
    axis = ctx.attr("axis") % len(shape)

    ins = [t for t in ins if not (is_static(t.shape[axis]) and t.shape[axis] == 0)]   # a symbolic piece may be empty at run time: kept
    bounds = list(itertools.accumulate([0] + [t.shape[axis] for t in ins]))

    def piece(t, idx, start, clamped):
        sub = list(idx)
        sub[axis] = idx[axis] - start
        if clamped:   # evaluated for every element: keep the read inside t
            sub[axis] = clamp(sub[axis], t.shape[axis])
        return t(sub)

    def f(idx):
        # Every piece is evaluated and one selected, each read clamped into its input. A stage that stores
        # the concatenation may instead be split into one loop nest per piece (the "piecewise" node's
        # unclamped pieces; see schedule.split_piecewise).
        out = None
        for t, start, end in reversed(list(zip(ins, bounds[:-1], bounds[1:]))):
            val = piece(t, idx, start, len(ins) > 1)
            out = val if out is None else select(cmp("lt", idx[axis], const(end, I64)), val, out)
        if len(ins) == 1 or not all(is_static(b) for b in bounds):   # split stages need static piece bounds
            return out
        # the unclamped pieces are built only if the stage is split (building them here too would double
        # the expression at every level of inlined concatenations)
        pieces = lambda: [piece(t, idx, start, False) for t, start in zip(ins, bounds[:-1])]  # noqa: E731
        return E("piecewise", [idx[axis], out], out.dtype, (axis, tuple(int(x) for x in bounds), pieces))
    return [TensorFn(shape, ins[0].dtype, f, "injective", view=("concat", axis, tuple(ins)))]


@lowering("Split")
def _split(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis", 0) % len(x.shape)
    outs, start = [], 0
    for o in ctx.node.outputs:
        n = o.shape[axis]

        def f(idx, start=start):
            sub = list(idx)
            sub[axis] = idx[axis] + start
            return x(sub)
        outs.append(TensorFn(tuple(o.shape), x.dtype, f, "injective"))
        start += n
    return outs


@lowering("Slice")
def _slice(ctx):
    x = ctx.input(0)
    starts, ends = shape_param(ctx, "starts", 1), shape_param(ctx, "ends", 2)
    if starts is None or ends is None:
        ctx.unsupported("starts/ends computed from tensor data (only constants and shape computations are supported)")
    rank = len(x.shape)
    axes = shape_param(ctx, "axes", 3) or list(range(len(starts)))
    steps = shape_param(ctx, "steps", 4) or [1] * len(starts)
    if not all(isinstance(v, int) for v in list(axes) + list(steps)):
        ctx.unsupported("axes/steps computed at run time")
    first, step = [0] * rank, [1] * rank
    for s, a, st in zip(starts, axes, steps):
        a %= rank
        d = x.shape[a]
        if isinstance(s, SymExpr):
            # computed from shapes: inside the dim over the profile (a condition shape inference recorded)
            first[a], step[a] = symbolic_slice_index(s, d), st
            continue
        # d may be symbolic: the start clamped into it is then a dim expression (dmax / dmin)
        if st > 0:
            s = dmin(dmax(s + d if s < 0 else s, 0), d)
        else:
            s = dmin(dmax(s + d if s < 0 else s, -1), d - 1)
        first[a], step[a] = s, st
    return [TensorFn(ctx.out_shape(), x.dtype, lambda idx: x([i * st + f0 for i, st, f0 in zip(idx, step, first)]), "injective",
                     view=("slice", x, tuple(first), tuple(step)))]


@lowering("Pad")
def _pad(ctx):
    x = ctx.input(0)
    pads = ctx.attr("pads")
    if pads is None:
        ctx.unsupported("non-constant pads")
    rank = len(x.shape)
    axes = ctx.attr("axes") or list(range(rank))
    begin = [0] * rank
    for k, a in enumerate(axes):
        begin[a % rank] = pads[k]
    mode = ctx.attr("mode", "constant")
    value = ctx.attr("constant_value", 0)
    value = 0 if value is None else value
    value_in = ctx.input(2)  # a constant_value computed at run time
    if mode not in ("constant", "edge", "reflect", "wrap"):
        ctx.unsupported(f"mode {mode}")

    def f(idx):
        src = [i - b for i, b in zip(idx, begin)]
        if mode == "constant":
            cond = all_of([in_range(s, 0, d) for s, d in zip(src, x.shape)])
            if value_in is not None:
                inside = x([clamp(s, d) for s, d in zip(src, x.shape)])
                return select(cond, inside, value_in([const(0, I64)] * len(value_in.shape)))
            return x.at_or(src, cond, value)
        if mode == "edge":
            return x([clamp(s, d) for s, d in zip(src, x.shape)])
        if mode == "reflect":
            return x([reflect(s, d) for s, d in zip(src, x.shape)])
        return x([((s % d) + d) % d for s, d in zip(src, x.shape)])  # wrap
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


def reflect(i: E, d: int) -> E:
    return E("reflect", (i,), I64, d)


@lowering("DepthToSpace", "SpaceToDepth")
def _depth_space(ctx):
    x = ctx.input(0)
    b = ctx.attr("blocksize")
    n, c, h, w = x.shape
    if ctx.node.op == "DepthToSpace":
        crd = ctx.attr("mode", "DCR") == "CRD"
        oc = c // (b * b)

        def f(idx):
            nn, cc, hh, ww = idx
            bh, bw = hh % b, ww % b
            src_c = cc * (b * b) + bh * b + bw if crd else (bh * b + bw) * oc + cc
            return x([nn, src_c, hh // b, ww // b])
    elif ctx.attr("mode", "DCR") == "CRD":
        def f(idx):
            nn, cc, hh, ww = idx
            blk = cc % (b * b)
            return x([nn, cc // (b * b), hh * b + blk // b, ww * b + blk % b])
    else:
        def f(idx):
            nn, cc, hh, ww = idx
            blk = cc // c
            return x([nn, cc % c, hh * b + blk // b, ww * b + blk % b])
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


@lowering("Shape", "Size")
def _shape(ctx):
    """Shapes are static at compile time: the output is a constant table."""
    x = ctx.input(0)
    dt = ctx.out_dtype()
    if ctx.node.op == "Size":
        n = product(x.shape)
        return [TensorFn((), dt, lambda idx: _dim_value(n, dt), "elementwise")]
    rank = len(x.shape)
    start, end = ctx.attr("start", 0) or 0, ctx.attr("end")
    start = max(0, min(rank, start + rank if start < 0 else start))
    end = rank if end is None else max(0, min(rank, end + rank if end < 0 else end))
    dims = list(x.shape[start:end])

    def f(idx):
        out = _dim_value(dims[-1] if dims else 0, dt)
        for k in range(len(dims) - 2, -1, -1):
            out = select(cmp("eq", idx[0], const(k, I64)), _dim_value(dims[k], dt), out)
        return out
    return [TensorFn(ctx.out_shape(), dt, f, "injective")]


def _dim_value(d, dt) -> E:
    """A dim as a value of ``dt``: a constant, or the run-time value of a symbolic dim."""
    return cast(dim_index(d), dt) if isinstance(d, SymExpr) else const(d, dt)


@lowering("ConstantOfShape")
def _constant_of_shape(ctx):
    dt = ctx.out_dtype()
    v = ctx.attr("value")
    v = 0 if v is None else np.asarray(v).reshape(-1)[0].item()
    return [TensorFn(ctx.out_shape(), dt, lambda idx: const(v, dt), "elementwise")]


@lowering("Range")
def _range(ctx):
    start, delta = ctx.input(0), ctx.input(2)
    dt = ctx.out_dtype()
    return [TensorFn(ctx.out_shape(), dt, lambda idx: binop("add", scalar_of(start), binop(
        "mul", cast(idx[0], dt), scalar_of(delta))), "injective")]


def _const_input(ctx, i: int):
    """The value of input ``i`` when it is a constant, else None."""
    ins = ctx.node.inputs
    if i < len(ins) and ins[i] is not None and ins[i].is_const:
        return np.asarray(ins[i].const)
    return None


@lowering("EyeLike")
def _eyelike(ctx):
    k = ctx.attr("k", 0)
    dt = ctx.out_dtype()
    return [TensorFn(ctx.out_shape(), dt, lambda idx: select(cmp("eq", idx[1] - idx[0], const(k, I64)),
                                                             const(1, dt), const(0, dt)), "injective")]


@lowering("Compress")
def _compress(ctx):
    x = ctx.input(0)
    cond = _const_input(ctx, 1)
    axis = ctx.attr("axis")
    if cond is None:
        return [_compress_at_run_time(ctx, x, axis)]
    sel = np.nonzero(cond.reshape(-1).astype(bool))[0]
    # the selected positions as runs of consecutive indices: position = start + (i - first) in each run
    runs = []
    for i, p in enumerate(sel.tolist()):
        if runs and p == runs[-1][1] + (i - runs[-1][0]):
            continue
        runs.append((i, p))
    if len(runs) > 64:
        ctx.unsupported(f"a condition selecting {len(runs)} separate runs")

    def pick(i: E) -> E:
        out = None
        for first, start in runs:  # later runs take over from their first position on
            val = i + (start - first)
            out = val if out is None else select(cmp("ge", i, const(first, I64)), val, out)
        return out if out is not None else const(0, I64)
    if axis is None:  # the flattened input
        return [TensorFn(ctx.out_shape(), x.dtype, lambda idx: x(unflat_index(pick(idx[0]), x.shape)), "injective")]
    axis %= len(x.shape)

    def f(idx):
        sub = list(idx)
        sub[axis] = pick(idx[axis])
        return x(sub)
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


def _compress_at_run_time(ctx, x, axis) -> TensorFn:
    """Compress by a condition computed at run time: its count of true entries (those within the axis) is
    the node's run-time size, the kept positions found by counting (:func:`cuvil.kernels.lower.core.selected_positions`)."""
    c = ctx.input(1)
    d = product(x.shape) if axis is None else x.shape[axis % len(x.shape)]
    m = c.shape[0]   # a condition shorter than the axis truncates it; entries past the axis are ignored

    def keep(i):
        hit = cmp("ne", cast(c([i]), I64), const(0, I64))
        return hit if isinstance(m, int) and isinstance(d, int) and m <= d else logic("and", cmp("lt", i, dim_index(d)), hit)
    at = selected_positions(ctx, keep, m, "compress")
    pick = lambda j: clamp(at(j), d)   # noqa: E731
    if axis is None:
        return TensorFn(ctx.out_shape(), x.dtype, lambda idx: x(unflat_index(pick(idx[0]), x.shape)), "injective")
    axis %= len(x.shape)

    def f(idx):
        sub = list(idx)
        sub[axis] = pick(idx[axis])
        return x(sub)
    return TensorFn(ctx.out_shape(), x.dtype, f, "injective")
