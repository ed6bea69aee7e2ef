"""Op lowerings: each op's outputs as tensor expressions of its inputs (a table keyed by op name).

A lowering receives a :class:`LowerCtx` whose ``inputs`` are :class:`TensorFn` (shape, dtype and a
function from output indices to an expression) and returns one TensorFn per output. Lowerings never
allocate: an op that needs an intermediate (Softmax's row max) asks ``ctx.temp`` for a materialised one.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np

from ..errors import UnsupportedOpError
from ..ir.dtype import DType
from ..ir.graph import Node
from .texpr import BOOL, I64, Buf, E, all_of, binop, call, cast, cmp, const, in_range, logic, reduce, select, unop

Index = List[E]


@attrs.define
class TensorFn:
    shape: Tuple[int, ...]
    dtype: DType
    fn: Callable[[Index], E]
    # "elementwise": output element i reads input elements at i (up to broadcasting) only;
    # "injective": data movement; "complex": reductions and windows (worth materialising before reuse)
    kind: str = "complex"
    # For elementwise ops: which inputs are read at exactly the output index (no broadcasting)
    same_index_inputs: Tuple[int, ...] = ()
    buf: Optional[Buf] = None   # set when the tensor is stored (its loads read this buffer)

    def __call__(self, idx: Index) -> E:
        return self.fn(list(idx))

    def at_or(self, idx: Index, cond: E, default) -> E:
        """``self[idx]`` where ``cond`` holds, else ``default``; indices are clamped so the read itself is
        always in bounds (padding reads no memory outside the tensor)."""
        if cond.op == "const" and cond.attr is True:
            return self(idx)
        return select(cond, self([clamp(i, d) for i, d in zip(idx, self.shape)]), const(default, self.dtype))


class LowerCtx:
    def __init__(self, node: Node, inputs: List[Optional[TensorFn]], temp: Callable):
        self.node, self.inputs, self._temp = node, inputs, temp

    def attr(self, name, default=None):
        from ..ir.registry import attr_defaults
        if name in self.node.attrs:
            return self.node.attrs[name]
        return attr_defaults(self.node.op).get(name, default)

    def input(self, i: int) -> Optional[TensorFn]:
        return self.inputs[i] if i < len(self.inputs) else None

    def out_shape(self, j: int = 0) -> Tuple[int, ...]:
        return tuple(self.node.outputs[j].shape)

    def out_dtype(self, j: int = 0) -> DType:
        return self.node.outputs[j].dtype

    def temp(self, shape, dtype, fn, name="tmp") -> TensorFn:
        """Materialise ``fn`` over ``shape`` into a scratch buffer; returns a loader of it."""
        return self._temp(tuple(shape), dtype, fn, f"{self.node.name}_{name}")

    def unsupported(self, detail: str):
        raise UnsupportedOpError(self.node.op, self.node.name, detail=detail)


LOWERINGS: Dict[str, Callable[[LowerCtx], List[TensorFn]]] = {}


def lowering(*ops):
    def deco(fn):
        for op in ops:
            LOWERINGS[op] = fn
        return fn
    return deco


def broadcast_index(idx: Index, in_shape: Sequence[int], out_shape: Sequence[int]) -> Index:
    k = len(out_shape) - len(in_shape)
    return [const(0, I64) if d == 1 and out_shape[k + j] != 1 else idx[k + j] for j, d in enumerate(in_shape)]


def _bcast(t: TensorFn, out_shape) -> Callable[[Index], E]:
    if tuple(t.shape) == tuple(out_shape):
        return t.fn
    return lambda idx: t.fn(broadcast_index(idx, t.shape, out_shape))


def elementwise(ctx: LowerCtx, scalar: Callable[..., E], inputs=None, dtype=None) -> List[TensorFn]:
    ins = [t for t in (inputs if inputs is not None else ctx.inputs)]
    shape = ctx.out_shape()
    fns = [_bcast(t, shape) for t in ins]
    same = tuple(k for k, t in enumerate(ins) if tuple(t.shape) == tuple(shape))
    return [TensorFn(shape, dtype or ctx.out_dtype(), lambda idx: scalar(*[f(idx) for f in fns]), "elementwise", same)]


def fconst(v, like: E) -> E:
    return const(v, like.dtype)


# --- elementwise math -----------------------------------------------------------------------------

_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div"}


@lowering("Add", "Sub", "Mul", "Div")
def _arith(ctx):
    op = _BINARY[ctx.node.op]
    return elementwise(ctx, lambda a, b: binop(op, a, b))


@lowering("Pow")
def _pow(ctx):
    def f(a, b):
        if a.dtype.is_float:
            return call("pow", a, cast(b, a.dtype))
        return cast(call("pow", cast(a, DType.DOUBLE), cast(b, DType.DOUBLE)), a.dtype)
    return elementwise(ctx, f)


@lowering("Mod")
def _mod(ctx):
    fmod = ctx.attr("fmod", 0)
    return elementwise(ctx, lambda a, b: E("fmod" if fmod or a.dtype.is_float else "pymod", (a, b), a.dtype))


def nan_max(a: E, b: E) -> E:
    """np.maximum: NaN if either is NaN; on ties the second argument."""
    if not a.dtype.is_float:
        return select(cmp("gt", a, b), a, b)
    return select(cmp("uno", a, a), a, select(cmp("gt", a, b), a, b))


def nan_min(a: E, b: E) -> E:
    if not a.dtype.is_float:
        return select(cmp("lt", a, b), a, b)
    return select(cmp("uno", a, a), a, select(cmp("lt", a, b), a, b))


@lowering("Max", "Min", "Sum", "Mean")
def _variadic(ctx):
    op = ctx.node.op
    ins = [t for t in ctx.inputs if t is not None]

    def f(*xs):
        acc = xs[0]
        for x in xs[1:]:
            acc = nan_max(acc, x) if op == "Max" else nan_min(acc, x) if op == "Min" else binop("add", acc, x)
        return binop("div", acc, fconst(len(xs), acc)) if op == "Mean" else acc
    return elementwise(ctx, f, ins)


_UNARY_CALLS = {"Sqrt": "sqrt", "Exp": "exp", "Log": "log", "Sin": "sin", "Cos": "cos", "Tan": "tan",
                "Asin": "asin", "Acos": "acos", "Atan": "atan", "Sinh": "sinh", "Cosh": "cosh",
                "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "Erf": "erf", "Floor": "floor",
                "Ceil": "ceil", "Round": "roundeven", "Tanh": "tanh"}


@lowering(*_UNARY_CALLS)
def _unary_call(ctx):
    fn = _UNARY_CALLS[ctx.node.op]
    return elementwise(ctx, lambda x: call(fn, x))


@lowering("Abs")
def _abs(ctx):
    return elementwise(ctx, lambda x: call("fabs", x) if x.dtype.is_float else select(cmp("lt", x, const(0, x.dtype)), unop("neg", x), x))


@lowering("Neg")
def _neg(ctx):
    return elementwise(ctx, lambda x: unop("neg", x))


@lowering("Reciprocal")
def _recip(ctx):
    return elementwise(ctx, lambda x: binop("div", fconst(1, x), x))


@lowering("Sign")
def _sign(ctx):
    def f(x):
        z = fconst(0, x)
        s = select(cmp("gt", x, z), fconst(1, x), select(cmp("lt", x, z), fconst(-1, x), z))
        return select(cmp("uno", x, x), x, s) if x.dtype.is_float else s
    return elementwise(ctx, f)


_CMP = {"Equal": "eq", "Less": "lt", "LessOrEqual": "le", "Greater": "gt", "GreaterOrEqual": "ge"}


@lowering(*_CMP)
def _cmp(ctx):
    pred = _CMP[ctx.node.op]
    return elementwise(ctx, lambda a, b: cmp(pred, a, b), dtype=BOOL)


@lowering("And", "Or", "Xor")
def _logic(ctx):
    op = ctx.node.op.lower()
    return elementwise(ctx, lambda a, b: logic(op, a, b), dtype=BOOL)


@lowering("Not")
def _not(ctx):
    return elementwise(ctx, lambda a: logic("not", a), dtype=BOOL)


@lowering("IsNaN")
def _isnan(ctx):
    return elementwise(ctx, lambda a: cmp("uno", a, a), dtype=BOOL)


@lowering("IsInf")
def _isinf(ctx):
    pos, neg = ctx.attr("detect_positive", 1), ctx.attr("detect_negative", 1)

    def f(a):
        conds = []
        if pos:
            conds.append(cmp("eq", a, fconst(math.inf, a)))
        if neg:
            conds.append(cmp("eq", a, fconst(-math.inf, a)))
        if not conds:
            return const(False, BOOL)
        return conds[0] if len(conds) == 1 else logic("or", *conds)
    return elementwise(ctx, f, dtype=BOOL)


@lowering("Where")
def _where(ctx):
    return elementwise(ctx, lambda c, a, b: select(c, a, b))


@lowering("Cast")
def _cast(ctx):
    to = DType(ctx.attr("to"))
    return elementwise(ctx, lambda x: cast(x, to), dtype=to)


@lowering("CastLike")
def _castlike(ctx):
    to = ctx.out_dtype()
    return elementwise(ctx, lambda x: cast(x, to), [ctx.input(0)], dtype=to)


# --- activations ------------------------------------------------------------------------------------

def relu(x: E) -> E:
    return nan_max(x, fconst(0, x))


@lowering("Relu")
def _relu(ctx):
    return elementwise(ctx, relu)


@lowering("LeakyRelu")
def _leaky(ctx):
    alpha = ctx.attr("alpha", 0.01)
    return elementwise(ctx, lambda x: select(cmp("lt", x, fconst(0, x)), binop("mul", x, fconst(alpha, x)), x))


@lowering("PRelu")
def _prelu(ctx):
    return elementwise(ctx, lambda x, s: select(cmp("lt", x, fconst(0, x)), binop("mul", x, s), x))


@lowering("Elu")
def _elu(ctx):
    alpha = ctx.attr("alpha", 1.0)
    return elementwise(ctx, lambda x: select(cmp("lt", x, fconst(0, x)),
                                             binop("mul", fconst(alpha, x), binop("sub", call("exp", x), fconst(1, x))), x))


@lowering("Selu")
def _selu(ctx):
    alpha, gamma = ctx.attr("alpha"), ctx.attr("gamma")
    return elementwise(ctx, lambda x: binop("mul", fconst(gamma, x), select(
        cmp("le", x, fconst(0, x)), binop("sub", binop("mul", fconst(alpha, x), call("exp", x)), fconst(alpha, x)), x)))


@lowering("Celu")
def _celu(ctx):
    alpha = ctx.attr("alpha", 1.0)

    def f(x):
        neg = binop("mul", fconst(alpha, x), binop("sub", call("exp", binop("div", x, fconst(alpha, x))), fconst(1, x)))
        return binop("add", nan_max(fconst(0, x), x), nan_min(fconst(0, x), neg))
    return elementwise(ctx, f)


@lowering("Sigmoid")
def _sigmoid(ctx):
    return elementwise(ctx, lambda x: binop("div", fconst(1, x), binop("add", fconst(1, x), call("exp", unop("neg", x)))))


@lowering("HardSigmoid")
def _hsig(ctx):
    a, b = ctx.attr("alpha", 0.2), ctx.attr("beta", 0.5)
    return elementwise(ctx, lambda x: nan_max(fconst(0, x), nan_min(fconst(1, x), binop("add", binop("mul", fconst(a, x), x), fconst(b, x)))))


@lowering("HardSwish")
def _hswish(ctx):
    def f(x):
        hs = nan_max(fconst(0, x), nan_min(fconst(1, x), binop("add", binop("mul", fconst(1 / 6, x), x), fconst(0.5, x))))
        return binop("mul", x, hs)
    return elementwise(ctx, f)


@lowering("Softplus")
def _softplus(ctx):
    return elementwise(ctx, lambda x: call("log", binop("add", call("exp", x), fconst(1, x))))


@lowering("Softsign")
def _softsign(ctx):
    return elementwise(ctx, lambda x: binop("div", x, binop("add", fconst(1, x), call("fabs", x))))


@lowering("Mish")
def _mish(ctx):
    return elementwise(ctx, lambda x: binop("mul", x, call("tanh", call("log", binop("add", call("exp", x), fconst(1, x))))))


@lowering("Gelu")
def _gelu(ctx):
    approx = ctx.attr("approximate", "none")

    def f(x):
        if approx == "tanh":
            inner = binop("mul", fconst(math.sqrt(2 / math.pi), x),
                          binop("add", x, binop("mul", fconst(0.044715, x), binop("mul", x, binop("mul", x, x)))))
            t = call("tanh", inner)
        else:
            t = call("erf", binop("div", x, fconst(math.sqrt(2), x)))
        return binop("mul", binop("mul", fconst(0.5, x), x), binop("add", fconst(1, x), t))
    return elementwise(ctx, f)


@lowering("ThresholdedRelu")
def _trelu(ctx):
    alpha = ctx.attr("alpha", 1.0)
    return elementwise(ctx, lambda x: select(cmp("gt", x, fconst(alpha, x)), x, fconst(0, x)))


@lowering("Shrink")
def _shrink(ctx):
    bias, lambd = ctx.attr("bias", 0.0), ctx.attr("lambd", 0.5)
    return elementwise(ctx, lambda x: select(cmp("lt", x, fconst(-lambd, x)), binop("add", x, fconst(bias, x)),
                                             select(cmp("gt", x, fconst(lambd, x)), binop("sub", x, fconst(bias, x)), fconst(0, x))))


@lowering("Clip")
def _clip(ctx):
    lo, hi = ctx.attr("min"), ctx.attr("max")
    lo_in, hi_in = ctx.input(1), ctx.input(2)

    def f(x, *bounds):
        bounds = list(bounds)
        y = x
        lo_e = bounds.pop(0) if lo_in is not None else (fconst(lo, x) if lo is not None else None)
        hi_e = bounds.pop(0) if hi_in is not None else (fconst(hi, x) if hi is not None else None)
        # numpy clip with scalar bounds: t = lo if x < lo else x; y = hi if t > hi else t; NaN stays NaN
        if lo_e is not None:
            y = select(cmp("lt", y, lo_e), lo_e, y)
        if hi_e is not None:
            y = select(cmp("gt", y, hi_e), hi_e, y)
        return y
    ins = [ctx.input(0)] + [t for t in (lo_in, hi_in) if t is not None]
    return elementwise(ctx, f, ins)


@lowering("Identity", "Dropout")
def _identity(ctx):
    x = ctx.input(0)
    outs = [TensorFn(x.shape, x.dtype, x.fn, "elementwise", (0,))]
    if len(ctx.node.outputs) > 1:  # Dropout's mask, inference mode: all kept
        outs.append(TensorFn(x.shape, BOOL, lambda idx: const(True, BOOL), "elementwise"))
    return outs


# --- data movement ----------------------------------------------------------------------------------

def flat_index(idx: Index, shape: Sequence[int]) -> E:
    out = const(0, I64)
    stride = 1
    for i, d in zip(reversed(idx), reversed(shape)):
        out = out + i * stride
        stride *= d
    return out


def unflat_index(flat: E, shape: Sequence[int]) -> Index:
    out = []
    for d in reversed(shape):
        out.append(flat % d)
        flat = flat // d
    return list(reversed(out))


@lowering("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape(ctx):
    x = ctx.input(0)
    shape = ctx.out_shape()
    return [TensorFn(shape, x.dtype, lambda idx: x(unflat_index(flat_index(idx, shape), x.shape)), "alias")]


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
    return [TensorFn(ctx.out_shape(), x.dtype, _bcast(x, ctx.out_shape()), "injective")]


@lowering("Tile")
def _tile(ctx):
    x = ctx.input(0)
    return [TensorFn(ctx.out_shape(), x.dtype, lambda idx: x([i % d for i, d in zip(idx, x.shape)]), "injective")]


@lowering("Concat")
def _concat(ctx):
    ins = [t for t in ctx.inputs if t is not None]
    shape = ctx.out_shape()
    axis = ctx.attr("axis") % len(shape)

    def f(idx):
        out = None
        start = sum(t.shape[axis] for t in ins)
        for t in reversed(ins):  # the last input is the default; earlier ones win below their end
            start -= t.shape[axis]
            sub = list(idx)
            sub[axis] = idx[axis] - start
            val = t(sub)
            out = val if out is None else select(cmp("lt", idx[axis], const(start + t.shape[axis], I64)), val, out)
        return out
    return [TensorFn(shape, ins[0].dtype, f, "injective")]


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
    starts, ends = ctx.attr("starts"), ctx.attr("ends")
    if starts is None or ends is None:
        ctx.unsupported("non-constant starts/ends")
    rank = len(x.shape)
    axes = ctx.attr("axes") or list(range(len(starts)))
    steps = ctx.attr("steps") or [1] * len(starts)
    first, step = [0] * rank, [1] * rank
    for s, a, st in zip(starts, axes, steps):
        a %= rank
        d = x.shape[a]
        if st > 0:
            s = min(max(s + d if s < 0 else s, 0), d)
        else:
            s = min(max(s + d if s < 0 else s, -1), d - 1)
        first[a], step[a] = s, st
    return [TensorFn(ctx.out_shape(), x.dtype, lambda idx: x([i * st + f0 for i, st, f0 in zip(idx, step, first)]), "injective")]


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

    def f(idx):
        src = [i - b for i, b in zip(idx, begin)]
        if mode == "constant":
            return x.at_or(src, all_of([in_range(s, 0, d) for s, d in zip(src, x.shape)]), value)
        if mode == "edge":
            return x([clamp(s, d) for s, d in zip(src, x.shape)])
        if mode == "reflect":
            return x([reflect(s, d) for s, d in zip(src, x.shape)])
        ctx.unsupported(f"mode {mode}")
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


def clamp(i: E, d: int) -> E:
    return E("clamp", (i,), I64, (0, d - 1))


def reflect(i: E, d: int) -> E:
    return E("reflect", (i,), I64, d)


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
    else:
        def f(idx):
            nn, cc, hh, ww = idx
            blk = cc // c
            return x([nn, cc % c, hh * b + blk // b, ww * b + blk % b])
    return [TensorFn(ctx.out_shape(), x.dtype, f, "injective")]


@lowering("Shape", "Size", "ConstantOfShape", "Range")
def _folded_only(ctx):
    ctx.unsupported("shape computations must fold to constants before compilation (static shapes)")


# --- convolution, matrix products -------------------------------------------------------------------

def _window_params(ctx, spatial: int, kernel: Sequence[int], in_sizes: Sequence[int], out_sizes: Sequence[int]):
    strides = ctx.attr("strides") or [1] * spatial
    dil = ctx.attr("dilations") or [1] * spatial
    pads = ctx.attr("pads")
    auto = ctx.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begin = []
        for k in range(spatial):
            total = max((out_sizes[k] - 1) * strides[k] + (kernel[k] - 1) * dil[k] + 1 - in_sizes[k], 0)
            begin.append(total // 2 if auto == "SAME_UPPER" else total - total // 2)
    elif pads:
        begin = list(pads[:spatial])
    else:
        begin = [0] * spatial
    return strides, dil, begin


@lowering("Conv")
def _conv(ctx):
    x, w, b = ctx.input(0), ctx.input(1), ctx.input(2)
    out = ctx.out_shape()
    spatial = len(x.shape) - 2
    group = ctx.attr("group", 1)
    cin_g = w.shape[1]
    m_g = w.shape[0] // group
    kern = w.shape[2:]
    strides, dil, begin = _window_params(ctx, spatial, kern, x.shape[2:], out[2:])

    def f(idx):
        n, m, o = idx[0], idx[1], idx[2:]
        g_off = (m // m_g) * cin_g if group > 1 else const(0, I64)

        def body(c, *ks):
            pos = [oi * s - p + ki * d for oi, s, p, ki, d in zip(o, strides, begin, ks, dil)]
            # only dims whose windows can leave the input need a bounds test
            cond = all_of([in_range(pp, 0, size) for pp, size, p, oo, s, kk, d in
                           zip(pos, x.shape[2:], begin, out[2:], strides, kern, dil)
                           if p > 0 or (oo - 1) * s - p + (kk - 1) * d >= size])
            return binop("mul", x.at_or([n, g_off + c] + pos, cond, 0.0), w([m, c] + list(ks)))
        acc = reduce("sum", [cin_g] + list(kern), body)
        return binop("add", acc, b([m])) if b is not None else acc
    return [TensorFn(out, ctx.out_dtype(), f, "complex")]


@lowering("ConvTranspose")
def _conv_transpose(ctx):
    x, w, b = ctx.input(0), ctx.input(1), ctx.input(2)
    out = ctx.out_shape()
    spatial = len(x.shape) - 2
    group = ctx.attr("group", 1)
    cin = x.shape[1]
    cin_g = cin // group
    m_g = w.shape[1]
    kern = w.shape[2:]
    strides = ctx.attr("strides") or [1] * spatial
    dil = ctx.attr("dilations") or [1] * spatial
    pads = ctx.attr("pads")
    if ctx.attr("auto_pad", "NOTSET") != "NOTSET" or ctx.attr("output_shape") is not None:
        if pads is None:
            total = [max((x.shape[2 + k] - 1) * strides[k] + ((kern[k] - 1) * dil[k] + 1) - out[2 + k], 0) for k in range(spatial)]
            auto = ctx.attr("auto_pad", "NOTSET")
            pads = [t // 2 if auto != "SAME_LOWER" else t - t // 2 for t in total]
    begin = list(pads[:spatial]) if pads else [0] * spatial

    def f(idx):
        n, m, o = idx[0], idx[1], idx[2:]
        grp = m // m_g if group > 1 else const(0, I64)
        mm = m % m_g if group > 1 else m

        def body(c, *ks):
            # out[o] gets x[i] * w[k] where o = i*s - p + k*d, i.e. i = (o + p - k*d) / s when divisible
            num = [oi + p - ki * d for oi, p, ki, d in zip(o, begin, ks, dil)]
            pos = [nn // s for nn, s in zip(num, strides)]
            conds = [in_range(pp, 0, size) for pp, size in zip(pos, x.shape[2:])]
            conds += [cmp("ge", nn, const(0, I64)) for nn in num]
            conds += [cmp("eq", nn % s, const(0, I64)) for nn, s in zip(num, strides) if s > 1]
            xv = x.at_or([n, grp * cin_g + c if group > 1 else c] + pos, all_of(conds), 0.0)
            return binop("mul", xv, w([grp * cin_g + c if group > 1 else c, mm] + list(ks)))
        acc = reduce("sum", [cin_g] + list(kern), body)
        return binop("add", acc, b([m])) if b is not None else acc
    return [TensorFn(out, ctx.out_dtype(), f, "complex")]


@lowering("MatMul")
def _matmul(ctx):
    a, b = ctx.input(0), ctx.input(1)
    out = ctx.out_shape()
    a_shape, b_shape = list(a.shape), list(b.shape)
    K = a_shape[-1]

    def f(idx):
        if len(a_shape) == 1:
            ai = lambda k: [k]
        else:
            batch = broadcast_index(idx[:-2] if len(b_shape) > 1 else idx[:-1], a_shape[:-2], out[:len(out) - (2 if len(b_shape) > 1 else 1)])
            row = idx[-2] if len(b_shape) > 1 else idx[-1]
            ai = lambda k: batch + [row, k]
        if len(b_shape) == 1:
            bi = lambda k: [k]
        else:
            col = idx[-1]
            bbatch = broadcast_index(idx[:-2] if len(a_shape) > 1 else idx[:-1], b_shape[:-2],
                                     out[:len(out) - (2 if len(a_shape) > 1 else 1)])
            bi = lambda k: bbatch + [k, col]
        return reduce("sum", [K], lambda k: binop("mul", a(ai(k)), b(bi(k))))
    return [TensorFn(out, ctx.out_dtype(), f, "complex")]


@lowering("Gemm")
def _gemm(ctx):
    a, b, c = ctx.input(0), ctx.input(1), ctx.input(2)
    ta, tb = ctx.attr("transA", 0), ctx.attr("transB", 0)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    out = ctx.out_shape()
    K = a.shape[0] if ta else a.shape[1]
    cf = _bcast(c, out) if c is not None else None

    def f(idx):
        i, j = idx
        acc = reduce("sum", [K], lambda k: binop("mul", a([k, i] if ta else [i, k]), b([j, k] if tb else [k, j])))
        if alpha != 1.0:
            acc = binop("mul", acc, fconst(alpha, acc))
        if cf is not None and beta != 0.0:
            cv = cf(idx)
            acc = binop("add", acc, cv if beta == 1.0 else binop("mul", cv, fconst(beta, cv)))
        return acc
    return [TensorFn(out, ctx.out_dtype(), f, "complex")]


# --- pooling ----------------------------------------------------------------------------------------

@lowering("MaxPool", "AveragePool", "LpPool")
def _pool(ctx):
    x = ctx.input(0)
    out = ctx.out_shape()
    spatial = len(x.shape) - 2
    kern = ctx.attr("kernel_shape")
    strides, dil, begin = _window_params(ctx, spatial, kern, x.shape[2:], out[2:])
    op = ctx.node.op
    count_pad = ctx.attr("count_include_pad", 0)
    p = ctx.attr("p", 2)

    def f(idx):
        n, c, o = idx[0], idx[1], idx[2:]
        pos_of = lambda ks: [oi * s - pb + ki * d for oi, s, pb, ki, d in zip(o, strides, begin, ks, dil)]
        if op == "MaxPool":
            def body(*ks):
                pos = pos_of(ks)
                cond = all_of([in_range(pp, 0, size) for pp, size in zip(pos, x.shape[2:])])
                return x.at_or([n, c] + pos, cond, -math.inf if x.dtype.is_float else np.iinfo(x.dtype.numpy).min)
            return reduce("max", kern, body)
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
        ctx.unsupported("MaxPool Indices output")
    return outs


def _end_pads(ctx, spatial):
    pads = ctx.attr("pads")
    return list(pads[spatial:]) if pads else [0] * spatial


@lowering("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def _global_pool(ctx):
    x = ctx.input(0)
    sp = list(x.shape[2:])
    n_el = int(np.prod(sp))
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
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "complex")]


# --- reductions, normalisation, softmax ----------------------------------------------------------------

def _reduce_axes(ctx, rank):
    axes = ctx.attr("axes")
    if axes is None and ctx.input(1) is not None:
        ctx.unsupported("non-constant axes")
    if not axes:
        return [] if ctx.attr("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a % rank for a in axes)


_REDUCE = {"ReduceSum": "sum", "ReduceMean": "sum", "ReduceMax": "max", "ReduceMin": "min", "ReduceProd": "prod",
           "ReduceL1": "sum", "ReduceL2": "sum", "ReduceSumSquare": "sum", "ReduceLogSum": "sum", "ReduceLogSumExp": "sum"}


@lowering(*_REDUCE)
def _reduce(ctx):
    x = ctx.input(0)
    rank = len(x.shape)
    axes = _reduce_axes(ctx, rank)
    keep = ctx.attr("keepdims", 1)
    op = ctx.node.op
    ext = [x.shape[a] for a in axes]
    count = int(np.prod(ext)) if ext else 1

    def f(idx):
        if not axes:
            return x(idx)

        def src(*ks):
            full, it, kk = [], iter(idx), iter(ks)
            for d in range(rank):
                if d in axes:
                    full.append(next(kk))
                    if keep:
                        next(it)
                else:
                    full.append(next(it))
            v = x(full)
            if op == "ReduceL1":
                return call("fabs", v) if v.dtype.is_float else select(cmp("lt", v, const(0, v.dtype)), unop("neg", v), v)
            if op in ("ReduceL2", "ReduceSumSquare"):
                return binop("mul", v, v)
            if op == "ReduceLogSumExp":
                return call("exp", v)
            return v
        r = reduce(_REDUCE[op], ext, src)
        if op == "ReduceMean":
            return binop("div", r, fconst(count, r))
        if op == "ReduceL2":
            return call("sqrt", r)
        if op in ("ReduceLogSum", "ReduceLogSumExp"):
            return call("log", r)
        return r
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "complex")]


@lowering("ArgMax", "ArgMin")
def _argmax(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis", 0) % len(x.shape)
    keep = ctx.attr("keepdims", 1)
    last = ctx.attr("select_last_index", 0)
    n = x.shape[axis]
    better = "gt" if ctx.node.op == "ArgMax" else "lt"

    def f(idx):
        base = list(idx) if keep else idx[:axis] + [const(0, I64)] + idx[axis:]
        # a sequential scan: (best value, best index) pairs folded left
        return E("argscan", (), I64, (x, base, axis, n, better, bool(last)))
    return [TensorFn(ctx.out_shape(), I64, f, "complex")]


def _row_temp(ctx, x: TensorFn, axis: int, kind: str, body=None, name="row"):
    """A materialised reduction of ``x`` over ``axis`` with keepdims (shape[axis] = 1)."""
    shape = list(x.shape)
    n = shape[axis]
    shape[axis] = 1

    def f(idx):
        def src(k):
            full = list(idx)
            full[axis] = k
            return body(full) if body else x(full)
        return reduce(kind, [n], src)
    return ctx.temp(shape, x.dtype, f, name)


@lowering("Softmax", "LogSoftmax")
def _softmax(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis", -1) % len(x.shape)
    m = _row_temp(ctx, x, axis, "max", name="max")

    def at_row(t, idx):
        full = list(idx)
        full[axis] = const(0, I64)
        return t(full)
    s = _row_temp(ctx, x, axis, "sum", body=lambda full: call("exp", binop("sub", x(full), at_row(m, full))), name="sum")
    if ctx.node.op == "Softmax":
        f = lambda idx: binop("div", call("exp", binop("sub", x(idx), at_row(m, idx))), at_row(s, idx))
    else:
        f = lambda idx: binop("sub", binop("sub", x(idx), at_row(m, idx)), call("log", at_row(s, idx)))
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "elementwise", (0,))]


@lowering("BatchNormalization")
def _batchnorm(ctx):
    if ctx.attr("training_mode", 0):
        ctx.unsupported("training mode")
    x, sc, bi, mean, var = ctx.inputs[:5]
    eps = ctx.attr("epsilon", 1e-5)
    out = ctx.out_shape()

    def f(idx):
        c = [idx[1]]
        xv = x(idx)
        inv = call("sqrt", binop("add", var(c), fconst(eps, xv)))
        return binop("add", binop("mul", binop("div", binop("sub", xv, mean(c)), inv), sc(c)), bi(c))
    return [TensorFn(out, ctx.out_dtype(), f, "elementwise", (0,))]


@lowering("InstanceNormalization")
def _instancenorm(ctx):
    x, sc, bi = ctx.inputs[:3]
    eps = ctx.attr("epsilon", 1e-5)
    shape = list(x.shape)
    sp = shape[2:]
    cnt = int(np.prod(sp))
    stat_shape = shape[:2] + [1] * len(sp)
    zeros = [const(0, I64)] * len(sp)
    mean = ctx.temp(stat_shape, x.dtype, lambda idx: binop("div", reduce("sum", sp, lambda *ks: x(idx[:2] + list(ks))), const(cnt, x.dtype)), "mean")
    var = ctx.temp(stat_shape, x.dtype, lambda idx: binop("div", reduce("sum", sp, lambda *ks: _sq(binop(
        "sub", x(idx[:2] + list(ks)), mean(idx[:2] + zeros)))), const(cnt, x.dtype)), "var")

    def f(idx):
        st = idx[:2] + zeros
        xv = x(idx)
        return binop("add", binop("div", binop("mul", binop("sub", xv, mean(st)), sc([idx[1]])),
                                  call("sqrt", binop("add", var(st), fconst(eps, xv)))), bi([idx[1]]))
    return [TensorFn(tuple(shape), ctx.out_dtype(), f, "elementwise", (0,))]


def _sq(v):
    return binop("mul", v, v)


@lowering("LayerNormalization")
def _layernorm(ctx):
    x, sc, bi = ctx.input(0), ctx.input(1), ctx.input(2)
    if len(ctx.node.outputs) > 1:
        ctx.unsupported("Mean/InvStdDev outputs")
    axis = ctx.attr("axis", -1) % len(x.shape)
    eps = ctx.attr("epsilon", 1e-5)
    shape = list(x.shape)
    norm = shape[axis:]
    cnt = int(np.prod(norm))
    stat_shape = shape[:axis] + [1] * len(norm)
    zeros = [const(0, I64)] * len(norm)
    mean = ctx.temp(stat_shape, x.dtype, lambda idx: binop("div", reduce("sum", norm, lambda *ks: x(idx[:axis] + list(ks))), const(cnt, x.dtype)), "mean")
    var = ctx.temp(stat_shape, x.dtype, lambda idx: binop("div", reduce("sum", norm, lambda *ks: _sq(binop(
        "sub", x(idx[:axis] + list(ks)), mean(idx[:axis] + zeros)))), const(cnt, x.dtype)), "var")
    scf, bif = _bcast(sc, shape), (_bcast(bi, shape) if bi is not None else None)

    def f(idx):
        st = idx[:axis] + zeros
        xv = x(idx)
        y = binop("mul", binop("div", binop("sub", xv, mean(st)), call("sqrt", binop("add", var(st), fconst(eps, xv)))), scf(idx))
        return binop("add", y, bif(idx)) if bif else y
    return [TensorFn(tuple(shape), ctx.out_dtype(), f, "elementwise", (0,))]


@lowering("LRN")
def _lrn(ctx):
    x = ctx.input(0)
    size = ctx.attr("size")
    alpha, beta, bias = ctx.attr("alpha", 1e-4), ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    C = x.shape[1]
    lo = (size - 1) // 2

    def f(idx):
        n, c, rest = idx[0], idx[1], idx[2:]

        def body(k):
            cc = c - lo + k
            return _sq(x.at_or([n, cc] + rest, in_range(cc, 0, C), 0.0))
        s = reduce("sum", [size], body)
        xv = x(idx)
        den = call("pow", binop("add", fconst(bias, xv), binop("mul", fconst(alpha / size, xv), s)), fconst(beta, xv))
        return binop("div", xv, den)
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "complex")]
