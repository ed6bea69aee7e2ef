"""Indexing: gathers, scatters, one-hot, sorting-like selections and data-dependent selections.

NonZero, Unique and NonMaxSuppression produce as many elements as their input's values say; their output
sizes are fresh symbols named after the node (see ``shape.fresh_dim``), known only at run time.
"""
from __future__ import annotations

import numpy as np

from ..dim import SymExpr, product
from ..dtype import DType
from ..registry import HALF_EXACT, InferCtx, op
from ..types import TensorType
from .shape import dims, fmt, fresh_dim, text, unify

_INDEX = (DType.INT32, DType.INT64)
_REDUCTIONS = ("none", "add", "mul", "max", "min")


def _index_dtype(ctx: InferCtx, i: int, what: str = "indices"):
    if ctx.dtype(i) not in _INDEX:
        ctx.fail(f"{what} must be int32 or int64, got {ctx.dtype(i).name}")


def _scalar(ctx: InferCtx, name: str, i: int):
    """A lifted scalar (given as a scalar or a one-element list), None when computed at run time."""
    v = dims(ctx.attr_or_input(name, i))
    if v is None:
        return None
    if len(v) != 1:
        ctx.fail(f"{name} must hold exactly one element, got {len(v)}")
    return v[0]


def _gather_sym(ctx: InferCtx):
    data, idx = ctx.sym(0), ctx.sym(1)
    if data is None or idx is None or ctx.rank(0) != 1 or not all(isinstance(i, int) for i in idx):
        return None
    return [tuple(data[i] for i in idx)]  # negative indices count from the end, as in Python


@op("Gather", half=HALF_EXACT, sym_eval=_gather_sym)
def gather(ctx: InferCtx):
    s, q = ctx.shape(0), ctx.shape(1)
    _index_dtype(ctx, 1)
    if not s:
        ctx.fail("data must have rank >= 1")
    a = ctx.axis(ctx.attr("axis"), len(s))
    idx = ctx.const(1)
    if idx is not None and isinstance(s[a], int) and idx.size and not (-s[a] <= idx.min() and idx.max() < s[a]):
        ctx.fail(f"indices in [{idx.min()}, {idx.max()}] out of range for axis {a} of size {s[a]}")
    return TensorType(ctx.dtype(0), s[:a] + q + s[a + 1:])


@op("GatherElements")
def gather_elements(ctx: InferCtx):
    s, q = ctx.shape(0), ctx.shape(1)
    _index_dtype(ctx, 1)
    if len(s) != len(q) or not s:
        ctx.fail(f"data {fmt(s)} and indices {fmt(q)} must have the same rank >= 1")
    a = ctx.axis(ctx.attr("axis"), len(s))
    # Off the axis, each output element reads data at its own position: an indices dim longer than data's
    # would read past it (onnxruntime refuses such shapes too).
    for d, (n, m) in enumerate(zip(s, q)):
        if d != a and isinstance(n, int) and isinstance(m, int) and m > n:
            ctx.fail(f"indices {fmt(q)} longer than data {fmt(s)} in dim {d} (only the axis {a} may differ)")
    idx = ctx.const(1)
    if idx is not None and isinstance(s[a], int) and idx.size and not (-s[a] <= idx.min() and idx.max() < s[a]):
        ctx.fail(f"indices in [{idx.min()}, {idx.max()}] out of range for axis {a} of size {s[a]}")
    return TensorType(ctx.dtype(0), q)


@op("GatherND")
def gather_nd(ctx: InferCtx):
    s, q = ctx.shape(0), ctx.shape(1)
    _index_dtype(ctx, 1, "indices")
    b = ctx.attr("batch_dims")
    if not q or not s:
        ctx.fail("data and indices must have rank >= 1")
    if not 0 <= b < min(len(s), len(q)):
        ctx.fail(f"batch_dims {b} must be below the ranks of data ({len(s)}) and indices ({len(q)})")
    for k in range(b):
        unify(ctx, s[k], q[k], f"batch dim {k} of data and indices")
    k = q[-1]
    if not isinstance(k, int):
        return TensorType(ctx.dtype(0), None)  # the index depth decides the output rank
    if not 1 <= k <= len(s) - b:
        ctx.fail(f"indices' last dim {k} must be in [1, {len(s) - b}] (data rank {len(s)}, batch_dims {b})")
    return TensorType(ctx.dtype(0), q[:-1] + s[b + k:])


def _reduction(ctx: InferCtx):
    if text(ctx.attr("reduction")) not in _REDUCTIONS:
        ctx.fail(f"reduction must be one of {', '.join(_REDUCTIONS)}, got {ctx.attr('reduction')!r}")
    if ctx.dtype(2) != ctx.dtype(0):
        ctx.fail(f"updates dtype {ctx.dtype(2).name} differs from data dtype {ctx.dtype(0).name}")


@op("ScatterND")
def scatter_nd(ctx: InferCtx):
    s, q, u = ctx.shape(0), ctx.shape(1), ctx.shape(2)
    _index_dtype(ctx, 1)
    _reduction(ctx)
    if not q or not s:
        ctx.fail("data and indices must have rank >= 1")
    k = q[-1]
    if isinstance(k, int):
        if not 1 <= k <= len(s):
            ctx.fail(f"indices' last dim {k} must be in [1, {len(s)}]")
        want = q[:-1] + s[k:]
        if len(u) != len(want):
            ctx.fail(f"updates shape {fmt(u)} must be {fmt(want)}")
        for j, (a, w) in enumerate(zip(u, want)):
            unify(ctx, a, w, f"updates shape {fmt(u)} must be {fmt(want)}, dim {j}")
    return TensorType(ctx.dtype(0), s)


@op("ScatterElements")
def scatter_elements(ctx: InferCtx):
    s, q, u = ctx.shape(0), ctx.shape(1), ctx.shape(2)
    _index_dtype(ctx, 1)
    _reduction(ctx)
    if not len(s) == len(q) == len(u) or not s:
        ctx.fail(f"data {fmt(s)}, indices {fmt(q)} and updates {fmt(u)} must have the same rank >= 1")
    ctx.axis(ctx.attr("axis"), len(s))
    for j, (a, b) in enumerate(zip(q, u)):
        unify(ctx, a, b, f"indices {fmt(q)} and updates {fmt(u)} differ in dim {j}")
    return TensorType(ctx.dtype(0), s)


# depth is lifted as int64 whatever its dtype: ONNX accepts any numeric depth and truncates it to an integer.
@op("OneHot", lifted=(("depth", 1, "i64"),))
def one_hot(ctx: InferCtx):
    if ctx.type(0).shape is None:
        return TensorType(ctx.dtype(2), None)  # the registry's fallback would take input 0's dtype
    s = ctx.shape(0)
    a = ctx.attr("axis")
    if not -(len(s) + 1) <= a <= len(s):
        ctx.fail(f"axis {a} out of range for output rank {len(s) + 1}")
    a = a + len(s) + 1 if a < 0 else a
    vs = ctx.type(2).shape
    if vs is not None and (len(vs) != 1 or isinstance(vs[0], int) and vs[0] != 2):
        ctx.fail(f"values must hold [off_value, on_value], got shape {fmt(vs)}")
    v = ctx.attr_or_input("depth", 1)  # attribute, symbolic contents, or a float constant as an array
    v = None if v is None else np.asarray(v, dtype=object).reshape(-1).tolist()
    if v is not None and len(v) != 1:
        ctx.fail(f"depth must hold exactly one element, got {len(v)}")
    if v is None:
        depth = fresh_dim(ctx, "depth")  # the class count comes from a tensor computed at run time
    else:
        depth = v[0] if isinstance(v[0], SymExpr) else int(v[0])
    if isinstance(depth, int) and depth < 1:
        ctx.fail(f"depth must be positive, got {depth}")
    return TensorType(ctx.dtype(2), s[:a] + (depth,) + s[a:])


@op("NonZero")
def non_zero(ctx: InferCtx):
    if ctx.type(0).shape is None:
        return TensorType(DType.INT64, None)
    s, c = ctx.shape(0), ctx.const(0)
    # The count of non-zero elements is data-dependent: a fresh symbol unless the input is constant.
    n = fresh_dim(ctx, "nnz") if c is None else int(np.count_nonzero(c))
    return TensorType(DType.INT64, (len(s), n))


@op("TopK", lifted=(("k", 1, "i64"),))
def top_k(ctx: InferCtx):
    if ctx.type(0).shape is None:
        return [TensorType(ctx.dtype(0), None), TensorType(DType.INT64, None)]
    s = ctx.shape(0)
    if not s:
        ctx.fail("input must have rank >= 1")
    a = ctx.axis(ctx.attr("axis"), len(s))
    k = _scalar(ctx, "k", 1)
    if k is None:
        k = fresh_dim(ctx, "k")  # k computed at run time
    elif isinstance(k, int) and (k < 0 or isinstance(s[a], int) and k > s[a]):
        ctx.fail(f"k = {k} out of range for axis {a} of size {s[a]}")
    out = s[:a] + (k,) + s[a + 1:]
    return [TensorType(ctx.dtype(0), out), TensorType(DType.INT64, out)]


@op("Trilu", lifted=(("k", 1, "i64"),))
def trilu(ctx: InferCtx):
    if ctx.rank(0) < 2:
        ctx.fail(f"input must have rank >= 2, got {ctx.rank(0)}")
    return ctx.type(0)


@op("CumSum", "CumProd", lifted=(("axis", 1, "i64"),))
def cum_sum(ctx: InferCtx):
    s = ctx.shape(0)
    a = _scalar(ctx, "axis", 1)
    if isinstance(a, int):
        ctx.axis(a, len(s))
    return ctx.type(0)


@op("Unique")
def unique(ctx: InferCtx):
    if ctx.type(0).shape is None:
        return [TensorType(ctx.dtype(0), None)] + [TensorType(DType.INT64, None)] * 3
    s, c = ctx.shape(0), ctx.const(0)
    axis = ctx.attr("axis")
    a = None if axis is None else ctx.axis(axis, len(s))
    if c is not None:
        n = int(np.unique(c, axis=a).shape[0 if a is None else a])
    else:
        n = fresh_dim(ctx, "unique")  # the number of distinct values is data-dependent
    i64 = lambda *shape: TensorType(DType.INT64, shape)
    if a is None:
        y, inverse = (n,), (product(s),)
    else:
        y, inverse = s[:a] + (n,) + s[a + 1:], (s[a],)
    return [TensorType(ctx.dtype(0), y), i64(n), i64(*inverse), i64(n)]


@op("ReverseSequence")
def reverse_sequence(ctx: InferCtx):
    s = ctx.shape(0)
    if len(s) < 2:
        ctx.fail(f"input must have rank >= 2, got {len(s)}")
    b, t = ctx.attr("batch_axis"), ctx.attr("time_axis")
    if {b, t} != {0, 1}:
        ctx.fail(f"batch_axis and time_axis must be 0 and 1 in some order, got {b} and {t}")
    if ctx.dtype(1) != DType.INT64:
        ctx.fail(f"sequence_lens must be int64, got {ctx.dtype(1).name}")
    lens = ctx.shape(1)
    if len(lens) != 1:
        ctx.fail(f"sequence_lens must be 1-D, got shape {fmt(lens)}")
    unify(ctx, lens[0], s[b], "sequence_lens length and batch size")
    return ctx.type(0)


@op("NonMaxSuppression")
def non_max_suppression(ctx: InferCtx):
    boxes, scores = ctx.type(0).shape, ctx.type(1).shape  # the output's rank is known even if theirs is not
    if boxes is not None and (len(boxes) != 3 or isinstance(boxes[2], int) and boxes[2] != 4):
        ctx.fail(f"boxes must be [batch, boxes, 4], got {fmt(boxes)}")
    if scores is not None and len(scores) != 3:
        ctx.fail(f"scores must be [batch, classes, boxes], got {fmt(scores)}")
    if boxes is not None and scores is not None:
        unify(ctx, boxes[0], scores[0], "batch of boxes and scores")
        unify(ctx, boxes[1], scores[2], "box count of boxes and scores")
    # How many boxes survive depends on the scores and overlaps: a fresh symbol.
    return TensorType(DType.INT64, (fresh_dim(ctx, "selected"), 3))


@op("TensorScatter")
def tensor_scatter(ctx: InferCtx):
    """A KV-cache write: ``update`` (the cache's shape but ``sequence_length`` on ``axis``) written into
    ``past_cache`` from each batch row's write index (modulo the cache length in circular mode)."""
    s, u = ctx.shape(0), ctx.shape(1)
    if len(s) < 2 or len(u) != len(s):
        ctx.fail(f"past_cache {fmt(s)} and update {fmt(u)} must have the same rank >= 2")
    a = ctx.axis(ctx.attr("axis"), len(s))
    if a == 0:
        ctx.fail("axis must not be the batch axis 0")
    if text(ctx.attr("mode")) not in ("linear", "circular"):
        ctx.fail(f"mode must be linear or circular, got {ctx.attr('mode')!r}")
    if ctx.dtype(1) != ctx.dtype(0):
        ctx.fail(f"update dtype {ctx.dtype(1).name} differs from past_cache dtype {ctx.dtype(0).name}")
    for j, (c, d) in enumerate(zip(s, u)):
        if j != a:
            unify(ctx, c, d, f"past_cache {fmt(s)} and update {fmt(u)} differ in dim {j}")
    if isinstance(s[a], int) and isinstance(u[a], int) and u[a] > s[a]:
        ctx.fail(f"update's sequence length {u[a]} exceeds the cache's {s[a]} on axis {a}")
    if ctx.has_input(2):
        w = ctx.shape(2)
        if len(w) != 1:
            ctx.fail(f"write_indices must be [batch_size], got {fmt(w)}")
        unify(ctx, w[0], s[0], "write_indices length and batch size")
    return ctx.type(0)
