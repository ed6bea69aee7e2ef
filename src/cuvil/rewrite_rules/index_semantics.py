"""Index semantics of ONNX ops, for shape- and attribute-generic proofs (:mod:`cuvil.rewrite_rules.generic`).

A tensor here has a fixed rank, dims that are Z3 ``Int`` terms (of the leaves' symbolic dims and of the
rule's attribute variables) and an element function from a tuple of Z3 ``Int`` indices to a scalar term.
Each op gives, from its inputs' tensors, its output dims and its element at a symbolic index, as a term of
input elements at index terms (padding and broadcasting as ``If``). The scalar arithmetic is the prover's
own (:mod:`cuvil.rewrite_rules.semantics`, evaluated on 0-d tensors), so both provers agree on every
scalar op. Conditions that make a node valid (matching channels, output dims >= 1, broadcastable dims)
are collected in :attr:`Side.valid`.

Reductions over a symbolic extent (Conv, MatMul, Gemm, ReduceSum/Mean/Max, pools) cannot be expanded: each
becomes a :class:`Fold` (kind, extents, the body at symbolic reduction indices ``ks``) represented in the
element term by a fresh constant; :mod:`generic` decides which folds are equal. A fold's order is the one
of :mod:`cuvil.rewrite_rules.semantics`: row-major over its extents, left to right from the first term.

Anything this module cannot express raises :class:`Unsupported`; the caller then gives no verdict.
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List, Optional, Sequence

import attrs
import numpy as np
import z3

from ..errors import UnsupportedOpError
from ..ir.registry import BROADCAST, op_schema, ops_with
from . import semantics as sem


class Unsupported(Exception):
    """The rule is outside the generic fragment (an op, attribute or guard without index semantics)."""


def _capturing(base):
    class Capturing(base):
        """The prover's domain, with definedness conditions collected per fold body (see :class:`Side`)."""

        def __init__(self):
            super().__init__()
            self.frames: List[List[z3.BoolRef]] = [[]]

        def require(self, cond) -> None:
            cond = z3.simplify(cond) if not isinstance(cond, bool) else z3.BoolVal(cond)
            if not z3.is_true(cond):
                self.frames[-1].append(cond)

    Capturing.__name__ = base.__name__
    return Capturing


ExactDomain = _capturing(sem.FP32Domain)
RealDomain = _capturing(sem.RealDomain)


def make_domain(proof: str) -> sem.Domain:
    return ExactDomain() if proof == "exact" else RealDomain()


@attrs.define(eq=False)
class Tensor:
    dims: List[Any]                              # Z3 Int terms
    elem: Callable[[Sequence[Any]], Any]         # index terms -> scalar term
    kind: str = "float"                          # "float" or "bool"

    @property
    def rank(self) -> int:
        return len(self.dims)


@attrs.define(eq=False)
class Fold:
    kind: str                 # "sum", "max" (np.maximum), "nanmax" (MaxPool's NaN-skipping max)
    extents: List[Any]        # Z3 Int terms, row-major order
    ks: List[Any]             # the symbolic reduction indices
    body: Any                 # the term at ks
    guard: Any                # which terms take part (None: all); a filtered fold skips the others
    value: Any                # the fresh constant standing for the fold's value
    depth: int = 0            # > 0: built inside another fold's body (real sums only, see :meth:`Side.fold`)


@attrs.define(eq=False)
class Rest:
    """The attributes a ``..rest`` binds: unknown, the same wherever the same rest is used."""
    name: str


def simp(t):
    return z3.simplify(t) if isinstance(t, z3.ExprRef) else t


def as_int(t) -> Optional[int]:
    """A concrete integer, or None for a symbolic term."""
    if isinstance(t, (bool, np.bool_)):
        return int(t)
    if isinstance(t, (int, np.integer)):
        return int(t)
    if isinstance(t, z3.ExprRef):
        s = z3.simplify(t)
        if z3.is_int_value(s):
            return s.as_long()
    return None


def iv(t):
    """An Int term from a Python int or a Z3 term."""
    if isinstance(t, z3.ExprRef):
        return t
    if isinstance(t, (bool, float)) or not isinstance(t, (int, np.integer)):
        raise Unsupported(f"expected an integer, got {t!r}")
    return z3.IntVal(int(t))


def zmax(a, b):
    return z3.If(a >= b, a, b)


def zmin(a, b):
    return z3.If(a <= b, a, b)


def prod(xs):
    out = z3.IntVal(1)
    for x in xs:
        out = simp(out * x) if as_int(x) != 1 else out
    return out


def select(items: Sequence[Any], k) -> Any:
    """``items[k]`` for a symbolic position ``k`` (an If chain; out of range gives the last item)."""
    c = as_int(k)
    if c is not None:
        return items[c]
    out = items[-1]
    for j in range(len(items) - 2, -1, -1):
        out = z3.If(k == j, items[j], out)
    return out


class Side:
    """Evaluation of one side of a rule: validity conditions and folds are collected as the ops run."""

    def __init__(self, dom: sem.Domain, tag: str, folds: List[Fold], rests: Dict[str, Dict[str, Any]]):
        self.dom, self.tag = dom, tag
        self.rests = rests          # rest name -> the symbolic window attributes it stands for
        self.valid: List[z3.BoolRef] = []
        self.folds = folds
        self._n = itertools.count()
        self._depth = 0

    def require(self, cond) -> None:
        """A condition the node needs to be valid (what shape inference checks)."""
        cond = simp(cond) if isinstance(cond, z3.ExprRef) else z3.BoolVal(bool(cond))
        if not z3.is_true(cond):
            self.valid.append(cond)

    def scalar(self, op: str, args: Sequence[Any], at: Optional[Dict[str, Any]] = None):
        """The prover's scalar semantics of an elementwise op, on scalar terms."""
        arrays = []
        for a in args:
            arr = np.empty((), dtype=object)
            arr[()] = a
            arrays.append(arr)
        try:
            return sem.evaluate(self.dom, op, arrays, at or {})[0][()]
        except UnsupportedOpError as e:
            raise Unsupported(str(e)) from None

    def fold(self, kind: str, extents: Sequence[Any], body: Callable, guard: Optional[Callable] = None):
        """The value of a reduction: a fresh constant standing for the fold of ``body`` over ``extents``."""
        if self._depth and not (self.dom.name == "real" and kind == "sum" and guard is None):
            # a fold's constant stands for one value; inside another fold's body it would vary with the outer
            # indices. Only real sums are nested: generic's nested-sum normal form (sum_normal) expands them.
            raise Unsupported("a reduction inside a reduction")
        depth = self._depth
        n = next(self._n)
        ks = [z3.Int(f"k.{self.tag}{n}.{j}") for j in range(len(extents))]
        self._depth += 1
        start = len(self.folds)
        self.dom.frames.append([])
        try:
            b = body(ks)
            g = guard(ks) if guard is not None else None
        finally:
            self._depth -= 1
            conds = self.dom.frames.pop()
        inside = z3.And([z3.And(k >= 0, k < e) for k, e in zip(ks, extents)])
        # what varies with ks: ks, and the value of any fold nested in the body (it may read ks)
        varying = ks + [f.value for f in self.folds[start:]]
        for c in conds:  # a definedness condition of the body holds for every term of the fold
            if _mentions(c, varying):
                c = z3.ForAll(ks, z3.Implies(inside, c)) if ks else c
            self.dom.frames[-1].append(c)
        real = self.dom.name == "real"
        if real and g is not None:  # over the reals a skipped term is a zero term
            b, g = (z3.If(g, b, z3.RealVal(0)) if kind == "sum" else b), (None if kind == "sum" else g)
        outside = z3.RealVal(1)
        if real and kind == "sum":  # factors that do not depend on ks come out of the sum
            inner, outer = [], []
            for f in _factors(b):
                (inner if _mentions(f, varying) else outer).append(f)
            if outer:
                b = _product(inner) if inner else z3.RealVal(1)
                outside = _product(outer)
        value = z3.Const(f"fold.{self.tag}{n}", self.dom.sort)
        self.folds.append(Fold(kind, list(extents), ks, b, g, value, depth))
        return value if real is False or z3.eq(simp(outside), z3.RealVal(1)) else outside * value


def _mentions(t, ks) -> bool:
    names = {k.decl().name() for k in ks}
    todo, seen = [t], set()
    while todo:
        e = todo.pop()
        if e.get_id() in seen:
            continue
        seen.add(e.get_id())
        if z3.is_const(e) and e.decl().name() in names:
            return True
        if z3.is_quantifier(e):
            todo.append(e.body())
        elif z3.is_app(e):
            todo.extend(e.children())
    return False


def _factors(t) -> List[Any]:
    if z3.is_app_of(t, z3.Z3_OP_MUL):
        return [f for c in t.children() for f in _factors(c)]
    return [t]


def _product(fs):
    out = fs[0]
    for f in fs[1:]:
        out = out * f
    return out


# --- leaves ------------------------------------------------------------------------------------------

def leaf_dims(name: str, rank: int) -> List[Any]:
    return [z3.Int(f"{name}.d{p}") for p in range(rank)]


def leaf(side: Side, name: str, rank: int, kind: str = "float", dims: Optional[List[Any]] = None) -> Tensor:
    dims = leaf_dims(name, rank) if dims is None else dims
    sort = z3.BoolSort() if kind == "bool" else side.dom.sort
    if rank == 0:
        c = z3.Const(name, sort)
        return Tensor(dims, lambda idx: c, kind)
    f = z3.Function(name, *([z3.IntSort()] * rank), sort)
    return Tensor(dims, lambda idx: f(*idx), kind)


def constant(value, rank: int, side: Side, name: str, dims: Optional[List[Any]] = None) -> Tensor:
    """A constant tensor every element of which is ``value`` (a literal of the pattern, any shape)."""
    dims = leaf_dims(name, rank) if dims is None else dims
    c = side.dom.lift(value) if not isinstance(value, z3.ExprRef) else value
    return Tensor(dims, lambda idx: c)


# --- ops -----------------------------------------------------------------------------------------------

OpFn = Callable[[Side, List[Optional[Tensor]], "Attrs"], Tensor]
OPS: Dict[str, OpFn] = {}


def op(*names):
    def deco(fn):
        for n in names:
            OPS[n] = fn
        return fn
    return deco


class Attrs:
    """An op call's attributes: explicit values (Python numbers/strings, Z3 terms, lists of them), else a
    rest's unknown attributes, else the schema default."""

    def __init__(self, op: str, explicit: Dict[str, Any], rest: Optional[Rest], defaults: Dict[str, Any]):
        self.op, self.explicit, self.rest, self.defaults = op, explicit, rest, defaults

    def given(self, name: str) -> bool:
        return name in self.explicit

    def get(self, name: str, default=None):
        if name in self.explicit:
            return self.explicit[name]
        if self.rest is not None:
            raise Unsupported(f"attribute {name!r} comes from ..{self.rest.name}")
        return self.defaults.get(name, default)

    def int(self, name: str, default=None) -> int:
        v = as_int(self.get(name, default))
        if v is None:
            raise Unsupported(f"attribute {name!r} must be a concrete integer here")
        return v

    def ints(self, name: str, default=None) -> Optional[List[Any]]:
        v = self.get(name, default)
        if v is None:
            return None
        if not isinstance(v, (list, tuple)):
            v = [v]
        return [iv(x) if isinstance(x, z3.ExprRef) else iv(int(x)) for x in v]

    def concrete_ints(self, name: str, default=None) -> Optional[List[int]]:
        v = self.ints(name, default)
        if v is None:
            return None
        out = [as_int(x) for x in v]
        if any(x is None for x in out):
            raise Unsupported(f"attribute {name!r} must be concrete here")
        return out

    def scalar(self, name: str):
        """A float attribute as given (number or Z3 term), or None."""
        return self.get(name)


def broadcast(side: Side, shapes: List[List[Any]]) -> List[Any]:
    r = max((len(s) for s in shapes), default=0)
    out = []
    for p in range(r):
        ds = [s[len(s) - r + p] for s in shapes if len(s) - r + p >= 0]
        d = ds[0]
        for e in ds[1:]:
            if as_int(e) == 1 or z3.eq(simp(d), simp(e)):
                continue
            if as_int(d) == 1:
                d = e
                continue
            side.require(z3.Or(d == e, d == 1, e == 1))
            d = simp(z3.If(d == 1, e, d))
        out.append(simp(d))
    return out


def bcast_index(dims: List[Any], idx: Sequence[Any], out_dims: Optional[Sequence[Any]] = None) -> List[Any]:
    """The index an operand of ``dims`` is read at for the output index ``idx`` (numpy broadcasting). Where
    the operand's dim is the output's own (``out_dims``) or a known size other than 1, it is ``idx`` itself."""
    off = len(idx) - len(dims)
    out = []
    for j, d in enumerate(dims):
        one = as_int(d)
        same = out_dims is not None and z3.eq(simp(d), simp(out_dims[off + j]))
        if one == 1:
            out.append(z3.IntVal(0))
        elif same or one is not None:
            out.append(idx[off + j])
        else:
            out.append(z3.If(d == 1, 0, idx[off + j]))
    return out


def _bool_output(op: str) -> bool:
    """Whether the op's ONNX schema makes its first output Bool (comparisons, logic, IsNaN)."""
    schema = op_schema(op)
    allowed = {tc.type_param_str: list(tc.allowed_type_strs) for tc in schema.type_constraints}
    return allowed.get(schema.outputs[0].type_str, [schema.outputs[0].type_str]) == ["tensor(bool)"]


# Elementwise ops read at one broadcast index, each element by its scalar semantics: the op registry's
# broadcast-elementwise ops that the semantics table models. Dropout has its own index semantics (below:
# its training mode and mask output).
ELEMENTWISE = frozenset((ops_with("elementwise", BROADCAST) & set(sem.SEMANTICS)) - {"Dropout"})
BOOL_OUT = frozenset(o for o in ELEMENTWISE if _bool_output(o))


def _scalar_attrs(at: Attrs) -> Dict[str, Any]:
    if at.rest is not None:
        raise Unsupported("an elementwise op with ..rest")
    return dict(at.explicit)


@op(*sorted(ELEMENTWISE))
def _elementwise(side: Side, ins, at: Attrs) -> Tensor:
    ins = [t for t in ins if t is not None]
    if not ins:
        raise Unsupported("an elementwise op without inputs")
    dims = broadcast(side, [t.dims for t in ins])
    sa = _scalar_attrs(at)
    opname = at.op

    def elem(idx):
        return side.scalar(opname, [t.elem(bcast_index(t.dims, idx, dims)) for t in ins], sa)
    return Tensor(dims, elem, "bool" if opname in BOOL_OUT else ins[-1].kind if opname == "Where" else "float")


@op("Dropout")
def _dropout(side, ins, at):
    if len([t for t in ins if t is not None]) != 1 or at.rest is not None:
        raise Unsupported("Dropout with a ratio or training_mode input")
    return ins[0]


@op("Transpose")
def _transpose(side, ins, at):
    x = ins[0]
    perm = at.concrete_ints("perm") or list(range(x.rank))[::-1]
    if sorted(perm) != list(range(x.rank)):
        raise Unsupported(f"perm {perm} is not a permutation of rank {x.rank}")

    def elem(idx):
        src = [None] * x.rank
        for p, q in enumerate(perm):
            src[q] = idx[p]
        return x.elem(src)
    return Tensor([x.dims[q] for q in perm], elem, x.kind)


def linear(idx, dims):
    """Row-major offset of ``idx`` in ``dims`` (dims that are literally 1 contribute nothing)."""
    out, stride = z3.IntVal(0), z3.IntVal(1)
    for i, d in zip(reversed(list(idx)), reversed(list(dims))):
        if as_int(d) == 1:
            continue
        out = simp(out + i * stride) if as_int(stride) != 1 else simp(out + i)
        stride = simp(stride * d)
    return out


def unlinear(offset, dims):
    """The row-major index of ``offset`` in ``dims``; exact without division when at most one dim is not 1."""
    big = [p for p, d in enumerate(dims) if as_int(d) != 1]
    if len(big) <= 1:
        return [offset if p in big else z3.IntVal(0) for p in range(len(dims))]
    out = []
    for p, d in enumerate(dims):
        inner = prod(dims[p + 1:])
        out.append(z3.IntVal(0) if as_int(d) == 1 else simp((offset / inner) % d))
    return out


def _regroup(side, x: Tensor, out_dims: List[Any]) -> Tensor:
    side.require(prod(out_dims) == prod(x.dims))
    if len(out_dims) == x.rank and all(z3.eq(simp(a), simp(b)) for a, b in zip(out_dims, x.dims)):
        return Tensor(list(out_dims), x.elem, x.kind)
    return Tensor(list(out_dims), lambda idx: x.elem(unlinear(linear(idx, out_dims), x.dims)), x.kind)


@op("Reshape")
def _reshape(side, ins, at):
    x = ins[0]
    spec = at.concrete_ints("shape")
    if spec is None:
        raise Unsupported("Reshape without a shape attribute")
    allowzero = at.int("allowzero", 0)
    out: List[Any] = []
    for p, s in enumerate(spec):
        if s == 0 and not allowzero:
            if p >= x.rank:
                raise Unsupported("Reshape copies a dim the input does not have")
            out.append(x.dims[p])
        elif s < -1 or (s == 0 and allowzero):
            raise Unsupported(f"Reshape shape entry {s}")
        else:
            out.append(z3.IntVal(s))
    if spec.count(-1) > 1:
        raise Unsupported("Reshape with two -1 entries")
    if -1 in spec:
        k = spec.index(-1)
        known = prod([d for j, d in enumerate(out) if j != k])
        total = prod(x.dims)
        side.require(total % known == 0)
        out[k] = simp(total / known) if as_int(known) != 1 else total
    return _regroup(side, x, out)


@op("Flatten")
def _flatten(side, ins, at):
    x = ins[0]
    a = at.int("axis", 1)
    a = a + x.rank if a < 0 else a
    if not 0 <= a <= x.rank:
        raise Unsupported("Flatten axis out of range")
    head, tail = x.dims[:a], x.dims[a:]

    def elem(idx):
        return x.elem(unlinear(idx[0], head) + unlinear(idx[1], tail))
    return Tensor([prod(head), prod(tail)], elem, x.kind)


def _axes(at: Attrs, name: str, rank: int) -> List[int]:
    axes = at.concrete_ints(name)
    if axes is None:
        raise Unsupported(f"{name} must be given")
    out = []
    for a in axes:
        if not -rank <= a < rank:
            raise Unsupported(f"axis {a} out of range for rank {rank}")
        out.append(a + rank if a < 0 else a)
    if len(set(out)) != len(out):
        raise Unsupported("repeated axes")
    return out


@op("Squeeze")
def _squeeze(side, ins, at):
    x = ins[0]
    axes = _axes(at, "axes", x.rank)
    for a in axes:
        side.require(x.dims[a] == 1)
    keep = [p for p in range(x.rank) if p not in axes]

    def elem(idx):
        src = [z3.IntVal(0)] * x.rank
        for j, p in enumerate(keep):
            src[p] = idx[j]
        return x.elem(src)
    return Tensor([x.dims[p] for p in keep], elem, x.kind)


@op("Unsqueeze")
def _unsqueeze(side, ins, at):
    x = ins[0]
    n = len(at.concrete_ints("axes") or [])
    r = x.rank + n
    axes = _axes(at, "axes", r)
    keep = [p for p in range(r) if p not in axes]
    dims: List[Any] = [z3.IntVal(1)] * r
    for j, p in enumerate(keep):
        dims[p] = x.dims[j]
    return Tensor(dims, lambda idx: x.elem([idx[p] for p in keep]), x.kind)


@op("Concat")
def _concat(side, ins, at):
    xs = [t for t in ins if t is not None]
    r = xs[0].rank
    a = at.int("axis")
    if not -r <= a < r:
        raise Unsupported("Concat axis out of range")
    a = a + r if a < 0 else a
    for t in xs[1:]:
        if t.rank != r:
            raise Unsupported("Concat of different ranks")
        for p in range(r):
            if p != a:
                side.require(t.dims[p] == xs[0].dims[p])
    offsets = [z3.IntVal(0)]
    for t in xs:
        offsets.append(simp(offsets[-1] + t.dims[a]))
    dims = list(xs[0].dims)
    dims[a] = offsets[-1]

    def elem(idx):
        out = None
        for t, off in reversed(list(zip(xs, offsets))):
            v = t.elem([simp(i - off) if p == a else i for p, i in enumerate(idx)])
            out = v if out is None else z3.If(idx[a] < off + t.dims[a], v, out)
        return out
    return Tensor(dims, elem, xs[0].kind)


def slice_bounds(d, s, e, step):
    """ONNX Slice's effective start and length along an axis of size ``d`` (negative and clamped ends)."""
    s = z3.If(s < 0, s + d, s)
    e = z3.If(e < 0, e + d, e)
    pos = step > 0
    s = z3.If(pos, zmin(zmax(s, 0), d), zmin(zmax(s, 0), d - 1))
    e = z3.If(pos, zmin(zmax(e, 0), d), zmin(zmax(e, -1), d - 1))
    span = z3.If(pos, e - s, s - e)
    mag = z3.If(pos, step, -step)
    n = z3.If(span > 0, (span + mag - 1) / mag, 0)
    return simp(s), simp(n)


@op("Slice")
def _slice(side, ins, at):
    x = ins[0]
    starts, ends = at.ints("starts"), at.ints("ends")
    if starts is None or ends is None:
        raise Unsupported("Slice without starts/ends")
    r = x.rank
    axes = at.ints("axes") if at.get("axes") is not None else [z3.IntVal(j) for j in range(len(starts))]
    steps = at.ints("steps") or [z3.IntVal(1)] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise Unsupported("Slice lists of different lengths")
    norm = []
    for a in axes:  # an axis may be a variable: every position it can name is a case
        side.require(z3.And(a >= -r, a < r))
        norm.append(simp(z3.If(a < 0, a + r, a)))
    for a, b in itertools.combinations(norm, 2):
        side.require(a != b)
    dims = list(x.dims)
    first: List[Any] = [z3.IntVal(0)] * r
    step_of: List[Any] = [z3.IntVal(1)] * r
    touched = [False] * r
    for s, e, a, st in zip(starts, ends, norm, steps):
        side.require(st != 0)
        for p in range(r):
            if as_int(a) is not None and as_int(a) != p:
                continue
            b, n = slice_bounds(x.dims[p], s, e, st)
            here = a == p
            dims[p] = simp(z3.If(here, n, dims[p]))
            first[p] = simp(z3.If(here, b, first[p]))
            step_of[p] = simp(z3.If(here, st, step_of[p]))
            touched[p] = True

    def elem(idx):
        return x.elem([simp(first[p] + i * step_of[p]) if touched[p] else i for p, i in enumerate(idx)])
    return Tensor(dims, elem, x.kind)


@op("Pad")
def _pad(side, ins, at):
    x = ins[0]
    pads = at.ints("pads")
    if pads is None:
        raise Unsupported("Pad without pads")
    axes = _axes(at, "axes", x.rank) if at.get("axes") is not None else list(range(x.rank))
    n = len(axes)
    if len(pads) != 2 * n:
        raise Unsupported("pads of the wrong length")
    begin, end = [z3.IntVal(0)] * x.rank, [z3.IntVal(0)] * x.rank
    for j, a in enumerate(axes):
        begin[a], end[a] = pads[j], pads[j + n]
    mode = at.get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    dims = [simp(d + b + e) for d, b, e in zip(x.dims, begin, end)]
    zero = all(as_int(p) == 0 for p in pads)
    if zero or mode in ("reflect", "wrap"):
        if not zero:
            raise Unsupported(f"Pad mode {mode!r} with symbolic pads")
        return Tensor(dims, x.elem, x.kind)
    if mode == "edge":
        return Tensor(dims, lambda idx: x.elem([zmin(zmax(i - b, 0), d - 1) for i, b, d in zip(idx, begin, x.dims)]),
                      x.kind)
    if mode != "constant":
        raise Unsupported(f"Pad mode {mode!r}")
    cv = at.scalar("constant_value")
    cv = side.dom.const(0.0) if cv is None else side.dom.lift(cv)

    def elem(idx):
        src = [simp(i - b) for i, b in zip(idx, begin)]
        # an axis padded by nothing needs no test: its index is within the output's dim, the input's
        inside = z3.And([z3.And(j >= 0, j < d) for j, d, b, e in zip(src, x.dims, begin, end)
                         if not (as_int(b) == 0 and as_int(e) == 0)])
        return z3.If(inside, x.elem(src), cv)
    return Tensor(dims, elem, x.kind)


@op("Expand")
def _expand(side, ins, at):
    x = ins[0]
    shape = at.ints("shape")
    if shape is None:
        raise Unsupported("Expand without shape")
    for s in shape:
        side.require(s >= 1)
    dims = broadcast(side, [x.dims, list(shape)])
    return Tensor(dims, lambda idx: x.elem(bcast_index(x.dims, idx, dims)), x.kind)


def _to_float(side: Side, n):
    """An Int count as the domain's number (rounded to float32 in the IEEE domain, like dom.const(float))."""
    r = z3.ToReal(n)
    return r if side.dom.name == "real" else z3.fpToFP(z3.RNE(), r, sem.FP32)


def _fold_sum(side, extents, body, guard=None):
    return side.fold("sum", extents, body, guard)


@op("MatMul")
def _matmul(side, ins, at):
    """numpy's matmul for a of rank 1, 2 or 3 and b of rank 1 or 2: a vector operand is a row (a) or a
    column (b) whose axis is dropped from the output; a's leading axis at rank 3 is a batch axis (b has none,
    so nothing is broadcast)."""
    a, b = ins[0], ins[1]
    if a.rank not in (1, 2, 3) or b.rank not in (1, 2) or (a.rank == 3 and b.rank != 2):
        raise Unsupported("MatMul of ranks other than (1|2|3, 2) or (1|2, 1)")
    k_a, k_b = a.dims[-1], b.dims[0]
    side.require(k_a == k_b)
    batch = list(a.dims[:-2]) if a.rank == 3 else []
    rows = [a.dims[-2]] if a.rank >= 2 else []
    cols = [b.dims[1]] if b.rank == 2 else []

    def elem(idx):
        nb, nr = len(batch), len(rows)
        pre, i, j = list(idx[:nb]), list(idx[nb:nb + nr]), list(idx[nb + nr:])
        return _fold_sum(side, [k_a], lambda ks: side.dom.mul(a.elem(pre + i + [ks[0]]), b.elem([ks[0]] + j)))
    return Tensor(batch + rows + cols, elem)


@op("Gemm")
def _gemm(side, ins, at):
    a, b = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    if a.rank != 2 or b.rank != 2:
        raise Unsupported("Gemm of rank other than 2")
    ta, tb = at.int("transA", 0), at.int("transB", 0)
    m, k = (a.dims[1], a.dims[0]) if ta else (a.dims[0], a.dims[1])
    k2, n = (b.dims[1], b.dims[0]) if tb else (b.dims[0], b.dims[1])
    side.require(k == k2)
    dom = side.dom
    alpha, beta = at.scalar("alpha"), at.scalar("beta")
    alpha = 1.0 if alpha is None else alpha
    beta = 1.0 if beta is None else beta
    if c is not None:
        if c.rank > 2:
            raise Unsupported("Gemm C of rank > 2")
        broadcast(side, [[m, n], c.dims])
        for d, e in zip(c.dims[::-1], [n, m]):
            side.require(z3.Or(d == e, d == 1))

    def elem(idx):
        i, j = idx

        def term(ks):
            av = a.elem([ks[0], i] if ta else [i, ks[0]])
            bv = b.elem([j, ks[0]] if tb else [ks[0], j])
            return dom.mul(av, bv)
        y = _fold_sum(side, [k], term)
        if sem._py_number(alpha) is None or float(sem._py_number(alpha)) != 1.0:
            y = dom.mul(y, dom.lift(alpha))
        bn = sem._py_number(beta)
        if c is None or (bn is not None and float(bn) == 0.0):
            return y
        cv = c.elem(bcast_index(c.dims, [i, j], [m, n]))
        if bn is not None and float(bn) == 1.0:
            return dom.add(y, cv)
        be = dom.lift(beta)
        if dom.name == "real":
            return dom.add(y, dom.mul(cv, be))
        return dom.ite(dom.eq(be, dom.const(0.0)), y, dom.add(y, dom.mul(cv, be)))
    return Tensor([m, n], elem)


def _window_attrs(side: Side, at: Attrs, spatial: List[Any], kernel: List[Any], op_name: str):
    """(output sizes, begin pads, strides, dilations) of a sliding window, each a list of Int terms."""
    ns = len(spatial)
    if at.rest is not None:
        for name in ("pads", "strides", "dilations", "auto_pad", "kernel_shape", "group", "ceil_mode"):
            if at.given(name):
                raise Unsupported(f"{op_name} with both {name}= and ..{at.rest.name}")
        r = at.rest.name
        strides = [z3.Int(f"{r}.strides{j}") for j in range(ns)]
        dils = [z3.Int(f"{r}.dilations{j}") for j in range(ns)]
        # Explicit pads or auto_pad: either way some begin/end padding that depends on the input size and
        # the kernel only; the same rest on the same sizes gives the same padding.
        fb = [z3.Function(f"{r}.pad_begin{j}", z3.IntSort(), z3.IntSort(), z3.IntSort()) for j in range(ns)]
        fe = [z3.Function(f"{r}.pad_end{j}", z3.IntSort(), z3.IntSort(), z3.IntSort()) for j in range(ns)]
        begins = [fb[j](spatial[j], kernel[j]) for j in range(ns)]
        ends = [fe[j](spatial[j], kernel[j]) for j in range(ns)]
        side.rests.setdefault(r, {}).update(strides=strides, dilations=dils, pads=begins + ends)
    else:
        auto = at.get("auto_pad", "NOTSET")
        if auto not in ("NOTSET", b"NOTSET", "VALID", b"VALID"):
            raise Unsupported(f"auto_pad {auto!r}")
        if at.int("ceil_mode", 0) if op_name != "Conv" else 0:
            raise Unsupported("ceil_mode")
        strides = at.ints("strides") or [z3.IntVal(1)] * ns
        dils = at.ints("dilations") or [z3.IntVal(1)] * ns
        pads = at.ints("pads") or [z3.IntVal(0)] * (2 * ns)
        if auto in ("VALID", b"VALID"):
            pads = [z3.IntVal(0)] * (2 * ns)
        if len(strides) != ns or len(dils) != ns or len(pads) != 2 * ns:
            raise Unsupported("window attributes of the wrong length")
        begins, ends = pads[:ns], pads[ns:]
    outs = []
    for h, k, s, d, b, e in zip(spatial, kernel, strides, dils, begins, ends):
        side.require(z3.And(s >= 1, d >= 1, b >= 0, e >= 0))
        span = simp(h + b + e - (d * (k - 1) + 1))
        side.require(span >= 0)
        outs.append(simp(span / s + 1) if as_int(s) != 1 else simp(span + 1))
    return outs, begins, ends, strides, dils


def _positions(o, k, begins, strides, dils):
    return [simp(oo * s - b + kk * d) for oo, kk, s, b, d in zip(o, k, strides, begins, dils)]


def _inside(pos, dims):
    return z3.And([z3.And(p >= 0, p < h) for p, h in zip(pos, dims)])


@op("Conv")
def _conv(side, ins, at):
    x, w = ins[0], ins[1]
    bias = ins[2] if len(ins) > 2 else None
    r = x.rank
    if r < 3 or w.rank != r:
        raise Unsupported("Conv ranks")
    ns = r - 2
    kernel = w.dims[2:]
    if at.rest is None and at.get("kernel_shape") is not None:
        for a, b in zip(at.ints("kernel_shape"), kernel):
            side.require(a == b)
    g = z3.Int(f"{at.rest.name}.group") if at.rest is not None else iv(at.get("group", 1))
    if at.rest is not None:
        side.rests.setdefault(at.rest.name, {})["group"] = g
    n, c = x.dims[:2]
    m, cg = w.dims[:2]
    side.require(z3.And(g >= 1, c == cg * g, m % g == 0))
    if bias is not None:
        if bias.rank != 1:
            raise Unsupported("Conv bias of rank other than 1")
        side.require(bias.dims[0] == m)
    outs, begins, _e, strides, dils = _window_attrs(side, at, x.dims[2:], kernel, "Conv")
    dom = side.dom
    mg = simp(m / g) if as_int(g) != 1 else m
    zero = dom.const(0.0)

    def elem(idx):
        bi, mi, o = idx[0], idx[1], idx[2:]
        gi = simp(mi / mg) if as_int(g) != 1 else z3.IntVal(0)

        def term(ks):
            ci, k = ks[0], ks[1:]
            pos = _positions(o, k, begins, strides, dils)
            xv = z3.If(_inside(pos, x.dims[2:]), x.elem([bi, simp(gi * cg + ci)] + pos), zero)
            return dom.mul(xv, w.elem([mi, ci] + list(k)))
        acc = _fold_sum(side, [cg] + list(kernel), term)
        return acc if bias is None else dom.add(acc, bias.elem([mi]))
    return Tensor([n, m] + outs, elem)


@op("BatchNormalization")
def _batchnorm(side, ins, at):
    x = ins[0]
    if at.rest is not None or at.int("training_mode", 0):
        raise Unsupported("BatchNormalization in training mode")
    params = ins[1:5]
    if x.rank < 2 or any(p is None or p.rank != 1 for p in params):
        raise Unsupported("BatchNormalization shapes")
    for p in params:
        side.require(p.dims[0] == x.dims[1])
    eps = at.scalar("epsilon")
    sa = {"epsilon": eps} if eps is not None else {}

    def elem(idx):
        xv = np.empty((1, 1), dtype=object)
        xv[0, 0] = x.elem(idx)
        ps = []
        for p in params:
            a = np.empty((1,), dtype=object)
            a[0] = p.elem([idx[1]])
            ps.append(a)
        try:
            return sem.evaluate(side.dom, "BatchNormalization", [xv] + ps, sa)[0][0, 0]
        except UnsupportedOpError as e:
            raise Unsupported(str(e)) from None
    return Tensor(list(x.dims), elem)


def _reduce(side: Side, x: Tensor, axes: List[int], keepdims: bool, kind: str, post=None) -> Tensor:
    kept = [p for p in range(x.rank) if p not in axes]
    ext = [x.dims[a] for a in sorted(axes)]
    dims = [z3.IntVal(1) if p in axes else x.dims[p] for p in range(x.rank)] if keepdims else [x.dims[p] for p in kept]

    def elem(idx):
        outer = list(idx) if keepdims else None

        def body(ks):
            src = [None] * x.rank
            for a, k in zip(sorted(axes), ks):
                src[a] = k
            for j, p in enumerate(kept):
                src[p] = outer[p] if keepdims else idx[j]
            return x.elem(src)
        v = side.fold(kind, ext, body)
        return post(v, prod(ext)) if post else v
    return Tensor(dims, elem, x.kind)


def _reduce_op(kind, mean=False):
    def run(side, ins, at):
        x = ins[0]
        if at.rest is not None:
            raise Unsupported("a reduction with ..rest")
        if at.get("axes") is None:
            if at.int("noop_with_empty_axes", 0):
                raise Unsupported("noop_with_empty_axes")
            axes = list(range(x.rank))
        else:
            axes = _axes(at, "axes", x.rank)
        if not axes:
            raise Unsupported("an empty reduction")
        post = (lambda v, cnt: side.dom.div(v, _to_float(side, cnt))) if mean else None
        return _reduce(side, x, axes, bool(at.int("keepdims", 1)), kind, post)
    return run


OPS["ReduceSum"] = _reduce_op("sum")
OPS["ReduceMean"] = _reduce_op("sum", mean=True)
OPS["ReduceMax"] = _reduce_op("max")


@op("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(side, ins, at):
    x = ins[0]
    if x.rank < 3:
        raise Unsupported("global pooling of rank < 3")
    axes = list(range(2, x.rank))
    if at.op == "GlobalMaxPool":
        return _reduce(side, x, axes, True, "max")
    return _reduce(side, x, axes, True, "sum", lambda v, cnt: side.dom.div(v, _to_float(side, cnt)))


@op("AveragePool", "MaxPool")
def _pool(side, ins, at):
    x = ins[0]
    opname = at.op
    if x.rank < 3 or at.rest is not None:
        raise Unsupported("pool shapes")
    kernel = at.ints("kernel_shape")
    if kernel is None or len(kernel) != x.rank - 2:
        raise Unsupported("pool kernel_shape")
    for k in kernel:
        side.require(k >= 1)
    outs, begins, ends, strides, dils = _window_attrs(side, at, x.dims[2:], kernel, opname)
    # every window lies inside the padded input (ceil_mode 0): the count with padding is the kernel size
    padded_zero = all(as_int(b) == 0 for b in begins + ends)
    dom = side.dom

    def elem(idx):
        nc, o = idx[:2], idx[2:]
        pos_of = lambda ks: _positions(o, ks, begins, strides, dils)  # noqa: E731
        guard = None if padded_zero else (lambda ks: _inside(pos_of(ks), x.dims[2:]))

        def body(ks):
            pos = pos_of(ks)
            return x.elem(list(nc) + pos) if padded_zero else z3.If(_inside(pos, x.dims[2:]),
                                                                  x.elem(list(nc) + pos), dom.const(0.0))
        if opname == "MaxPool":
            if not padded_zero and dom.name == "real":
                raise Unsupported("MaxPool with padding over the reals")
            return side.fold("nanmax", kernel, body, guard)
        if not padded_zero and not at.int("count_include_pad", 0):
            raise Unsupported("AveragePool with padding that does not count")
        return dom.div(side.fold("sum", kernel, body, guard), _to_float(side, prod(kernel)))
    return Tensor(list(x.dims[:2]) + outs, elem)


# --- ranks ---------------------------------------------------------------------------------------------
# RANKS[op](ins, at, out): the constraints an op puts on the ranks of its inputs and output (Z3 Ints).
# ``at(name)`` gives an attribute's length (lists; a Z3 Int for a list variable) or value (ints), or None
# when absent. The generic prover proves a rule for every rank these constraints allow, so they must allow
# at least every rank the op accepts; a rule whose ranks they leave unbounded gets no generic verdict.

RANKS: Dict[str, Callable] = {}


def ranks(*names):
    def deco(fn):
        for n in names:
            RANKS[n] = fn
        return fn
    return deco


def _zmax_all(xs):
    out = xs[0]
    for x in xs[1:]:
        out = zmax(out, x)
    return out


@ranks(*sorted(ELEMENTWISE))
def _r_elementwise(ins, at, out):
    xs = [r for r in ins if r is not None]
    return [out == _zmax_all(xs)]


@ranks("Dropout")
def _r_dropout(ins, at, out):
    return [out == ins[0]] + [r == 0 for r in ins[1:] if r is not None]


@ranks("Transpose")
def _r_transpose(ins, at, out):
    n = at("perm")
    return [out == ins[0]] + ([ins[0] == n] if n is not None else [])


@ranks("Reshape")
def _r_reshape(ins, at, out):
    n = at("shape")
    return [out == n] if n is not None else [z3.BoolVal(False)]


@ranks("Flatten")
def _r_flatten(ins, at, out):
    return [out == 2]


@ranks("Squeeze")
def _r_squeeze(ins, at, out):
    n = at("axes")
    return [out == ins[0] - n] if n is not None else [out <= ins[0]]


@ranks("Unsqueeze")
def _r_unsqueeze(ins, at, out):
    n = at("axes")
    return [out == ins[0] + n] if n is not None else [z3.BoolVal(False)]


@ranks("Concat")
def _r_concat(ins, at, out):
    return [out == r for r in ins if r is not None]


@ranks("Slice")
def _r_slice(ins, at, out):
    return [out == ins[0]]


@ranks("Pad")
def _r_pad(ins, at, out):
    n, axes = at("pads"), at("axes")
    cs = [out == ins[0]]
    if n is not None:
        cs.append(n == 2 * (axes if axes is not None else ins[0]))
    return cs


@ranks("Expand")
def _r_expand(ins, at, out):
    n = at("shape")
    return [out == zmax(ins[0], n)] if n is not None else [out >= ins[0]]


@ranks("MatMul")
def _r_matmul(ins, at, out):
    a, b = ins[0], ins[1]
    vec = z3.If(a == 1, b - 1, z3.If(b == 1, a - 1, zmax(a, b)))
    return [a >= 1, b >= 1, out == z3.If(z3.And(a == 1, b == 1), 0, vec)]


@ranks("Gemm")
def _r_gemm(ins, at, out):
    return [ins[0] == 2, ins[1] == 2, out == 2] + ([ins[2] <= 2] if len(ins) > 2 and ins[2] is not None else [])


@ranks("Conv")
def _r_conv(ins, at, out):
    x = ins[0]
    cs = [x >= 3, ins[1] == x, out == x] + ([ins[2] == 1] if len(ins) > 2 and ins[2] is not None else [])
    for name, mult in (("strides", 1), ("dilations", 1), ("kernel_shape", 1), ("pads", 2)):
        n = at(name)
        if n is not None:
            cs.append(n == mult * (x - 2))
    return cs


@ranks("BatchNormalization")
def _r_batchnorm(ins, at, out):
    return [ins[0] >= 1, out == ins[0]] + [r == 1 for r in ins[1:] if r is not None]


@ranks("ReduceSum", "ReduceMean", "ReduceMax")
def _r_reduce(ins, at, out):
    n, keep = at("axes"), at("keepdims")
    keep = 1 if keep is None else keep
    if isinstance(keep, z3.ExprRef):
        return [z3.BoolVal(False)]
    if keep:
        return [out == ins[0]]
    return [out == ins[0] - n] if n is not None else [out == 0]


@ranks("GlobalAveragePool", "GlobalMaxPool")
def _r_global(ins, at, out):
    return [ins[0] >= 2, out == ins[0]]


@ranks("AveragePool", "MaxPool")
def _r_pool(ins, at, out):
    x = ins[0]
    cs = [x >= 3, out == x]
    for name, mult in (("strides", 1), ("dilations", 1), ("kernel_shape", 1), ("pads", 2)):
        n = at(name)
        if n is not None:
            cs.append(n == mult * (x - 2))
    return cs
