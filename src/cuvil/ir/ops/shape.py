"""Shape manipulation: reshaping, joining, splitting, slicing, padding, and shape queries.

Many of these ops take a small integer input that decides the output shape (Reshape's shape, Slice's
starts). Constant ones are lifted into attributes on import; computed ones (the Shape -> Gather -> Concat
chains of dynamic-batch models) come through ``ctx.attr_or_input`` as their symbolic contents, so output
shapes stay symbolic. When such an input is truly unknown, the output rank is unknown: a TensorType cannot
hold a dimension that is not even symbolically known.
"""
from __future__ import annotations

import math
import re

import numpy as np
import onnx
from onnx import numpy_helper

from ...errors import ShapeError
from ..dim import SymExpr, as_dim, ceildiv, dmin, floordiv, product
from ..dtype import DType
from ..registry import HALF_EXACT, InferCtx, broadcast_shapes, op
from ..types import TensorType

# Slice bounds at least this large in magnitude (INT64_MAX, INT32_MAX...) mean "to the end"/"to the start".
_BIG = 2**31 - 1
# Largest symbolic value we generate (Range, ConstantOfShape, Expand, Tile): sym values are for shape math.
_SMALL = 1024


# --- helpers shared with the other families --------------------------------------------------------

def fresh_dim(ctx: InferCtx, tag: str) -> SymExpr:
    """A new symbol, named after the node, for a size that depends on tensor contents (NonZero's count)."""
    name = re.sub(r"\W", "_", f"{ctx.node.name}_{tag}")
    return SymExpr.symbol(name if name[0].isalpha() or name[0] == "_" else "_" + name)


def dims(x):
    """A lifted integer list (attribute, symbolic contents or constant array) as a list of dims, or None."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        x = x.reshape(-1).tolist()
    elif not isinstance(x, (list, tuple)):
        x = [x]
    if not all(isinstance(v, (int, np.integer, SymExpr)) for v in x):
        raise ShapeError(f"expected integers, got {x if len(x) <= 8 else x[:8] + ['...']}")
    return [as_dim(v) for v in x]


def ints(x):
    """Like :func:`dims`, but None unless every element is a plain int (axes, steps, ...)."""
    d = dims(x)
    return d if d is not None and all(isinstance(v, int) for v in d) else None


def present(ctx: InferCtx, name: str, i: int) -> bool:
    """Whether an optional lifted input was given (as an attribute or an input; empty tensors count as absent)."""
    if ctx.has_attr(name):
        return np.size(ctx.attr(name)) > 0
    return ctx.has_input(i) and ctx.type(i).shape != (0,)


def fmt(dims_) -> str:
    """A shape or list of dims for messages: [N, 3]."""
    return "[" + ", ".join(str(d) for d in dims_) + "]"


def text(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


def same_sym(ctx: InferCtx):
    """Ops that only reinterpret their input's shape keep its elements."""
    return [ctx.sym(0)]


def unify(ctx: InferCtx, a, b, what: str):
    """Two dims the model says are equal: a static one wins over a symbol; two different statics fail."""
    return ctx.unify(a, b, f"{what}: {a} != {b}")


def tensor_attr_dtype(ctx: InferCtx, v) -> DType:
    """Element type of a tensor attribute, given as a TensorProto or a numpy array."""
    code = v.data_type if isinstance(v, onnx.TensorProto) else np.asarray(v).dtype
    try:
        return DType(code) if isinstance(code, int) else DType.from_numpy(code)
    except (ValueError, TypeError):
        ctx.fail(f"tensor attribute has an unsupported element type ({code})")


def tensor_attr_array(v) -> np.ndarray:
    return numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)


def _required(ctx: InferCtx, name: str):
    v = ctx.attr(name)
    if v is None:
        ctx.fail(f"missing required attribute {name!r}")
    return v


def _unknown(ctx: InferCtx, i: int = 0) -> TensorType:
    return TensorType(ctx.dtype(i), None)


# --- reshaping ---------------------------------------------------------------------------------------

@op("Reshape", half=HALF_EXACT, lifted=(("shape", 1, "i64"),), sym_eval=same_sym)
def reshape(ctx: InferCtx):
    x = ctx.type(0)
    spec = dims(ctx.attr_or_input("shape", 1))
    if spec is None:
        return _unknown(ctx)  # shape computed from data at run time
    if sum(1 for d in spec if d == -1) > 1:
        ctx.fail(f"shape {fmt(spec)} has more than one -1")
    allowzero = ctx.attr("allowzero")
    out = []
    for i, d in enumerate(spec):
        if d == 0 and not allowzero:  # 0 copies the input dim
            if x.shape is None:
                return _unknown(ctx)
            if i >= len(x.shape):
                ctx.fail(f"shape[{i}] = 0 copies input dim {i}, but the input has rank {len(x.shape)}")
            d = x.shape[i]
        elif isinstance(d, int) and d < -1:
            ctx.fail(f"shape {fmt(spec)} has a negative entry {d}")
        out.append(d)
    if x.shape is None:
        return TensorType(x.dtype, None if -1 in out else out)
    total = product(x.shape)
    if -1 in out:
        if allowzero and 0 in out:
            ctx.fail(f"shape {fmt(spec)} has both 0 and -1 with allowzero=1")
        k = out.index(-1)
        known = product(d for j, d in enumerate(out) if j != k)
        if known == 0:
            ctx.fail(f"cannot reshape {fmt(x.shape)} ({total} elements) to {fmt(spec)}")
        ctx.require("mod0", total, known, f"cannot reshape {fmt(x.shape)} ({total} elements) to {fmt(spec)}: "
                                          f"needs {total} % {known} == 0")
        out[k] = floordiv(total, known)
    else:
        n = product(out)
        ctx.require("eq", total, n, f"cannot reshape {fmt(x.shape)} ({total} elements) to {fmt(spec)} ({n} elements)")
    return TensorType(x.dtype, out)


@op("Flatten", half=HALF_EXACT, sym_eval=same_sym)
def flatten(ctx: InferCtx):
    s = ctx.shape(0)
    a = ctx.attr("axis")
    if not -len(s) <= a <= len(s):
        ctx.fail(f"axis {a} out of range for rank {len(s)}")
    a = a + len(s) if a < 0 else a
    return TensorType(ctx.dtype(0), (product(s[:a]), product(s[a:])))


@op("Squeeze", half=HALF_EXACT, lifted=(("axes", 1, "i64"),), sym_eval=same_sym)
def squeeze(ctx: InferCtx):
    s = ctx.shape(0)
    if not present(ctx, "axes", 1):
        # Without axes every size-1 dim goes; whether a symbolic dim is 1 is not known before run time.
        if not all(isinstance(d, int) for d in s):
            return _unknown(ctx)
        return TensorType(ctx.dtype(0), [d for d in s if d != 1])
    axes = ints(ctx.attr_or_input("axes", 1))
    if axes is None:
        return _unknown(ctx)
    axes = {ctx.axis(a, len(s)) for a in axes}
    for a in sorted(axes):
        if isinstance(s[a], int) and s[a] != 1:
            ctx.fail(f"cannot squeeze axis {a} of size {s[a]} (shape {fmt(s)})")
    return TensorType(ctx.dtype(0), [d for i, d in enumerate(s) if i not in axes])


@op("Unsqueeze", half=HALF_EXACT, lifted=(("axes", 1, "i64"),), sym_eval=same_sym)
def unsqueeze(ctx: InferCtx):
    s = ctx.shape(0)
    axes = ints(ctx.attr_or_input("axes", 1))
    if axes is None:
        return _unknown(ctx)
    r = len(s) + len(axes)
    norm = [ctx.axis(a, r) for a in axes]
    if len(set(norm)) != len(norm):
        ctx.fail(f"axes {axes} repeat an axis")
    rest = iter(s)
    return TensorType(ctx.dtype(0), [1 if i in norm else next(rest) for i in range(r)])


@op("Transpose", half=HALF_EXACT)
def transpose(ctx: InferCtx):
    s = ctx.shape(0)
    perm = ctx.attr("perm")
    perm = list(range(len(s)))[::-1] if perm is None else list(perm)
    if sorted(perm) != list(range(len(s))):
        ctx.fail(f"perm {perm} is not a permutation of the {len(s)} axes")
    return TensorType(ctx.dtype(0), [s[p] for p in perm])


@op("DepthToSpace", half=HALF_EXACT)
def depth_to_space(ctx: InferCtx):
    s, b = _nchw(ctx), _required(ctx, "blocksize")
    if text(ctx.attr("mode")) not in ("DCR", "CRD"):
        ctx.fail(f"mode must be DCR or CRD, got {ctx.attr('mode')!r}")
    n, c, h, w = s
    if isinstance(c, int) and c % (b * b):
        ctx.fail(f"channels {c} are not divisible by blocksize^2 = {b * b}")
    return TensorType(ctx.dtype(0), (n, floordiv(c, b * b), h * b, w * b))


@op("SpaceToDepth", half=HALF_EXACT)
def space_to_depth(ctx: InferCtx):
    s, b = _nchw(ctx), _required(ctx, "blocksize")
    n, c, h, w = s
    for d in (h, w):
        if isinstance(d, int) and d % b:
            ctx.fail(f"spatial dims {h}x{w} are not divisible by blocksize {b}")
    return TensorType(ctx.dtype(0), (n, c * b * b, floordiv(h, b), floordiv(w, b)))


def _nchw(ctx: InferCtx):
    s = ctx.shape(0)
    if len(s) != 4:
        ctx.fail(f"input must be 4-D (N,C,H,W), got rank {len(s)}")
    if _required(ctx, "blocksize") < 1:
        ctx.fail(f"blocksize must be positive, got {ctx.attr('blocksize')}")
    return s


# --- joining and splitting ---------------------------------------------------------------------------

def _concat_sym(ctx: InferCtx):
    """The joined elements in row-major order: each input contributes, per index of the dims before the
    axis, its run of ``product(dims from the axis on)`` elements. Joining the flat tuples whole is right
    only when those leading dims are all 1 (a dynamo export's ``[1, 1, 1, S, 2]`` mask index, built by a
    Concat on the last axis, came out as wrong pairs)."""
    parts = [ctx.sym(i) for i in range(ctx.num_inputs)]
    if any(p is None for p in parts):
        return None
    shapes = [ctx.shape(i) for i in range(ctx.num_inputs)]
    if not shapes[0]:
        return None
    a = ctx.axis(_required(ctx, "axis"), len(shapes[0]))
    if any(len(s) != len(shapes[0]) or not all(isinstance(d, int) for d in s) for s in shapes):
        return None if len(shapes[0]) != 1 else [sum(parts, ())]
    outer = product(shapes[0][:a])
    runs = [product(s[a:]) for s in shapes]
    if any(len(p) != outer * r for p, r in zip(parts, runs)):
        return None
    return [tuple(x for k in range(outer) for p, r in zip(parts, runs) for x in p[k * r:(k + 1) * r])]


@op("Concat", half=HALF_EXACT, sym_eval=_concat_sym)
def concat(ctx: InferCtx):
    n = ctx.num_inputs
    if n == 0:
        ctx.fail("needs at least one input")
    shapes = [ctx.shape(i) for i in range(n)]
    r = len(shapes[0])
    if r == 0:
        ctx.fail("cannot concatenate scalars")
    a = ctx.axis(_required(ctx, "axis"), r)
    out = list(shapes[0])
    for i, s in enumerate(shapes[1:], 1):
        if ctx.dtype(i) != ctx.dtype(0):
            ctx.fail(f"input dtypes differ: {ctx.dtype(0).name} and {ctx.dtype(i).name}")
        if len(s) != r:
            ctx.fail(f"input ranks differ: {fmt(shapes[0])} and {fmt(s)}")
        for k in range(r):
            if k != a:
                out[k] = unify(ctx, out[k], s[k], f"inputs 0 and {i} differ in dim {k} off the concat axis")
    out[a] = sum((s[a] for s in shapes), 0)
    return TensorType(ctx.dtype(0), out)


@op("Split", half=HALF_EXACT, lifted=(("split", 1, "i64"),))
def split(ctx: InferCtx):
    s = ctx.shape(0)
    a = ctx.axis(ctx.attr("axis"), len(s))
    d, num = s[a], ctx.attr("num_outputs")
    if present(ctx, "split", 1):
        if num is not None:
            ctx.fail("give either the split input or the num_outputs attribute, not both")
        sizes = dims(ctx.attr_or_input("split", 1))
        if sizes is None:
            return [_unknown(ctx)] * ctx.num_outputs  # split sizes computed at run time
        if any(isinstance(v, int) and v < 0 for v in sizes):
            ctx.fail(f"split sizes {fmt(sizes)} must not be negative")
        total = sum(sizes, 0)
        if isinstance(total, int) and isinstance(d, int) and total != d:
            ctx.fail(f"split sizes {fmt(sizes)} sum to {total}, but axis {a} has size {d}")
    else:
        n = ctx.num_outputs if num is None else num
        if n < 1:
            ctx.fail(f"num_outputs must be positive, got {n}")
        if isinstance(d, int) and d < n - 1:
            ctx.fail(f"cannot split axis {a} of size {d} into {n} parts")
        # Opset 18: equal parts of ceil(d / n), the last one smaller when d does not divide.
        chunk = ceildiv(d, n)
        sizes = [chunk] * (n - 1) + [d - chunk * (n - 1)]
    return [TensorType(ctx.dtype(0), s[:a] + (v,) + s[a + 1:]) for v in sizes]


def _tile_sym(ctx: InferCtx):
    v, reps = ctx.sym(0), ints(ctx.attr_or_input("repeats", 1))
    return [_repeat(v, reps[0])] if v is not None and reps is not None and ctx.rank(0) == 1 == len(reps) else None


@op("Tile", half=HALF_EXACT, lifted=(("repeats", 1, "i64"),), sym_eval=_tile_sym)
def tile(ctx: InferCtx):
    s = ctx.shape(0)
    reps = dims(ctx.attr_or_input("repeats", 1))
    if reps is None:
        return _unknown(ctx)
    if len(reps) != len(s):
        ctx.fail(f"repeats {fmt(reps)} must have one entry per input dim ({len(s)})")
    if any(isinstance(k, int) and k < 0 for k in reps):
        ctx.fail(f"repeats {fmt(reps)} must not be negative")
    return TensorType(ctx.dtype(0), [d * k for d, k in zip(s, reps)])


def _repeat(t, n):
    """``t`` repeated ``n`` times as a sym value, when small enough to be shape arithmetic."""
    return t * n if isinstance(n, int) and 0 <= len(t) * n <= _SMALL else None


def _expand_sym(ctx: InferCtx):
    v, target = ctx.sym(0), ints(ctx.attr_or_input("shape", 1))
    if v is None or target is None:
        return None
    n = product(broadcast_shapes(ctx, ctx.shape(0), target))
    return [v if n == len(v) else _repeat(v, n) if len(v) == 1 else None]


@op("Expand", half=HALF_EXACT, lifted=(("shape", 1, "i64"),), sym_eval=_expand_sym)
def expand(ctx: InferCtx):
    target = dims(ctx.attr_or_input("shape", 1))
    if target is None:
        return _unknown(ctx)
    if any(isinstance(d, int) and d < 0 for d in target):
        ctx.fail(f"shape {fmt(target)} must not be negative")
    return TensorType(ctx.dtype(0), broadcast_shapes(ctx, ctx.shape(0), target))


_PAD_MODES = ("constant", "reflect", "edge", "wrap")


@op("Pad", half=HALF_EXACT, lifted=(("pads", 1, "i64"), ("constant_value", 2, "data"), ("axes", 3, "i64")))
def pad(ctx: InferCtx):
    s = ctx.shape(0)
    mode = text(ctx.attr("mode"))
    if mode not in _PAD_MODES:
        ctx.fail(f"mode must be one of {', '.join(_PAD_MODES)}, got {mode!r}")
    pads = dims(ctx.attr_or_input("pads", 1))
    axes = ints(ctx.attr_or_input("axes", 3)) if present(ctx, "axes", 3) else list(range(len(s)))
    if pads is None or axes is None:
        return _unknown(ctx)
    axes = [ctx.axis(a, len(s)) for a in axes]
    if len(set(axes)) != len(axes):
        ctx.fail(f"axes {axes} repeat an axis")
    if len(pads) != 2 * len(axes):
        ctx.fail(f"pads {fmt(pads)} must have 2 entries per padded axis ({2 * len(axes)})")
    out = list(s)
    for i, a in enumerate(axes):
        out[a] = s[a] + pads[i] + pads[i + len(axes)]
        if isinstance(out[a], int) and out[a] < 0:
            ctx.fail(f"pads {fmt(pads)} crop axis {a} of size {s[a]} below zero")
    return TensorType(ctx.dtype(0), out)


@op("Compress")
def compress(ctx: InferCtx):
    s = ctx.shape(0)
    if ctx.dtype(1) != DType.BOOL:
        ctx.fail(f"condition must be bool, got {ctx.dtype(1).name}")
    if ctx.type(1).rank not in (None, 1):
        ctx.fail(f"condition must be 1-D, got rank {ctx.type(1).rank}")
    axis = ctx.attr("axis")
    a = None if axis is None else ctx.axis(axis, len(s))
    d = product(s) if a is None else s[a]
    cond = ctx.const(1)
    if cond is None:
        n = fresh_dim(ctx, "count")  # how many elements are kept depends on the condition's values
    else:
        # A shorter condition truncates the axis; a symbolic axis is assumed to cover the condition.
        n = int(np.count_nonzero(cond[:d] if isinstance(d, int) else cond))
    return TensorType(ctx.dtype(0), [n] if a is None else s[:a] + (n,) + s[a + 1:])


# --- slicing -----------------------------------------------------------------------------------------

def _clamp(d: int, s: int, e: int, step: int):
    """ONNX Slice's clamping of start/end on a static dim (differs from Python's for negative steps)."""
    s, e = s + d if s < 0 else s, e + d if e < 0 else e
    if step > 0:
        return min(max(s, 0), d), min(max(e, 0), d)
    return min(max(s, 0), d - 1), min(max(e, -1), d - 1)


def _slice_len(d, s, e, step, ctx: InferCtx = None):
    if all(isinstance(v, int) for v in (d, s, e)):
        s, e = _clamp(d, s, e, step)
        return max(0, -((s - e) // step))
    # A symbolic dim, or bounds computed from shapes (assumed in range). Sentinels (INT64_MAX...) mean
    # "past the end". The result is exact once the dim is at least as long as the constant bounds (so
    # x[1:-1] has N - 2 elements), except that a constant end is clamped with min(): truncating slices such
    # as x[:, :512] do meet shorter inputs.
    fwd = step > 0
    if isinstance(s, int) and isinstance(e, int):
        if fwd and (s >= _BIG or e <= -_BIG or e == 0) or not fwd and (e >= _BIG or s <= -_BIG):
            return int(not fwd and s <= -_BIG and e <= -_BIG)  # x[-inf:-inf:-1] keeps element 0
        if -_BIG < min(s, e) and max(s, e) < _BIG and ((s < 0) == (e < 0) and (e - s) * step <= 0
                                                       or (s < 0) != (e < 0) and (s < 0) == fwd):
            return 0  # empty for any long enough dim: x[3:1], x[-2:-5], x[-3:2], x[2:-3:-1]
        if fwd and e >= _BIG and s < 0:
            return ceildiv(dmin(-s, d), step)  # x[-k:] keeps min(k, d) elements

    def bound(v, is_end):
        if not isinstance(v, int):
            # A start or end computed from shapes (x[:, :S], x[:, P:P + S], x[:, -S:]) is taken as it is,
            # without ONNX's clamping: a condition the profile's ranges must meet (checked by Z3 at compile
            # time, with a counterexample otherwise), so the output dim stays the plain expression.
            if ctx is not None and counts_from_end(v):
                ctx.require("ge", -1, v, f"the {'end' if is_end else 'start'} {v}, computed from shapes, must "
                                         "stay negative (it counts from the end)")
            v = symbolic_slice_index(v, d)
            if ctx is not None:
                lo, hi = (0, d) if fwd else (-1 if is_end else 0, d - 1)
                what = (f"the {'end' if is_end else 'start'} {v}, computed from shapes, must lie inside the sliced "
                        f"dim of size {d} (a profile whose symbols keep it there compiles)")
                ctx.require("ge", v, lo, what)
                ctx.require("ge", hi, v, what)
            return v
        if v >= _BIG:
            return d if fwd else d - 1
        if v <= -_BIG:
            return -1 if not fwd else 0
        if v < 0:
            return d + v
        return dmin(v, d) if fwd and is_end else dmin(v, d - 1) if not fwd and not is_end else v

    s2, e2 = bound(s, False), bound(e, True)
    n = ceildiv(e2 - s2, step) if fwd else ceildiv(s2 - e2, -step)
    if isinstance(n, int):
        return max(n, 0)
    if ctx is not None and not (isinstance(s, int) and isinstance(e, int)):
        ctx.require("ge", n, 0, f"the bounds {s}:{e}, computed from shapes, must not be reversed")
    return n


def counts_from_end(v) -> bool:
    """A Slice bound computed from shapes that reads as negative (``-S``, ``-S - 1``: no positive term), so it
    counts from the end of the dim as a negative constant does (a condition makes sure it is <= -1)."""
    return isinstance(v, SymExpr) and all(c <= 0 for _, c in v.terms)


def symbolic_slice_index(v, d):
    """The position in a dim of size ``d`` of a Slice bound ``v`` computed from shapes: ``d + v`` where ``v``
    counts from the end, else ``v``."""
    return d + v if counts_from_end(v) else v


def _slice_args(ctx: InferCtx, r: int):
    """(starts, ends, axes, steps) normalised and checked, or None when some are not known."""
    starts, ends = dims(ctx.attr_or_input("starts", 1)), dims(ctx.attr_or_input("ends", 2))
    axes = ints(ctx.attr_or_input("axes", 3)) if present(ctx, "axes", 3) else None if starts is None else list(range(len(starts)))
    steps = ints(ctx.attr_or_input("steps", 4)) if present(ctx, "steps", 4) else None if starts is None else [1] * len(starts)
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if not len(starts) == len(ends) == len(axes) == len(steps):
        ctx.fail(f"starts, ends, axes and steps differ in length ({len(starts)}, {len(ends)}, {len(axes)}, {len(steps)})")
    axes = [ctx.axis(a, r) for a in axes]
    if len(set(axes)) != len(axes):
        ctx.fail(f"axes {axes} repeat an axis")
    if 0 in steps:
        ctx.fail("steps must not be zero")
    return starts, ends, axes, steps


def _slice_sym(ctx: InferCtx):
    v, args = ctx.sym(0), _slice_args(ctx, 1)
    if v is None or args is None or ctx.rank(0) != 1:
        return None
    (s,), (e,), _, (step,) = args
    if not (isinstance(s, int) and isinstance(e, int)):
        return None
    s, e = _clamp(len(v), s, e, step)
    return [tuple(v[i] for i in range(s, e, step))]


@op("Slice", half=HALF_EXACT, sym_eval=_slice_sym,
    lifted=(("starts", 1, "i64"), ("ends", 2, "i64"), ("axes", 3, "i64"), ("steps", 4, "i64")))
def slice_(ctx: InferCtx):
    s = ctx.shape(0)
    args = _slice_args(ctx, len(s))
    if args is None:
        return _unknown(ctx)
    out = list(s)
    for st, en, a, step in zip(*args):
        out[a] = _slice_len(s[a], st, en, step, ctx)
    return TensorType(ctx.dtype(0), out)


# --- shape queries and generators --------------------------------------------------------------------

def _shape_part(ctx: InferCtx):
    s = ctx.shape(0)
    return s[ctx.attr("start"):ctx.attr("end")]  # Python's clamping of a step-1 slice is ONNX's


@op("Shape", shape_only=True, sym_eval=lambda ctx: [tuple(_shape_part(ctx))])
def shape(ctx: InferCtx):
    if ctx.type(0).shape is None:
        return TensorType(DType.INT64, None)
    return TensorType(DType.INT64, (len(_shape_part(ctx)),))


@op("Size", shape_only=True, sym_eval=lambda ctx: [(product(ctx.shape(0)),)])
def size(ctx: InferCtx):
    return TensorType(DType.INT64, ())


def _cos_value(ctx: InferCtx):
    v = ctx.attr("value")
    return np.zeros(1, np.float32) if v is None else tensor_attr_array(v).reshape(-1)


def _cos_sym(ctx: InferCtx):
    v, shape = _cos_value(ctx), ints(ctx.attr_or_input("shape", 0))
    n = None if shape is None else product(shape)
    return [_repeat((int(v[0]),), n)] if v.dtype.kind in "iu" else None


@op("ConstantOfShape", lifted=(("shape", 0, "i64"),), sym_eval=_cos_sym)
def constant_of_shape(ctx: InferCtx):
    v = ctx.attr("value")
    dt = DType.FLOAT if v is None else tensor_attr_dtype(ctx, v)
    if _cos_value(ctx).size != 1:
        ctx.fail(f"value must hold exactly one element, got {_cos_value(ctx).size}")
    shape = dims(ctx.attr_or_input("shape", 0))
    if shape is None:
        return TensorType(dt, None)
    if any(isinstance(d, int) and d < 0 for d in shape):
        ctx.fail(f"shape {shape} must not be negative")
    return TensorType(dt, shape)


def _range_args(ctx: InferCtx):
    out = []
    for i in range(3):
        v = ctx.sym(i)
        if v is None and ctx.const(i) is not None:
            v = ctx.const(i).reshape(-1).tolist()
        if v is None or len(v) != 1:
            return None
        out.append(v[0])
    return out


def _range_len(ctx: InferCtx, start, limit, delta):
    if delta == 0:
        ctx.fail("delta must not be zero")
    if all(isinstance(v, (int, float)) for v in (start, limit, delta)):
        if all(isinstance(v, int) for v in (start, limit, delta)):
            return max(-((start - limit) // delta), 0)
        return max(math.ceil((limit - start) / delta), 0)
    if isinstance(delta, int) and delta < 0:
        return ceildiv(start - limit, -delta)
    return ceildiv(limit - start, delta)  # symbolic bounds: assumed to give a non-empty range


def _range_sym(ctx: InferCtx):
    args = _range_args(ctx)
    if args is None or not ctx.dtype(0).is_int:
        return None
    n = _range_len(ctx, *args)
    if not isinstance(n, int) or n > _SMALL:
        return None
    start, _, delta = args
    return [tuple(as_dim(start + k * delta) for k in range(n))]


@op("Range", sym_eval=_range_sym)
def range_(ctx: InferCtx):
    for i in range(3):
        if ctx.dtype(i) != ctx.dtype(0):
            ctx.fail(f"start, limit and delta must share a dtype, got {ctx.dtype(0).name} and {ctx.dtype(i).name}")
        if ctx.type(i).shape not in (None, (), (1,)):  # one-element vectors are accepted too
            ctx.fail(f"input {i} must be a scalar, got shape {fmt(ctx.shape(i))}")
    args = _range_args(ctx)
    # Without known bounds the length depends on tensor contents: a fresh symbol stands for it.
    n = fresh_dim(ctx, "len") if args is None else _range_len(ctx, *args)
    return TensorType(ctx.dtype(0), (n,))


@op("EyeLike")
def eye_like(ctx: InferCtx):
    s, dt = ctx.type(0).shape, ctx.attr("dtype")
    if s is not None and len(s) != 2:
        ctx.fail(f"input must be 2-D, got rank {len(s)}")
    try:
        return TensorType(ctx.dtype(0) if dt is None else DType(dt), s)
    except ValueError:
        ctx.fail(f"unsupported dtype {dt}")
