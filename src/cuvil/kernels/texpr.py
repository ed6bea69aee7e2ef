"""Tensor expressions: the kernel IR shared by the backends.

A kernel computes every element of an output buffer from a scalar expression of the output's loop
variables. Expressions are trees of :class:`E` nodes: integer index arithmetic, loads from buffers (plain
or guarded by a bounds condition, for padding), scalar math, selects, casts and reductions (which
introduce their own loop variables). Lowering an op means writing that expression; fusing ops means
substituting one op's expression where another loads its output.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import attrs

from ..ir.dim import SymExpr, product
from ..ir.dtype import DType

I64 = DType.INT64
BOOL = DType.BOOL
_ids = itertools.count()


@attrs.define(eq=False)
class Buf:
    """A buffer: ``bufs[base] + offset`` bytes, row-major ``shape``. Aliases (reshapes) are other Buf
    objects over the same bytes. A *pitched* view (``pitch``: element strides, not the shape's row-major ones;
    ``shift``: bytes from its root's start) is the interior of a larger buffer, written by a producer in place
    (:mod:`cuvil.kernels.pad_in_place`), or a tensor stored with longer rows than its shape's (Winograd's M,
    :func:`cuvil.kernels.contraction.winograd_m_row`: a root that no stage writes whole): kernels address it
    through :attr:`strides`, never as flat offsets."""
    name: str
    dtype: DType
    shape: Tuple[int, ...]
    base: int = -1        # index into the kernel's bufs array (0 arena, 1 weights, then inputs, outputs)
    offset: int = 0       # bytes
    root: Optional["Buf"] = None   # the buffer this one is a view of (reshapes)
    pitch: Optional[Tuple[int, ...]] = None   # element strides of a pitched view (None: row-major)
    shift: int = 0        # bytes from the root's first byte to this view's first element

    @property
    def storage(self) -> "Buf":
        return self.root if self.root is not None else self

    @property
    def nbytes(self):
        """Bytes of the buffer: an int, or a dimension expression when the shape is symbolic."""
        return product(self.shape) * self.dtype.itemsize

    @property
    def span(self):
        """Bytes of its root from the root's start to past this view's last element (``nbytes`` for a
        row-major view at the root's start): what must fit in the root."""
        if self.pitch is None:
            return self.shift + self.nbytes
        last = sum((d - 1) * s for d, s in zip(self.shape, self.pitch))
        return self.shift + (last + 1) * self.dtype.itemsize

    @property
    def strides(self) -> Tuple[int, ...]:
        if self.pitch is not None:
            return tuple(self.pitch)
        out, acc = [], 1
        for d in reversed(self.shape):
            out.append(acc)
            acc *= d
        return tuple(reversed(out))


class E:
    """An expression node. ``op`` names the operation, ``args`` are sub-expressions, ``attr`` holds the
    non-expression payload (a constant's value, a Buf, a function name, reduction variables)."""

    __slots__ = ("op", "args", "dtype", "attr", "uid")

    def __init__(self, op: str, args: Sequence["E"], dtype: DType, attr: Any = None):
        self.op, self.args, self.dtype, self.attr = op, tuple(args), dtype, attr
        self.uid = next(_ids)

    def __repr__(self):
        if self.op == "const":
            return f"{self.attr!r}"
        if self.op == "var":
            return self.attr
        return f"{self.op}{'[' + str(self.attr) + ']' if self.attr is not None and self.op != 'load' else ''}({', '.join(map(repr, self.args))})"

    # integer index arithmetic, simplified as it is built
    def __add__(self, o):
        return iadd(self, o)

    __radd__ = __add__

    def __sub__(self, o):
        return iadd(self, imul(as_index(o), -1))

    def __rsub__(self, o):
        return iadd(as_index(o), imul(self, -1))

    def __mul__(self, o):
        return imul(self, o)

    __rmul__ = __mul__

    def __floordiv__(self, o):
        return idiv(self, o)

    def __mod__(self, o):
        return imod(self, o)


def is_var_minus(e: E, name: str, c: int) -> bool:
    """``e`` is the variable ``name`` minus the constant ``c`` (or the variable itself when c is 0)."""
    if e.op == "var":
        return c == 0 and e.attr == name
    if e.op == "sub" and len(e.args) == 2:
        v, k = e.args
        return v.op == "var" and v.attr == name and k.op == "const" and int(k.attr) == c
    if e.op == "add" and len(e.args) == 2:
        for v, k in (e.args, e.args[::-1]):
            if v.op == "var" and v.attr == name and k.op == "const" and int(k.attr) == -c:
                return True
    return False


def users_by_storage(stages) -> "Tuple[Dict[int, list], Dict[int, list]]":
    """({id(storage): the stages writing it}, {id(storage): the stages reading it}) over ``stages`` (their
    ``reads`` set): views count as their storage, so a value's every user shows, whatever view it goes through."""
    writers: Dict[int, list] = {}
    readers: Dict[int, list] = {}
    for st in stages:
        writers.setdefault(id(st.buf.storage), []).append(st)
        for b in st.reads:
            readers.setdefault(id(b.storage), []).append(st)
    return writers, readers


def var(name: str) -> E:
    return E("var", (), I64, f"{name}{next(_ids)}")


def const(value, dtype: DType) -> E:
    """A constant of ``dtype``; a symbolic dimension (an element count over symbols) becomes its run-time
    value converted to ``dtype``."""
    if isinstance(value, SymExpr):
        return cast(dim_index(value), dtype)
    if dtype.is_float:
        value = float(value)
    elif dtype == BOOL:
        value = bool(value)
    else:
        value = int(value)
    return E("const", (), dtype, value)


def as_index(x) -> E:
    if isinstance(x, E):
        return x
    if isinstance(x, SymExpr):
        return dim_index(x)
    return const(int(x), I64)


def sym(name: str) -> E:
    """The run-time value of the shape symbol ``name`` (bound from the input shapes at each run)."""
    return E("sym", (), I64, name)


def dim_index(d) -> E:
    """A dimension (int or :class:`~cuvil.ir.dim.SymExpr`) as an index expression over run-time symbols."""
    if not isinstance(d, SymExpr):
        return const(int(d), I64)
    total = None
    for mono, coef in d.terms:
        term = const(coef, I64)
        for a in mono:
            term = imul(term, _atom_index(a))
        total = term if total is None else iadd(total, term)
    return total if total is not None else const(0, I64)


def _atom_index(a) -> E:
    if a.kind == "sym":
        return sym(a.args[0])
    xs = [dim_index(x) for x in a.args]
    if a.kind == "floordiv":
        return E("fdiv", xs, I64)     # floor division (operands may be negative in intermediate forms)
    if a.kind == "mod":
        return E("fmod_i", xs, I64)
    out = xs[0]
    for x in xs[1:]:
        out = select(cmp("gt" if a.kind == "max" else "lt", out, x), out, x)
    return out


def _cval(e: E) -> Optional[int]:
    return e.attr if e.op == "const" else None


def iadd(a, b) -> E:
    a, b = as_index(a), as_index(b)
    ca, cb = _cval(a), _cval(b)
    if ca is not None and cb is not None:
        return const(ca + cb, I64)
    if ca == 0:
        return b
    if cb == 0:
        return a
    return E("add", (a, b), I64)


def imul(a, b) -> E:
    a, b = as_index(a), as_index(b)
    ca, cb = _cval(a), _cval(b)
    if ca is not None and cb is not None:
        return const(ca * cb, I64)
    if ca == 0 or cb == 0:
        return const(0, I64)
    if ca == 1:
        return b
    if cb == 1:
        return a
    return E("mul", (a, b), I64)


def idiv(a, b) -> E:
    """Floor division of non-negative indices."""
    a, b = as_index(a), as_index(b)
    ca, cb = _cval(a), _cval(b)
    if cb == 1:
        return a
    if ca is not None and cb is not None:
        return const(ca // cb, I64)
    return E("idiv", (a, b), I64)


def imod(a, b) -> E:
    a, b = as_index(a), as_index(b)
    ca, cb = _cval(a), _cval(b)
    if cb == 1:
        return const(0, I64)
    if ca is not None and cb is not None:
        return const(ca % cb, I64)
    return E("imod", (a, b), I64)


def load(buf: Buf, idx: Sequence) -> E:
    if len(idx) != len(buf.shape):
        raise ValueError(f"load of {buf.name}{list(buf.shape)} with {len(idx)} indices")
    return E("load", [as_index(i) for i in idx], buf.dtype, buf)


def guarded_load(buf: Buf, idx: Sequence, cond: E, default) -> E:
    """``buf[idx]`` where ``cond`` holds, else ``default`` (the load is never out of bounds)."""
    return E("gload", [cond, const(default, buf.dtype)] + [as_index(i) for i in idx], buf.dtype, buf)


def binop(op: str, a: E, b: E) -> E:
    return E(op, (a, b), a.dtype)


def unop(op: str, a: E) -> E:
    return E(op, (a,), a.dtype)


def call(fn: str, *args: E) -> E:
    return E("call", args, args[0].dtype, fn)


def cmp(pred: str, a: E, b: E) -> E:
    return E("cmp", (a, b), BOOL, pred)


def logic(op: str, *args: E) -> E:
    return E(op, args, BOOL)


def select(c: E, a: E, b: E) -> E:
    return E("select", (c, a, b), a.dtype)


def cast(a: E, dtype: DType, saturate: bool = True, round_mode: str = "up") -> E:
    """``a`` converted to ``dtype``. Cast's attributes, for float8 targets only: ``saturate=False`` makes
    magnitudes past the largest finite value inf/NaN instead of it; ``round_mode`` (up, down, nearest) rounds
    into float8e8m0."""
    if a.dtype == dtype:
        return a
    mode = (bool(saturate), round_mode) if dtype.is_minifloat else None
    return E("cast", (a,), dtype, None if mode == (True, "up") else mode)


def identity_value(kind: str, dtype: DType):
    """The neutral element of a reduction (``sum``/``add``/``fma``, ``prod``/``mul``, ``max``, ``min``,
    ``fmax``) in ``dtype``. ``fma`` (``acc = fma(a, b, acc)``, the kernel rules' contracted sum of products)
    starts where a sum does: without it here it fell through to the float ``min``'s +inf."""
    if kind in ("sum", "add", "fma"):
        return 0
    if kind in ("prod", "mul"):
        return 1
    if kind == "fmax":   # NaN-skipping max (numpy's fmax): NaN only when every element is NaN
        return float("nan")
    if dtype.is_float:
        return -float("inf") if kind == "max" else float("inf")
    if dtype == BOOL:
        return kind == "min"
    lo, hi = dtype.int_range
    return lo if kind == "max" else hi


def reduce(kind: str, extents: Sequence[int], body_fn: Callable[..., E], dtype: Optional[DType] = None) -> E:
    """``kind`` (sum, max, min, prod) of ``body_fn(*vars)`` over ``vars`` ranging over ``extents``."""
    vs = [var("r") for _ in extents]
    body = body_fn(*vs)
    return E("reduce", (body,), dtype or body.dtype,
             (kind, tuple(vs), tuple(x if isinstance(x, SymExpr) else int(x) for x in extents)))


def in_range(i: E, lo: int, hi: int) -> E:
    """lo <= i < hi, simplified when ``i`` is constant."""
    c = _cval(i)
    if c is not None and not isinstance(lo, SymExpr) and not isinstance(hi, SymExpr):
        return const(lo <= c < hi, BOOL)
    return logic("and", cmp("ge", i, as_index(lo)), cmp("lt", i, as_index(hi)))


def all_of(conds: Sequence[E]) -> E:
    conds = [c for c in conds if not (c.op == "const" and c.attr is True)]
    if not conds:
        return const(True, BOOL)
    out = conds[0]
    for c in conds[1:]:
        out = logic("and", out, c)
    return out


def substitute(e: E, mapping) -> E:
    """``e`` with variables (by name) replaced by expressions."""
    return _rebuild(e, lambda x: mapping.get(x.attr, x) if x.op == "var" else None)


def replace_node(e: E, target: E, repl: E) -> E:
    """``e`` with the node ``target`` (by identity) replaced by ``repl``."""
    return _rebuild(e, lambda x: repl if x is target else None)


def _rebuild(e: E, swap) -> E:
    """``e`` rebuilt bottom-up where ``swap(node)`` returns a replacement (None: keep the node, rebuilding it
    only if an argument changed)."""
    memo = {}

    def go(x: E) -> E:
        if x.uid in memo:
            return memo[x.uid]
        out = swap(x)
        if out is None:
            if not x.args:
                out = x
            else:
                args = [go(a) for a in x.args]
                out = x if all(a is b for a, b in zip(args, x.args)) else E(x.op, args, x.dtype, x.attr)
        memo[x.uid] = out
        return out

    return go(e)


def top_level(e: E, op: str):
    """The nodes of kind ``op`` in ``e`` outside reductions (not looking inside them), and the reductions
    (``reduce``/``argscan`` nodes) met on the way, whose insides were not searched."""
    found, reductions, seen, stack = [], [], set(), [e]
    while stack:
        x = stack.pop()
        if x.uid in seen:
            continue
        seen.add(x.uid)
        if x.op == op:
            found.append(x)
        elif x.op in ("reduce", "argscan"):
            reductions.append(x)
        else:
            stack.extend(x.args)
    return found, reductions


def nodes(e: E):
    """Every node of ``e`` once (shared subtrees once), depth first."""
    stack, seen = [e], set()
    while stack:
        x = stack.pop()
        if x.uid in seen:
            continue
        seen.add(x.uid)
        yield x
        stack.extend(x.args)


def contains(e: E, op: str) -> bool:
    return any(x.op == op for x in nodes(e))
