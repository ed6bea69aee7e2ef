"""Counterexamples for the generic prover: a failing generic obligation, made concrete and checked.

The generic obligation abstracts reductions, so its failing model is only a hint. This module takes small
dims and attribute values from it, checks that the rule really matches there (the pattern, its guards and
the replacement's type, through the op registry and the rule compiler, as the engine would), evaluates
both sides with the concrete prover's semantics (:mod:`cuvil.rewrite_rules.semantics`, every input
element a Z3 variable) and asks Z3 for inputs on which they differ. Only such a difference is a refutation;
its witness (shapes, attributes, input values) can be replayed through any ONNX runtime.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import numpy as np
import z3

from ..dsl.ast import Expr, FuncCall, ListLit, Num, OpCall, Rule, Var, Wildcard
from ..dsl.compiler import BuildError, build, match
from ..errors import CuvilError
from ..ir.graph import Graph
from ..ir.types import TensorType
from . import semantics as sem

MAX_TRIES = 4
_BOUNDS = (3, 5)


def refute(rule: Rule, inst, assumptions: List[Any], negated_goal, timeout_ms: int):
    """A "refuted" GenericResult for a small instance where the sides really differ, or None."""
    from .generic import GenericResult
    s = z3.Solver()
    s.set("timeout", int(timeout_ms))
    s.add(*assumptions, negated_goal)
    small = _small(inst)
    for bound in _BOUNDS:
        s.push()
        s.add(*[c(bound) for c in small])
        for _ in range(MAX_TRIES):
            if s.check() != z3.sat:
                break
            m = s.model()
            concrete = _concretize(inst, m)
            found = _check(rule, inst.v, concrete, timeout_ms)
            if found is not None:
                text, witness = found
                return GenericResult("refuted", "counterexample at " + _describe(concrete), text, witness)
            s.add(_block(inst, m))
        s.pop()
    return None


def _terms(inst):
    dims = [d for t in inst.leaf.values() for d in t.dims]
    ints = []
    for val in inst.attr.values():
        if isinstance(val, list):
            ints += val
        elif isinstance(val, z3.ExprRef) and z3.is_int(val):
            ints.append(val)
    rest = []
    for r in inst.rests.values():
        for key in ("strides", "dilations", "pads"):
            rest += list(r.get(key, []))
        if "group" in r:
            rest.append(r["group"])
    return dims, ints, rest


def _small(inst):
    dims, ints, rest = _terms(inst)
    return [lambda b, d=d: d <= b for d in dims] + [lambda b, t=t: z3.And(t >= -b, t <= b + 1) for t in ints] + \
        [lambda b, t=t: z3.And(t >= 0, t <= b) for t in rest]


def _block(inst, m):
    dims, ints, rest = _terms(inst)
    ts = dims + ints + rest
    return z3.Or([t != m.eval(t, model_completion=True) for t in ts]) if ts else z3.BoolVal(False)


def _val(m, t) -> int:
    return m.eval(t, model_completion=True).as_long()


def _concretize(inst, m) -> Dict[str, Any]:
    shapes = {name: tuple(_val(m, d) for d in t.dims) for name, t in inst.leaf.items()}
    attrs_: Dict[str, Any] = {}
    for name, val in inst.attr.items():
        if isinstance(val, list):
            attrs_[name] = [_val(m, x) for x in val]
        elif isinstance(val, z3.ExprRef) and z3.is_int(val):
            attrs_[name] = _val(m, val)
        elif isinstance(val, str):
            attrs_[name] = val
        else:
            attrs_[name] = None  # a float attribute: symbolic in the concrete check too
    rests = {}
    for r, terms in inst.rests.items():
        out = {}
        for key, unit in (("strides", 1), ("dilations", 1), ("pads", 0)):
            vals = [_val(m, t) for t in terms.get(key, [])]
            if vals and any(v != unit for v in vals):
                out[key] = vals
        if "group" in terms and _val(m, terms["group"]) != 1:
            out["group"] = _val(m, terms["group"])
        rests[r] = out
    for name in inst.v.rests:
        rests.setdefault(name, {})
    return {"shapes": shapes, "attrs": attrs_, "rests": rests}


def _describe(c) -> str:
    parts = [f"{k}=[{','.join(map(str, s))}]" for k, s in sorted(c["shapes"].items()) if not k.startswith("_in")]
    parts += [f"{k}={v}" for k, v in sorted(c["attrs"].items()) if v is not None and not k.startswith("_any")]
    parts += [f"..{k}={{{', '.join(f'{a}={b}' for a, b in sorted(r.items()))}}}" for k, r in sorted(c["rests"].items())]
    return " ".join(parts)


# --- the concrete instance ------------------------------------------------------------------------------

def _attr(p, attrs_, dom):
    if isinstance(p, Num):
        return p.value
    if isinstance(p, ListLit):
        return [_attr(x, attrs_, dom) for x in p.items]
    if isinstance(p, Var):
        v = attrs_[p.name]
        return dom.var(p.name) if v is None and dom is not None else (0.5 if v is None else v)
    raise ValueError(p)


def node_attrs(e: OpCall, concrete, dom=None) -> Dict[str, Any]:
    """The concrete attributes of an op call of the rule (None for dom: placeholders for float variables)."""
    out = dict(concrete["rests"].get(e.rest, {})) if e.rest else {}
    for name, p in e.attrs:
        out[name] = _attr(p, concrete["attrs"], dom)
    return out


def _graph_side(e: Expr, g: Graph, vals, v, concrete, lhs: bool):
    if isinstance(e, Var):
        return vals[e.name]
    if isinstance(e, (Wildcard, Num)) and lhs:
        return vals[v.anon[id(e)]]
    if isinstance(e, Num):
        return g.const(np.asarray(e.value, np.float32), "lit")
    ins = [_graph_side(a, g, vals, v, concrete, lhs) for a in e.args]
    return g.add_node(e.op, ins, node_attrs(e, concrete)).outputs[0]


def _matches(rule: Rule, v, concrete) -> bool:
    """The engine would apply the rule to this instance: the pattern matches (guards included) and the
    replacement type-checks to the root's type."""
    g = Graph()
    consts = {a.name for gd in rule.guards if isinstance(gd, FuncCall) and gd.name == "const" for a in gd.args
              if isinstance(a, Var)}
    vals = {}
    for name, shape in concrete["shapes"].items():
        boolean = v.leaves[name] == "bool"
        dt = np.bool_ if boolean else np.float32
        if name in v.literal:
            vals[name] = g.const(np.full(shape, v.literal[name], dt), name)
        elif name in consts:
            vals[name] = g.const(np.full(shape, 0.5, dt), name)
        else:
            vals[name] = g.add_input(name, TensorType(9 if boolean else 1, shape))
    try:
        root = _graph_side(rule.lhs, g, vals, v, concrete, True)
        b = match(rule, root, g)
        if b is None:
            return False
        return build(rule, b, g, []).type == root.type
    except (CuvilError, BuildError, ValueError, TypeError, KeyError, IndexError, ZeroDivisionError):
        return False


def _sem_side(e: Expr, dom, vals, v, concrete, lhs: bool):
    if isinstance(e, Var):
        if e.name in vals:
            return vals[e.name]
        out = np.empty((), dtype=object)
        out[()] = dom.var(e.name)
        return out
    if isinstance(e, (Wildcard, Num)) and lhs:
        return vals[v.anon[id(e)]]
    if isinstance(e, Num):
        return sem.constant_tensor(dom, float(e.value))
    ins = [_sem_side(a, dom, vals, v, concrete, lhs) for a in e.args]
    return sem.evaluate(dom, e.op, ins, node_attrs(e, concrete, dom))[0]


def _check(rule: Rule, v, concrete, timeout_ms: int):
    if not _matches(rule, v, concrete):
        return None
    dom = sem.FP32Domain() if rule.proof == "exact" else sem.RealDomain()
    vals = {}
    for name, shape in concrete["shapes"].items():
        if name in v.literal:
            vals[name] = sem.constant_tensor(dom, np.full(shape, float(v.literal[name])))
        else:
            vals[name] = sem.symbolic(dom, name, shape, v.leaves[name])
    try:
        mark = dom.mark()
        lhs = _sem_side(rule.lhs, dom, vals, v, concrete, True)
        lhs_side = dom.side_since(mark)
        mark = dom.mark()
        rhs = _sem_side(rule.rhs, dom, vals, v, concrete, False)
        rhs_side = dom.side_since(mark)
    except (CuvilError, ValueError, TypeError, KeyError, IndexError):
        return None
    if np.shape(lhs) != np.shape(rhs):
        return None
    goal = z3.And(sem.element_equalities(dom, lhs, rhs) + rhs_side)
    inputs = {n: a for n, a in vals.items() if n not in v.literal}
    for prefer in (True, False):
        s = z3.Solver()
        s.set("timeout", int(timeout_ms))
        s.add(*dom.axioms, *lhs_side, z3.Not(goal))
        if prefer:  # small integers make a readable counterexample; any value will do otherwise
            s.add(*[_small_value(dom, x) for a in inputs.values() for x in a.reshape(-1) if not z3.is_bool(x)])
        if s.check() == z3.sat:
            return _report(s.model(), dom, inputs, concrete, lhs, rhs, rhs_side)
    return None


def _small_value(dom, x):
    if dom.name == "real":
        return z3.And(z3.IsInt(x), x >= -3, x <= 3)
    return z3.Or([x == dom.const(float(k)) for k in range(-3, 4)])


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if math.isnan(v):
        return "nan"
    if v == 0:
        return "-0.0" if math.copysign(1, v) < 0 else "+0.0"
    return repr(float(np.float32(v)))


def _report(m, dom, inputs, concrete, lhs, rhs, rhs_side):
    arrays = {}
    for name, arr in inputs.items():
        flat = [dom.value_of(m, x) for x in arr.reshape(-1)]
        dt = np.bool_ if flat and isinstance(flat[0], bool) else np.float32
        arrays[name] = np.asarray(flat, dt).reshape(arr.shape)
    floats = {}
    for name, val in concrete["attrs"].items():
        if val is None:
            floats[name] = float(dom.value_of(m, dom.var(name)))
    parts = [f"{n} = {np.array2string(a.reshape(-1)[:8], separator=', ')}" for n, a in arrays.items()]
    parts += [f"{n} = {_fmt(x)}" for n, x in floats.items() if not n.startswith("_any")]
    where = "the replacement is undefined there"
    for idx in np.ndindex(*np.shape(lhs)):
        if not z3.is_true(m.eval(dom.equal(lhs[idx], rhs[idx]), model_completion=True)):
            at = f"[{','.join(map(str, idx))}]" if idx else ""
            where = f"lhs{at} = {_fmt(dom.value_of(m, lhs[idx]))}, rhs{at} = {_fmt(dom.value_of(m, rhs[idx]))}"
            break
    witness = dict(concrete, inputs=arrays, floats=floats)
    return ", ".join(parts) + ": " + where, witness
