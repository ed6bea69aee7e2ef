"""The range analysis: every float tensor of a graph bounded by interval arithmetic from its inputs' ranges.

:func:`analyze` walks the nodes in order and applies each op's rule (:data:`RULES`): elementwise ops on
intervals (broadcast as the op broadcasts), contractions with constant weights bounded by the weights' actual
values (``sum |W|·|x|`` per output channel, signs kept: ``sum_k min(W·lo, W·hi)``), normalisations by their
algebra (LayerNormalization's output lies within ``beta ± sqrt(N)·|gamma|`` whatever its input), Softmax in
[0, 1], and shape ops passing ranges through. :mod:`cuvil.precision.affine` tightens the subtractions that
intervals over-approximate (``x - mean(x)``, ``x - max(x)``). An op without a rule gives an unbounded range
whose ``why`` names it; everything downstream says so too.

Besides its outputs, a node may compute *internal* values that a narrowed kernel stores in the narrow format:
LayerNormalization's centred input and its square (the variance computation is fp16's classic overflow).
:func:`internal_ranges` bounds them and :func:`internal_values` computes them on a concrete input (the
counterexample search, :mod:`cuvil.precision.search`).
"""
from __future__ import annotations

import contextvars
import math
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..ir.dtype import DType
from ..ir.graph import Graph, Node, Value
from .affine import tighten
from .interval import CERTIFIED, SLACK, Interval, join_origin, join_why, union

FLOAT_DTYPES = (DType.FLOAT, DType.FLOAT16, DType.DOUBLE, DType.BFLOAT16)

Ranges = Dict[int, Interval]   # id(value) -> its interval


def is_float(v: Optional[Value]) -> bool:
    return v is not None and v.type.dtype in FLOAT_DTYPES


def dim_max(d, graph: Graph) -> int:
    """A dim's largest value: itself, or a symbolic one at its symbols' maxima."""
    if isinstance(d, (int, np.integer)):
        return int(d)
    env = {name: s.max for name, s in graph.symbols.items()}
    try:
        return int(d.evaluate(env))
    except Exception:   # an expression we cannot bound: say so through an unbounded range
        return -1


def analyze(graph: Graph, inputs: Mapping[str, Interval], narrowed: Optional[Mapping[str, object]] = None) -> Ranges:
    """The interval of every float value of ``graph`` (graph inputs by name from ``inputs``; an input without
    one is unbounded, saying so). ``narrowed``: node name -> the unit roundoff of the format its inputs are
    rounded to (a contraction computing in bf16/fp16): its bounds widen by that rounding; or (unit roundoff,
    absolute pad) for a format whose small values round absolutely (fp8's subnormals): the outputs widen by
    the pad as well."""
    r: Ranges = {}
    for v in graph.inputs:
        if v.name in inputs:
            r[id(v)] = inputs[v.name]     # an integer input's range too (a mask cast to float)
        elif is_float(v):
            r[id(v)] = Interval.unbounded(
                f"input {v.name} has no declared range (give --input-range {v.name}=LO:HI or --calibrate DIR)")
    for v in graph.values():
        if v.is_const and v.const.dtype.kind in "fiub" and v.const.size:
            # small constants exactly (masks, biases); weights by their hull (the contraction rules read the
            # weights' values themselves), so that a model's weights are not copied twice in float64
            r[id(v)] = Interval.exact(v.const) if v.const.size <= 65536 else Interval.of(
                float(np.min(v.const)), float(np.max(v.const)))
    for n in graph.nodes:
        rounding = (narrowed or {}).get(n.name, 0.0)
        rel, pad = rounding if isinstance(rounding, tuple) else (rounding, 0.0)
        token = _INPUT_ROUNDING.set(rel)
        try:
            outs = node_ranges(graph, n, r)
        finally:
            _INPUT_ROUNDING.reset(token)
        for o, iv in zip(n.outputs, outs):
            if iv is not None and is_float(o):
                r[id(o)] = iv if not pad else Interval(iv.lo - pad, iv.hi + pad, iv.origin, iv.why, iv.method)
    return r


def node_ranges(graph: Graph, n: Node, r: Ranges) -> List[Optional[Interval]]:
    ins = [r.get(id(v)) if v is not None else None for v in n.inputs]
    if n.op in ("Shape", "Size", "NonZero", "ArgMax", "ArgMin") or not any(is_float(o) for o in n.outputs):
        return [None] * len(n.outputs)
    rule = RULES.get(n.op)
    float_ins = [iv for v, iv in zip(n.inputs, ins) if is_float(v)]
    origin = join_origin(float_ins)
    if rule is None:
        out = Interval.unbounded(f"no range rule for op {n.op} (node {n.name})", origin)
        return [out] * len(n.outputs)
    if any(iv is None for v, iv in zip(n.inputs, ins) if is_float(v)) or (
            n.op in ("Cast", "CastLike") and ins and ins[0] is None):
        src = n.inputs[0].name if n.inputs and n.inputs[0] is not None else "?"
        return [Interval.unbounded(f"an input of {n.name} ({src}) has no range", origin)] * len(n.outputs)
    with np.errstate(all="ignore"):
        res = rule(graph, n, ins)
    res = res if isinstance(res, list) else [res] * len(n.outputs)
    tight = tighten(graph, n, r)
    if tight is not None:
        t = _intersect(res[0], tight)
        res = [Interval(t.lo, t.hi, t.origin, t.why, "affine" if t.max - t.min < res[0].max - res[0].min else "")] + res[1:]
    why = join_why(float_ins)
    guarded = _nan_guarded(n)
    wild = next((v.name for v, iv in zip(n.inputs, ins) if is_float(v) and v is not guarded and _wild(n, iv)), None)
    out = []
    for o, iv in zip(n.outputs, res):
        if iv is None:
            out.append(None)
            continue
        if wild is not None:
            iv = Interval.unbounded(f"{n.op} {n.name}: its input {wild} may be infinite or NaN"
                                    + (f" ({why})" if why else ""))
        iv = Interval(np.nan_to_num(iv.lo, nan=-np.inf), np.nan_to_num(iv.hi, nan=np.inf), origin,
                      iv.why or ("" if iv.bounded else why), iv.method)
        dt = o.type.dtype if o is not None else DType.FLOAT
        pre = iv
        if n.op not in _EXACT_OPS:
            iv = iv.widened(_ROUNDING.get(dt, SLACK))
        if n.op in _APPROXIMATED:   # vectorised approximations: an absolute error (onnxruntime's Sigmoid(-13): 1%)
            iv = Interval(iv.lo - _APPROX_ABS, iv.hi + _APPROX_ABS, iv.origin, iv.why, iv.method)
        u = _INPUT_ROUNDING.get()
        if u and n.op not in _CONTRACTIONS:   # a narrowed elementwise node: its inputs and result rounded
            mag = iv.max_abs + sum(i.max_abs for v, i in zip(n.inputs, ins) if is_float(v) and i is not None)
            iv = Interval(iv.lo - 3 * u * mag, iv.hi + 3 * u * mag, iv.origin, iv.why, iv.method)
        out.append(_overflowed(iv, dt, n, pre))
    return out


#: Ops whose rules follow IEEE arithmetic on infinite bounds (inf + x = inf; inf - inf gives a NaN bound, which
#: becomes [-inf, inf]): an input element that may be ±inf is fine for them, one that may be NaN is not.
_IEEE_OPS = frozenset({"Add", "Sub", "Where", "Max", "Min", "Relu", "Neg", "Abs", "Identity", "Dropout", "Cast",
                       "CastLike", "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Tile",
                       "Slice", "Gather", "GatherElements", "GatherND", "Concat", "Split", "Pad", "ReduceMax",
                       "ReduceMin", "MaxPool", "GlobalMaxPool", "Softmax"})


def _wild(n: Node, iv: Optional[Interval]) -> bool:
    """Whether ``n``'s rule may not hold for an input in ``iv``. An element bounded by [-inf, inf] may be NaN
    (inf - inf, 0 * inf upstream; an input without a range), and no rule holds for NaN (Sigmoid, Softmax,
    LayerNormalization, Clip would certify a finite range); a one-sided infinite bound (-inf in a mask, an
    overflow) is a real value, only the IEEE-faithful rules handle it. Softmax: NaN where a row may be all -inf
    or hold +inf."""
    if iv is None or iv.bounded:
        return False
    if n.op not in _IEEE_OPS:
        return True
    if np.any(np.isneginf(iv.lo) & np.isposinf(iv.hi)):
        return True
    if n.op == "Softmax":
        rank = n.inputs[0].type.rank
        x = _aligned(iv, rank)
        if np.any(np.isposinf(x.hi)) or x.lo.ndim == 0:
            return bool(np.any(np.isposinf(x.hi)) or np.isneginf(x.lo))
        axis = int(n.attrs.get("axis", -1)) % x.lo.ndim
        return not bool(np.all(np.any(np.isfinite(x.lo), axis=axis)))
    return False


#: Ops that runtimes compute by polynomial approximations, accurate to an absolute error rather than a
#: relative one near 0 (onnxruntime's Sigmoid(-13.2) is 1.848e-6, the real value 1.83e-6): padded by it.
_APPROXIMATED = frozenset({"Sigmoid", "Tanh", "Erf", "Gelu", "Mish", "Softplus", "Softsign", "Atan", "Sin", "Cos",
                           "Elu", "Selu", "HardSwish", "Exp", "Log", "LogSoftmax"})
_APPROX_ABS = 2.0 ** -20


#: Ops whose rules pad for a narrowed node's input rounding themselves (:func:`_summed`).
_CONTRACTIONS = frozenset({"Conv", "MatMul", "Gemm"})


#: Relative rounding of one op's result in the narrow float types (their unit roundoff, doubled).
_ROUNDING = {DType.FLOAT16: 2.0 ** -10, DType.BFLOAT16: 2.0 ** -7}
_MAX_FINITE = {DType.FLOAT: float(np.finfo(np.float32).max), DType.FLOAT16: 65504.0,
               DType.BFLOAT16: float(np.finfo(np.float32).max) * (1 - 2.0 ** -8)}
#: Where rounding to nearest overflows: the largest finite value plus half its ulp.
_OVERFLOW_AT = {DType.FLOAT: 2.0 ** 128 - 2.0 ** 103, DType.FLOAT16: 65520.0, DType.BFLOAT16: 2.0 ** 128 - 2.0 ** 119}


def _overflowed(iv: Interval, dt, n: Node, pre: Interval) -> Interval:
    """Real bounds (``pre``, before the rounding pad) at or past where the tensor's type rounds to inf: the
    computation may overflow there; elsewhere a finite result of the type is within its largest value, so the
    padded bounds are clipped to it (``finfo.min`` masks stay finite)."""
    big, at = _MAX_FINITE.get(dt), _OVERFLOW_AT.get(dt)
    if big is None or not (np.any(iv.hi > big) or np.any(iv.lo < -big)):
        return iv
    lo = np.where(np.broadcast_to(pre.lo, np.shape(iv.lo)) <= -at, -np.inf, np.maximum(iv.lo, -big))
    hi = np.where(np.broadcast_to(pre.hi, np.shape(iv.hi)) >= at, np.inf, np.minimum(iv.hi, big))
    if np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)):
        return Interval(lo, hi, iv.origin, iv.why, iv.method)
    return Interval(lo, hi, iv.origin,
                    iv.why or f"{n.op} {n.name} may overflow {dt.name.lower()} (a bound past ±{big:.6g})", iv.method)


def _intersect(a: Interval, b: Interval) -> Interval:
    try:
        lo, hi = np.maximum(a.lo, b.lo), np.minimum(a.hi, b.hi)
    except ValueError:
        return b
    return Interval.of(lo, hi, a.origin, a.why)


# ----------------------------------------------------------------------------------------------------------
# elementwise helpers
def _shape_rank(v: Value) -> Optional[int]:
    return v.type.rank


def _aligned(iv: Interval, rank: Optional[int]) -> Interval:
    """``iv`` with its arrays at ``rank`` (leading 1s added) so numpy broadcasting matches ONNX's."""
    if rank is None or iv.lo.ndim == 0 or iv.lo.ndim == rank:
        return iv
    if iv.lo.ndim < rank:
        shape = (1,) * (rank - iv.lo.ndim) + iv.lo.shape
        return Interval(iv.lo.reshape(shape), iv.hi.reshape(shape), iv.origin, iv.why)
    return iv.hull()


def _bin(n: Node, ins, fn) -> Interval:
    rank = n.outputs[0].type.rank
    a, b = (_aligned(i, rank) for i in ins[:2])
    try:
        lo, hi = fn(a.lo, a.hi, b.lo, b.hi)
    except ValueError:   # ranges that do not broadcast (should not happen): fall back to hulls
        a, b = a.hull(), b.hull()
        lo, hi = fn(a.lo, a.hi, b.lo, b.hi)
    return Interval.of(lo, hi)


def _add(al, ah, bl, bh):
    return al + bl, ah + bh


def _sub(al, ah, bl, bh):
    return al - bh, ah - bl


def _mul(al, ah, bl, bh):
    c = np.stack(np.broadcast_arrays(al * bl, al * bh, ah * bl, ah * bh))
    c = np.where(np.isnan(c), 0.0, c)   # 0 * inf: the product of a zero bound with an infinite one
    return c.min(0), c.max(0)


def _div(al, ah, bl, bh):
    zero = (bl <= 0) & (bh >= 0)
    rl, rh = 1.0 / np.where(zero, 1, bh), 1.0 / np.where(zero, 1, bl)
    lo, hi = _mul(al, ah, rl, rh)
    lo, hi = np.broadcast_arrays(lo, hi)
    zero = np.broadcast_to(zero, lo.shape)
    return np.where(zero, -np.inf, lo), np.where(zero, np.inf, hi)


def _maximum(al, ah, bl, bh):
    return np.maximum(al, bl), np.maximum(ah, bh)


def _minimum(al, ah, bl, bh):
    return np.minimum(al, bl), np.minimum(ah, bh)


def _mono(fn) -> Callable:
    """A rule for a monotone non-decreasing elementwise function."""
    def rule(g, n, ins):
        x = ins[0]
        return Interval.of(fn(x.lo), fn(x.hi))
    return rule


def _unary(fn) -> Callable:
    """A rule from ``fn(lo, hi) -> (lo, hi)``."""
    def rule(g, n, ins):
        x = ins[0]
        lo, hi = fn(x.lo, x.hi, n)
        return Interval.of(lo, hi)
    return rule


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _abs(lo, hi, n):
    return np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(np.abs(lo), np.abs(hi))), np.maximum(np.abs(lo), np.abs(hi))


def _neg(lo, hi, n):
    return -hi, -lo


def _square(lo, hi):
    return _abs(lo, hi, None)[0] ** 2, np.maximum(lo * lo, hi * hi)


def _pow(g, n, ins):
    x, y = ins[0], ins[1]
    if y.lo.size and np.all(y.lo == y.hi) and np.all(y.lo == y.lo.flat[0]):
        e = float(y.lo.flat[0])
        if e == int(e):
            e = int(e)
            if e == 0:
                return Interval.of(1.0, 1.0)
            if e % 2 == 0:
                lo, hi = _square(x.lo, x.hi)
                return Interval.of(lo ** (e // 2), hi ** (e // 2)) if e > 0 else Interval.of(
                    np.where(hi == 0, np.inf, 1 / np.where(hi == 0, 1, hi)) ** (-e // 2),
                    np.where(lo == 0, np.inf, 1 / np.where(lo == 0, 1, lo)) ** (-e // 2))
            if e > 0:
                return Interval.of(x.lo ** e, x.hi ** e)
        if e > 0 and x.min >= 0:
            return Interval.of(x.lo ** e, x.hi ** e)
        if e == 0.5 and x.min >= 0:
            return Interval.of(np.sqrt(x.lo), np.sqrt(x.hi))
    if x.min > 0:   # x^y = exp(y log x)
        ll = _bin(n, [Interval.of(np.log(x.lo), np.log(x.hi)), y], _mul)
        return Interval.of(np.exp(ll.lo), np.exp(ll.hi))
    return Interval.unbounded(f"Pow {n.name}: a non-constant or fractional exponent of a base that may be <= 0")


def _clip(g, n, ins):
    x = ins[0]
    # min(max(x, a), b) is non-decreasing in x, a and b: the low bound from every low bound, the high from the highs
    a = ins[1] if len(ins) > 1 and ins[1] is not None else Interval.exact(n.attrs.get("min", -np.inf))
    b = ins[2] if len(ins) > 2 and ins[2] is not None else Interval.exact(n.attrs.get("max", np.inf))
    return Interval.of(np.minimum(np.maximum(x.lo, a.min), b.min), np.minimum(np.maximum(x.hi, a.max), b.max))


def _leaky(alpha_default):
    def rule(g, n, ins):
        x, a = ins[0], float(n.attrs.get("alpha", alpha_default))
        fl, fh = np.where(x.lo < 0, a * x.lo, x.lo), np.where(x.hi < 0, a * x.hi, x.hi)
        zero = np.where((x.lo < 0) & (x.hi > 0), 0.0, fl)   # f(0) = 0 inside (a negative alpha is not monotone)
        return Interval.of(np.minimum(np.minimum(fl, fh), zero), np.maximum(np.maximum(fl, fh), zero))
    return rule


def _prelu(g, n, ins):
    x, s = _aligned(ins[0], n.outputs[0].type.rank), _aligned(ins[1], n.outputs[0].type.rank)
    neg_lo, neg_hi = _mul(np.minimum(x.lo, 0), np.minimum(x.hi, 0), s.lo, s.hi)
    return Interval.of(np.minimum(neg_lo, np.maximum(x.lo, 0)), np.maximum(neg_hi, np.maximum(x.hi, 0)))


def _elu(g, n, ins):
    a = float(n.attrs.get("alpha", 1.0))
    f = lambda t: np.where(t >= 0, t, a * (np.exp(np.minimum(t, 0)) - 1))
    x = ins[0]
    if a < 0:   # a·(e^t - 1) for t < 0 decreases: between 0 and -a below 0
        return Interval.of(np.minimum(f(x.lo), 0.0), np.maximum(np.maximum(f(x.hi), 0.0), np.where(x.lo < 0, -a, 0.0)))
    return Interval.of(np.minimum(f(x.lo), -a), f(x.hi)) if x.min < 0 else Interval.of(f(x.lo), f(x.hi))


def _selu(g, n, ins):
    gamma = float(n.attrs.get("gamma", 1.0507009873554805))
    e = _elu(g, n, ins) if "alpha" in n.attrs else _elu_alpha(g, n, ins, 1.6732632423543772)
    return Interval.of(gamma * e.lo, gamma * e.hi)


def _elu_alpha(g, n, ins, a):
    f = lambda t: np.where(t >= 0, t, a * (np.exp(np.minimum(t, 0)) - 1))
    x = ins[0]
    return Interval.of(np.minimum(f(x.lo), -a) if x.min < 0 else f(x.lo), f(x.hi))


def _gelu_fn(n: Node):
    """(f, argmin): each of these decreases below its argmin and increases above it."""
    if n.op == "Mish":
        return (lambda t: t * np.tanh(np.logaddexp(t, 0.0))), -1.19237
    if n.op == "HardSwish":
        return (lambda t: t * np.clip(t + 3.0, 0.0, 6.0) / 6.0), -1.5
    approx = n.attrs.get("approximate", "none")
    if (approx.decode() if isinstance(approx, bytes) else approx) == "tanh":
        return (lambda t: 0.5 * t * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))), -0.75179
    return (lambda t: 0.5 * t * (1.0 + _erf(t / math.sqrt(2.0)))), -0.75179


def _gelu_like(g, n, ins):
    # the minimum at the argmin clipped into [lo, hi], the maximum at an end (Mish's is -0.309, HardSwish's -0.375)
    x = ins[0]
    f, a = _gelu_fn(n)
    return Interval.of(f(np.clip(a, x.lo, x.hi)), np.maximum(f(x.lo), f(x.hi)))


def _hard_sigmoid(g, n, ins):
    a, b = float(n.attrs.get("alpha", 0.2)), float(n.attrs.get("beta", 0.5))
    x = ins[0]
    f = lambda t: np.clip(a * t + b, 0, 1)
    return Interval.of(np.minimum(f(x.lo), f(x.hi)), np.maximum(f(x.lo), f(x.hi)))


def _variadic(fn):
    def rule(g, n, ins):
        acc = ins[0]
        for other in ins[1:]:
            acc = _bin(n, [acc, other], fn)
        return acc
    return rule


def _mean(g, n, ins):
    return union(ins)


def _where(g, n, ins):
    guarded = _nan_guarded(n)
    if guarded is not None:   # Where(IsNaN(p), c, p): p's values where it is not NaN (a Softmax's: [0, 1])
        i = 1 if n.inputs[1] is guarded else 2
        ins = list(ins)
        ins[i] = Interval.of(0.0, 1.0) if guarded.producer.op in ("Softmax", "Hardmax") else ins[i]
    return union([ins[1], ins[2]])


def _nan_guarded(n: Node) -> Optional[Value]:
    """``p`` of ``Where(IsNaN(p), c, p)``, the guard exporters put after a Softmax whose row may be fully masked:
    its NaNs never reach the output."""
    if n.op != "Where" or len(n.inputs) != 3 or any(v is None for v in n.inputs):
        return None
    c = n.inputs[0].producer
    if c is None or c.op != "IsNaN" or not c.inputs or c.inputs[0] is None:
        return None
    p = c.inputs[0]
    if n.inputs[2] is p and n.inputs[1] is not p and p.producer is not None:
        return p
    return None


def _same(g, n, ins):
    return ins[0]


def _hull(g, n, ins):
    return ins[0].hull()


def _hull_all(g, n, ins):
    return union([i for v, i in zip(n.inputs, ins) if is_float(v) and i is not None])


def _pad(g, n, ins):
    mode = n.attrs.get("mode", "constant")
    x = ins[0].hull()
    if mode in ("constant", b"constant"):
        c = ins[2] if len(ins) > 2 and ins[2] is not None else Interval.of(0.0, 0.0)
        return union([x, c])
    return x


def _transpose(g, n, ins):
    x = ins[0]
    if x.lo.ndim == 0:
        return x
    perm = n.attrs.get("perm") or list(range(x.lo.ndim))[::-1]
    if len(perm) != x.lo.ndim:
        return x.hull()
    return Interval.of(np.transpose(x.lo, perm), np.transpose(x.hi, perm))


def _unsqueeze_like(g, n, ins):
    """Reshape-like ops: keep a range along the last axis when that axis survives unchanged, else hull."""
    x, src, dst = ins[0], n.inputs[0].type.shape, n.outputs[0].type.shape
    if x.lo.ndim == 0 or src is None or dst is None or not len(src) or not len(dst):
        return x.hull()
    if src[-1] == dst[-1] and all(s == 1 for s in x.lo.shape[:-1]):
        shape = (1,) * (len(dst) - 1) + (x.lo.shape[-1],)
        return Interval.of(x.lo.reshape(shape), x.hi.reshape(shape))
    return x.hull()


def _expand(g, n, ins):
    return _aligned(ins[0], n.outputs[0].type.rank)


def _gather(g, n, ins):
    data = n.inputs[0]
    if data.is_const and data.const.size:   # an embedding table: its actual values
        return Interval.of(float(np.min(data.const)), float(np.max(data.const)))
    return ins[0].hull()


def _reduce_axes(n: Node, rank: int) -> Optional[List[int]]:
    axes = n.attrs.get("axes")
    if axes is None and len(n.inputs) > 1 and n.inputs[1] is not None and n.inputs[1].is_const:
        axes = [int(a) for a in np.asarray(n.inputs[1].const).ravel()]
    if axes is None and len(n.inputs) > 1 and n.inputs[1] is not None:
        return list(range(rank))   # axes computed at run time: hulled over every axis (the count is not known)
    if not axes:
        return None if n.attrs.get("noop_with_empty_axes") else list(range(rank))
    return sorted(a % rank for a in axes)


def _reduced(g: Graph, n: Node, x: Interval):
    """(lo, hi of the elements each output element reduces, hulled over the reduced axes; the count)."""
    v = n.inputs[0]
    rank = v.type.rank
    if rank is None:
        return x.hull(), -1
    axes = _reduce_axes(n, rank)
    if axes is None:
        return x, 1
    x = _aligned(x, rank)
    count = 1
    for a in axes:
        d = dim_max(v.type.shape[a], g)
        count = -1 if d < 0 or count < 0 else count * d
    n_axes = len(n.inputs) > 1 and n.inputs[1] is not None and not n.inputs[1].is_const and n.attrs.get("axes") is None
    if count > 0 and (n_axes or not all(isinstance(v.type.shape[a], (int, np.integer)) for a in axes)):
        count = -count   # at most |count| elements, maybe fewer: the caller bounds sums for every count up to it
    if x.lo.ndim == 0:
        lo, hi = x.lo, x.hi
    else:
        lo, hi = x.lo.min(axis=tuple(axes), keepdims=True), x.hi.max(axis=tuple(axes), keepdims=True)
        if not n.attrs.get("keepdims", 1):
            lo, hi = np.squeeze(lo, tuple(axes)), np.squeeze(hi, tuple(axes))
    return Interval.of(lo, hi), count


def _reduce(kind):
    def rule(g, n, ins):
        x, count = _reduced(g, n, ins[0])
        if kind in ("ReduceMax", "ReduceMin"):
            return x
        mag = np.maximum(np.abs(x.lo), np.abs(x.hi))
        if kind == "ReduceMean":   # the float32 sum's rounding, then the division's
            return _summed(x.lo, x.hi, mag, abs(count) + 1) if count != -1 else Interval.unbounded(
                f"{n.op} {n.name}: the number of reduced elements is not known")
        if count == -1:
            return Interval.unbounded(f"{n.op} {n.name}: the number of reduced elements is not known")
        c, fewer = abs(count), count < 0   # fewer: any count from 1 (0: an empty sum) up to c
        def total(lo, hi):
            lo, hi, m = c * lo, c * hi, c * np.maximum(np.abs(lo), np.abs(hi))
            if fewer:
                lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
            return lo, hi, m
        if kind == "ReduceSum":
            return _summed(*total(x.lo, x.hi), c)
        sq_lo, sq_hi = _square(x.lo, x.hi)
        if kind == "ReduceSumSquare":
            return _summed(*total(sq_lo, sq_hi), c + 1)
        if kind == "ReduceL2":
            s = _summed(*total(sq_lo, sq_hi), c + 1)
            return Interval.of(np.sqrt(np.maximum(s.lo, 0)), np.sqrt(s.hi))
        if kind == "ReduceL1":
            a_lo, a_hi = _abs(x.lo, x.hi, n)
            return _summed(*total(a_lo, a_hi), c)
        if kind == "ReduceLogSumExp":
            return Interval.of(x.lo, x.hi + math.log(c))
        return Interval.unbounded(f"no range rule for {kind}")
    return rule


def _pool(g, n, ins):
    x = _aligned(ins[0], n.inputs[0].type.rank)
    if x.lo.ndim > 2:   # the output plane is not the input's: per channel only (hulled over the spatial axes)
        sp = tuple(range(2, x.lo.ndim))
        x = Interval.of(x.lo.min(axis=sp, keepdims=True), x.hi.max(axis=sp, keepdims=True), x.origin, x.why)
    pads = n.attrs.get("pads") or []
    auto = n.attrs.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    padded = any(pads) or auto in ("SAME_UPPER", "SAME_LOWER")
    if n.op in ("MaxPool", "GlobalMaxPool"):
        return x
    if n.op == "AveragePool" and padded and n.attrs.get("count_include_pad", 0):
        x = Interval.of(np.minimum(x.lo, 0), np.maximum(x.hi, 0))
    # an average: the float32 sum's rounding over the window (GlobalAveragePool: the whole plane)
    if n.op == "GlobalAveragePool":
        k = _norm_axis_count(g, n, 2) if n.inputs[0].type.shape is not None else -1
    else:
        k = int(np.prod(n.attrs.get("kernel_shape") or [1]))
    if k < 0:
        return Interval.unbounded(f"{n.op} {n.name}: the pooled size is not bounded")
    return _summed(x.lo, x.hi, np.maximum(np.abs(x.lo), np.abs(x.hi)), k + 1)


def _channels(x: Interval, rank: int, c: int):
    """``x`` as per-channel (axis 1) arrays of length ``c``."""
    x = _aligned(x, rank)
    if x.lo.ndim == 0:
        return np.full(c, float(x.lo)), np.full(c, float(x.hi))
    axes = tuple(a for a in range(x.lo.ndim) if a != 1)
    lo, hi = x.lo.min(axis=axes), x.hi.max(axis=axes)
    return np.broadcast_to(lo, (c,)).copy(), np.broadcast_to(hi, (c,)).copy()


def _bound_sum(w: np.ndarray, lo: np.ndarray, hi: np.ndarray, axes):
    """Bounds of sum over ``axes`` of ``w * x`` with ``x`` in [lo, hi] (broadcast against ``w``)."""
    lo, hi = _bound_sum_abs(w, lo, hi, axes)[:2]
    return lo, hi


def _bound_sum_abs(w: np.ndarray, lo: np.ndarray, hi: np.ndarray, axes):
    """:func:`_bound_sum` and a bound of ``sum |w·x|``, which the float32 sum's rounding error is relative to."""
    a, b = w * lo, w * hi
    a, b = np.where(np.isnan(a), 0.0, a), np.where(np.isnan(b), 0.0, b)
    return (np.minimum(a, b).sum(axis=axes), np.maximum(a, b).sum(axis=axes),
            np.maximum(np.abs(a), np.abs(b)).sum(axis=axes))


#: Relative rounding of a contraction's inputs when the node computes narrowed (the policy's second pass): set by
#: :func:`analyze`'s ``narrowed`` for the node being bounded, read by :func:`_summed`.
_INPUT_ROUNDING = contextvars.ContextVar("cuvil_precision_input_rounding", default=0.0)


def _summed(lo, hi, mag, k: int) -> Interval:
    """A k-term float32 sum bounded by [lo, hi] in reals: widened by k·2^-23·``mag`` (``mag`` bounds the sum
    of the terms' magnitudes; with cancellation the error is relative to it, not to the result); a narrowed
    node's inputs rounded to its format add (2u + u²)·``mag``."""
    pad = np.asarray(mag, np.float64) * (max(k, 1) * 2.0 ** -23 + 2.01 * _INPUT_ROUNDING.get())
    return Interval.of(np.asarray(lo) - pad, np.asarray(hi) + pad)


def _conv(g, n, ins):
    x, w = n.inputs[0], n.inputs[1]
    rank = n.outputs[0].type.rank
    if not w.is_const or rank is None:
        return _product_bound(g, n, ins, "a non-constant kernel")
    W = np.asarray(w.const, dtype=np.float64)
    O, cg = W.shape[0], W.shape[1]
    group = int(n.attrs.get("group", 1))
    C = cg * group
    lo, hi = _channels(ins[0], rank, C)
    pads = n.attrs.get("pads") or []
    auto = n.attrs.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if any(pads) or auto in ("SAME_UPPER", "SAME_LOWER"):   # padded taps read zeros
        lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
    gi = np.arange(O) // (O // group)                       # each output channel's group
    idx = gi[:, None] * cg + np.arange(cg)[None, :]        # [O, cg] its input channels
    ext = (slice(None), slice(None)) + (None,) * (W.ndim - 2)
    olo, ohi, mag = _bound_sum_abs(W, lo[idx][ext], hi[idx][ext], tuple(range(1, W.ndim)))
    if len(n.inputs) > 2 and n.inputs[2] is not None:
        b = ins[2]
        blo, bhi = np.broadcast_to(b.lo, (O,)), np.broadcast_to(b.hi, (O,))
        olo, ohi, mag = olo + blo, ohi + bhi, mag + np.maximum(np.abs(blo), np.abs(bhi))
    shape = (1, O) + (1,) * (rank - 2)
    k = W[0].size + 1
    return _summed(olo.reshape(shape), ohi.reshape(shape), mag.reshape(shape), k)


def _last_axis(x: Interval, k: int):
    if x.lo.ndim == 0:
        return np.full(k, float(x.lo)), np.full(k, float(x.hi))
    axes = tuple(range(x.lo.ndim - 1))
    lo, hi = x.lo.min(axis=axes), x.hi.max(axis=axes)
    return np.broadcast_to(lo, (k,)).copy(), np.broadcast_to(hi, (k,)).copy()


def _contract_const(xr: Interval, W: np.ndarray, rank: int):
    """x[..., K] @ W[..., K, N] with W constant: per-output-column bounds, shape (1, ..., 1, N)."""
    K, N = W.shape[-2], W.shape[-1]
    lo, hi = _last_axis(xr, K)
    W2 = W.reshape(-1, K, N)
    olo, ohi, mag = _bound_sum_abs(W2, lo[None, :, None], hi[None, :, None], 1)   # [B, N]
    olo, ohi, mag = olo.min(0), ohi.max(0), mag.max(0)
    shape = (1,) * (rank - 1) + (N,)
    return olo.reshape(shape), ohi.reshape(shape), K, mag.reshape(shape)


def _product_bound(g, n, ins, what: str) -> Interval:
    """sum over K of a*b with both unknown: K * the hull product; K from the contracted dim."""
    a, b = ins[0].hull(), ins[1].hull()
    lo, hi = _mul(a.lo, a.hi, b.lo, b.hi)
    k = _contracted(g, n)
    if k < 0:
        return Interval.unbounded(f"{n.op} {n.name}: {what} and a contracted dim that is not bounded")
    return _summed(k * np.minimum(lo, 0), k * np.maximum(hi, 0), k * np.maximum(np.abs(lo), np.abs(hi)), k)


def _contracted(g, n) -> int:
    x, w = n.inputs[0], n.inputs[1]
    if n.op == "Conv" and w.type.shape is not None:
        k = 1
        for d in w.type.shape[1:]:
            dm = dim_max(d, g)
            if dm < 0:
                return -1
            k *= dm
        return k
    shape = x.type.shape
    if shape is None:
        return -1
    d = shape[0] if n.op == "Gemm" and n.attrs.get("transA", 0) else shape[-1]
    return dim_max(d, g)


#: a float32 Softmax row's sum, at most ``(1 + ROW_SUM_SLACK) / (1 - gamma_K)``: the sum S of its K exponentials
#: is rounded (``1 - gamma_K``), and each output ``fl(e_k / S)`` once more; the slack also covers an exponential
#: computed by another implementation in the sum than in the output (a vector polynomial beside libm: a few ulps)
ROW_SUM_SLACK = 2.0 ** -16


def _row_stochastic(g: Graph, a: Value, iv: Optional[Interval]) -> bool:
    """Whether ``a``'s rows along its last axis are non-negative with a sum of at most about 1 (see
    :data:`ROW_SUM_SLACK`): a Softmax over its last axis whose range is bounded (no NaN row), or the
    ``Where(IsNaN(p), 0, p)`` guard of one (a fully masked row is all zeros)."""
    p = a.producer
    if p is not None and p.op == "Where" and _nan_guarded(p) is not None:
        c = p.inputs[1]
        if not (c.is_const and np.all(np.asarray(c.const) == 0)):
            return False
        g_ = _nan_guarded(p)
        if g_.type.shape is None or a.type.shape is None or tuple(g_.type.shape) != tuple(a.type.shape):
            return False          # the guard broadcasts p (a size-1 softmax axis repeated): rows no longer sum to 1
        a, iv = _nan_guarded(p), Interval.of(0.0, 1.0)
        p = a.producer
    if p is None or p.op != "Softmax" or a.type.rank is None or iv is None or not iv.bounded:
        return False
    rank = a.type.rank
    # the IR's Softmax: default axis -1 whatever the model's opset (the importer rewrites an opset < 13
    # Softmax's flattened rows into this form; the lowering reads the attribute so)
    return int(p.attrs.get("axis", -1)) % rank == rank - 1


def _convex_product(g, n, ins) -> Optional[Interval]:
    """``P @ V`` with ``P``'s rows convex weights (:func:`_row_stochastic`, attention's probabilities):
    each output lies between ``sigma·min(0, min V)`` and ``sigma·max(0, max V)``, sigma the row sum's bound,
    plus the K-term float32 sum's rounding; None when ``P`` is not such a tensor."""
    if n.op != "MatMul" or not _row_stochastic(g, n.inputs[0], ins[0]) or not ins[1].bounded:
        return None
    k = _contracted(g, n)
    if k < 0:
        return None
    gam = k * 2.0 ** -24 / (1 - k * 2.0 ** -24)
    sigma = (1 + ROW_SUM_SLACK) / (1 - gam)
    v = ins[1].hull()
    lo, hi = sigma * min(0.0, v.min), sigma * max(0.0, v.max)
    return _summed(lo, hi, sigma * v.max_abs, k)


def _matmul(g, n, ins):
    a, b = n.inputs[0], n.inputs[1]
    rank = n.outputs[0].type.rank
    convex = _convex_product(g, n, ins)
    if convex is not None:
        plain = _product_bound(g, n, ins, "two non-constant operands")
        if plain.bounded:     # both bounds hold: their intersection does
            return Interval.of(np.maximum(convex.lo, plain.min), np.minimum(convex.hi, plain.max))
        return convex
    if b.is_const and b.const.ndim >= 2 and rank is not None:
        lo, hi, k, mag = _contract_const(ins[0], np.asarray(b.const, np.float64), rank)
        return _summed(lo, hi, mag, k)
    if a.is_const and a.const.ndim == 2 and rank is not None:   # W[M,K] @ x[..., K, N]: per-row bounds
        W = np.asarray(a.const, np.float64)
        xr = ins[1].hull()
        olo, ohi, mag = _bound_sum_abs(W, xr.lo, xr.hi, 1)
        shape = (1,) * (rank - 2) + (W.shape[0], 1)
        return _summed(olo.reshape(shape), ohi.reshape(shape), mag.reshape(shape), W.shape[1])
    return _product_bound(g, n, ins, "two non-constant operands")


def _gemm(g, n, ins):
    alpha, beta = float(n.attrs.get("alpha", 1.0)), float(n.attrs.get("beta", 1.0))
    b = n.inputs[1]
    if b.is_const and not n.attrs.get("transA", 0):
        W = np.asarray(b.const, np.float64)
        W = W.T if n.attrs.get("transB", 0) else W
        lo, hi, k, mag = _contract_const(ins[0], alpha * W, 2)
        out = Interval.of(lo, hi)
    else:
        out = _product_bound(g, n, ins, "a non-constant B")
        out = Interval.of(*_mul(out.lo, out.hi, np.float64(alpha), np.float64(alpha)))
        mag = np.maximum(np.abs(out.lo), np.abs(out.hi))
    if len(n.inputs) > 2 and n.inputs[2] is not None:
        c = _aligned(ins[2], 2)
        clo, chi = _mul(c.lo, c.hi, np.float64(beta), np.float64(beta))
        out = Interval.of(*_add(out.lo, out.hi, clo, chi))
        mag = mag + np.maximum(np.abs(clo), np.abs(chi))
    return _summed(out.lo, out.hi, mag, max(_contracted(g, n), 1) + 2)


def _norm_axis_count(g, n, axis: int):
    shape = n.inputs[0].type.shape
    count = 1
    for d in shape[axis:]:
        dm = dim_max(d, g)
        if dm < 0:
            return -1
        count *= dm
    return count


def _layer_norm(g, n, ins):
    """|(x - mean) / sqrt(var + eps)| <= sqrt(N) for N normalised elements, whatever x is: the output lies within
    beta ± sqrt(N)·|gamma| elementwise, padded for float32's rounding. Proof, for the float32 computation of
    Cuvil's kernels (:mod:`cuvil.kernels.lower.norm`, two passes): ``d_i = fl(x_i - mean)`` is the one value
    both the variance (``var = fl(sum_j fl(d_j^2)) / N``) and the output read, so ``d_i^2 <= sum_j d_j^2``
    exactly (no assumption on how well ``mean`` was rounded: Samuelson's sqrt(N-1) needs the exact mean);
    a sum of N non-negative float32 terms in any order, its squares and its division are at least
    ``(1 - gamma_{N+2})`` of the exact (gamma_k = k u / (1 - k u), u = 2^-24), so ``|d_i| / sqrt(var + eps) <=
    sqrt(N / (1 - gamma_{N+2}))``, times ``(1 + u)^4`` for the add, the root, the division and the product
    with gamma; the add of beta rounds once more. A one-pass variance (``E[x^2] - mean^2``, onnxruntime's) can
    cancel to 0 and reach ``|x - mean| / sqrt(eps)``: not what these kernels compute. RMSNormalization
    (``x / sqrt(mean(x^2) + eps)``, ``d_i = x_i``) has the same bound. Needs a float32 input and
    ``eps >= 2^-100`` as float32 (the kernels add eps in x's type): a zero or negative eps makes a constant
    row 0/0, an eps rounded to 0 in float16 (BERT's 1e-12) the same, and squares that underflow (below
    2^-149 each, N of them) are then negligible beside eps; otherwise unbounded, with the reason."""
    x = n.inputs[0]
    rank = x.type.rank
    if rank is None:
        return Interval.unbounded(f"{n.op} {n.name}: unknown rank")
    axis = int(n.attrs.get("axis", -1)) % rank
    count = _norm_axis_count(g, n, axis)
    if count < 0:
        return Interval.unbounded(f"{n.op} {n.name}: the normalised size is not bounded")
    if x.dtype != DType.FLOAT:
        return Interval.unbounded(f"{n.op} {n.name}: the bound is proved for float32 statistics, not {x.dtype.name}")
    eps = float(np.float32(n.attrs.get("epsilon", 1e-5)))
    if not eps >= 2.0 ** -100:
        return Interval.unbounded(f"{n.op} {n.name}: epsilon {eps:g} (as float32) is below 2^-100: a constant row "
                                  "can divide 0 by 0")
    u = 2.0 ** -24
    gam_k = (count + 2) * u / (1 - (count + 2) * u)
    s = math.sqrt(max(count, 1) / (1 - gam_k)) * (1 + u) ** 4
    gam = _aligned(ins[1], rank) if len(ins) > 1 and ins[1] is not None else Interval.of(1.0, 1.0)
    glo, ghi = _mul(gam.lo, gam.hi, np.float64(-s), np.float64(s))
    if len(ins) > 2 and ins[2] is not None:
        bet = _aligned(ins[2], rank)
        glo, ghi = _add(glo, ghi, bet.lo, bet.hi)
    xr = ins[0]
    if xr is not None and xr.bounded and count * xr.max_abs > float(np.finfo(np.float32).max) / 2:
        return [Interval.unbounded(f"{n.op} {n.name}: its float32 sum over {count} elements may overflow")] + [
            None] * (len(n.outputs) - 1)
    if xr is None or not xr.bounded:     # the bound holds for any finite input; an inf or NaN one is NaN out
        return [Interval.unbounded(f"{n.op} {n.name}: its input is not bounded")] + [None] * (len(n.outputs) - 1)
    out = _summed(glo, ghi, np.maximum(np.abs(glo), np.abs(ghi)), 2)
    return [out] + [None] * (len(n.outputs) - 1)


def _channel_norm(g, n, ins):
    """InstanceNormalization / GroupNormalization: per channel beta ± sqrt(N-1)·|gamma|, N the elements
    normalised together."""
    x = n.inputs[0]
    rank = x.type.rank
    if rank is None or x.type.shape is None:
        return Interval.unbounded(f"{n.op} {n.name}: unknown shape")
    count = _norm_axis_count(g, n, 2)
    if n.op == "GroupNormalization":
        c = dim_max(x.type.shape[1], g)
        count = count * c // int(n.attrs.get("num_groups", 1)) if c > 0 and count > 0 else -1
    if count < 0:
        return Interval.unbounded(f"{n.op} {n.name}: the normalised size is not bounded")
    s = math.sqrt(max(count - 1, 0))
    shape = (1, -1) + (1,) * (rank - 2)
    gl, gh = ins[1].lo.reshape(shape) if ins[1].lo.ndim else ins[1].lo, ins[1].hi.reshape(shape) if ins[1].hi.ndim else ins[1].hi
    lo, hi = _mul(gl, gh, np.float64(-s), np.float64(s))
    bl, bh = (ins[2].lo.reshape(shape) if ins[2].lo.ndim else ins[2].lo), (ins[2].hi.reshape(shape) if ins[2].hi.ndim else ins[2].hi)
    out = _summed(lo + bl, hi + bh, np.maximum(np.abs(lo + bl), np.abs(hi + bh)), count + 8)
    return _summed(out.lo, out.hi, _norm_terms(n, ins[0], Interval.of(gl, gh)), 4)


def _norm_terms(n: Node, x: Optional[Interval], gamma: Interval) -> float:
    """A bound of the terms a normalisation's float32 computation may round: |x|·|gamma| / sqrt(eps)."""
    if x is None or not x.bounded:
        return np.inf
    eps = float(n.attrs.get("epsilon", 1e-5))
    return x.max_abs * gamma.max_abs / math.sqrt(eps) if eps > 0 else np.inf


def _batch_norm(g, n, ins):
    rank = n.outputs[0].type.rank or 4
    shape = (1, -1) + (1,) * (rank - 2)
    vals = [v.const if v.is_const else None for v in n.inputs[1:5]]
    if any(v is None for v in vals):
        return Interval.unbounded(f"BatchNormalization {n.name}: non-constant statistics")
    scale, bias, mean, var = (np.asarray(v, np.float64).reshape(shape) for v in vals)
    k = scale / np.sqrt(var + float(n.attrs.get("epsilon", 1e-5)))
    x = _aligned(ins[0], rank)
    lo, hi = _mul(x.lo - mean, x.hi - mean, k, k)
    mag = (np.maximum(np.abs(x.lo), np.abs(x.hi)) + np.abs(mean)) * np.abs(k) + np.abs(bias)
    return [_summed(lo + bias, hi + bias, mag, 4)] + [None] * (len(n.outputs) - 1)


def _lrn(g, n, ins):
    """x / (bias + alpha/size·sum x²)^beta: the denominator is at least bias^beta (alpha, beta >= 0), so
    |y| <= |x| / bias^beta, with y's sign x's."""
    alpha, beta, bias = (float(n.attrs.get(k, d)) for k, d in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)))
    if alpha < 0 or beta < 0 or bias <= 0:
        return Interval.unbounded(f"LRN {n.name}: alpha, beta >= 0 and bias > 0 needed for a bound")
    x, k = ins[0], bias ** -beta
    return Interval.of(np.minimum(x.lo * k, 0), np.maximum(x.hi * k, 0))


def _softmax(g, n, ins):
    return Interval.of(0.0, 1.0)


def _log_softmax(g, n, ins):
    x = ins[0].hull()
    rank = n.inputs[0].type.rank
    axis = int(n.attrs.get("axis", -1)) % rank if rank else 0
    c = dim_max(n.inputs[0].type.shape[axis], g) if rank else -1
    if c < 0:
        return Interval.unbounded(f"LogSoftmax {n.name}: the axis size is not bounded")
    return Interval.of(x.min - x.max - math.log(c), 0.0)


def _attention(g, n, ins):
    # softmax(q k^T) v: each output row a convex combination of v's rows
    return ins[2].hull()


def _dequantize(g, n, ins):
    scale = ins[1]
    zp = n.inputs[2].const if len(n.inputs) > 2 and n.inputs[2] is not None and n.inputs[2].is_const else None
    kind = n.inputs[0].type.dtype
    if ins[0] is not None and ins[0].bounded:   # a constant (an int32 bias) or a declared input: its own values
        qlo, qhi = ins[0].min, ins[0].max
    elif kind.is_int:
        qlo, qhi = (float(q) for q in kind.int_range)
    else:
        return Interval.unbounded(f"DequantizeLinear {n.name}: the quantized type {kind} has no known range")
    if zp is not None:
        zlo = zhi = np.asarray(zp, np.float64)
    elif len(n.inputs) > 2 and n.inputs[2] is not None:   # a zero point computed at run time
        if ins[2] is None or not ins[2].bounded:
            return Interval.unbounded(f"DequantizeLinear {n.name}: a zero point that is not bounded")
        zlo, zhi = np.float64(ins[2].min), np.float64(ins[2].max)
    else:
        zlo = zhi = np.float64(0.0)
    lo, hi = _mul(np.float64(qlo) - zhi, np.float64(qhi) - zlo, scale.lo, scale.hi)
    return Interval.of(np.min(lo), np.max(hi))


def _constant(g, n, ins):
    for key in ("value", "value_float", "value_floats"):
        if key in n.attrs:
            return Interval.exact(np.asarray(n.attrs[key], np.float64)).hull()
    return Interval.unbounded(f"Constant {n.name}: no float value")


def _constant_of_shape(g, n, ins):
    v = n.attrs.get("value")
    return Interval.exact(np.asarray(v if v is not None else 0.0, np.float64).ravel()[:1]).hull()


def _split(g, n, ins):
    return [ins[0].hull()] * len(n.outputs)


def _trig(g, n, ins):
    return Interval.of(-1.0, 1.0)


def _sqrt(lo, hi, n):   # below 0: NaN, which no interval holds
    return np.where(lo < 0, np.nan, np.sqrt(np.maximum(lo, 0))), np.where(lo < 0, np.nan, np.sqrt(np.maximum(hi, 0)))


def _log(lo, hi, n):   # log(0) = -inf; below 0: NaN
    neg = lo < 0
    return (np.where(neg, np.nan, np.where(lo <= 0, -np.inf, np.log(np.maximum(lo, 1e-300)))),
            np.where(neg, np.nan, np.where(hi <= 0, -np.inf, np.log(np.maximum(hi, 1e-300)))))


def _reciprocal(g, n, ins):
    return _bin(n, [Interval.of(1.0, 1.0), ins[0]], _div)


def _softsign(g, n, ins):
    x = ins[0]
    return Interval.of(x.lo / (1 + np.abs(x.lo)), x.hi / (1 + np.abs(x.hi)))


RULES: Dict[str, Callable] = {
    "Add": lambda g, n, i: _bin(n, i, _add), "Sub": lambda g, n, i: _bin(n, i, _sub),
    "Mul": lambda g, n, i: _bin(n, i, _mul), "Div": lambda g, n, i: _bin(n, i, _div),
    "Max": _variadic(_maximum), "Min": _variadic(_minimum), "Sum": _variadic(_add), "Mean": _mean,
    "Pow": _pow, "Neg": _unary(_neg), "Abs": _unary(_abs), "Reciprocal": _reciprocal,
    "Relu": _mono(lambda t: np.maximum(t, 0)), "Clip": _clip, "LeakyRelu": _leaky(0.01), "PRelu": _prelu,
    "Elu": _elu, "Selu": _selu,
    "Sigmoid": _mono(_sigmoid), "Tanh": _mono(np.tanh), "Erf": _mono(_erf), "Exp": _mono(np.exp),
    "Log": _unary(_log), "Sqrt": _unary(_sqrt), "Softplus": _mono(lambda t: np.logaddexp(t, 0)),
    "Softsign": _softsign, "HardSigmoid": _hard_sigmoid, "Gelu": _gelu_like, "Mish": _gelu_like,
    "HardSwish": _gelu_like,
    "Floor": _mono(np.floor), "Ceil": _mono(np.ceil), "Round": _mono(np.round),
    "Sin": _trig, "Cos": _trig, "Atan": _mono(np.arctan),
    "Where": _where, "Cast": _same, "CastLike": _same, "Identity": _same, "Dropout": _same,
    "Transpose": _transpose, "Reshape": _unsqueeze_like, "Flatten": _unsqueeze_like, "Squeeze": _unsqueeze_like,
    "Unsqueeze": _unsqueeze_like, "Expand": _expand, "Tile": _hull, "Slice": _hull, "Gather": _gather,
    "GatherElements": _hull, "GatherND": _hull, "Concat": _hull_all, "Split": _split, "Pad": _pad,
    "Resize": _hull, "DepthToSpace": _hull, "SpaceToDepth": _hull, "Trilu": lambda g, n, i: union(
        [i[0], Interval.of(0.0, 0.0)]),
    "ReduceMean": _reduce("ReduceMean"), "ReduceMax": _reduce("ReduceMax"), "ReduceMin": _reduce("ReduceMin"),
    "ReduceSum": _reduce("ReduceSum"), "ReduceSumSquare": _reduce("ReduceSumSquare"),
    "ReduceL2": _reduce("ReduceL2"), "ReduceL1": _reduce("ReduceL1"), "ReduceLogSumExp": _reduce("ReduceLogSumExp"),
    "MaxPool": _pool, "AveragePool": _pool, "GlobalAveragePool": _pool, "GlobalMaxPool": _pool,
    "Conv": _conv, "MatMul": _matmul, "Gemm": _gemm,
    "LayerNormalization": _layer_norm, "RMSNormalization": _layer_norm, "InstanceNormalization": _channel_norm,
    "GroupNormalization": _channel_norm, "BatchNormalization": _batch_norm,
    "LRN": _lrn, "Softmax": _softmax, "Hardmax": _softmax, "LogSoftmax": _log_softmax, "FusedAttention": _attention,
    "DequantizeLinear": _dequantize, "Constant": _constant, "ConstantOfShape": _constant_of_shape,
}

#: Ops whose output values are among their inputs' (no rounding to widen for).
_EXACT_OPS = frozenset({"Relu", "Clip", "Max", "Min", "Where", "Identity", "Dropout",   # (Cast rounds)
                        "Transpose", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Expand", "Tile", "Slice",
                        "Gather", "GatherElements", "GatherND", "Concat", "Split", "Pad", "ReduceMax",
                        "ReduceMin", "MaxPool", "GlobalMaxPool", "Softmax", "Hardmax", "Constant",
                        "ConstantOfShape", "Neg", "Abs", "DepthToSpace", "SpaceToDepth", "Trilu"})


# ----------------------------------------------------------------------------------------------------------
# internal values of a node (what a narrowed kernel stores besides its inputs and outputs)
def internal_ranges(graph: Graph, n: Node, r: Ranges) -> Dict[str, Interval]:
    """Named intervals of the values ``n`` computes internally (LayerNormalization: ``x - mean`` and its
    square, whose mean is the variance)."""
    if n.op in ("LayerNormalization", "InstanceNormalization", "GroupNormalization") and r.get(id(n.inputs[0])):
        x = r[id(n.inputs[0])].hull()
        span = x.max - x.min
        return {"x - mean": Interval.of(-span, span, x.origin, x.why),
                "(x - mean)^2": Interval.of(0.0, span * span, x.origin, x.why)}
    if n.op == "RMSNormalization" and r.get(id(n.inputs[0])):
        x = r[id(n.inputs[0])].hull()
        return {"x^2": Interval.of(0.0, x.max_abs ** 2, x.origin, x.why)}
    if n.op == "Gelu" and _attr_str(n, "approximate") == "tanh" and r.get(id(n.inputs[0])):
        x = r[id(n.inputs[0])].hull()   # 0.5·x·(1 + tanh(sqrt(2/pi)·(x + 0.044715·x³)))
        return {"x^3": Interval.of(x.min ** 3, x.max ** 3, x.origin, x.why)}
    return {}


def _attr_str(n: Node, key: str) -> str:
    v = n.attrs.get(key, "")
    return v.decode() if isinstance(v, bytes) else str(v)


def internal_values(n: Node, inputs: Sequence[np.ndarray]) -> Dict[str, np.ndarray]:
    """The internal values of :func:`internal_ranges` computed (float64) from concrete inputs."""
    x = np.asarray(inputs[0], np.float64)
    if n.op == "LayerNormalization":
        axis = int(n.attrs.get("axis", -1)) % x.ndim
        c = x - x.mean(axis=tuple(range(axis, x.ndim)), keepdims=True)
        return {"x - mean": c, "(x - mean)^2": c * c}
    if n.op == "InstanceNormalization":
        c = x - x.mean(axis=tuple(range(2, x.ndim)), keepdims=True)
        return {"x - mean": c, "(x - mean)^2": c * c}
    if n.op == "RMSNormalization":
        return {"x^2": x * x}
    if n.op == "Gelu" and _attr_str(n, "approximate") == "tanh":
        return {"x^3": x * x * x}
    return {}


__all__ = ["analyze", "node_ranges", "internal_ranges", "internal_values", "RULES", "is_float", "CERTIFIED"]
