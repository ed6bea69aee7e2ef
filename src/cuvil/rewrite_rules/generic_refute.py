"""Counterexamples for the generic prover: a failing generic obligation, made concrete and checked.

The generic obligation abstracts reductions, so its failing model is only a hint. This module takes small
dims and attribute values from it, checks that the rule really matches there (the pattern, its guards and
the replacement's type, through the op registry and the rule compiler, as the engine would), evaluates
both sides with the concrete prover's semantics (:mod:`cuvil.rewrite_rules.semantics`, every input
element a Z3 variable) and asks Z3 for inputs on which they differ. Only such a difference is a refutation;
its witness (shapes, attributes, input values) can be replayed through any ONNX runtime, and is: a
counterexample is reported only when ``onnx.reference``, running both sides in float32 on the witness, shows
the difference (bits for ``exact``, a gap far above float32 rounding for ``real``); a weaker one is passed
over and the search goes on.

The search is bounded by Z3 steps (its ``rlimit``), not by time: each query may take a fixed number of steps
and the whole search a fixed total, so a rule gets the same search, hence the same verdict and counterexample,
on an idle machine and on a loaded one (CI's workers). Wall-clock limits stay only as a backstop far above
what the steps take.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import attrs
import numpy as np
import z3

from ..dsl.ast import Expr, FuncCall, ListLit, Num, OpCall, Rule, Var, Wildcard
from ..dsl.compiler import BuildError, build, match
from ..errors import CuvilError
from ..frontend.onnx_export import export_model
from ..ir.graph import Graph
from ..ir.types import TensorType
from ..reference import run_reference
from . import semantics as sem

MAX_TRIES = 2
_BOUNDS = (3, 5)         # largest dim tried, first pass then second
# Z3 steps (rlimit), measured on the wrong variants of tests/test_generic_proofs.py: the search's instance
# queries take up to ~1 M steps when they decide (~2 s idle), the concrete check's up to ~0.2 M (~1 s).
QUICK_QUERY_STEPS = 500_000     # per instance query of the quick search
QUICK_BUDGET_STEPS = 1_500_000  # for the whole quick search
QUERY_STEPS = 1_000_000         # per instance query, and per query of the concrete check
BUDGET_STEPS = 10_000_000       # for the whole search
BACKSTOP_MS = 120_000           # wall clock, per query: only so that a pathological query cannot hang
WITNESS_TRIES = 3               # models of one concrete check whose float32 replay may fail to show a gap
# A real rule's counterexample must show, replayed in float32, |lhs - rhs| > REPLAY_GAP * (1 + |lhs|): ten times
# the tolerance the tests' own replay allows, far above float32 rounding of the few operations a rule spans.
REPLAY_GAP = 1e-2


# Defined here rather than in generic.py, which imports this module: the refuter builds "refuted" results.
@attrs.frozen
class GenericResult:
    """The generic prover's verdict for a rule: "proved" (with what the proof covers) or "refuted"."""
    status: str                      # "proved" or "refuted"
    coverage: str                    # what the proof covers
    counterexample: Optional[str] = None
    # A refutation's concrete instance (shapes, attributes, input values), for replaying it elsewhere.
    witness: Optional[dict] = attrs.field(default=None, eq=False)


def quick_refute(rule: Rule, inst, assumptions: List[Any], parts: Dict[str, Any], timeout_ms: int):
    """Before any hard query: one small instance with dims >= 2 (random inputs only), and one where the
    output dims differ. Obviously wrong rules are refuted here in well under a second."""
    same = parts["dims"] + parts["valid"] + parts["defined"]
    queries = [(same, 2, "elem"), (same, (2, 2), "elem"), (_dims_differ(parts), 1, "dims")]
    return _search(rule, inst, assumptions, queries, bounds=(3,), tries=1,
                   budget=_Steps(QUICK_BUDGET_STEPS, QUICK_QUERY_STEPS, timeout_ms), solve=False)


def _dims_differ(parts):
    return parts["valid"] + [z3.Not(z3.And(parts["dims"]))] if parts["dims"] else None


def refute(rule: Rule, inst, assumptions: List[Any], parts: Dict[str, Any], hints: List[Any], timeout_ms: int):
    """A "refuted" GenericResult for a small instance where the sides really differ, or None.

    ``parts`` are the obligation's pieces: "dims" (equal output dims), "valid" (the replacement's nodes
    valid), "defined" (the replacement defined at the index), "eq" (equal elements at the index).
    Candidates are tried in order: elements that differ where both sides are valid and the replacement's
    reductions differ from the pattern's (``hints``); the same without hints; output dims that differ;
    finally any small instance (when Z3 could not decide)."""
    same = parts["dims"] + parts["valid"]
    queries = [(same + [z3.Or(hints)] if hints else None, 2, "elem"),
               (same + [z3.Not(z3.And(parts["defined"] + [parts["eq"]]))], 1, "elem"),
               (_dims_differ(parts), 1, "dims"),
               (same, 2, "elem")]
    return _search(rule, inst, assumptions, queries, bounds=_BOUNDS, tries=MAX_TRIES,
                   budget=_Steps(BUDGET_STEPS, QUERY_STEPS, timeout_ms), solve=True)


class _Steps:
    """The Z3 steps a search may still take: each query gets at most ``per_query`` of them (fewer when fewer
    are left) and is charged what it took. ``timeout_ms`` only raises the wall-clock backstop."""

    def __init__(self, total: int, per_query: int, timeout_ms: int):
        self.left, self.per_query = total, per_query
        self.backstop_ms = max(BACKSTOP_MS, int(timeout_ms))

    def solver(self) -> Optional[z3.Solver]:
        if self.left <= 0:
            return None
        s = z3.Solver()
        s.set("rlimit", int(min(self.per_query, self.left)))
        s.set("timeout", self.backstop_ms)
        return s

    def check(self, s: z3.Solver):
        before = _steps_so_far(s)
        res = s.check()
        self.left -= max(1, _steps_so_far(s) - before)
        return res


def _steps_so_far(s: z3.Solver) -> int:
    """Z3's step counter (its "rlimit count", shared by every solver of the context)."""
    return int(s.statistics().get_key_value("rlimit count"))


def _search(rule, inst, assumptions, queries, *, bounds, tries, budget: _Steps, solve):
    small = _small(inst)
    for goal, lo, kind in queries:
        if goal is None:
            continue
        for bound in bounds:
            s = budget.solver()
            if s is None:
                return None
            s.add(*assumptions, *goal)
            s.add(*[c(lo, bound) for c in small])
            for _ in range(tries):
                if budget.left <= 0 or budget.check(s) != z3.sat:
                    break
                m = s.model()
                concrete = _concretize(inst, m)
                if kind == "elem":
                    found = _check(rule, inst.v, concrete, budget, solve)
                else:
                    found = _shapes_differ(rule, inst.v, concrete)
                if found is not None:
                    text, witness = found
                    return GenericResult("refuted", "counterexample at " + _describe(concrete), text, witness)
                s.add(_block(inst, m))
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
    """Bounds (lo, hi) -> a constraint keeping the instance small (dims >= lo avoid degenerate sizes; a
    pair lo = (dims_lo, ints_lo) also keeps integer attributes away from degenerate values)."""
    dims, ints, rest = _terms(inst)

    def lo_of(lo, k):
        return lo[k] if isinstance(lo, tuple) else (lo if k == 0 else None)
    return [lambda lo, b, d=d: z3.And(d >= lo_of(lo, 0), d <= b) for d in dims] + \
        [lambda lo, b, t=t: z3.And(t >= (-b if lo_of(lo, 1) is None else lo_of(lo, 1)), t <= b + 1) for t in ints] + \
        [lambda lo, b, t=t: z3.And(t >= 0, t <= b) for t in rest]


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
    parts = [f"{k}=[{','.join(map(str, s))}]" for k, s in sorted(c["shapes"].items()) if not k.startswith("in.")]
    parts += [f"{k}={v}" for k, v in sorted(c["attrs"].items()) if v is not None and not k.startswith("any.")]
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
    types = _types(rule, v, concrete)
    return types is not None and types[0] == types[1]


def _shapes_differ(rule: Rule, v, concrete):
    """A counterexample where the pattern matches and the replacement builds, with another shape."""
    types = _types(rule, v, concrete)
    if types is None or types[0].shape == types[1].shape:
        return None
    inputs = {n: np.zeros(s, np.bool_ if v.leaves[n] == "bool" else np.float32)
              for n, s in concrete["shapes"].items() if n not in v.literal}
    floats = {n: 0.5 for n, val in concrete["attrs"].items() if val is None}
    text = f"the output shapes differ: lhs {list(types[0].shape)}, rhs {list(types[1].shape)}"
    return text, dict(concrete, inputs=inputs, floats=floats)


def _types(rule: Rule, v, concrete):
    """(pattern root type, replacement type) on this instance, or None if the rule does not match there or
    the replacement does not build."""
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
            return None
        return root.type, build(rule, b, g, []).type
    except (CuvilError, BuildError, ValueError, TypeError, KeyError, IndexError, ZeroDivisionError):
        return None


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


def _check(rule: Rule, v, concrete, budget: _Steps, solve: bool = True):
    """A counterexample (text, witness) on this instance whose float32 replay shows the difference, or None."""
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
    floats = [dom.var(n) for n, val in concrete["attrs"].items() if val is None]
    leaves = [x for a in inputs.values() for x in a.reshape(-1)] + floats
    for tried in _random_trials(dom, leaves, lhs_side, goal):
        found = _report(tried, dom, inputs, concrete, lhs, rhs, rhs_side)
        if _replay_shows(rule, v, found[1]):
            return found
    for prefer in (True, False) if solve else ():
        s = budget.solver()
        if s is None:
            return None
        s.add(*dom.axioms, *lhs_side, z3.Not(goal))
        if prefer:  # small integers make a readable counterexample; any value will do otherwise
            s.add(*[_small_value(dom, x) for x in leaves if not z3.is_bool(x)])
        values = [x for x in leaves if not z3.is_bool(x)]
        for _ in range(WITNESS_TRIES):
            if budget.check(s) != z3.sat:
                break
            m = s.model()
            found = _report(m, dom, inputs, concrete, lhs, rhs, rhs_side)
            if _replay_shows(rule, v, found[1]):
                return found
            if not values:
                break
            s.add(z3.Or([x != m.eval(x, model_completion=True) for x in values]))  # another model, please
    return None


class _Values:
    """A model made of concrete values for the leaves (what :func:`_report` needs of a Z3 model)."""

    def __init__(self, pairs):
        self.pairs = pairs

    def eval(self, e, model_completion=True):
        return z3.simplify(z3.substitute(e, *self.pairs)) if self.pairs else z3.simplify(e)


def _random_trials(dom, leaves, lhs_side, goal, n: int = 12):
    """Cheap first: random small integers, then random floats of every magnitude, substituted into both
    sides; each trial where the pattern is defined and the goal simplifies to false is a counterexample."""
    if not leaves:
        return
    rng = np.random.default_rng(0)
    for trial in range(n):
        pairs = []
        for x in leaves:
            if z3.is_bool(x):
                pairs.append((x, z3.BoolVal(bool(rng.integers(2)))))
                continue
            if trial < n // 2 or dom.name == "real":
                val = float(rng.integers(-3, 4))
            else:
                val = float(np.float32(rng.standard_normal() * 10.0 ** rng.integers(-4, 5)))
            pairs.append((x, dom.const(val)))
        m = _Values(pairs)
        if not all(z3.is_true(m.eval(c)) for c in lhs_side):
            continue
        if z3.is_false(m.eval(goal)):
            yield m


def _small_value(dom, x):
    if dom.name == "real":
        return z3.And(z3.IsInt(x), x >= -3, x <= 3)
    return z3.Or([x == dom.const(float(k)) for k in range(-3, 4)])


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
    parts += [f"{n} = {sem.format_value(x)}" for n, x in floats.items() if not n.startswith("any.")]
    where = sem.first_difference(m, dom, lhs, rhs) or "the replacement is undefined there"
    witness = dict(concrete, inputs=arrays, floats=floats)
    return ", ".join(parts) + ": " + where, witness


# --- the witness replayed in float32 ---------------------------------------------------------------------

def _replay_shows(rule: Rule, v, witness) -> bool:
    """Whether onnx.reference, running both sides in float32 on the witness, shows them differ: in some bit
    (``exact``; NaN equal to NaN) or by more than REPLAY_GAP (``real``). A witness it cannot run shows nothing."""
    concrete = dict(witness, attrs={k: (witness["floats"][k] if val is None else val)
                                    for k, val in witness["attrs"].items()})
    g = Graph()
    vals, feeds = {}, {}
    for name, shape in concrete["shapes"].items():
        if name in v.literal:
            vals[name] = g.const(np.full(shape, v.literal[name], np.float32), name)
        else:
            arr = witness["inputs"][name]
            vals[name] = g.add_input(name, TensorType(9 if arr.dtype == np.bool_ else 1, shape))
            feeds[name] = arr
    try:
        lhs = _replay_side(rule.lhs, g, vals, v, concrete, True)
        rhs = _replay_side(rule.rhs, g, vals, v, concrete, False)
        g.outputs, g.output_names = [lhs, rhs], ["lhs", "rhs"]
        a, b = (np.asarray(x) for x in run_reference(export_model(g), feeds))
    except Exception:  # noqa: BLE001 - an instance the exporter or onnx.reference cannot run proves nothing
        return False
    if a.shape != b.shape:
        return True
    if a.dtype.kind != "f" or b.dtype.kind != "f":
        return bool(np.any(a != b))
    if rule.proof == "exact":
        same = (a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))
        return not bool(same.all())
    return not np.allclose(b, a, rtol=REPLAY_GAP, atol=REPLAY_GAP, equal_nan=True)


def _replay_side(e: Expr, g: Graph, vals, v, concrete, lhs: bool):
    """One side as graph nodes, a float attribute used as a value (``var + eps``) as a float32 constant."""
    if isinstance(e, Var) and e.name not in vals:
        return g.const(np.asarray(concrete["attrs"][e.name], np.float32), e.name)
    if isinstance(e, OpCall):
        ins = [_replay_side(a, g, vals, v, concrete, lhs) for a in e.args]
        return g.add_node(e.op, ins, node_attrs(e, concrete)).outputs[0]
    return _graph_side(e, g, vals, v, concrete, lhs)
