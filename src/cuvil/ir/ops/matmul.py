"""Matrix products: MatMul (numpy semantics), Gemm, MatMulInteger, QLinearMatMul's shape, and Einsum."""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

from ..dim import Dim
from ..dtype import DType
from ..registry import HALF_ACCUMULATE, InferCtx, broadcast_shapes, op
from ..types import TensorType


def _fmt(s: Sequence[Dim]) -> str:
    return "[" + ",".join(map(str, s)) + "]"


def _unify(ctx: InferCtx, a: Dim, b: Dim, what: str) -> Dim:
    return ctx.unify(a, b, what)


def matmul_shape(ctx: InferCtx, a: Sequence[Dim], b: Sequence[Dim]) -> Tuple[Dim, ...]:
    """numpy.matmul: 1-D operands get a unit dim (then dropped), leading dims broadcast."""
    if not a or not b:
        ctx.fail(f"operands must have rank >= 1, got {_fmt(a)} and {_fmt(b)}")
    a2 = (1, *a) if len(a) == 1 else tuple(a)
    b2 = (*b, 1) if len(b) == 1 else tuple(b)
    _unify(ctx, a2[-1], b2[-2], f"inner dimensions differ: {_fmt(a)} @ {_fmt(b)} ({a2[-1]} vs {b2[-2]})")
    rows = (a2[-2],) if len(a) > 1 else ()
    cols = (b2[-1],) if len(b) > 1 else ()
    return (*broadcast_shapes(ctx, a2[:-2], b2[:-2]), *rows, *cols)


@op("MatMul", half=HALF_ACCUMULATE)
def matmul(ctx: InferCtx):
    if ctx.dtype(0) != ctx.dtype(1):
        ctx.fail(f"input dtypes differ: {ctx.dtype(0).name} and {ctx.dtype(1).name}")
    return TensorType(ctx.dtype(0), matmul_shape(ctx, ctx.shape(0), ctx.shape(1)))


@op("MatMulInteger")
def matmul_integer(ctx: InferCtx):
    return TensorType(DType.INT32, matmul_shape(ctx, ctx.shape(0), ctx.shape(1)))  # int32 accumulation


@op("Gemm", half=HALF_ACCUMULATE)
def gemm(ctx: InferCtx):
    a, b = ctx.shape(0), ctx.shape(1)
    if len(a) != 2 or len(b) != 2:
        ctx.fail(f"A and B must be 2-D, got {_fmt(a)} and {_fmt(b)}")
    (m, ka), (kb, n) = a[::-1] if ctx.attr("transA") else a, b[::-1] if ctx.attr("transB") else b
    _unify(ctx, ka, kb, f"inner dimensions differ: A {_fmt(a)} (transA={ctx.attr('transA')}) and "
                        f"B {_fmt(b)} (transB={ctx.attr('transB')}) give K = {ka} vs {kb}")
    if ctx.has_input(2):  # C broadcasts unidirectionally to (M, N)
        c = ctx.shape(2)
        if len(c) > 2 or any(isinstance(x, int) and isinstance(y, int) and x not in (1, y)
                             for x, y in zip(c[::-1], (n, m))):
            ctx.fail(f"C {_fmt(c)} does not broadcast to [{m},{n}]")
    return TensorType(ctx.dtype(0), (m, n))


def _parse_term(ctx: InferCtx, term: str, shape: Sequence[Dim]):
    """Split ``term`` against ``shape``: (labels with dims, ellipsis dims or None)."""
    if term.count("...") > 1 or "." in term.replace("...", ""):
        ctx.fail(f"bad Einsum term {term!r}")
    pre, ell, post = term.partition("...")
    if pre + post and not (pre + post).isalpha():
        ctx.fail(f"Einsum labels must be letters, got {term!r}")
    n_ell = len(shape) - len(pre) - len(post)
    if n_ell < 0 or (n_ell and not ell):
        ctx.fail(f"Einsum term {term!r} does not match an input of rank {len(shape)}")
    dims = tuple(shape[:len(pre)]) + tuple(shape[len(shape) - len(post):])
    return list(zip(pre + post, dims)), (tuple(shape[len(pre):len(pre) + n_ell]) if ell else None)


@op("Einsum")
def einsum(ctx: InferCtx):
    eq = ctx.attr("equation").replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != ctx.num_inputs:
        ctx.fail(f"equation {eq!r} has {len(terms)} operands but the node has {ctx.num_inputs} inputs")
    sizes: Dict[str, Dim] = {}
    counts: Dict[str, int] = {}
    ell = None  # broadcast shape of all ellipsis dims
    for i, term in enumerate(terms):
        if ctx.dtype(i) != ctx.dtype(0):
            ctx.fail(f"input dtypes differ: {ctx.dtype(0).name} and {ctx.dtype(i).name}")
        labels, e = _parse_term(ctx, term, ctx.shape(i))
        if e is not None:
            ell = e if ell is None else broadcast_shapes(ctx, ell, e)
        for ch, d in labels:
            counts[ch] = counts.get(ch, 0) + 1
            if ch not in sizes or sizes[ch] == 1:  # a unit dim broadcasts against the label's size
                sizes[ch] = d
            elif d != 1:
                sizes[ch] = _unify(ctx, sizes[ch], d, f"label {ch!r} has sizes {sizes[ch]} and {d} in {eq!r}")
    if not arrow:  # implicit output: ellipsis dims, then labels used once, in alphabetical (ASCII) order
        rhs = ("..." if ell is not None else "") + "".join(sorted(ch for ch, n in counts.items() if n == 1))
    pre, dots, post = rhs.partition("...")
    if "." in pre + post:
        ctx.fail(f"bad Einsum output {rhs!r}")
    for ch in pre + post:
        if ch not in sizes or (pre + post).count(ch) > 1:
            ctx.fail(f"output label {ch!r} of {eq!r} is {'repeated' if ch in sizes else 'not an input label'}")
    out = [sizes[ch] for ch in pre] + (list(ell or ()) if dots else []) + [sizes[ch] for ch in post]
    return TensorType(ctx.dtype(0), out)
