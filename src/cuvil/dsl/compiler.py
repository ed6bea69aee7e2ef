"""Rule AST -> matcher and builder over the graph IR.

``match(rule, value, graph)`` returns the bindings of the rule's pattern rooted at ``value`` (or None);
``build(rule, bindings, graph)`` creates the replacement nodes through the op registry, so replacements
are type-checked exactly like imported nodes.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Iterator, List, Optional, Set

import numpy as np
from attrs import define, field

from ..errors import ShapeError
from ..ir.dim import SymExpr, bounds
from ..ir.dtype import DType
from ..ir.graph import Graph, Node, Value
from ..ir.registry import attr_defaults, lookup, op_schema
from ..ir.lifting import implicit_attr
from .ast import DTYPE_NAMES, Compare, Expr, FuncCall, ListLit, Num, OpCall, OptionalVar, Rule, Var, Wildcard
from .cases import GUARDS_OVER_PRESENT, resolve

_ARITH = {"Add": lambda a, b: a + b, "Sub": lambda a, b: a - b, "Mul": lambda a, b: a * b,
          "Div": lambda a, b: a / b}


@define
class Bindings:
    values: Dict[str, Value] = field(factory=dict)
    attrs: Dict[str, Any] = field(factory=dict)
    rests: Dict[str, Dict[str, Any]] = field(factory=dict)
    nodes: List[Node] = field(factory=list)   # the matched nodes, root first
    absent: Set[str] = field(factory=set)     # optional inputs (``b?``) the matched nodes do not have


def attr_equal(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and \
            a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(attr_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        try:
            return np.float32(a).tobytes() == np.float32(b).tobytes()
        except (TypeError, ValueError):
            return False
    return a == b


def literal_matches(v: Value, num) -> bool:
    """A constant all of whose elements are the literal, bit for bit in the constant's dtype."""
    if not v.is_const or v.const.size == 0:
        return False
    arr = v.const
    try:
        with np.errstate(over="ignore"):
            lit = np.asarray(num, dtype=arr.dtype)
    except (OverflowError, ValueError):
        return False
    if arr.dtype.kind == "f" and math.isfinite(float(num)) and not np.all(np.isfinite(lit)):
        return False                # a finite literal beyond the dtype's range is no constant of it (not inf)
    if arr.dtype.kind == "f":  # bit for bit: 0 does not match -0.0, nan matches only nan's bits
        bits = np.dtype(f"u{arr.dtype.itemsize}")
        return bool(np.all(arr.reshape(-1).view(bits) == lit.reshape(1).view(bits)))
    return bool(np.all(arr == lit))


# --- matching --------------------------------------------------------------------------------------

def match(rule: Rule, root: Value, g: Graph) -> Optional[Bindings]:
    """The bindings of the first match of the rule's pattern at ``root`` whose element types and guards hold,
    or None. Operands of Add and Mul nodes of the pattern are tried in the written order first, then swapped,
    where ``rule.commutative`` allows it (commutativity proved for the rule's obligation and types)."""
    allowed = None if rule.dtypes is None else {DTYPE_NAMES[d] for d in rule.dtypes}
    b = Bindings()
    for _ in _matches(rule.lhs, root, b, rule.commutative):
        if allowed is not None and not _dtypes_covered(b.nodes, allowed):
            continue
        if all(guard_holds(gd, b, g) for gd in rule.guards):
            return Bindings(dict(b.values), dict(b.attrs), dict(b.rests), list(b.nodes), set(b.absent))
    return None


_FLOAT_TYPE_STRS = {"tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"}


def _float_capable(formals, type_constraints, i: int) -> bool:
    """Whether formal ``i`` (the last one for variadic tails) may hold a float tensor: a data position, as
    opposed to one fixed to bool (a condition) or to integers (shapes, indices, axes)."""
    if not formals:
        return False
    formal = formals[min(i, len(formals) - 1)]
    allowed = {tc.type_param_str: set(tc.allowed_type_strs) for tc in type_constraints}
    return bool(allowed.get(formal.type_str, {formal.type_str}) & _FLOAT_TYPE_STRS)


def _dtypes_covered(nodes: List[Node], allowed) -> bool:
    """Every value in a float-capable position of the matched nodes (operands, whether bound to a name, a
    wildcard or a literal, intermediate values and the root) has one of the ``allowed`` element types: the
    proof's semantics model those positions in these types only."""
    for n in nodes:
        try:
            schema = op_schema(n.op)
        except Exception:  # noqa: BLE001 - no schema (kernel-only ops): positions unknown, refuse (cautious)
            return False
        tcs = schema.type_constraints
        for i, v in enumerate(n.inputs):
            if v is not None and _float_capable(schema.inputs, tcs, i) and v.type.dtype not in allowed:
                return False
        for i, v in enumerate(n.outputs[:1]):
            if _float_capable(schema.outputs, tcs, i) and v.type.dtype not in allowed:
                return False
    return True


def _matches(p: Expr, v: Optional[Value], b: Bindings, commutative) -> Iterator[None]:
    """Yields once per way ``p`` matches ``v``, with ``b`` extended by that match; the extension is undone
    when the generator resumes, so the caller can backtrack into the next way (the swapped operands)."""
    if isinstance(p, Wildcard):
        if v is not None:
            yield
        return
    if isinstance(p, OptionalVar) and v is None:
        b.absent.add(p.name)
        yield
        b.absent.discard(p.name)
        return
    if v is None:
        return
    if isinstance(p, (Var, OptionalVar)):
        if p.name in b.values:
            if b.values[p.name] is v:
                yield
            return
        b.values[p.name] = v
        yield
        del b.values[p.name]
        return
    if isinstance(p, Num):
        if literal_matches(v, p.value):
            yield
        return
    if not isinstance(p, OpCall):
        return
    n = v.producer
    if n is None or n.op != p.op or n.domain not in ("", "ai.onnx", lookup(p.op).domain) or n.outputs[0] is not v:
        return
    present = len(n.inputs)
    while present and n.inputs[present - 1] is None:
        present -= 1
    required = sum(not isinstance(a, OptionalVar) for a in p.args)  # optional inputs are the trailing ones
    if not required <= present <= len(p.args):
        return
    added = _match_attrs(p, n, b)
    if added is None:
        return
    if any(n.inputs[i] is None for i in range(required, present)):
        return  # an optional input left out before a present one: the cases only leave out trailing inputs
    inputs = list(n.inputs[:present]) + [None] * (len(p.args) - present)
    orders = [inputs]
    if p.op in commutative and len(inputs) == 2:
        orders.append(inputs[::-1])
    b.nodes.append(n)
    for order in orders:
        yield from _all_match(p.args, order, b, commutative)
    b.nodes.pop()
    for table, key in added:
        del table[key]


def _all_match(patterns, values, b: Bindings, commutative) -> Iterator[None]:
    if not patterns:
        yield
        return
    for _ in _matches(patterns[0], values[0], b, commutative):
        yield from _all_match(patterns[1:], values[1:], b, commutative)


def _match_attrs(p: OpCall, n: Node, b: Bindings):
    """The (table, key) entries of ``b`` that matching the attributes of ``p`` added, or None (no match;
    nothing added)."""
    added = []
    defaults = attr_defaults(n.op)
    mentioned = dict(p.attrs)
    for name, pat in p.attrs:
        val = n.attrs[name] if name in n.attrs else implicit_attr(n, name)
        if not _match_attr(pat, val, b, added):
            break
    else:
        rest = {}
        for name, val in n.attrs.items():
            if name in mentioned or name.startswith("_"):
                continue
            if p.rest is not None:
                rest[name] = val
            elif name not in defaults or not attr_equal(val, defaults[name]):
                break  # an attribute the pattern does not mention must hold its default
        else:
            if p.rest is None:
                return added
            if p.rest in b.rests:
                if all(attr_equal(b.rests[p.rest].get(k), rest.get(k)) for k in set(rest) | set(b.rests[p.rest])):
                    return added
            else:
                b.rests[p.rest] = rest
                added.append((b.rests, p.rest))
                return added
    for table, key in added:
        del table[key]
    return None


def _match_attr(pat: Expr, val, b: Bindings, added: list) -> bool:
    if isinstance(pat, Wildcard):
        return True
    if isinstance(pat, Var):
        if pat.name in b.attrs:
            return attr_equal(b.attrs[pat.name], val)
        if val is None:
            return False
        b.attrs[pat.name] = val
        added.append((b.attrs, pat.name))
        return True
    if isinstance(pat, Num):
        return val is not None and not isinstance(val, (list, np.ndarray)) and attr_equal(val, pat.value)
    if isinstance(pat, ListLit):
        if not isinstance(val, (list, tuple)) or len(val) != len(pat.items):
            return False
        return all(_match_attr(x, y, b, added) for x, y in zip(pat.items, val))
    return False


# --- guards ----------------------------------------------------------------------------------------

class _NoValue(Exception):
    """A guard asked about something unknown (unknown rank, a symbolic dim in an order comparison)."""


def guard_holds(gd, b: Bindings, g: Graph) -> bool:
    try:
        if isinstance(gd, Compare) and gd.op == "in":  # dtype(x) in [float, float16]
            v = b.values.get(gd.left.args[0].name)
            return v is not None and v.dtype in {DTYPE_NAMES[item.name] for item in gd.right.items}
        if isinstance(gd, FuncCall):
            return bool(_guard_value(gd, b, g))
        left, right = _guard_value(gd.left, b, g), _guard_value(gd.right, b, g)
        return _compare(gd.op, left, right, g.symbol_ranges())
    except _NoValue:
        return False


def _compare(op: str, a, b, ranges=None) -> bool:
    if op == "==":
        return _eq(a, b)
    if op == "!=":
        return not _eq(a, b)
    if ranges is not None and any(isinstance(x, SymExpr) for x in (a, b)) and \
            all(isinstance(x, (int, SymExpr)) for x in (a, b)):
        # symbolic dims: the comparison must hold for every value in the symbols' ranges (interval bounds of
        # a - b: sound, so a guard that holds is true for every shape the graph accepts)
        try:
            lo, hi = bounds(a - b, ranges)
        except (ValueError, KeyError):
            raise _NoValue() from None
        return {"<": hi < 0, "<=": hi <= 0, ">": lo > 0, ">=": lo >= 0}[op]
    if not all(isinstance(x, (int, float, np.ndarray, np.number)) for x in (a, b)):
        raise _NoValue()
    fn = {"<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal}[op]
    return bool(np.all(fn(a, b)))


def _eq(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.all(np.asarray(a) == np.asarray(b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_eq(x, y) for x, y in zip(a, b))
    return a == b


def _guard_value(e, b: Bindings, g: Graph):
    if isinstance(e, Num):
        return e.value
    if isinstance(e, ListLit):
        return [_guard_value(x, b, g) for x in e.items]
    if isinstance(e, Var):
        if e.name in b.attrs:
            return b.attrs[e.name]
        v = b.values[e.name]
        if not v.is_const:
            raise _NoValue()
        return v.const
    if isinstance(e, OpCall):  # arithmetic sugar inside a guard
        args = [_guard_value(a, b, g) for a in e.args]
        if e.op == "Neg":
            return -args[0]
        return _ARITH[e.op](*args)
    if isinstance(e, FuncCall):
        args = e.args
        if e.name in GUARDS_OVER_PRESENT:  # they hold for the optional inputs that are present
            args = [a for a in args if not (isinstance(a, Var) and a.name in b.absent)]
        vals = [b.values.get(a.name) if isinstance(a, Var) else None for a in args]
        if e.name == "const":
            return all(v is not None and v.is_const for v in vals)
        if e.name == "single_use":
            return all(v is not None and g.num_uses(v) == 1 for v in vals)
        shape = vals[0].shape
        if shape is None:
            raise _NoValue()
        if e.name == "rank":
            return len(shape)
        if e.name == "shape":
            return tuple(shape)
        if e.name == "dim":
            i = _guard_value(e.args[1], b, g)
            if not isinstance(i, int) or not -len(shape) <= i < len(shape):
                raise _NoValue()
            return shape[i]
    raise _NoValue()


# --- building --------------------------------------------------------------------------------------

class BuildError(Exception):
    """The replacement does not type-check for these bindings; the rewrite is skipped."""


def build(rule: Rule, b: Bindings, g: Graph, created: List[Node]) -> Value:
    """The replacement of the matched case (optional inputs absent or present, see :mod:`cuvil.dsl.cases`)."""
    try:
        return _build(resolve(rule.rhs, frozenset(b.absent)), b, g, created, None)
    except ShapeError as e:
        raise BuildError(str(e)) from None


def _is_scalar_literal(e: Expr, b: Bindings) -> bool:
    return isinstance(e, Num) or (isinstance(e, Var) and e.name not in b.values and e.name in b.attrs)


def _build(e: Expr, b: Bindings, g: Graph, created: List[Node], dtype: Optional[DType]) -> Value:
    if isinstance(e, Var) and e.name in b.values:
        return b.values[e.name]
    if _is_scalar_literal(e, b):
        val = e.value if isinstance(e, Num) else b.attrs[e.name]
        if isinstance(val, (list, np.ndarray)):
            arr = np.asarray(val, dtype=(dtype or DType.FLOAT).numpy)
        else:
            arr = np.asarray(val, dtype=(dtype or DType.FLOAT).numpy)
        return g.const(arr, "lit")
    if isinstance(e, OpCall):
        inputs: List[Optional[Value]] = [None] * len(e.args)
        for k, a in enumerate(e.args):  # non-literals first: literals take their siblings' dtype
            if not _is_scalar_literal(a, b):
                inputs[k] = _build(a, b, g, created, dtype)
        for k, a in enumerate(e.args):
            if inputs[k] is None:
                inputs[k] = _build(a, b, g, created, _literal_dtype(e.op, k, inputs, dtype))
        attrs_: Dict[str, Any] = dict(b.rests.get(e.rest, {})) if e.rest else {}
        for name, a in e.attrs:
            attrs_[name] = _attr_value(a, b)
        node = g.add_node(e.op, inputs, attrs_, domain=lookup(e.op).domain)
        created.append(node)
        return node.outputs[0]
    raise BuildError(f"cannot build {e!r}")


def _literal_dtype(op: str, k: int, inputs: List[Optional[Value]], default: Optional[DType]) -> Optional[DType]:
    """The element type of a scalar literal at input ``k`` of ``op``: that of an input sharing its type
    parameter in the op's schema (Where(c, x, 0): x's, not the bool condition's), else of the first built
    input, else ``default``."""
    formals = list(op_schema(op).inputs)
    if formals:
        ts = formals[min(k, len(formals) - 1)].type_str
        for j, v in enumerate(inputs):
            if v is not None and formals[min(j, len(formals) - 1)].type_str == ts:
                return v.dtype
    return next((v.dtype for v in inputs if v is not None), default)


def _attr_value(e: Expr, b: Bindings):
    if isinstance(e, Num):
        return e.value
    if isinstance(e, Var):
        return b.attrs[e.name]
    if isinstance(e, ListLit):
        return [_attr_value(x, b) for x in e.items]
    raise BuildError(f"bad attribute value {e!r}")


def types_equal(a: Value, b: Value) -> bool:
    return a.type == b.type
