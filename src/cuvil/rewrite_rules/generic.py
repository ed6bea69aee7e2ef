"""Shape- and attribute-generic proofs of structured rules (pads, axes, perms, strides, reductions).

The concrete prover (:mod:`cuvil.rewrite_rules.prove`) evaluates a rule on small shapes with every element
a Z3 variable, which says nothing about the shapes and attribute values it did not try (a Conv pads rule
proved only where t = l = d = r). Here a rule is proved once for every shape and attribute value:

* **Ranks.** Every op constrains the ranks of its inputs and output (:data:`index_semantics.RANKS`); with
  the guards (``rank(x) == 4``), the lengths of literal lists (``perm=[0, 2, 3, 1]``, ``pads=[...]``) and
  the engine's rule that the replacement has the root's type, Z3 finds every rank the rule can match. If a
  rank or a list variable's length is unbounded the rule is outside this fragment (no verdict); else the
  proof below runs for each of the (few) rank assignments, which together cover every shape.
* **Dims and attributes.** For fixed ranks, each leaf's dims are Z3 ``Int`` variables (>= 1: tensors are
  non-empty), attributes bound to rule variables are Z3 ``Int`` (or float) variables, literal attributes
  are concrete, and the attributes a ``..rest`` binds are unknown but the same on both sides (a Conv's
  strides, dilations and group as variables, its begin/end padding as unknown functions of the input size
  and kernel size, which covers explicit pads and every ``auto_pad``).
* **The obligation.** At a symbolic output index ``i`` inside the output dims, under the guards, the
  validity conditions of the pattern's nodes (what shape inference requires of them) and the engine's
  check that both sides have the same type (so the same dims), the replacement's nodes must be valid and
  its element at ``i`` must equal the pattern's: bit for bit in float32 for ``prove exact`` (the prover's
  FP32Domain equality: +0 and -0 differ, NaN equals NaN), over the reals where the pattern is defined for
  ``prove real`` (definedness of every element the output reads). Element terms come from the op index
  semantics of :mod:`cuvil.rewrite_rules.index_semantics`, whose scalar arithmetic is :mod:`cuvil.rewrite_rules.semantics`'s.
* **Reductions.** A sum over a symbolic extent cannot be expanded. Each reduction is a fold: (kind,
  extents, body at symbolic reduction indices k, optional filter), standing in the element term for a fresh
  constant. Two folds are taken as equal when, under the assumptions, their kinds and extents are equal and
  their bodies (and filters) are equal for every k in range. This is sound for ``exact`` too: a fold adds
  its terms left to right in row-major order of its extents, starting from the first term, on both sides
  alike, so equal extents and pointwise-equal bodies give the same sequence of float operations, hence the
  same bits. Over the reals, factors of a sum's body that do not depend on k are first moved out of the sum
  (distributivity), which is what weight folding (Conv + BatchNormalization) needs. Folds nested in folds
  are outside the fragment.

A refutation is never read off the abstraction: when the generic obligation fails, the failing model gives
small concrete dims and attribute values, and :mod:`cuvil.rewrite_rules.generic_refute` checks that
instance with the concrete prover's semantics (every element a variable); only a real difference there is
"refuted", with its counterexample. Anything else (an op or guard without index semantics, an unbounded
rank, Z3 answering unknown) gives None: no verdict, never a wrong "proved".
"""
from __future__ import annotations

import itertools
from typing import Any, Dict, List, Optional, Tuple

import attrs
import onnx
import z3

from ..dsl.ast import Compare, Expr, FuncCall, ListLit, Num, OpCall, Rule, Var, Wildcard
from ..dsl.cases import expand_cases
from ..errors import UnsupportedOpError
from ..ir.registry import attr_defaults, lookup, op_schema
from . import index_semantics as ix
from .generic_refute import GenericResult, quick_refute, refute
from .index_semantics import Unsupported
from .sum_normal import Normaliser

MAX_RANK = 8            # a rank or list length that can exceed this is "unbounded"
MAX_COMBOS = 16         # rank assignments proved at most
MAX_PERMUTED = 4        # a real sum's indices are matched in every order up to this many indices
READ_MS = 3000          # per attempt to prove two reads of an input at the same index (unknown: kept apart)
STRING_CHOICES = {("Pad", "mode"): ("constant", "reflect", "edge", "wrap")}


def prove_generic(rule: Rule, timeout_ms: int) -> Optional[GenericResult]:
    """None when the rule is outside the generic fragment or Z3 answers unknown."""
    return explain_generic(rule, timeout_ms)[0]


def explain_generic(rule: Rule, timeout_ms: int) -> Tuple[Optional[GenericResult], str]:
    """The verdict and, when there is none, why. A rule with optional inputs is proved case by case
    (:func:`cuvil.dsl.cases.expand_cases`): proved if every case is, refuted if one is (the case named)."""
    cases = expand_cases(rule)
    if len(cases) > 1:
        results = []
        for label, case in cases:
            res, why = _explain_case(case, timeout_ms)
            if res is None:
                return None, f"{label}: {why}"
            if res.status == "refuted":
                return attrs.evolve(res, counterexample=f"{label}: {res.counterexample}"), ""
            results.append((label, res))
        prefix = "generic: "
        return GenericResult("proved", prefix + "; ".join(
            f"{label}: {res.coverage[len(prefix):] if res.coverage.startswith(prefix) else res.coverage}"
            for label, res in results)), ""
    return _explain_case(rule, timeout_ms)


def _explain_case(rule: Rule, timeout_ms: int) -> Tuple[Optional[GenericResult], str]:
    try:
        return _Proof(rule, timeout_ms).run(), ""
    except Unsupported as e:
        return None, str(e)
    except Exception as e:  # noqa: BLE001 - a prover failure is "no verdict" with its reason, never a traceback
        return None, f"{type(e).__name__}: {e}"


# --- the rule's variables --------------------------------------------------------------------------

def _ops(e: Expr):
    if isinstance(e, OpCall):
        yield e
        for a in e.args:
            yield from _ops(a)


def _attr_kind(op: str, name: str, in_list: bool) -> str:
    """"int", "ints", "float" or "string": how a variable bound to this attribute is represented."""
    try:
        lifted = {n: kind for n, _, kind in lookup(op).lifted}
    except UnsupportedOpError:
        lifted = {}
    if name in lifted:
        if lifted[name] == "data":
            return "float"
        return "int" if in_list else "ints"
    a = op_schema(op).attributes.get(name)
    t = None if a is None else a.type
    if t == onnx.AttributeProto.FLOAT:
        return "float"
    if t == onnx.AttributeProto.INT:
        return "int"
    if t == onnx.AttributeProto.INTS:
        return "int" if in_list else "ints"
    if t == onnx.AttributeProto.STRING:
        return "string"
    raise Unsupported(f"{op}'s attribute {name!r} has no generic representation")


def _name_wildcards(rule: Rule) -> Rule:
    """``attr=_`` matches any value: each becomes a fresh variable, so the proof covers every value."""
    counter = itertools.count()

    def item(p):
        return Var(f"any.{next(counter)}", p.loc) if isinstance(p, Wildcard) else p

    def fix(e):
        if isinstance(e, OpCall):
            at = tuple((n, attrs.evolve(p, items=tuple(item(x) for x in p.items))
                        if isinstance(p, ListLit) else item(p)) for n, p in e.attrs)
            return attrs.evolve(e, args=tuple(fix(a) for a in e.args), attrs=at)
        return e

    return attrs.evolve(rule, lhs=fix(rule.lhs))


class _Vars:
    """What the pattern binds: leaves (values), attribute variables and their kinds, rests."""

    def __init__(self, rule: Rule):
        self.leaves: Dict[str, str] = {}          # name -> "float" / "bool"
        self.anon: Dict[int, str] = {}            # id of a Wildcard or Num input of the pattern -> leaf name
        self.literal: Dict[str, Any] = {}         # leaf name of a pattern literal -> its value
        self.attrs: Dict[str, Tuple[str, str, str]] = {}   # attribute variable -> (kind, op, attribute)
        self.rests: Dict[str, str] = {}           # rest name -> op
        for c in _ops(rule.lhs):
            for k, a in enumerate(c.args):
                if isinstance(a, Var):
                    self.leaves.setdefault(a.name, "bool" if _bool_input(c.op, k) else "float")
                elif isinstance(a, (Wildcard, Num)):
                    name = f"in.{len(self.anon)}"
                    self.anon[id(a)] = name
                    self.leaves[name] = "bool" if _bool_input(c.op, k) else "float"
                    if isinstance(a, Num):
                        self.literal[name] = a.value
            for name, p in c.attrs:
                if isinstance(p, Var):
                    self._bind(p.name, _attr_kind(c.op, name, False), c.op, name)
                elif isinstance(p, ListLit):
                    for x in p.items:
                        if isinstance(x, Var):
                            self._bind(x.name, _attr_kind(c.op, name, True), c.op, name)
            if c.rest:
                self.rests[c.rest] = c.op

    def _bind(self, var, kind, op, name):
        old = self.attrs.setdefault(var, (kind, op, name))
        if old[0] != kind:
            raise Unsupported(f"{var!r} is bound to attributes of different kinds")


def _bool_input(op: str, i: int) -> bool:
    try:
        schema = op_schema(op)
    except Exception:  # noqa: BLE001 - kernel-only ops have no schema
        return False
    if not schema.inputs:
        return False
    formal = schema.inputs[min(i, len(schema.inputs) - 1)]
    allowed = {tc.type_param_str: list(tc.allowed_type_strs) for tc in schema.type_constraints}
    return allowed.get(formal.type_str, [formal.type_str]) == ["tensor(bool)"]


# --- ranks -----------------------------------------------------------------------------------------

class _Ranks:
    """The ranks (and list lengths) the rule can match with, by Z3 over the ops' rank constraints."""

    def __init__(self, rule: Rule, v: _Vars):
        self.rule, self.v = rule, v
        self.leaf = {n: z3.Int(f"rank.{n}") for n in v.leaves}
        self.length = {n: z3.Int(f"len.{n}") for n, (k, _, _) in v.attrs.items() if k == "ints"}
        self.node: Dict[int, Any] = {}
        self.cs: List[Any] = [r >= 0 for r in self.leaf.values()] + [n >= 0 for n in self.length.values()]
        lhs, rhs = self.of(rule.lhs, True), self.of(rule.rhs, False)
        self.cs.append(lhs == rhs)  # the engine applies a rule only where both sides have the same type
        for g in rule.guards:
            self.cs += self.guard(g)

    def of(self, e: Expr, lhs: bool):
        if isinstance(e, Var):
            if e.name in self.leaf:
                return self.leaf[e.name]
            kind = self.v.attrs.get(e.name, ("?",))[0]
            if kind == "float":
                return z3.IntVal(0)
            raise Unsupported(f"{e.name!r} is used as a value but bound to an attribute")
        if isinstance(e, (Wildcard, Num)):
            if lhs:
                return self.leaf[self.v.anon[id(e)]]
            if isinstance(e, Num):
                return z3.IntVal(0)
            raise Unsupported("a wildcard in the replacement")
        if isinstance(e, OpCall):
            fn = ix.RANKS.get(e.op)
            if fn is None or e.op not in ix.OPS:
                raise Unsupported(f"{e.op} has no index semantics")
            ins = [self.of(a, lhs) for a in e.args]
            out = z3.Int(f"rank.node{len(self.node)}")
            self.node[id(e)] = out
            explicit = dict(e.attrs)

            def at(name):
                p = explicit.get(name)
                if p is None:
                    return None
                if isinstance(p, ListLit):
                    return z3.IntVal(len(p.items))
                if isinstance(p, Num):
                    return p.value
                if isinstance(p, Var) and p.name in self.length:
                    return self.length[p.name]
                if isinstance(p, Var) and self.v.attrs.get(p.name, ("",))[0] == "int":
                    return z3.Int(f"attr.{p.name}")
                return None
            self.cs += fn(ins, at, out)
            return out
        raise Unsupported(f"cannot express {type(e).__name__} as a value")

    def guard(self, g) -> List[Any]:
        if isinstance(g, FuncCall):
            return []
        out = []
        left, right = self.term(g.left), self.term(g.right)
        if left is not None and right is not None:
            out.append(_compare(g.op, left, right))
        for side in (g.left, g.right):
            if isinstance(side, FuncCall) and side.name == "shape":
                other = g.right if side is g.left else g.left
                r = self.leaf.get(side.args[0].name)
                if isinstance(other, FuncCall) and other.name == "shape":
                    out.append(r == self.leaf.get(other.args[0].name))
                elif isinstance(other, Var) and other.name in self.length:
                    out.append(r == self.length[other.name])
                elif isinstance(other, ListLit):
                    out.append(r == len(other.items))
            if isinstance(side, FuncCall) and side.name == "dim":
                r, i = self.leaf[side.args[0].name], side.args[1]
                if isinstance(i, Num):
                    out.append(z3.And(-r <= i.value, i.value < r))
        return out

    def term(self, e):
        if isinstance(e, Num) and isinstance(e.value, int):
            return z3.IntVal(e.value)
        if isinstance(e, FuncCall) and e.name == "rank":
            return self.leaf[e.args[0].name]
        return None

    def assignments(self) -> List[Dict[str, int]]:
        keys = list(self.leaf.items()) + list(self.length.items())
        s = z3.Solver()
        s.add(*self.cs)
        for name, var in keys:
            s.push()
            s.add(var > MAX_RANK)
            unbounded = s.check() != z3.unsat
            s.pop()
            if unbounded:
                what = f"the rank of {name!r}" if name in self.leaf else f"the length of {name!r}"
                raise Unsupported(f"{what} is not fixed by the pattern and guards")
        out = []
        while s.check() == z3.sat:
            m = s.model()
            combo = {f"{'rank' if n in self.leaf else 'len'}:{n}": m.eval(var, model_completion=True).as_long()
                     for n, var in keys}
            out.append(combo)
            if len(out) > MAX_COMBOS:
                raise Unsupported("too many rank assignments")
            s.add(z3.Or([var != m.eval(var, model_completion=True) for _, var in keys]) if keys else z3.BoolVal(False))
        if not out:
            raise Unsupported("no rank satisfies the pattern, guards and types")
        return out


def _compare(op: str, a, b):
    return {"==": lambda: a == b, "!=": lambda: a != b, "<": lambda: a < b, "<=": lambda: a <= b,
            ">": lambda: a > b, ">=": lambda: a >= b}[op]()


# --- one rank assignment ------------------------------------------------------------------------------

class _Instance:
    """Both sides of the rule at fixed ranks: tensors, validity, folds, and the environment behind them."""

    def __init__(self, rule: Rule, v: _Vars, combo: Dict[str, int], strings: Dict[str, str]):
        self.rule, self.v, self.combo = rule, v, combo
        self.dom = ix.make_domain(rule.proof)
        self.folds: List[ix.Fold] = []
        self.rests: Dict[str, Dict[str, Any]] = {}
        self.lhs_side = ix.Side(self.dom, "l", self.folds, self.rests)
        self.rhs_side = ix.Side(self.dom, "r", self.folds, self.rests)
        self.attr: Dict[str, Any] = {}
        for name, (kind, _, _) in v.attrs.items():
            if kind == "int":
                self.attr[name] = z3.Int(name)
            elif kind == "ints":
                self.attr[name] = [z3.Int(f"{name}[{j}]") for j in range(combo[f"len:{name}"])]
            elif kind == "float":
                self.attr[name] = self.dom.var(name)
            else:
                self.attr[name] = strings[name]
        self.leaf: Dict[str, ix.Tensor] = {}
        dims = self.guarded_dims(rule, v, combo)
        for name, kind in v.leaves.items():
            r = combo[f"rank:{name}"]
            if name in v.literal:
                self.leaf[name] = ix.constant(float(v.literal[name]), r, self.lhs_side, name, dims[name])
            else:
                self.leaf[name] = ix.leaf(self.lhs_side, name, r, kind, dims[name])
        self.prefix = combo.get("prefix")
        self.prefixed: set = set()
        if self.prefix is not None:
            self.prefixed.add(id(self.leaf[self.prefix]))
        self.lhs = self.eval(rule.lhs, self.lhs_side, True)
        self.rhs = self.eval(rule.rhs, self.rhs_side, False)
        if self.prefix is not None and not (id(self.lhs) in self.prefixed and id(self.rhs) in self.prefixed):
            raise Unsupported(f"a root that does not keep {self.prefix!r}'s leading dims")
        self.guards = [c for g in rule.guards for c in self.guard(g)]

    def guarded_dims(self, rule: Rule, v: _Vars, combo: Dict[str, int]) -> Dict[str, List[Any]]:
        """The leaves' dims, with the equalities the guards state (``dim(c, 1) == 1``, ``shape(x) == s``)
        substituted, so that equal dims are the same term. The guards stay assumptions as well; this only
        spares Z3 case splits such as broadcasting a dim against itself."""
        dims = {n: ix.leaf_dims(n, combo[f"rank:{n}"]) for n in v.leaves}

        def slots(e):
            if isinstance(e, Num) and isinstance(e.value, int):
                return [z3.IntVal(e.value)]
            if isinstance(e, FuncCall) and e.name == "dim" and isinstance(e.args[1], Num) and e.args[0].name in dims:
                ds, i = dims[e.args[0].name], e.args[1].value
                return [ds[i]] if -len(ds) <= i < len(ds) else None
            if isinstance(e, FuncCall) and e.name == "shape" and e.args[0].name in dims:
                return list(dims[e.args[0].name])
            if isinstance(e, Var) and isinstance(self.attr.get(e.name), list):
                return list(self.attr[e.name])
            return None
        sub: List[Tuple[Any, Any]] = []
        names = {d.decl().name() for ds in dims.values() for d in ds}
        for g in rule.guards:
            if not isinstance(g, Compare) or g.op != "==":
                continue
            a, b = slots(g.left), slots(g.right)
            if a is None or b is None or len(a) != len(b):
                continue
            for x, y in zip(a, b):
                x, y = (z3.substitute(t, *sub) if sub else t for t in (x, y))
                if z3.eq(x, y):
                    continue
                if z3.is_const(x) and x.decl().name() in names:
                    sub.append((x, y))
                elif z3.is_const(y) and y.decl().name() in names:
                    sub.append((y, x))
        if not sub:
            return dims
        out = {}
        for n, ds in dims.items():
            res = []
            for d in ds:
                for _ in range(len(sub) + 1):
                    d2 = z3.simplify(z3.substitute(d, *sub))
                    if z3.eq(d2, d):
                        break
                    d = d2
                res.append(d)
            out[n] = res
        return out

    # values
    def eval(self, e: Expr, side: ix.Side, lhs: bool) -> ix.Tensor:
        if isinstance(e, Var):
            if e.name in self.leaf:
                return self.leaf[e.name]
            val = self.attr.get(e.name)
            if isinstance(val, z3.ExprRef) and val.sort() == self.dom.sort:
                return ix.Tensor([], lambda idx, c=val: c)
            raise Unsupported(f"{e.name!r} cannot be a value")
        if isinstance(e, (Wildcard, Num)) and lhs:
            return self.leaf[self.v.anon[id(e)]]
        if isinstance(e, Num):
            return ix.constant(float(e.value), 0, side, "lit")
        if isinstance(e, OpCall):
            ins = [self.eval(a, side, lhs) for a in e.args]
            explicit = {name: self.attr_value(p) for name, p in e.attrs}
            defaults = attr_defaults(e.op)
            rest = ix.Rest(e.rest) if e.rest else None
            out = ix.OPS[e.op](side, ins, ix.Attrs(e.op, explicit, rest, defaults))
            if self.prefix is not None:
                self.check_prefix(e.op, ins, out)
            return out
        raise Unsupported(f"cannot evaluate {type(e).__name__}")

    def check_prefix(self, op: str, ins: List[ix.Tensor], out: ix.Tensor) -> None:
        """The rank-3 view of a leaf of any rank >= 3 (its leading dims as one axis P) is exact when every
        op reading it acts on each index of P alike and keeps P as its output's first axis: then, by
        induction, every tensor computed from the leaf has the leaf's leading dims, and the rule at rank n
        is the rule at rank 3 on the leaf reshaped to [prod(leading dims), rows, cols]. Those ops: MatMul
        of the leaf's descendant (rank 3) by a tensor of rank 2 not computed from it (no batch dims to
        broadcast), and Add, Sub, Mul whose other operands have rank <= 2 (broadcast over the last two axes
        only) or are descendants themselves (the same leading dims)."""
        pre = [id(t) in self.prefixed for t in ins]
        if not any(pre):
            return
        p0 = self.leaf[self.prefix].dims[0]
        if op == "MatMul":
            ok = pre[0] and not pre[1] and ins[0].rank == 3 and ins[1].rank == 2
        elif op in ("Add", "Sub", "Mul"):
            ok = all((t.rank == 3 and z3.eq(ix.simp(t.dims[0]), p0)) if is_pre else t.rank <= 2
                     for t, is_pre in zip(ins, pre))
        else:
            ok = False
        if not ok or out.rank != 3 or not z3.eq(ix.simp(out.dims[0]), p0):
            raise Unsupported(f"{op} does not act on {self.prefix!r}'s leading dims alike")
        self.prefixed.add(id(out))

    def attr_value(self, p):
        if isinstance(p, Num):
            return p.value
        if isinstance(p, ListLit):
            return [self.attr_value(x) for x in p.items]
        if isinstance(p, Var):
            if p.name not in self.attr:
                raise Unsupported(f"{p.name!r} is not an attribute variable")
            return self.attr[p.name]
        raise Unsupported("an attribute pattern without a value")

    # guards
    def guard(self, g) -> List[Any]:
        if isinstance(g, FuncCall):
            if g.name in ("const", "single_use"):
                return []  # any value may be constant; uses do not change values
            raise Unsupported(f"guard {g.name}(...)")
        a, b = self.gterm(g.left), self.gterm(g.right)
        if isinstance(a, list) or isinstance(b, list):
            if not (isinstance(a, list) and isinstance(b, list)) or g.op not in ("==", "!="):
                raise Unsupported("a list compared with a number")
            same = z3.And([x == y for x, y in zip(a, b)]) if len(a) == len(b) else z3.BoolVal(False)
            return [same if g.op == "==" else z3.Not(same)]
        return [_compare(g.op, a, b)]

    def gterm(self, e):
        if isinstance(e, Num):
            if not isinstance(e.value, int):
                raise Unsupported("a float in a guard")
            return z3.IntVal(e.value)
        if isinstance(e, ListLit):
            return [self.gterm(x) for x in e.items]
        if isinstance(e, Var):
            val = self.attr.get(e.name)
            if isinstance(val, list) or (isinstance(val, z3.ExprRef) and z3.is_int(val)):
                return val
            raise Unsupported(f"a guard on {e.name!r} (values and float attributes are not generic)")
        if isinstance(e, OpCall) and e.op in ("Add", "Sub", "Mul", "Neg"):
            xs = [self.gterm(x) for x in e.args]
            if any(isinstance(x, list) for x in xs):
                raise Unsupported("arithmetic on a list")
            return {"Add": lambda: xs[0] + xs[1], "Sub": lambda: xs[0] - xs[1], "Mul": lambda: xs[0] * xs[1],
                    "Neg": lambda: -xs[0]}[e.op]()
        if isinstance(e, FuncCall) and e.name in ("rank", "dim", "shape"):
            t = self.leaf[e.args[0].name]
            if e.name == "rank":
                return z3.IntVal(t.rank)
            if e.name == "shape":
                return list(t.dims)
            i = self.gterm(e.args[1])
            c = ix.as_int(i)
            if c is not None:
                if not -t.rank <= c < t.rank:
                    return z3.IntVal(-1)  # unreachable: the rank constraints exclude it
                return t.dims[c]
            self.guards_extra = getattr(self, "guards_extra", []) + [z3.And(-t.rank <= i, i < t.rank)]
            return ix.select(t.dims, z3.If(i < 0, i + t.rank, i))
        raise Unsupported(f"guard term {type(e).__name__}")


# --- the proof -------------------------------------------------------------------------------------

class _Proof:
    def __init__(self, rule: Rule, timeout_ms: int):
        self.rule = _name_wildcards(rule)
        self.timeout_ms = timeout_ms

    def run(self) -> Optional[GenericResult]:
        rule = self.rule
        if rule.on == "kernel":
            raise Unsupported("kernel rules are scalar; the elementwise prover covers them")
        if rule.proof not in ("exact", "real"):
            raise Unsupported(f"obligation {rule.proof!r}")
        v = _Vars(rule)
        view, elementwise = None, False
        try:
            combos = _Ranks(rule, v).assignments()
        except Unsupported:
            view = _axis_view(rule)
            if view is not None:
                # Slice and Concat along one axis act on [dims before, the axis, dims after] of any rank as
                # on the rank-3 tensor of those three sizes: proving that view proves every rank >= 1.
                rule = self.rule = view
                v = _Vars(rule)
                combos = [{f"rank:{n}": 3 for n in v.leaves}]
            elif _elementwise(rule):
                # Elementwise ops read each leaf at one (broadcast) index per output element, whatever the
                # ranks: the rule on scalars is the rule on every shape. Rank guards only restrict shapes.
                rule = attrs.evolve(rule, guards=tuple(g for g in rule.guards if not _rank_guard(g)))
                combos = [{f"rank:{n}": 0 for n in v.leaves}]
                elementwise = True
            elif _prefix_leaf(rule, v) is not None:
                # a leaf of any rank read only by prefix-uniform ops (MatMul by a rank-2 weight, elementwise
                # ops with rank <= 2 operands): ranks 0, 1 and 2 as they are, every rank >= 3 as rank 3 with
                # its leading dims as one batch axis (see _Instance.check_prefix)
                prefix = _prefix_leaf(rule, v)
                combos = []
                for r in (0, 1, 2, 3):
                    fixed = attrs.evolve(rule, guards=rule.guards + (_rank_is(prefix, r, rule.loc),))
                    try:
                        combos += [dict(c, prefix=prefix) if r == 3 else c
                                   for c in _Ranks(fixed, v).assignments()]
                    except Unsupported as e:
                        if "no rank satisfies" not in str(e):
                            raise
            else:
                raise
        strings = [n for n, (k, _, _) in v.attrs.items() if k == "string"]
        choices = []
        for n in strings:
            _, op, name = v.attrs[n]
            if (op, name) not in STRING_CHOICES:
                raise Unsupported(f"{op}'s {name} bound to a variable")
            choices.append(STRING_CHOICES[(op, name)])
        covered = []
        for combo in combos:
            reachable = False
            for pick in itertools.product(*choices):
                inst = _Instance(rule, v, combo, dict(zip(strings, pick)))
                status, live = self.prove(inst)
                if status is not None:
                    if view is not None:  # the view's counterexample is not an instance of the rule as written
                        raise Unsupported("refuted on the [before, axis, after] view; no generic verdict")
                    return status
                reachable = reachable or live
            if reachable:
                covered.append(_ranks_text(combo) + (" (every rank >= 3: its leading dims as one batch axis)"
                                                     if "prefix" in combo else ""))
        if not covered:
            raise Unsupported("no shape satisfies the pattern, guards and types")
        symbolic = sorted(n for n in v.attrs if not n.startswith("any."))
        rests = sorted(v.rests)
        if elementwise:
            cov = "generic: every shape (elementwise ops: each input read at one broadcast index)"
        elif view is not None:
            cov = "generic: every non-empty shape of every rank >= 1 (one axis, as [before, axis, after])"
        else:
            cov = "generic: every non-empty shape of " + "; ".join(covered)
        if symbolic or rests:
            cov += "; " + ", ".join(symbolic + [f"..{r}" for r in rests]) + " symbolic"
        return GenericResult("proved", cov)   # no time in it: coverage lands in manifests, which must be reproducible

    def solver(self, timeout_ms=None) -> z3.Solver:
        s = z3.Solver()
        s.set("timeout", int(timeout_ms or self.timeout_ms))
        return s

    def prove(self, inst: _Instance) -> Tuple[Optional[GenericResult], bool]:
        """(None, whether any shape reaches it) when these ranks are proved; (a refutation, True); raises
        Unsupported when undecided."""
        dom, lhs, rhs = inst.dom, inst.lhs, inst.rhs
        if lhs.rank != rhs.rank:
            return None, False  # the engine never applies the rule here: the types differ
        idx = [z3.Int(f"idx.{p}") for p in range(lhs.rank)]
        dom.frames = [[]]
        le = lhs.elem(idx)
        lhs_def = dom.frames[0]
        dom.frames = [[]]
        re = rhs.elem(idx)
        rhs_def = dom.frames[0]
        if any(f.depth for f in inst.folds):
            le, re = self.flatten_sums(inst, le, re, lhs_def + rhs_def)
        dims_ok = [d >= 1 for t in inst.leaf.values() for d in t.dims]
        base = (dims_ok + inst.lhs_side.valid + inst.guards + getattr(inst, "guards_extra", [])
                + [z3.And(i >= 0, i < d) for i, d in zip(idx, lhs.dims)] + list(dom.axioms) + lhs_def)
        s = self.solver()
        s.add(*base)
        if s.check() == z3.unsat:
            return None, False  # no shape and attributes satisfy the guards and validity at these ranks
        if le.sort() != re.sort():
            raise Unsupported("the two sides have different element types")
        parts = {"dims": [a == b for a, b in zip(lhs.dims, rhs.dims)], "valid": inst.rhs_side.valid,
                 "defined": rhs_def, "eq": dom.equal(le, re) if le.sort() == dom.sort else le == re}
        found = quick_refute(self.rule, inst, base, parts, self.timeout_ms)
        if found is not None:
            return found, True
        # folds are compared where both sides are valid with the same dims, the only place they matter
        context = z3.And(parts["dims"] + parts["valid"])
        merged, pairs = self.merge_folds(inst, base + [context])
        merged = [z3.Implies(context, e) for e in merged]
        # Where the replacement's nodes are valid its output has the root's dims, and conversely (so the
        # engine's type check never hides a wrong rule, and the replacement's validity is proved, not
        # trusted); there, it is defined wherever the pattern is and its element equals the pattern's.
        same, valid = z3.And(parts["dims"]), z3.And(parts["valid"])
        goal = z3.And(same == valid, z3.Implies(same, z3.And(parts["defined"] + [parts["eq"]])))
        if self.prove_abstracted(inst, base, parts, pairs, [le, re]):
            return None, True
        s = self.solver()
        s.add(*base, *merged)
        s.add(z3.Not(goal))
        res = s.check()
        if res == z3.unsat:
            return None, True
        why = f"z3: {s.reason_unknown()}" if res == z3.unknown else \
            "the generic obligation fails, but no small instance differs (reductions are abstracted)"
        found = refute(self.rule, inst, base + merged, parts, _hints(inst, pairs), self.timeout_ms)
        if found is None:
            raise Unsupported(why)
        return found, True

    def flatten_sums(self, inst: _Instance, le, re, defs):
        """Sums nested in sums (real only): both elements as sums of flat sums (:mod:`sum_normal`), which
        replace every fold of the instance, so no fold constant that varies with an outer index is left."""
        norm = Normaliser(inst.folds)
        for c in defs + inst.lhs_side.valid + inst.rhs_side.valid:
            if norm.has_fold(c):
                raise Unsupported("a condition on the value of a nested sum")
        le, re = norm.term(le, "l"), norm.term(re, "r")
        inst.folds[:] = norm.folds
        return le, re

    def prove_abstracted(self, inst: _Instance, base, parts, pairs, elems) -> bool:
        """The obligation in two easier steps: the dims/validity part alone (integers only), then the
        elements with every read of an input (and every fold) replaced by a variable, reads proved to be at
        the same index (and folds proved equal) sharing one. Replacing terms by variables only generalises
        the formula, so a proof of it is a proof of the original; the float part is then small."""
        same, valid = z3.And(parts["dims"]), z3.And(parts["valid"])
        s = self.solver()
        s.add(*base)
        s.add(z3.Not(same == valid))
        if s.check() != z3.unsat:
            return False
        ctx = base + [same, valid]
        goal = z3.And(parts["defined"] + [parts["eq"]])
        names = set(inst.leaf)
        reads: Dict[int, Any] = {}
        todo = list(elems) + [goal]
        seen = set()
        while todo:
            t = todo.pop()
            if t.get_id() in seen:
                continue
            seen.add(t.get_id())
            if z3.is_app(t) and t.decl().name() in names and not z3.is_int(t):
                reads[t.get_id()] = t
            elif z3.is_app(t):
                todo.extend(t.children())
        parent = {k: k for k in reads}

        def find(k):
            while parent[k] != k:
                k = parent[k]
            return k
        items = list(reads.values())
        for a, b in itertools.combinations(items, 2):
            if a.decl().name() != b.decl().name() or find(a.get_id()) == find(b.get_id()):
                continue
            args = [x == y for x, y in zip(a.children(), b.children())]
            if not all(z3.is_true(z3.simplify(c)) for c in args):
                q = self.solver(min(self.timeout_ms, READ_MS))
                q.add(*ctx)
                q.add(z3.Not(z3.And(args)))
                if q.check() != z3.unsat:
                    continue
            parent[find(b.get_id())] = find(a.get_id())
        sub = [(t, z3.Const(f"read!{find(k)}", t.sort())) for k, t in reads.items()]
        fold_rep = list(range(len(inst.folds)))
        for a, b in sorted(pairs):
            fold_rep[b] = fold_rep[a]
        sub += [(f.value, inst.folds[fold_rep[j]].value) for j, f in enumerate(inst.folds) if fold_rep[j] != j]
        if not sub:
            return False
        s = self.solver()
        s.add(*[z3.substitute(c, *sub) for c in ctx])
        s.add(z3.Not(z3.substitute(goal, *sub)))
        return s.check() == z3.unsat

    def merge_folds(self, inst: _Instance, base) -> Tuple[List[Any], set]:
        """Equalities between folds proved equal (same kind and extents, pointwise-equal bodies), and the
        pairs merged."""
        eqs: List[Any] = []
        pairs = set()
        folds = inst.folds
        classes: List[int] = list(range(len(folds)))
        real = inst.dom.name == "real"
        for a, b in itertools.combinations(range(len(folds)), 2):
            fa, fb = folds[a], folds[b]
            if classes[b] != b or fa.kind != fb.kind or len(fa.extents) != len(fb.extents):
                continue
            # a real sum over a box is the same in any order of its indices (finite sums commute); a float
            # sum, a max and a filtered fold are compared in their own order only
            orders = (itertools.permutations(range(len(fb.ks)))
                      if real and fa.kind == "sum" and fa.guard is None and fb.guard is None
                      and len(fb.ks) <= MAX_PERMUTED else [tuple(range(len(fb.ks)))])
            for order in orders:
                if self.same_fold(inst, base, fa, fb, order):
                    classes[b] = classes[a]
                    eqs.append(fa.value == fb.value)
                    pairs.add((a, b))
                    break
        return eqs, pairs

    def same_fold(self, inst: _Instance, base, fa: ix.Fold, fb: ix.Fold, order) -> bool:
        """Whether fold ``fb``, its indices taken in ``order``, equals ``fa``: equal extents, and equal bodies
        (and filters) at every index in range."""
        fb = attrs.evolve(fb, ks=[fb.ks[j] for j in order], extents=[fb.extents[j] for j in order])
        sub = list(zip(fb.ks, fa.ks))
        body_b = z3.substitute(fb.body, *sub) if sub else fb.body
        guard_b = z3.substitute(fb.guard, *sub) if (sub and fb.guard is not None) else fb.guard
        same_ext = z3.And([x == y for x, y in zip(fa.extents, fb.extents)])
        inside = z3.And([z3.And(k >= 0, k < e) for k, e in zip(fa.ks, fa.extents)])
        if (fa.guard is None) != (fb.guard is None):
            return False
        equal = inst.dom.equal(fa.body, body_b) if fa.body.sort() == inst.dom.sort else fa.body == body_b
        if fa.guard is not None:
            claim = z3.And(same_ext, fa.guard == guard_b, z3.Implies(fa.guard, equal))
        else:
            claim = z3.And(same_ext, equal)
        s = self.solver()
        s.add(*base, inside)
        s.add(z3.Not(claim))
        return s.check() == z3.unsat


def _hints(inst: _Instance, merged: set) -> List[Any]:
    """For finding a real counterexample: each unmerged pair of a pattern fold and a replacement fold of
    the same kind differs somewhere (in an extent, or in a term at some k)."""
    out = []
    for a, fa in enumerate(inst.folds):
        for b, fb in enumerate(inst.folds):
            if not (str(fa.value).startswith("fold.l") and str(fb.value).startswith("fold.r")) or (a, b) in merged:
                continue
            if fa.kind != fb.kind or len(fa.extents) != len(fb.extents):
                continue
            sub = list(zip(fb.ks, fa.ks))
            body_b = z3.substitute(fb.body, *sub) if sub else fb.body
            inside = z3.And([z3.And(k >= 0, k < e) for k, e in zip(fa.ks, fa.extents)])
            differ = z3.Or([x != y for x, y in zip(fa.extents, fb.extents)] + [fa.body != body_b])
            out.append(z3.And(inside, differ))
    return out


_AXIS_OPS = {"Slice", "Concat", "Identity"}


def _axis_view(rule: Rule) -> Optional[Rule]:
    """The rule on the rank-3 view [before, axis, after] when every op is a Slice, Concat or Identity along
    one and the same axis (a literal, or a variable used nowhere else but in ``dim(v, axis)`` guards), and
    the guards only compare such dims and integer attributes; else None."""
    calls = list(_ops(rule.lhs)) + list(_ops(rule.rhs))
    if not calls or any(c.op not in _AXIS_OPS or c.rest for c in calls):
        return None
    axes = []
    for c in calls:
        at = dict(c.attrs)
        if c.op == "Concat":
            axes.append(at.get("axis"))
        elif c.op == "Slice":
            if set(at) - {"starts", "ends", "axes", "steps"}:
                return None
            lists = [at.get(k) for k in ("starts", "ends", "steps") if k in at]
            if any(not isinstance(x, ListLit) or len(x.items) != 1 for x in lists):
                return None
            ax = at.get("axes")
            if ax is None:
                axes.append(Num(0, c.loc))
            elif isinstance(ax, ListLit) and len(ax.items) == 1:
                axes.append(ax.items[0])
            else:
                return None
        elif c.attrs:
            return None
    keys = {(type(a).__name__, a.value if isinstance(a, Num) else getattr(a, "name", None)) for a in axes}
    if len(keys) != 1 or not all(isinstance(a, (Num, Var)) for a in axes):
        return None
    kind, key = next(iter(keys))
    if kind == "Num" and not isinstance(key, int):
        return None

    def is_axis(e):
        return (isinstance(e, Num) and kind == "Num" and e.value == key) or \
            (isinstance(e, Var) and kind == "Var" and e.name == key)

    def mentions_axis_var(e):
        if kind != "Var":
            return False
        if isinstance(e, Var):
            return e.name == key
        if isinstance(e, ListLit):
            return any(mentions_axis_var(x) for x in e.items)
        if isinstance(e, (OpCall, FuncCall)):
            return any(mentions_axis_var(x) for x in e.args) or \
                any(mentions_axis_var(p) for _, p in getattr(e, "attrs", ()))
        if isinstance(e, Compare):
            return mentions_axis_var(e.left) or mentions_axis_var(e.right)
        return False
    one = lambda loc: Num(1, loc)  # noqa: E731

    def guard_term(e):
        if isinstance(e, FuncCall):
            if e.name != "dim" or not is_axis(e.args[1]):
                raise Unsupported("guard")
            return attrs.evolve(e, args=(e.args[0], one(e.loc)))
        if isinstance(e, OpCall):
            return attrs.evolve(e, args=tuple(guard_term(a) for a in e.args))
        if mentions_axis_var(e):
            raise Unsupported("guard")
        return e
    guards = []
    try:
        for g in rule.guards:
            if isinstance(g, FuncCall):
                if g.name not in ("const", "single_use"):
                    return None
                guards.append(g)
            else:
                guards.append(attrs.evolve(g, left=guard_term(g.left), right=guard_term(g.right)))
    except Unsupported:
        return None

    def fix(e):
        if not isinstance(e, OpCall):
            return e
        at = []
        for name, p in e.attrs:
            if e.op == "Concat" and name == "axis":
                p = one(e.loc)
            elif e.op == "Slice" and name == "axes":
                p = ListLit((one(e.loc),), e.loc)
            elif mentions_axis_var(p):
                raise Unsupported("axis")
            at.append((name, p))
        if e.op == "Slice" and "axes" not in dict(e.attrs):
            at.append(("axes", ListLit((one(e.loc),), e.loc)))
        return attrs.evolve(e, args=tuple(fix(a) for a in e.args), attrs=tuple(at))
    try:
        lhs, rhs = fix(rule.lhs), fix(rule.rhs)
    except Unsupported:
        return None
    return attrs.evolve(rule, lhs=lhs, rhs=rhs, guards=tuple(guards))


def _prefix_leaf(rule: Rule, v: _Vars) -> Optional[str]:
    """The one named leaf no guard mentions, when every other leaf's rank is fixed by a ``rank(y) == n``
    guard (and the pattern has no anonymous inputs): the candidate for the batch-prefix view; else None."""
    if v.anon:
        return None
    fixed, mentioned = set(), set()

    def names(e):
        if isinstance(e, Var):
            yield e.name
        for x in getattr(e, "args", ()):
            yield from names(x)
        if isinstance(e, Compare):
            yield from names(e.left)
            yield from names(e.right)
    for g in rule.guards:
        if isinstance(g, FuncCall) and g.name in ("const", "single_use"):
            continue
        mentioned |= set(names(g))
        if isinstance(g, Compare) and g.op == "==":
            for a, b in ((g.left, g.right), (g.right, g.left)):
                if isinstance(a, FuncCall) and a.name == "rank" and isinstance(b, Num):
                    fixed.add(a.args[0].name)
    free = [n for n in v.leaves if n not in fixed]
    if len(free) != 1 or free[0] in mentioned or free[0] in v.attrs:
        return None

    def reads(e) -> bool:  # whether e is computed from the leaf
        return isinstance(e, Var) and e.name == free[0] or \
            isinstance(e, OpCall) and any(reads(a) for a in e.args)
    for c in list(_ops(rule.lhs)) + list(_ops(rule.rhs)):
        hit = [reads(a) for a in c.args]
        if any(hit) and not (c.op in ("Add", "Sub", "Mul") and not c.attrs and not c.rest
                             or c.op == "MatMul" and hit == [True, False]):
            return None
    return free[0]


def _rank_is(name: str, r: int, loc) -> Compare:
    return Compare("==", FuncCall("rank", (Var(name, loc),), loc), Num(r, loc), loc)


def _elementwise(rule: Rule) -> bool:
    calls = list(_ops(rule.lhs)) + list(_ops(rule.rhs))
    if any(c.op not in ix.ELEMENTWISE or c.rest for c in calls):
        return False
    for g in rule.guards:
        if isinstance(g, FuncCall) and g.name not in ("const", "single_use"):
            return False
        if isinstance(g, Compare) and not _rank_guard(g):
            return False
    return True


def _rank_guard(g) -> bool:
    def is_rank(e):
        return isinstance(e, FuncCall) and e.name == "rank"
    return isinstance(g, Compare) and (is_rank(g.left) or is_rank(g.right)) and \
        all(is_rank(e) or isinstance(e, Num) for e in (g.left, g.right))


def _ranks_text(combo: Dict[str, int]) -> str:
    parts = [f"{k.split(':', 1)[1]} rank {v}" for k, v in sorted(combo.items()) if k.startswith("rank:")
             and not k.split(":", 1)[1].startswith("in.")]
    lens = [f"len({k.split(':', 1)[1]})={v}" for k, v in sorted(combo.items()) if k.startswith("len:")]
    return ", ".join(parts + lens) or "rank 0"
