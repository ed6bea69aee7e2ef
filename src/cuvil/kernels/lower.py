"""Op lowerings: each op's outputs as tensor expressions of its inputs (a table keyed by op name).

A lowering receives a :class:`LowerCtx` whose ``inputs`` are :class:`TensorFn` (shape, dtype and a
function from output indices to an expression) and returns one TensorFn per output. Lowerings never
allocate: an op that needs an intermediate (Softmax's row max) asks ``ctx.temp`` for a materialised one.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np

from ..errors import UnsupportedOpError
from ..ir.dim import SymExpr, dmax, dmin, evaluate, free_symbols, is_static, product
from ..ir.dtype import DType
from ..ir.graph import Node
from .contraction import (MR, Contraction, DepthwiseWindow, MatContraction, PadWindow, WinogradInput, WinogradOutput, channel_lanes, choose_tile,
                   pack_columns, pack_weights, winograd_interleaved)
from .texpr import (BOOL, I64, Buf, E, all_of, binop, call, cast, cmp, const, dim_index, identity_value, in_range, load,
                    logic, nodes, reduce, select, unop, var)

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
    contraction: bool = False   # holds a micro-kernel node (contract/window: at most one per stage)

    def __call__(self, idx: Index) -> E:
        return self.fn(list(idx))

    def at_or(self, idx: Index, cond: E, default) -> E:
        """``self[idx]`` where ``cond`` holds, else ``default``; indices are clamped so the read itself is
        always in bounds (padding reads no memory outside the tensor)."""
        if cond.op == "const" and cond.attr is True:
            return self(idx)
        return select(cond, self([clamp(i, d) for i, d in zip(idx, self.shape)]), const(default, self.dtype))


class LowerCtx:
    def __init__(self, node: Node, inputs: List[Optional[TensorFn]], temp: Callable,
                 weight: Optional[Callable] = None, gemm_cols: int = 0, gemm_tiles: tuple = (),
                 unpadded_contractions: bool = False, matmul_panels: bool = True, half_contractions: bool = False,
                 row_kernels: bool = False):
        self.node, self.inputs, self._temp, self._weight = node, inputs, temp, weight
        # (x86) short reductions (4+ terms) take the GEMM micro-kernels, 2-D average pools the row kernels
        self.row_kernels = row_kernels and gemm_cols > 0
        # a padded convolution's contraction reads the unpadded input (Contraction.pads; the GPU's kernels
        # test bounds) instead of a stored padded copy (x86 micro-kernels pack panels without tests)
        self.unpadded_contractions = unpadded_contractions
        self.half_contractions = half_contractions     # float16 convolutions as contractions too (GPU)
        self.matmul_panels = matmul_panels and gemm_cols > 0   # MatMuls as column-panel contractions (x86)
        # > 0: lower convolutions to packed contractions (and constant-weight MatMuls to column panels this
        # many wide); a convolution's register tile (rows, cols[, lanes]) is chosen among gemm_tiles
        self.gemm_cols = gemm_cols
        self.gemm_tiles = tuple(gemm_tiles) or ((MR, gemm_cols),)

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

    def weight(self, array: np.ndarray, name: str) -> Optional[Buf]:
        """A compile-time constant (e.g. weights repacked for a kernel) stored with the weights; None when the
        scheduler does not offer constants."""
        if self._weight is None:
            return None
        return self._weight(np.ascontiguousarray(array), f"{self.node.name}_{name}")

    def const_input(self, i: int) -> Optional[np.ndarray]:
        v = self.node.inputs[i] if i < len(self.node.inputs) else None
        return np.asarray(v.const) if v is not None and v.is_const else None

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

    def f(a, b):
        if fmod or not a.dtype.is_float:
            return E("fmod" if fmod else "pymod", (a, b), a.dtype)
        # fmod=0 on floats: numpy's mod (the sign of the divisor), as the reference computes it
        r = E("fmod", (a, b), a.dtype)
        z = fconst(0, r)
        b_neg = cmp("lt", b, z)
        fix = logic("and", cmp("ne", r, z), logic("xor", cmp("lt", r, z), b_neg))
        signed_zero = select(b_neg, fconst(-0.0, r), z)
        return select(fix, binop("add", r, b), select(cmp("eq", r, z), signed_zero, r))
    return elementwise(ctx, f)


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
    if ctx.node.op == "Dropout":
        ins = ctx.node.inputs
        train = ins[2] if len(ins) > 2 else None
        ratio = ins[1] if len(ins) > 1 else None
        if train is not None and (not train.is_const or bool(np.asarray(train.const).reshape(-1)[0])):
            if ratio is None or not ratio.is_const or float(np.asarray(ratio.const).reshape(-1)[0]) != 0.0:
                ctx.unsupported("training mode (random dropout) is not supported")
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
    """Row-major indices of ``flat`` (0 <= flat < prod(shape): the outermost index needs no modulo)."""
    if not shape:
        return []
    out = []
    for d in reversed(shape[1:]):
        out.append(flat % d)
        flat = flat // d
    out.append(flat)
    return list(reversed(out))


def _smaller(a, b) -> bool:
    """Which run of a reshape to extend: compares sizes, symbolic ones at a sample point. A wrong guess only
    costs index arithmetic (runs are accepted only when their sizes are equal as polynomials; otherwise the
    whole index is flattened and unflattened)."""
    if isinstance(a, SymExpr) or isinstance(b, SymExpr):
        sample = {name: 7 for name in free_symbols(a) | free_symbols(b)}
        return evaluate(a, sample) < evaluate(b, sample)
    return a < b


def reshape_index(idx: Index, out_shape: Sequence[int], in_shape: Sequence[int]) -> Index:
    """Input indices of a reshape's output element. Dims are split into runs of equal products (e.g.
    [N, C, H*W] <- [N, C, H, W]: N and C map through unchanged), and only within a run is the index
    flattened and unflattened, so index arithmetic stays cheap and contiguous dims stay unit-stride."""
    if 0 in out_shape or 0 in in_shape:
        return unflat_index(flat_index(idx, out_shape), in_shape)
    res: Index = []
    i = j = 0
    no, ni = len(out_shape), len(in_shape)
    while i < no or j < ni:
        i0, j0, po, pi = i, j, 1, 1
        if i < no:
            po, i = out_shape[i], i + 1
        if j < ni:
            pi, j = in_shape[j], j + 1
        while po != pi:
            if _smaller(po, pi) and i < no:
                po, i = po * out_shape[i], i + 1
            elif j < ni:
                pi, j = pi * in_shape[j], j + 1
            else:  # inconsistent sizes cannot come from shape inference; stay correct regardless
                return unflat_index(flat_index(idx, out_shape), in_shape)
        flat = idx[i0] if i - i0 == 1 else flat_index(idx[i0:i], out_shape[i0:i])
        res.extend([flat] if j - j0 == 1 else unflat_index(flat, in_shape[j0:j]))
    return res


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
        # d may be symbolic: the start clamped into it is then a dim expression (dmax / dmin)
        if st > 0:
            s = dmin(dmax(s + d if s < 0 else s, 0), d)
        else:
            s = dmin(dmax(s + d if s < 0 else s, -1), d - 1)
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
    return [TensorFn(ctx.out_shape(), dt, lambda idx: binop("add", _scalar_of(start), binop(
        "mul", cast(idx[0], dt), _scalar_of(delta))), "injective")]


# --- convolution, matrix products -------------------------------------------------------------------

def _window_params(ctx, spatial: int, kernel: Sequence[int], in_sizes: Sequence[int], out_sizes: Sequence[int]):
    strides = ctx.attr("strides") or [1] * spatial
    dil = ctx.attr("dilations") or [1] * spatial
    pads = ctx.attr("pads")
    auto = ctx.attr("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        begin = []
        for k in range(spatial):
            total = dmax((out_sizes[k] - 1) * strides[k] + (kernel[k] - 1) * dil[k] + 1 - in_sizes[k], 0)
            begin.append(total // 2 if auto == "SAME_UPPER" else total - total // 2)
    elif pads:
        begin = list(pads[:spatial])
    else:
        begin = [0] * spatial
    return strides, dil, begin


def _may_exceed(a, b) -> bool:
    """a > b for some value of the symbols (symbolic sizes whose difference is not a constant: assumed)."""
    d = a - b
    return d > 0 if isinstance(d, int) else True


def padded_window_input(ctx, x: TensorFn, out_sp, kern, strides, dil, begin, fill):
    """For a sliding window that reads outside ``x`` (padding, or a ceil-mode window past the end): a
    materialised copy bordered with ``fill`` and zero begin pads, so the window's loops read memory with no
    bounds tests. Otherwise ``x`` and ``begin`` unchanged."""
    spatial = len(kern)
    need = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(out_sp, strides, kern, dil)]
    if not (any(b0 != 0 for b0 in begin) or any(_may_exceed(n, size) for n, size in zip(need, x.shape[2:]))):
        return x, list(begin)
    padded = list(x.shape[:2]) + [dmax(size + b0, n) for size, b0, n in zip(x.shape[2:], begin, need)]

    def pad_fn(idx):
        src = [i - b0 for i, b0 in zip(idx[2:], begin)]
        safe = x.at_or(idx[:2] + src, all_of([in_range(p, 0, size) for p, size in zip(src, x.shape[2:])]), fill)
        if not ctx.gemm_cols or not all(isinstance(d, int) for d in list(x.shape[2:]) + list(begin)):
            return safe
        spec = PadWindow(tuple(begin), tuple(x.shape[2:]), fill, lambda: x(idx[:2] + src))
        return E("padwin", [safe], x.dtype, spec)
    return ctx.temp(padded, x.dtype, pad_fn, "pad"), [0] * spatial


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
    gemm = _conv_as_gemm(ctx, x, b, out, group, cin_g, m_g, kern, strides, dil, begin)
    if gemm is not None:
        return [gemm]

    # depthwise 2-D with row-vectorisable strides: a window node the x86 backend computes by rows, reading
    # the unpadded input (its loads are masked to the input: no padded copy is stored)
    depthwise = (ctx.gemm_cols and spatial == 2 and cin_g == 1 and m_g == 1 and w.buf is not None
                 and x.dtype == DType.FLOAT and ctx.out_dtype() == DType.FLOAT and strides[1] in (1, 2)
                 and all(isinstance(d, int) for d in x.shape[2:]))
    if depthwise:
        if x.buf is None:
            x = ctx.temp(x.shape, x.dtype, x.fn, "in")
    else:
        x, begin = padded_window_input(ctx, x, out[2:], kern, strides, dil, begin, 0.0)
    window = DepthwiseWindow(w.buf, x.buf, tuple(kern), tuple(strides), tuple(dil), tuple(out[2:]),
                             pads=(begin[0], begin[1])) if depthwise else None
    bounded = depthwise and (any(begin) or any(_may_exceed((o - 1) * s + (k - 1) * d + 1, size) for o, s, k, d, size
                                                in zip(out[2:], strides, kern, dil, x.shape[2:])))

    def f(idx):
        n, m, o = idx[0], idx[1], idx[2:]
        g_off = (m // m_g) * cin_g if group > 1 else const(0, I64)

        def body(c, *ks):
            pos = [oi * s - p + ki * d for oi, s, p, ki, d in zip(o, strides, begin, ks, dil)]
            if bounded:
                inside = all_of([in_range(q, 0, size) for q, size in zip(pos, x.shape[2:])])
                return binop("mul", x.at_or([n, g_off + c] + pos, inside, 0.0), w([m, c] + list(ks)))
            return binop("mul", x([n, g_off + c] + pos), w([m, c] + list(ks)))
        acc = reduce("sum", [cin_g] + list(kern), body)
        if window is not None:
            acc = E("window", [n, m] + list(o) + [acc], DType.FLOAT, window)
        return binop("add", acc, b([m])) if b is not None else acc
    return [TensorFn(out, ctx.out_dtype(), f, "complex", contraction=window is not None)]


def _conv_as_gemm(ctx, x, b, out, group, cin_g, m_g, kern, strides, dil, begin, wv=None,
                  interleaved: bool = False) -> Optional[TensorFn]:
    """The convolution as a packed contraction (see :mod:`cuvil.kernels.contraction`), when the target asks for
    them (``ctx.gemm_cols``), it is float32 (or, with the GPU's ``half_contractions``, float16) with
    constant weights and has enough output channels per group to fill a micro-kernel's rows. The input is
    stored, zero-padded when the convolution pads so the x86 kernels pack panels without bounds tests; with
    ``unpadded_contractions`` it stays unpadded and the contraction records the pads (its expression tests
    the bounds, as the GPU kernels do). ``interleaved``: channel c of group g is x's channel c*group + g
    (see :attr:`Contraction.interleaved`)."""
    wv = ctx.const_input(1) if wv is None else wv
    K = cin_g * int(np.prod(kern))
    dts = (DType.FLOAT, DType.FLOAT16) if ctx.half_contractions else (DType.FLOAT,)
    # x86 takes reductions from 4 terms: ShuffleNet's first grouped 1x1 convolution (6 input channels per
    # group) ran 0.130 ms as a loop nest and is one of the micro-kernel's cheaper steps (2.25 -> 2.14 ms in all)
    min_k = 4 if ctx.row_kernels else 8
    if (not ctx.gemm_cols or wv is None or ctx.out_dtype() not in dts or x.dtype != ctx.out_dtype() or m_g < 4
            or K < min_k or ctx._weight is None):
        return None
    half = x.dtype == DType.FLOAT16
    out_sp = tuple(out[2:])
    pads = ()
    if ctx.unpadded_contractions and all(isinstance(d, int) for d in list(x.shape[2:]) + list(begin)):
        need = [(o - 1) * s + (k - 1) * d + 1 for o, s, k, d in zip(out_sp, strides, kern, dil)]
        if any(begin) or any(n_ - b0 > size for n_, b0, size in zip(need, begin, x.shape[2:])):
            pads = tuple(int(b0) for b0 in begin)
    if not pads:
        x, _ = padded_window_input(ctx, x, out_sp, kern, strides, dil, begin, 0.0)
    if x.buf is None:
        x = ctx.temp(x.shape, x.dtype, x.fn, "in")
    tile = choose_tile(m_g, product(out_sp), ctx.gemm_tiles, K)
    mr, cols = tile[:2]
    wdt = np.float16 if half else np.float32
    a_buf = ctx.weight(pack_weights(wv.astype(wdt), group, mr, wdt), "packed")
    spec = Contraction(a_buf, x.buf, x.shape[0], group, m_g, cin_g, tuple(kern), tuple(strides), tuple(dil),
                       out_sp, cols, mr, pads, channel_lanes(tile), interleaved)
    kshape = [cin_g] + list(kern)

    def f(idx):
        n, m, o = idx[0], idx[1], idx[2:]
        g = m // m_g if group > 1 else const(0, I64)
        ml = m % m_g if group > 1 else m

        def body(k):
            c, *ks = unflat_index(k, kshape)
            ch = c * group + g if interleaved else g * cin_g + c
            if pads:
                pos = [oi * s - p + ki * d for oi, s, p, ki, d in zip(o, strides, pads, ks, dil)]
                inside = all_of([in_range(q, 0, size) for q, size in zip(pos, x.shape[2:])])
                return binop("mul", load(a_buf, [g, ml // mr, k, ml % mr]), x.at_or([n, ch] + pos, inside, 0.0))
            pos = [oi * s + ki * d for oi, s, ki, d in zip(o, strides, ks, dil)]
            return binop("mul", load(a_buf, [g, ml // mr, k, ml % mr]), x([n, ch] + pos))
        acc = E("contract", [n, m] + list(o) + [reduce("sum", [K], body)], x.dtype, spec)
        return binop("add", acc, b([m])) if b is not None else acc
    return TensorFn(out, ctx.out_dtype(), f, "complex", contraction=True)


@lowering("WinogradConv")
def _winograd_conv(ctx):
    """Three stages (:mod:`cuvil.ir.ops.winograd`): the input transform V (``wino_in``), one grouped 1x1
    contraction per tile element (the packed GEMM micro-kernels, ``U`` packed like any weight), and the
    output transform (``wino_out``) with the bias, where the stage's epilogue (activation, residual) fuses.
    The output transform also carries the direct convolution (from x, and W recovered from U's panels),
    which the x86 kernel computes instead for any tile whose Winograd values are not finite."""
    from ..ir.ops.winograd import matrices_f64, tiles_of
    x, b = ctx.input(0), ctx.input(2)
    uv = ctx.const_input(1)
    m = int(ctx.attr("tile", 4))
    a = m + 2
    pads = list(ctx.attr("pads") or [0, 0, 0, 0])
    out = ctx.out_shape()
    n_, c_ = x.shape[:2]
    oh, ow = out[2:]
    k_ = out[1]
    if uv is None or not ctx.gemm_cols or ctx._weight is None or not all(isinstance(d, int) for d in (oh, ow, c_)):
        ctx.unsupported("WinogradConv needs a constant kernel, static spatial dims and the x86 target")
    th_, tw_ = tiles_of(oh, m), tiles_of(ow, m)
    t_ = th_ * tw_
    if x.buf is None:   # the transform reads the stored, unpadded input (its loads are masked to it)
        x = ctx.temp(x.shape, x.dtype, x.fn, "in")
    bt, g, at = matrices_f64(m)
    bt_buf = ctx.weight(bt.astype(np.float32), "bt")
    at_buf = ctx.weight(at.astype(np.float32), "at")
    # G's pseudo-inverse (G has full column rank, so W = G+ U G+^T): the direct convolution that the output
    # transform computes instead for a tile whose Winograd values overflowed (inputs near 1e37 overflow Bt d B
    # where the direct sum stays finite) reads W from U's packed panels this way, so no copy of W is stored
    # (a float32 copy made ResNet-50-size libraries up to 56% larger: 512x512 7x7 layer 17.0 -> 26.4 MB).
    gi_buf = ctx.weight(np.linalg.pinv(g).astype(np.float32), "ginv")
    inter = winograd_interleaved(c_, t_, m)
    ispec = WinogradInput(x.buf, m, c_, (th_, tw_), (int(pads[0]), int(pads[1])), inter)
    xh, xw = x.shape[2:]

    def xp(idx):
        n, c, h, w = idx
        h, w = h - pads[0], w - pads[1]
        return x.at_or([n, c, h, w], all_of([in_range(h, 0, xh), in_range(w, 0, xw)]), 0.0)

    def v_fn(idx):
        n, ce, t = idx
        c, e = (ce // (a * a), ce % (a * a)) if inter else (ce % c_, ce // c_)
        i, j = e // a, e % a
        h0, w0 = (t // tw_) * m, (t % tw_) * m

        def body(p, q):
            coef = binop("mul", load(bt_buf, [i, p]), load(bt_buf, [j, q]))
            return binop("mul", coef, xp([n, c, h0 + p, w0 + q]))
        return E("wino_in", [n, ce, t, reduce("sum", [a, a], body)], DType.FLOAT, ispec)
    v = ctx.temp((n_, a * a * c_, t_), DType.FLOAT, v_fn, "wino_v")
    gemm = _conv_as_gemm(ctx, v, None, (n_, a * a * k_, t_), a * a, c_, k_, (1,), (1,), (1,), [0],
                         wv=uv.reshape(a * a * k_, c_, 1), interleaved=inter)
    if gemm is None:
        ctx.unsupported(f"WinogradConv with {c_} input and {k_} output channels has no GEMM micro-kernel")
    packed = next(e.attr for e in nodes(gemm([var("n"), var("ek"), var("t")]))
                  if e.op == "contract" and isinstance(e.attr, Contraction))   # U[e, k, c] = a[e, k/mr, c, k%mr]
    mt = ctx.temp(gemm.shape, DType.FLOAT, gemm.fn, "wino_m")
    ospec = WinogradOutput(mt.buf, m, k_, (th_, tw_), (oh, ow))

    def y_fn(idx):
        n, k, h, w = idx
        r, q = h % m, w % m
        t = (h // m) * tw_ + w // m

        def body(i, j):
            coef = binop("mul", load(at_buf, [r, i]), load(at_buf, [q, j]))
            return binop("mul", coef, mt([n, (i * a + j) * k_ + k, t]))

        def w_direct(c, p, q):             # W[k, c, p, q] = sum over i, j of G+[p, i] G+[q, j] U[i*a + j, k, c]
            def term(i, j):
                coef = binop("mul", load(gi_buf, [p, i]), load(gi_buf, [q, j]))
                return binop("mul", coef, load(packed.a, [i * a + j, k // packed.mr, c, k % packed.mr]))
            return reduce("sum", [a, a], term)

        def direct(c, p, q):
            return binop("mul", w_direct(c, p, q), xp([n, c, h + p, w + q]))
        # args[-2]: the direct convolution at this output (the x86 fallback; it also keeps x live until here)
        acc = E("wino_out", [n, k, h, w, reduce("sum", [c_, 3, 3], direct), reduce("sum", [a, a], body)],
                DType.FLOAT, ospec)
        return binop("add", acc, b([k])) if b is not None else acc
    return [TensorFn(out, ctx.out_dtype(), y_fn, "complex", contraction=True)]


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


def _matmul_as_gemm(ctx, a, wv: Optional[np.ndarray], out, epilogue=None) -> Optional[TensorFn]:
    """``A @ W`` with ``W[K, M]`` constant as a packed contraction (:class:`MatContraction`), when the target
    asks for micro-kernels and everything is float32. ``epilogue(idx, acc)`` adds what the op adds to the
    product (Gemm's alpha, beta * C). A is stored first when it is an expression."""
    if (not ctx.matmul_panels or wv is None or wv.ndim != 2 or len(a.shape) < 2 or a.dtype != DType.FLOAT
            or ctx.out_dtype() != DType.FLOAT or ctx._weight is None or isinstance(a.shape[-1], SymExpr)):
        return None
    K, M = wv.shape
    if K < 8 or M < 8 or tuple(out[:-1]) != tuple(a.shape[:-1]) or out[-1] != M:
        return None
    cols = ctx.gemm_cols
    if a.buf is None:
        a = ctx.temp(a.shape, a.dtype, a.fn, "in")
    wp = ctx.weight(pack_columns(wv.astype(np.float32), cols), "panels")
    spec = MatContraction(wp, a.buf, product(a.shape[:-1]), M, K, cols)

    def f(idx):
        rows, m = list(idx[:-1]), idx[-1]
        acc = E("contract", list(idx) + [reduce("sum", [K], lambda k: binop(
            "mul", a(rows + [k]), load(wp, [m // cols, k, m % cols])))], DType.FLOAT, spec)
        return epilogue(idx, acc) if epilogue is not None else acc
    return TensorFn(out, ctx.out_dtype(), f, "complex", contraction=True)


@lowering("MatMul")
def _matmul(ctx):
    a, b = ctx.input(0), ctx.input(1)
    out = ctx.out_shape()
    gemm = _matmul_as_gemm(ctx, a, ctx.const_input(1), out)
    if gemm is not None:
        return [gemm]
    if ctx.matmul_panels and b.buf is None and len(b.shape) >= 2:
        # the row schedule reads B's rows with the output column innermost: store B (e.g. a transposed
        # key matrix) so those reads are contiguous instead of strided through the expression
        b = ctx.temp(b.shape, b.dtype, b.fn, "rhs")
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
    wv = ctx.const_input(1)

    def epilogue(idx, acc):
        if alpha != 1.0:
            acc = binop("mul", acc, fconst(alpha, acc))
        if cf is not None and beta != 0.0:
            cv = cf(idx)
            acc = binop("add", acc, cv if beta == 1.0 else binop("mul", cv, fconst(beta, cv)))
        return acc
    if not ta and wv is not None:
        gemm = _matmul_as_gemm(ctx, a, wv.T if tb else wv, out, epilogue)
        if gemm is not None:
            return [gemm]
    if tb and wv is not None and ctx._weight is not None:
        # constant B^T: stored transposed at compile time so the row schedule reads it with unit stride
        bt = ctx.weight(np.ascontiguousarray(wv.T), "transposed")
        b, tb = TensorFn(bt.shape, bt.dtype, lambda idx: load(bt, idx), "elementwise", buf=bt), 0

    def f(idx):
        i, j = idx
        return epilogue(idx, reduce("sum", [K], lambda k: binop("mul", a([k, i] if ta else [i, k]),
                                                                 b([j, k] if tb else [k, j]))))
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

    orig_begin = list(begin)
    sizes = list(x.shape[2:])
    if (op == "AveragePool" and not count_pad and ctx.row_kernels and spatial == 2 and x.dtype == DType.FLOAT
            and ctx.out_dtype() == DType.FLOAT and all(d == 1 for d in dil) and strides[1] in (1, 2)
            and all(isinstance(d, int) for d in x.shape[1:])):
        return [_average_pool_window(ctx, x, out, kern, strides, begin)]
    x0 = x
    if op == "MaxPool" and len(ctx.node.outputs) == 1:
        lowest = -math.inf if x.dtype.is_float else np.iinfo(x.dtype.numpy).min
        x, begin = padded_window_input(ctx, x, out[2:], kern, strides, dil, begin, lowest)
    elif op == "AveragePool" and not count_pad and x.dtype.is_float and all(d == 1 for d in dil):
        x, begin = padded_window_input(ctx, x, out[2:], kern, strides, dil, begin, 0.0)
    padded = x is not x0
    # every window position lies inside x (as padded: by construction): reads need no bounds tests
    inside = padded or (not any(b0 != 0 for b0 in begin) and not any(
        _may_exceed((o - 1) * s_ + (k - 1) * d + 1, size) for o, s_, k, d, size in
        zip(out[2:], strides, kern, dil, x.shape[2:])))

    # a 2-D float32 max pool over a stored, padded input: rows in vector registers on x86
    window = None
    if (op == "MaxPool" and inside and ctx.gemm_cols and spatial == 2 and x.dtype == DType.FLOAT
            and len(ctx.node.outputs) == 1 and strides[1] in (1, 2)):
        if x.buf is None:
            x = ctx.temp(x.shape, x.dtype, x.fn, "in")
        window = DepthwiseWindow(None, x.buf, tuple(kern), tuple(strides), tuple(dil), tuple(out[2:]), "max")

    def window_count(o) -> E:
        return _window_count(o, strides, orig_begin, kern, sizes, ctx.out_dtype())

    def f(idx):
        n, c, o = idx[0], idx[1], idx[2:]
        pos_of = lambda ks: [oi * s - pb + ki * d for oi, s, pb, ki, d in zip(o, strides, begin, ks, dil)]
        if op == "AveragePool" and padded and not count_pad and inside:
            # the copy is zero-padded: a plain sum, divided by the in-bounds count
            total = reduce("sum", kern, lambda *ks: x([n, c] + pos_of(ks)))
            return binop("div", total, window_count(o))
        if op == "AveragePool" and not padded and inside:
            # every window lies inside the input (no pads, no ceil-mode overhang): a plain sum over a constant
            # count, no bounds tests (DenseNet-121: a 2x2 average pool over 256 channels of 56x56 0.54 -> 0.15 ms)
            total = reduce("sum", kern, lambda *ks: x([n, c] + pos_of(ks)))
            return binop("div", total, fconst(int(np.prod(kern)), total))
        # MaxPool skips NaN like the reference (and onnxruntime): NaN only when the whole window is NaN
        kind = "fmax" if x.dtype.is_float else "max"
        if op == "MaxPool" and inside:
            red = reduce(kind, kern, lambda *ks: x([n, c] + pos_of(ks)))
            return E("window", [n, c] + list(o) + [red], red.dtype, window) if window is not None else red
        if op == "MaxPool":
            def body(*ks):
                pos = pos_of(ks)
                cond = all_of([in_range(pp, 0, size) for pp, size in zip(pos, x.shape[2:])])
                return x.at_or([n, c] + pos, cond, -math.inf if x.dtype.is_float else np.iinfo(x.dtype.numpy).min)
            return reduce(kind, kern, body)
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
        outs.append(_maxpool_indices(ctx, x, out, kern, strides, dil, begin, ctx.temp(out, x.dtype, f, "max")))
    return outs


def _maxpool_indices(ctx, x, out, kern, strides, dil, begin, best) -> TensorFn:
    """MaxPool's Indices: the first window position (in scan order) holding the maximum, as a flat index
    into the input (row-major, or column-major over the spatial dims with storage_order=1)."""
    sizes = list(x.shape[2:])
    col_major = ctx.attr("storage_order", 0)
    n_win = int(np.prod(kern))
    step = int(np.prod(sizes))

    def f(idx):
        n, c, o = idx[0], idx[1], idx[2:]
        m = best(idx)

        def pos_of(ks):
            return [oi * s - pb + ki * d for oi, s, pb, ki, d in zip(o, strides, begin, ks, dil)]

        def body(*ks):
            pos = pos_of(ks)
            cond = all_of([in_range(pp, 0, size) for pp, size in zip(pos, sizes)])
            hit = cmp("eq", x.at_or([n, c] + pos, cond, 0), m)
            if not (cond.op == "const" and cond.attr is True):
                hit = logic("and", cond, hit)
            return select(hit, flat_index(list(ks), kern), const(n_win, I64))
        k = reduce("min", kern, body)
        pos = pos_of(unflat_index(k, kern))
        if col_major:
            spatial = const(0, I64)
            stride = 1
            for pp, size in zip(pos, sizes):
                spatial = spatial + pp * stride
                stride *= size
        else:
            spatial = flat_index(pos, sizes)
        return (n * x.shape[1] + c) * step + spatial
    return TensorFn(out, I64, f, "complex")


def _end_pads(ctx, spatial):
    pads = ctx.attr("pads")
    return list(pads[spatial:]) if pads else [0] * spatial


def _window_count(o, strides, begin, kern, sizes, dtype) -> E:
    """Elements of the window at output position ``o`` inside the input (unit dilation): a product of
    clipped extents, as ``dtype``."""
    total = None
    for oi, s_, pb, k, size in zip(o, strides, begin, kern, sizes):
        lo = oi * s_ - pb
        hi = lo + k
        lo_c = select(cmp("lt", lo, const(0, I64)), const(0, I64), lo)
        hi_c = select(cmp("gt", hi, dim_index(size)), dim_index(size), hi)
        ext = E("sub", (hi_c, lo_c), I64)
        total = ext if total is None else E("mul", (total, ext), I64)
    return cast(total, dtype)


def _average_pool_window(ctx, x, out, kern, strides, begin) -> TensorFn:
    """A 2-D float32 average pool (pads not counted) as a depthwise window of ones over the unpadded input,
    which the x86 backend computes by rows (masked loads read the padding as zeros), divided by each
    window's count of input elements. As a loop nest over a padded copy, ShuffleNet's three 3x3 stride-2
    pools took 0.15 ms of its 2.1."""
    if x.buf is None:
        x = ctx.temp(x.shape, x.dtype, x.fn, "in")
    sizes = x.shape[2:]
    ones = ctx.weight(np.ones((x.shape[1], 1) + tuple(kern), np.float32), "ones")
    window = DepthwiseWindow(ones, x.buf, tuple(kern), tuple(strides), (1, 1), tuple(out[2:]),
                             pads=(int(begin[0]), int(begin[1])))
    constant = not any(begin) and all((o - 1) * s + k <= size for o, s, k, size in zip(out[2:], strides, kern, sizes))

    def count(o) -> E:
        if constant:
            return const(float(np.prod(kern)), DType.FLOAT)
        return _window_count(o, strides, begin, kern, sizes, DType.FLOAT)

    def f(idx):
        n, c, o = idx[0], idx[1], idx[2:]

        def body(*ks):
            pos = [oi * s_ - pb + ki for oi, s_, pb, ki in zip(o, strides, begin, ks)]
            inside = all_of([in_range(q, 0, size) for q, size in zip(pos, sizes)])
            return binop("mul", x.at_or([n, c] + pos, inside, 0.0), load(ones, [c, const(0, I64)] + list(ks)))
        acc = E("window", [n, c] + list(o) + [reduce("sum", kern, body)], DType.FLOAT, window)
        return binop("div", acc, count(o))
    return TensorFn(out, ctx.out_dtype(), f, "complex", contraction=True)


@lowering("GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool")
def _global_pool(ctx):
    x = ctx.input(0)
    sp = list(x.shape[2:])
    n_el = product(sp)
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
    count = product(ext) if ext else 1

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
    cnt = product(sp)
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
    axis = ctx.attr("axis", -1) % len(x.shape)
    eps = ctx.attr("epsilon", 1e-5)
    shape = list(x.shape)
    norm = shape[axis:]
    cnt = product(norm)
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
    outs = [TensorFn(tuple(shape), ctx.out_dtype(), f, "elementwise", (0,))]
    if len(ctx.node.outputs) > 1:  # Mean and InvStdDev (keepdims shape)
        outs.append(TensorFn(tuple(stat_shape), ctx.out_dtype(1), lambda idx: cast(mean(idx), ctx.out_dtype(1)), "elementwise"))
    if len(ctx.node.outputs) > 2:
        def inv_std(idx):
            v = var(idx)
            return cast(binop("div", fconst(1, v), call("sqrt", binop("add", v, fconst(eps, v)))), ctx.out_dtype(2))
        outs.append(TensorFn(tuple(stat_shape), ctx.out_dtype(2), inv_std, "elementwise"))
    return outs


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
        den = pow_const(binop("add", fconst(bias, xv), binop("mul", fconst(alpha / size, xv), s)), beta)
        return binop("div", xv, den)
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "complex")]


def pow_const(b: E, beta: float) -> E:
    """``b ** beta`` for a constant exponent. The exponents LRN uses become square roots, which vectorise
    (a scalar powf call per element cost AlexNet/Inception-style LRN 10 ns per element): b^0.75 =
    sqrt(b) * sqrt(sqrt(b)) and b^0.5 = sqrt(b) for b >= 0 (equal over the reals; about one more ulp of
    rounding than powf), and NaN for b < 0 like pow."""
    if beta == 1.0:
        return b
    if beta == 0.5:
        return call("sqrt", b)
    if beta == 0.75:
        r = call("sqrt", b)
        return binop("mul", r, call("sqrt", r))
    return call("pow", b, fconst(beta, b))


# --- integer bit operations -------------------------------------------------------------------------

@lowering("BitwiseAnd", "BitwiseOr", "BitwiseXor")
def _bitwise(ctx):
    op = {"BitwiseAnd": "and", "BitwiseOr": "or", "BitwiseXor": "xor"}[ctx.node.op]
    return elementwise(ctx, lambda a, b: E(op, (a, b), a.dtype))


@lowering("BitwiseNot")
def _bitwise_not(ctx):
    return elementwise(ctx, lambda a: E("not", (a,), a.dtype))


@lowering("BitShift")
def _bitshift(ctx):
    left = ctx.attr("direction") == "LEFT"

    def f(a, b):
        bits = a.dtype.itemsize * 8
        signed = a.dtype.is_int and np.dtype(a.dtype.numpy).kind == "i"
        out_of_range = cmp("ge", b, const(bits, b.dtype))
        if signed:
            out_of_range = logic("or", out_of_range, cmp("lt", b, const(0, b.dtype)))
        if left:
            # every bit is shifted out when the amount reaches the width (or is negative)
            return select(out_of_range, const(0, a.dtype), E("shl", (a, b), a.dtype))
        if signed:  # arithmetic shift: the sign fills in
            return E("ashr", (a, select(out_of_range, const(bits - 1, b.dtype), b)), a.dtype)
        return select(out_of_range, const(0, a.dtype), E("lshr", (a, b), a.dtype))
    return elementwise(ctx, f)


# --- helpers for constant operands -------------------------------------------------------------------

def _scalar_attr(v, default=None):
    """A lifted scalar attribute (given as a scalar, a one-element list or array)."""
    if v is None:
        return default
    arr = np.asarray(v).reshape(-1)
    return arr[0].item() if arr.size else default


def _const_input(ctx, i: int):
    """The value of input ``i`` when it is a constant, else None."""
    ins = ctx.node.inputs
    if i < len(ins) and ins[i] is not None and ins[i].is_const:
        return np.asarray(ins[i].const)
    return None


def _scalar_of(t: TensorFn) -> E:
    """The single element of a one-element tensor."""
    return t([const(0, I64)] * len(t.shape))


def _per_axis(t: Optional[TensorFn], idx: Index, axis: int, rank: int, block: int = 0) -> Optional[E]:
    """A quantisation parameter at output index ``idx``: per tensor (one element), per ``axis`` (1-D) or
    blocked along ``axis`` (same rank as the data, ``block`` elements per entry)."""
    if t is None:
        return None
    if int(np.prod(t.shape)) == 1:
        return _scalar_of(t)
    if block:
        sub = list(idx)
        sub[axis] = idx[axis] // block
        return t(sub)
    if len(t.shape) == 1:
        return t([idx[axis]])
    return t(broadcast_index(idx, t.shape, [0] * rank))


# --- matrices: triangles, identity --------------------------------------------------------------------

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


@lowering("EyeLike")
def _eyelike(ctx):
    k = ctx.attr("k", 0)
    dt = ctx.out_dtype()
    return [TensorFn(ctx.out_shape(), dt, lambda idx: select(cmp("eq", idx[1] - idx[0], const(k, I64)),
                                                             const(1, dt), const(0, dt)), "injective")]


# --- gathers, scatters, one-hot -----------------------------------------------------------------------

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


@lowering("Compress")
def _compress(ctx):
    x = ctx.input(0)
    cond = _const_input(ctx, 1)
    if cond is None:
        ctx.unsupported("a condition computed at run time (the output size depends on it)")
    axis = ctx.attr("axis")
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


# --- scans and selections -----------------------------------------------------------------------------

@lowering("CumSum")
def _cumsum(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis")
    if axis is None:
        ctx.unsupported("non-constant axis")
    axis = int(_scalar_attr(axis)) % len(x.shape)
    excl, rev = ctx.attr("exclusive", 0), ctx.attr("reverse", 0)
    n = x.shape[axis]
    pred = {(0, 0): "le", (1, 0): "lt", (0, 1): "ge", (1, 1): "gt"}[(int(bool(excl)), int(bool(rev)))]

    def f(idx):
        def body(kk):
            sub = list(idx)
            sub[axis] = kk
            return select(cmp(pred, kk, idx[axis]), x(sub), const(0, x.dtype))
        return reduce("sum", [n], body)
    return [TensorFn(ctx.out_shape(), x.dtype, f, "complex")]


@lowering("Hardmax")
def _hardmax(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis", -1) % len(x.shape)
    n = x.shape[axis]
    shape = list(x.shape)
    shape[axis] = 1
    arg = ctx.temp(shape, I64, lambda idx: E("argscan", (), I64, (x, list(idx), axis, n, "gt", False)), "argmax")

    def f(idx):
        sub = list(idx)
        sub[axis] = const(0, I64)
        return select(cmp("eq", arg(sub), idx[axis]), const(1, x.dtype), const(0, x.dtype))
    return [TensorFn(ctx.out_shape(), x.dtype, f, "elementwise", (0,))]


@lowering("TopK")
def _topk(ctx):
    """Ranks by counting (element i's rank = how many elements beat it, ties to the lower index), then
    output r is the element whose rank is r: quadratic in the axis length."""
    x = ctx.input(0)
    k = ctx.attr("k")
    if k is None:
        ctx.unsupported("non-constant k")
    axis = ctx.attr("axis", -1) % len(x.shape)
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


# --- normalisations -----------------------------------------------------------------------------------

def _stat(ctx, x: TensorFn, axes: Sequence[int], body, name: str, dtype=None) -> TensorFn:
    """A materialised reduction (sum of ``body(full index)``) over ``axes`` with keepdims."""
    shape = list(x.shape)
    ext = [shape[a] for a in axes]
    for a in axes:
        shape[a] = 1

    def f(idx):
        def src(*ks):
            full = list(idx)
            for a, kk in zip(axes, ks):
                full[a] = kk
            return body(full)
        return reduce("sum", ext, src)
    return ctx.temp(shape, dtype or x.dtype, f, name)


def _at_stat(t: TensorFn, idx: Index, axes: Sequence[int]) -> E:
    sub = list(idx)
    for a in axes:
        sub[a] = const(0, I64)
    return t(sub)


@lowering("RMSNormalization")
def _rmsnorm(ctx):
    x, sc = ctx.input(0), ctx.input(1)
    rank = len(x.shape)
    axis = ctx.attr("axis", -1) % rank
    eps = ctx.attr("epsilon", 1e-5)
    axes = list(range(axis, rank))
    cnt = product([x.shape[a] for a in axes])
    ss = _stat(ctx, x, axes, lambda full: _sq(x(full)), "sumsq")
    scf = _bcast(sc, x.shape)

    def f(idx):
        xv = x(idx)
        rms = call("sqrt", binop("add", binop("div", _at_stat(ss, idx, axes), fconst(cnt, xv)), fconst(eps, xv)))
        return binop("mul", binop("div", xv, rms), scf(idx))
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "elementwise", (0,))]


@lowering("LpNormalization")
def _lpnorm(ctx):
    x = ctx.input(0)
    axis = ctx.attr("axis", -1) % len(x.shape)
    p = ctx.attr("p", 2)
    if p not in (1, 2):
        ctx.unsupported(f"p={p}")
    norm = _stat(ctx, x, [axis], lambda full: _sq(x(full)) if p == 2 else call("fabs", x(full)), "norm")

    def f(idx):
        nv = _at_stat(norm, idx, [axis])
        nv = call("sqrt", nv) if p == 2 else nv
        xv = x(idx)
        return select(cmp("eq", nv, fconst(0, nv)), fconst(0, xv), binop("div", xv, nv))
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "elementwise", (0,))]


@lowering("MeanVarianceNormalization")
def _mvn(ctx):
    x = ctx.input(0)
    rank = len(x.shape)
    axes = sorted(a % rank for a in (ctx.attr("axes") or [0, 2, 3]))
    cnt = product([x.shape[a] for a in axes])
    s1 = _stat(ctx, x, axes, lambda full: x(full), "sum")
    s2 = _stat(ctx, x, axes, lambda full: _sq(x(full)), "sumsq")

    def f(idx):
        xv = x(idx)
        mean = binop("div", _at_stat(s1, idx, axes), fconst(cnt, xv))
        var = binop("sub", binop("div", _at_stat(s2, idx, axes), fconst(cnt, xv)), _sq(mean))
        return binop("div", binop("sub", xv, mean), binop("add", call("sqrt", var), fconst(1e-9, xv)))
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "elementwise", (0,))]


@lowering("GroupNormalization")
def _groupnorm(ctx):
    x, sc, bi = ctx.input(0), ctx.input(1), ctx.input(2)
    groups = ctx.attr("num_groups")
    eps = ctx.attr("epsilon", 1e-5)
    N, C = x.shape[0], x.shape[1]
    sp = list(x.shape[2:])
    cg = C // groups
    cnt = cg * product(sp)
    xg = lambda n, g, c, ks: x([n, g * cg + c] + list(ks))
    mean = ctx.temp([N, groups], x.dtype, lambda idx: binop("div", reduce(
        "sum", [cg] + sp, lambda c, *ks: xg(idx[0], idx[1], c, ks)), const(cnt, x.dtype)), "mean")
    var = ctx.temp([N, groups], x.dtype, lambda idx: binop("div", reduce(
        "sum", [cg] + sp, lambda c, *ks: _sq(binop("sub", xg(idx[0], idx[1], c, ks), mean(idx)))), const(cnt, x.dtype)), "var")
    per_channel = sc.shape[0] == C

    def f(idx):
        n, c = idx[0], idx[1]
        g = [n, c // cg]
        xv = x(idx)
        y = binop("div", binop("sub", xv, mean(g)), call("sqrt", binop("add", var(g), fconst(eps, xv))))
        p = [c] if per_channel else [c // cg]
        return binop("add", binop("mul", y, sc(p)), bi(p))
    return [TensorFn(ctx.out_shape(), ctx.out_dtype(), f, "elementwise", (0,))]


# --- quantisation ---------------------------------------------------------------------------------------

def _saturate_round(v: E, dt: DType) -> E:
    """round-half-to-even of a float, clamped to ``dt``'s range, converted to ``dt``."""
    info = np.iinfo(dt.numpy)
    r = call("roundeven", v)
    r = nan_max(r, fconst(float(info.min), r))
    r = nan_min(r, fconst(float(info.max), r))
    return cast(r, dt)


def _quant_dtype(ctx, dt: DType):
    if dt not in (DType.UINT8, DType.INT8, DType.UINT16, DType.INT16):
        ctx.unsupported(f"quantisation to {dt.name}")


@lowering("QuantizeLinear")
def _quantize(ctx):
    x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
    dt = ctx.out_dtype()
    _quant_dtype(ctx, dt)
    rank = len(x.shape)
    axis = ctx.attr("axis", 1) % max(rank, 1)
    block = ctx.attr("block_size", 0) or 0
    work = DType.DOUBLE if x.dtype == DType.DOUBLE else DType.FLOAT

    def f(idx):
        s = cast(_per_axis(scale, idx, axis, rank, block), work)
        v = call("roundeven", binop("div", cast(x(idx), work), s))
        if zp is not None:
            v = binop("add", v, cast(_per_axis(zp, idx, axis, rank, block), work))
        return _saturate_round(v, dt)
    return [TensorFn(ctx.out_shape(), dt, f, "elementwise", (0,))]


@lowering("DequantizeLinear")
def _dequantize(ctx):
    x, scale, zp = ctx.input(0), ctx.input(1), ctx.input(2)
    dt = ctx.out_dtype()
    if x.dtype not in (DType.UINT8, DType.INT8, DType.UINT16, DType.INT16, DType.INT32):
        ctx.unsupported(f"dequantisation of {x.dtype.name}")
    rank = len(x.shape)
    axis = ctx.attr("axis", 1) % max(rank, 1)
    block = ctx.attr("block_size", 0) or 0

    def f(idx):
        v = cast(x(idx), DType.FLOAT)
        if zp is not None:
            v = binop("sub", v, cast(_per_axis(zp, idx, axis, rank, block), DType.FLOAT))
        return cast(binop("mul", v, cast(_per_axis(scale, idx, axis, rank, block), DType.FLOAT)), dt)
    return [TensorFn(ctx.out_shape(), dt, f, "elementwise", (0,))]


@lowering("DynamicQuantizeLinear")
def _dyn_quantize(ctx):
    x = ctx.input(0)
    ext = list(x.shape)
    f32 = DType.FLOAT
    lo = ctx.temp((), f32, lambda idx: nan_min(reduce("min", ext, lambda *ks: x(list(ks))), const(0.0, f32)), "min")
    hi = ctx.temp((), f32, lambda idx: nan_max(reduce("max", ext, lambda *ks: x(list(ks))), const(0.0, f32)), "max")

    def scale_fn(idx):
        mn, mx = lo([]), hi([])
        rng = select(cmp("eq", mx, mn), const(1.0, f32), binop("sub", mx, mn))
        return binop("div", rng, const(255.0, f32))
    scale = ctx.temp((), f32, scale_fn, "scale")

    def zp_fn(idx):
        z = binop("sub", const(0.0, f32), binop("div", lo([]), scale([])))
        z = nan_min(nan_max(z, const(0.0, f32)), const(255.0, f32))
        return cast(call("roundeven", z), DType.UINT8)
    zp = ctx.temp((), DType.UINT8, zp_fn, "zp")

    def y(idx):
        v = binop("add", call("roundeven", binop("div", x(idx), scale([]))), cast(zp([]), f32))
        return _saturate_round(v, DType.UINT8)
    return [TensorFn(ctx.out_shape(0), DType.UINT8, y, "elementwise", (0,)),
            TensorFn((), f32, lambda idx: scale([]), "elementwise"),
            TensorFn((), DType.UINT8, lambda idx: zp([]), "elementwise")]


def _minus_zp(t: TensorFn, zp: Optional[TensorFn], zp_axis: Optional[int]) -> TensorFn:
    """int32(t) - int32(zero point); the zero point is per tensor, or indexed by ``zp_axis`` of ``t``."""
    i32 = DType.INT32

    def f(idx):
        v = cast(t(idx), i32)
        if zp is None:
            return v
        if int(np.prod(zp.shape)) == 1:
            z = _scalar_of(zp)
        else:
            z = zp([idx[zp_axis]] if len(zp.shape) == 1 else broadcast_index(idx, zp.shape, t.shape))
        return binop("sub", v, cast(z, i32))
    return TensorFn(t.shape, i32, f, "elementwise")


def _sub_ctx(ctx, inputs) -> LowerCtx:
    return LowerCtx(ctx.node, inputs, ctx._temp, ctx._weight, ctx.gemm_cols, ctx.gemm_tiles, ctx.unpadded_contractions,
                    ctx.matmul_panels, ctx.half_contractions)


@lowering("MatMulInteger")
def _matmul_integer(ctx):
    a, b = ctx.input(0), ctx.input(1)
    a2 = _minus_zp(a, ctx.input(2), len(a.shape) - 2)
    b2 = _minus_zp(b, ctx.input(3), len(b.shape) - 1)
    return LOWERINGS["MatMul"](_sub_ctx(ctx, [a2, b2]))


@lowering("ConvInteger")
def _conv_integer(ctx):
    x, w = ctx.input(0), ctx.input(1)
    x2 = _minus_zp(x, ctx.input(2), 1)
    w2 = _minus_zp(w, ctx.input(3), 0)
    return LOWERINGS["Conv"](_sub_ctx(ctx, [x2, w2, None]))


def _requantize(acc: TensorFn, mult, yzp: Optional[TensorFn], dt: DType, axis: int) -> TensorFn:
    """saturate(rint(acc * mult) + y_zero_point) as ``dt``; ``mult`` maps an index to a float multiplier."""
    def f(idx):
        v = binop("mul", cast(acc(idx), DType.FLOAT), mult(idx))
        v = call("roundeven", v)
        if yzp is not None:
            v = binop("add", v, cast(_per_axis(yzp, idx, axis, len(acc.shape)), DType.FLOAT))
        return _saturate_round(v, dt)
    return TensorFn(acc.shape, dt, f, "complex")


@lowering("QLinearMatMul")
def _qlinear_matmul(ctx):
    a, a_s, a_zp, b, b_s, b_zp, y_s, y_zp = (ctx.input(i) for i in range(8))
    dt = ctx.out_dtype()
    _quant_dtype(ctx, dt)
    ra, rb = len(a.shape), len(b.shape)
    a2 = _minus_zp(a, a_zp, ra - 2)
    b2 = _minus_zp(b, b_zp, rb - 1)
    mctx = _sub_ctx(ctx, [a2, b2])
    mctx.out_dtype = lambda j=0: DType.INT32
    acc = LOWERINGS["MatMul"](mctx)[0]
    out = ctx.out_shape()

    def mult(idx):
        sa = cast(_scalar_of(a_s) if int(np.prod(a_s.shape)) == 1 else a_s([idx[-2]]), DType.FLOAT)
        sb = cast(_scalar_of(b_s) if int(np.prod(b_s.shape)) == 1 else b_s([idx[-1]]), DType.FLOAT)
        sy = cast(_scalar_of(y_s), DType.FLOAT)
        return binop("div", binop("mul", sa, sb), sy)
    return [_requantize(acc, mult, y_zp, dt, len(out) - 1)]


@lowering("QLinearConv")
def _qlinear_conv(ctx):
    x, x_s, x_zp, w, w_s, w_zp, y_s, y_zp = (ctx.input(i) for i in range(8))
    bias = ctx.input(8)
    dt = ctx.out_dtype()
    _quant_dtype(ctx, dt)
    x2 = _minus_zp(x, x_zp, 1)
    w2 = _minus_zp(w, w_zp, 0)
    cctx = _sub_ctx(ctx, [x2, w2, bias])
    cctx.out_dtype = lambda j=0: DType.INT32
    acc = LOWERINGS["Conv"](cctx)[0]

    def mult(idx):
        sw = cast(_scalar_of(w_s) if int(np.prod(w_s.shape)) == 1 else w_s([idx[1]]), DType.FLOAT)
        return binop("div", binop("mul", cast(_scalar_of(x_s), DType.FLOAT), sw), cast(_scalar_of(y_s), DType.FLOAT))
    return [_requantize(acc, mult, y_zp, dt, 1)]


# --- resampling ---------------------------------------------------------------------------------------

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


@lowering("Resize")
def _resize(ctx):
    """Separable resampling as the ONNX reference computes it: per resized axis, the source coordinate of
    the output index (coordinate_transformation_mode), then the taps around it with their weights
    (nearest, linear or cubic, edge-clamped); the output is the weighted sum over all tap combinations."""
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
    D = DType.DOUBLE
    dc = lambda v: const(float(v), D)
    work = [a for a in range(rank)
            if not (math.isclose(scale_of[a], 1.0) and out[a] == x.shape[a]
                    and (ctm != "tf_crop_and_resize" or (math.isclose(roi_of[a][0], 0.0) and math.isclose(roi_of[a][1], 1.0))))]

    def source(a: int, i: E) -> E:
        y = cast(i, D)
        length, scale = x.shape[a], scale_of[a]
        out_w = scale * length
        if ctm == "align_corners":
            return dc(0.0) if out_w == 1 else binop("div", binop("mul", y, dc(length - 1)), dc(out_w - 1))
        if ctm == "asymmetric":
            return binop("div", y, dc(scale))
        if ctm == "tf_crop_and_resize":
            r0, r1 = roi_of[a]
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

    def taps(a: int, i: E):
        """[(index, weight or None)] for output index ``i`` along axis ``a``, and an extrapolation test."""
        length = x.shape[a]
        xo = source(a, i)
        fl = call("floor", xo)
        frac = binop("sub", xo, fl)
        is_int = cmp("eq", frac, dc(0.0))
        fl_i = cast(fl, I64)
        outside = None
        if ctm == "tf_crop_and_resize":
            outside = logic("or", cmp("lt", xo, dc(0.0)), cmp("gt", xo, dc(length - 1)))
        if mode == "nearest":
            if nearest_mode == "round_prefer_floor":
                up = cmp("gt", frac, dc(0.5))
            elif nearest_mode == "round_prefer_ceil":
                up = cmp("ge", frac, dc(0.5))
            elif nearest_mode == "floor":
                up = const(False, BOOL)
            else:
                up = const(True, BOOL)
            j = select(logic("and", up, logic("not", is_int)), fl_i + 1, fl_i)
            return [(clamp(j, length), None)], outside
        ratio = select(is_int, dc(1.0), frac)
        if antialias:
            ws = _aa_coeffs(ratio, scale_of[a], mode == "cubic", A)
        elif mode == "cubic":
            ws = _cubic_coeffs(ratio, A)
        else:
            ws = [binop("sub", dc(1.0), ratio), ratio]
        n = len(ws)
        first = fl_i + select(is_int, const(-(n // 2), I64), const(-(n // 2) + 1, I64))
        idxs = [first + k for k in range(n)]
        if exclude:
            ws = [select(in_range(j, 0, length), w, dc(0.0)) for j, w in zip(idxs, ws)]
            total = ws[0]
            for w in ws[1:]:
                total = binop("add", total, w)
            total = select(cmp("eq", total, dc(0.0)), dc(1.0), total)
            ws = [binop("div", w, total) for w in ws]
        return [(clamp(j, length), w) for j, w in zip(idxs, ws)], outside

    n_terms = 1
    for a in work:
        n_terms *= 1 if mode == "nearest" else (4 if mode == "cubic" else 2) * (int(1 / min(scale_of[a], 1.0)) + 1 if antialias else 1)
    if n_terms > 4096:
        ctx.unsupported(f"{n_terms} interpolation taps per output element")

    def f(idx):
        per_axis = {a: taps(a, idx[a]) for a in work}
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
            term = binop("mul", cast(v, D), w)
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
            total = select(cond, const(extrap, x.dtype), total)
        return total
    return [TensorFn(out, x.dtype, f, "complex")]


# --- Einsum -------------------------------------------------------------------------------------------

def _einsum_labels(term: str, rank: int, what: str, ctx) -> List:
    """Labels of ``term``'s dims: letters, and ("...", k) for the k-th ellipsis dim counted from its end."""
    term = term.strip()
    if "..." in term:
        left, right = term.split("...")
        n_ell = rank - len(left) - len(right)
        if n_ell < 0:
            ctx.unsupported(f"{what} {term!r} does not fit rank {rank}")
        return list(left) + [("...", n_ell - k) for k in range(n_ell)] + list(right)
    if len(term) != rank:
        ctx.unsupported(f"{what} {term!r} does not fit rank {rank}")
    return list(term)


@lowering("Einsum")
def _einsum(ctx):
    eq = ctx.attr("equation").replace(" ", "")
    ins = [t for t in ctx.inputs if t is not None]
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ins):
        ctx.unsupported(f"equation {eq!r} has {len(terms)} operands, the node {len(ins)}")
    labels = [_einsum_labels(t, len(x.shape), "operand", ctx) for t, x in zip(terms, ins)]
    n_ell = max([sum(1 for lb in ls if isinstance(lb, tuple)) for ls in labels] + [0])
    ell = [("...", n_ell - k) for k in range(n_ell)]
    if "->" in eq:
        out_labels = [lb for lb in (list(rhs.split("...")[0]) + (ell if "..." in rhs else []) +
                                    (list(rhs.split("...")[1]) if "..." in rhs else []))]
    else:
        letters = [lb for ls in labels for lb in ls if not isinstance(lb, tuple)]
        out_labels = ell + sorted(lb for lb in set(letters) if letters.count(lb) == 1)
    size = {}
    for ls, x in zip(labels, ins):
        for lb, d in zip(ls, x.shape):
            if d != 1 or lb not in size:
                size[lb] = max(size.get(lb, 1), d) if isinstance(lb, tuple) else d
    red = [lb for lb in dict.fromkeys(lb for ls in labels for lb in ls) if lb not in out_labels]
    dt = ctx.out_dtype()

    def f(idx):
        env = dict(zip(out_labels, idx))

        def product(*ks):
            e = dict(env)
            e.update(zip(red, ks))
            acc = None
            for ls, x in zip(labels, ins):
                sub = [const(0, I64) if d == 1 and size.get(lb, 1) != 1 else e[lb] for lb, d in zip(ls, x.shape)]
                v = x(sub)
                acc = v if acc is None else binop("mul", acc, v)
            return acc
        if not red:
            return product()
        return reduce("sum", [size[lb] for lb in red], product)
    return [TensorFn(ctx.out_shape(), dt, f, "complex")]


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


@lowering("MaxUnpool")
def _max_unpool(ctx):
    """Each output element searches its (n, c) plane of the input for the position whose index names it
    (the last one wins); elements nobody names are 0."""
    x, ind = ctx.input(0), ctx.input(1)
    out = ctx.out_shape()
    sp = list(x.shape[2:])
    k = len(sp)
    kern = ctx.attr("kernel_shape")
    strides = ctx.attr("strides") or [1] * k
    pads = ctx.attr("pads") or [0] * (2 * k)
    # indices address the default unpooled shape, even when output_shape pads it further (as the reference)
    default = list(out[:2]) + [(d - 1) * s_ - pads[i] - pads[k + i] + kk
                               for i, (d, s_, kk) in enumerate(zip(sp, strides, kern))]

    def f(idx):
        target = flat_index(idx, default)
        inside = all_of([cmp("lt", i, const(d, I64)) for i, d, o in zip(idx[2:], default[2:], out[2:]) if d < o])
        target = select(inside, target, const(-2, I64)) if not (inside.op == "const") else target

        def body(*ks):
            q = [idx[0], idx[1]] + list(ks)
            return select(cmp("eq", cast(ind(q), I64), target), flat_index(list(ks), sp), const(-1, I64))
        last = reduce("max", sp, body)
        q = [idx[0], idx[1]] + unflat_index(clamp(last, int(np.prod(sp))), sp)
        return select(cmp("ge", last, const(0, I64)), x(q), const(0, x.dtype))
    return [TensorFn(out, x.dtype, f, "complex")]


@lowering("Det")
def _det(ctx):
    """Leibniz expansion: small matrices only (n <= 4)."""
    import itertools
    x = ctx.input(0)
    n = x.shape[-1]
    if n > 4:
        ctx.unsupported(f"{n}x{n} matrices (only up to 4x4)")

    def f(idx):
        total = None
        for perm in itertools.permutations(range(n)):
            inv = sum(1 for i in range(n) for j in range(i + 1, n) if perm[i] > perm[j])
            term = None
            for i, j in enumerate(perm):
                v = x(list(idx) + [const(i, I64), const(j, I64)])
                term = v if term is None else binop("mul", term, v)
            if total is None:
                total = term if inv % 2 == 0 else unop("neg", term)
            else:
                total = binop("add" if inv % 2 == 0 else "sub", total, term)
        return total
    return [TensorFn(ctx.out_shape(), x.dtype, f, "complex")]


@lowering("RoiAlign")
def _roi_align(ctx):
    """As the ONNX reference, for a fixed sampling_ratio (the adaptive one, 0, makes the number of samples
    depend on the roi values)."""
    x, rois, bidx = ctx.input(0), ctx.input(1), ctx.input(2)
    sr = ctx.attr("sampling_ratio", 0)
    if sr <= 0:
        ctx.unsupported("sampling_ratio=0 (the sample count would depend on the roi values)")
    mode = ctx.attr("mode", "avg")
    scale = float(ctx.attr("spatial_scale", 1.0))
    half = ctx.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    out = ctx.out_shape()
    ph_n, pw_n = out[2], out[3]
    H, W = x.shape[2], x.shape[3]
    F = x.dtype if x.dtype.is_float else DType.FLOAT
    c = lambda v: const(float(v), F)

    def f(idx):
        r, ch, ph, pw = idx
        coord = lambda k: binop("sub", binop("mul", cast(rois([r, const(k, I64)]), F), c(scale)), c(0.5 if half else 0.0))
        sw, sh, ew, eh = coord(0), coord(1), coord(2), coord(3)
        rw, rh = binop("sub", ew, sw), binop("sub", eh, sh)
        if not half:
            rw, rh = nan_max(rw, c(1.0)), nan_max(rh, c(1.0))
        bh, bw = binop("div", rh, c(ph_n)), binop("div", rw, c(pw_n))
        n = cast(bidx([r]), I64)
        samples = []
        for iy in range(sr):
            yy = binop("add", binop("add", sh, binop("mul", cast(ph, F), bh)), binop("div", binop("mul", c(iy + 0.5), bh), c(sr)))
            for ix in range(sr):
                xx = binop("add", binop("add", sw, binop("mul", cast(pw, F), bw)), binop("div", binop("mul", c(ix + 0.5), bw), c(sr)))
                empty = logic("or", logic("or", cmp("lt", yy, c(-1.0)), cmp("gt", yy, c(H))),
                              logic("or", cmp("lt", xx, c(-1.0)), cmp("gt", xx, c(W))))
                y0, x0 = nan_max(yy, c(0.0)), nan_max(xx, c(0.0))
                yl, xl = cast(y0, I64), cast(x0, I64)
                y_edge, x_edge = cmp("ge", yl, const(H - 1, I64)), cmp("ge", xl, const(W - 1, I64))
                yl = select(y_edge, const(H - 1, I64), yl)
                xl = select(x_edge, const(W - 1, I64), xl)
                yh = select(y_edge, const(H - 1, I64), yl + 1)
                xh = select(x_edge, const(W - 1, I64), xl + 1)
                y0 = select(y_edge, cast(yl, F), y0)
                x0 = select(x_edge, cast(xl, F), x0)
                ly, lx = binop("sub", y0, cast(yl, F)), binop("sub", x0, cast(xl, F))
                hy, hx = binop("sub", c(1.0), ly), binop("sub", c(1.0), lx)
                px = lambda yi, xi: cast(x([n, ch, clamp(yi, H), clamp(xi, W)]), F)
                terms = [binop("mul", binop("mul", hy, hx), px(yl, xl)), binop("mul", binop("mul", hy, lx), px(yl, xh)),
                         binop("mul", binop("mul", ly, hx), px(yh, xl)), binop("mul", binop("mul", ly, lx), px(yh, xh))]
                if mode == "avg":
                    v = binop("add", binop("add", terms[0], terms[1]), binop("add", terms[2], terms[3]))
                else:
                    v = nan_max(nan_max(terms[0], terms[1]), nan_max(terms[2], terms[3]))
                samples.append(select(empty, c(0.0), v))
        acc = samples[0]
        for v in samples[1:]:
            acc = binop("add", acc, v) if mode == "avg" else nan_max(acc, v)
        if mode == "avg":
            acc = binop("div", acc, c(sr * sr))
        return cast(acc, x.dtype)
    return [TensorFn(out, x.dtype, f, "complex")]


@lowering("DeformConv")
def _deform_conv(ctx):
    """2-D deformable convolution as the ONNX reference: each kernel tap reads the input bilinearly at its
    offset position (zero outside), scaled by the mask."""
    x, w, off, b, mask = (ctx.input(i) for i in range(5))
    if len(x.shape) != 4:
        ctx.unsupported("only 2-D deformable convolution")
    N, C, H, W_ = x.shape
    M, cin_g, kh_n, kw_n = w.shape
    group = ctx.attr("group", 1) or 1
    og_n = ctx.attr("offset_group", 1) or 1
    m_g = M // group
    c_og = C // og_n
    sh, sw = ctx.attr("strides") or [1, 1]
    dh, dw = ctx.attr("dilations") or [1, 1]
    pads = ctx.attr("pads") or [0, 0, 0, 0]
    F = x.dtype
    fc = lambda v: const(float(v), F)

    def f(idx):
        n, m, i, j = idx
        g = m // m_g if group > 1 else const(0, I64)

        def body(c, ki, kj):
            ic = g * cin_g + c if group > 1 else c
            og = ic // c_og if og_n > 1 else const(0, I64)
            tap = (og * kh_n + ki) * kw_n + kj
            oh = off([n, tap * 2, i, j])
            ow = off([n, tap * 2 + 1, i, j])
            ph = binop("add", cast(i * sh + ki * dh - pads[0], F), oh)
            pw = binop("add", cast(j * sw + kj * dw - pads[1], F), ow)
            fh, fw = call("floor", ph), call("floor", pw)
            th, tw = binop("sub", ph, fh), binop("sub", pw, fw)
            h0, w0 = cast(fh, I64), cast(fw, I64)
            total = None
            for dy, wy in ((0, binop("sub", fc(1), th)), (1, th)):
                for dx, wx in ((0, binop("sub", fc(1), tw)), (1, tw)):
                    hh, ww = h0 + dy, w0 + dx
                    inside = logic("and", in_range(hh, 0, H), in_range(ww, 0, W_))
                    v = select(inside, x([n, ic, clamp(hh, H), clamp(ww, W_)]), fc(0))
                    term = binop("mul", binop("mul", wy, wx), v)
                    total = term if total is None else binop("add", total, term)
            val = binop("mul", total, w([m, c, ki, kj]))
            if mask is not None:
                val = binop("mul", val, mask([n, tap, i, j]))
            return val
        acc = reduce("sum", [cin_g, kh_n, kw_n], body)
        return binop("add", acc, b([m])) if b is not None else acc
    return [TensorFn(ctx.out_shape(), x.dtype, f, "complex")]
