"""Reductions over axes (ReduceX, with axes lifted from input 1) and ArgMax/ArgMin."""
from __future__ import annotations

from ..dim import dmax, dmin, product
from ..dtype import DType
from ..registry import HALF_ACCUMULATE, HALF_EXACT, InferCtx, op
from ..types import TensorType

# Reductions that are exact on dimensions, for shape computations such as ReduceProd(Shape(x)).
_SYM_FOLD = {"ReduceSum": lambda v: sum(v[1:], v[0]), "ReduceProd": product,
             "ReduceMax": lambda v: dmax(*v), "ReduceMin": lambda v: dmin(*v)}


def _axes(ctx: InferCtx, rank: int):
    """The reduced axes (sorted, non-negative), or None for the no-op case of empty axes."""
    axes = ctx.attr_or_input("axes", 1)
    if (axes is None and ctx.has_input(1)) or not all(isinstance(a, int) for a in axes or []):
        ctx.fail("axes must be constant (or computable from shapes) to know the output shape")
    axes = list(axes or [])
    if not axes:
        return None if ctx.attr("noop_with_empty_axes") else list(range(rank))
    norm = sorted(ctx.axis(a, rank, "axes entry") for a in axes)
    if len(set(norm)) != len(norm):
        ctx.fail(f"axes {axes} repeat an axis")
    return norm


def _sym_reduce(ctx: InferCtx):
    v, fold = ctx.sym(0), _SYM_FOLD.get(ctx.node.op)
    if fold is None or not v or ctx.rank(0) > 1 or _axes(ctx, ctx.rank(0)) is None:
        return None
    return [(fold(list(v)),)]


_AXES = (("axes", 1, "i64"),)


@op("ReduceSum", "ReduceMean", half=HALF_ACCUMULATE, lifted=_AXES, sym_eval=_sym_reduce)
@op("ReduceMax", "ReduceMin", half=HALF_EXACT, lifted=_AXES, sym_eval=_sym_reduce)  # select an element
@op("ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", lifted=_AXES,
    sym_eval=_sym_reduce)
def reduce(ctx: InferCtx):
    x = ctx.shape(0)
    axes = _axes(ctx, len(x))
    if axes is None:
        return ctx.type(0)
    keep = ctx.attr("keepdims")
    return TensorType(ctx.dtype(0), [1 if i in axes else d for i, d in enumerate(x) if keep or i not in axes])


@op("ArgMax", "ArgMin")
def arg_reduce(ctx: InferCtx):
    x = ctx.shape(0)
    axis = ctx.axis(ctx.attr("axis"), len(x))
    keep = ctx.attr("keepdims")
    return TensorType(DType.INT64, [1 if i == axis else d for i, d in enumerate(x) if keep or i != axis])
