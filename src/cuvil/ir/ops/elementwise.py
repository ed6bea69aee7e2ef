"""Elementwise math, logic and comparison ops (numpy broadcasting).

Ops that share a shape function but not their float16 class stack several ``@op`` on it.
"""
from __future__ import annotations

from ..dim import dmax, dmin, floordiv, mod
from ..dtype import DType
from ..registry import BROADCAST, HALF_COMPUTE, HALF_FLOAT32, InferCtx, broadcast_shapes, op
from ..types import TensorType


def _neg_sym(ctx: InferCtx):
    """-x of a shape value (``x[:, -S:]``)."""
    v = ctx.sym(0)
    return None if v is None or not ctx.dtype(0).is_int else [tuple(-x for x in v)]


@op("Neg", elementwise=BROADCAST, half=HALF_COMPUTE, sym_eval=_neg_sym)
@op("Abs", "Reciprocal", "Sqrt", "Exp", "Erf", elementwise=BROADCAST, half=HALF_COMPUTE)
@op("Log", elementwise=BROADCAST, half=HALF_FLOAT32)  # log of values near 0 loses too much in half
@op("Floor", "Ceil", "Round", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh",
    "Atanh", "Sign", "BitwiseNot", elementwise=BROADCAST)
def unary(ctx: InferCtx):
    return ctx.type(0)


@op("Not", "IsNaN", "IsInf", elementwise=BROADCAST)
def unary_bool(ctx: InferCtx):
    return TensorType(DType.BOOL, ctx.shape(0))


def _sym_binary(fn):
    """Elementwise arithmetic on symbolic shape vectors (1-D or scalar), for shape computations."""

    def ev(ctx: InferCtx):
        a, b = ctx.sym(0), ctx.sym(1)
        if a is None or b is None or any(len(ctx.shape(i)) > 1 for i in (0, 1)):
            return None  # shape vectors are scalars or 1-D
        if len(a) == 1 and len(b) != 1:
            a = a * len(b)
        if len(b) == 1 and len(a) != 1:
            b = b * len(a)
        if len(a) != len(b):
            return None
        return [tuple(fn(x, y) for x, y in zip(a, b))]

    return ev


@op("Add", elementwise=BROADCAST, half=HALF_COMPUTE, commutative=True, sym_eval=_sym_binary(lambda x, y: x + y))
def add(ctx):
    return _binary(ctx)


@op("Sub", elementwise=BROADCAST, half=HALF_COMPUTE, sym_eval=_sym_binary(lambda x, y: x - y))
def sub(ctx):
    return _binary(ctx)


@op("Mul", elementwise=BROADCAST, half=HALF_COMPUTE, commutative=True, sym_eval=_sym_binary(lambda x, y: x * y))
def mul(ctx):
    return _binary(ctx)


@op("Div", elementwise=BROADCAST, half=HALF_COMPUTE, sym_eval=_sym_binary(floordiv))
def div(ctx):
    return _binary(ctx)


@op("Mod", elementwise=BROADCAST, sym_eval=_sym_binary(mod))
def mod_(ctx):
    return _binary(ctx)


@op("Pow", elementwise=BROADCAST, half=HALF_FLOAT32)  # x**y overflows half for moderate x, y
@op("BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", elementwise=BROADCAST)
def binary(ctx):
    return _binary(ctx)


def _binary(ctx: InferCtx) -> TensorType:
    if ctx.node.op not in ("Pow", "BitShift") and ctx.dtype(0) != ctx.dtype(1):
        ctx.fail(f"input dtypes differ: {ctx.dtype(0).name} and {ctx.dtype(1).name}")
    return TensorType(ctx.dtype(0), broadcast_shapes(ctx, ctx.shape(0), ctx.shape(1)))


def _signs(d) -> frozenset:
    """The signs (-1, 0, 1) dim expression ``d`` can take over symbol values >= 0: a polynomial over symbols only
    whose coefficients share the constant term's sign keeps it (``S + 1`` > 0, ``S`` >= 0, ``-S - 1`` < 0)."""
    if isinstance(d, int):
        return frozenset({(d > 0) - (d < 0)})
    if any(a.kind != "sym" for mono, _ in d.terms for a in mono):
        return frozenset({-1, 0, 1})
    const = dict(d.terms).get((), 0)
    coefs = [c for mono, c in d.terms if mono]
    if const >= 0 and all(c > 0 for c in coefs):
        return frozenset({1} if const > 0 else {0, 1})
    if const <= 0 and all(c < 0 for c in coefs):
        return frozenset({-1} if const < 0 else {-1, 0})
    return frozenset({-1, 0, 1})


# Each comparison as a function of sign(a - b) (None: undecided).
_COMPARE = {"Equal": lambda sg: sg == 0, "Less": lambda sg: sg < 0, "LessOrEqual": lambda sg: sg <= 0,
            "Greater": lambda sg: sg > 0, "GreaterOrEqual": lambda sg: sg >= 0}


def _compare_sym(ctx: InferCtx):
    """Comparisons of shape values decided where the sign of their difference is known (``Equal(Shape(x),
    -1)`` of the exporters' Expand/Reshape shapes: a dim is never -1); booleans as 0/1."""
    test = _COMPARE.get(ctx.node.op)
    if test is None or not ctx.dtype(0).is_int:
        return None

    def one(x, y):
        outcomes = {test(sg) for sg in ({0} if x == y else _signs(x - y))}
        if len(outcomes) != 1:
            raise ValueError("undecided")   # no value: the comparison is computed at run time
        return int(outcomes.pop())
    return _sym_binary(one)(ctx)


@op("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", elementwise=BROADCAST,
    sym_eval=_compare_sym)
def compare(ctx: InferCtx):
    if ctx.dtype(0) != ctx.dtype(1):
        ctx.fail(f"input dtypes differ: {ctx.dtype(0).name} and {ctx.dtype(1).name}")
    return TensorType(DType.BOOL, broadcast_shapes(ctx, ctx.shape(0), ctx.shape(1)))


def _extremum_sym(ctx: InferCtx):
    """Max/Min of shape values (``max(S, 1)``), as dim expressions."""
    if ctx.node.op not in ("Max", "Min") or ctx.num_inputs != 2 or not ctx.dtype(0).is_int:
        return None
    return _sym_binary(dmax if ctx.node.op == "Max" else dmin)(ctx)


@op("Sum", "Max", "Min", "Mean", elementwise=BROADCAST, half=HALF_COMPUTE, sym_eval=_extremum_sym)
def variadic(ctx: InferCtx):
    n = ctx.num_inputs
    if n == 0:
        ctx.fail("needs at least one input")
    for i in range(1, n):
        if ctx.dtype(i) != ctx.dtype(0):
            ctx.fail(f"input dtypes differ: {ctx.dtype(0).name} and {ctx.dtype(i).name}")
    return TensorType(ctx.dtype(0), broadcast_shapes(ctx, *(ctx.shape(i) for i in range(n))))


def _where_sym(ctx: InferCtx):
    """Where over shape values with a condition known element by element (0/1)."""
    c, a, b = ctx.sym(0), ctx.sym(1), ctx.sym(2)
    if c is None or a is None or b is None or any(len(ctx.shape(i)) > 1 for i in range(3)):
        return None
    n = max(len(c), len(a), len(b))
    if any(len(v) not in (1, n) for v in (c, a, b)) or not all(isinstance(x, int) for x in c):
        return None
    pick = lambda v, k: v[0] if len(v) == 1 else v[k]  # noqa: E731
    return [tuple(pick(a, k) if pick(c, k) else pick(b, k) for k in range(n))]


@op("Where", elementwise=BROADCAST, half=HALF_COMPUTE, sym_eval=_where_sym)
def where(ctx: InferCtx):
    if ctx.dtype(0) != DType.BOOL:
        ctx.fail(f"condition must be bool, got {ctx.dtype(0).name}")
    if ctx.dtype(1) != ctx.dtype(2):
        ctx.fail(f"branch dtypes differ: {ctx.dtype(1).name} and {ctx.dtype(2).name}")
    return TensorType(ctx.dtype(1), broadcast_shapes(ctx, ctx.shape(0), ctx.shape(1), ctx.shape(2)))
