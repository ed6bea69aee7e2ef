"""Shape constraints over symbol ranges, decided by Z3.

Shape inference records every condition it cannot decide on symbolic dims (``Node.constraints``: a
Reshape's element counts, broadcasting, MatMul inner dims, Concat's other dims, Conv output sizes >= 1).
:func:`check_constraints` proves each one for every value of the symbols in their ranges (a profile), or
returns a counterexample: ``N = 3 makes Reshape 'r1' need (12*N) % (8) == 0``. A symbol whose profile
takes only multiples (``Symbol.multiple``) ranges over those multiples here too. :func:`dim_ranges` gives
the exact range of derived dims (``(H + 1)/2`` for H in [1, 224] is [1, 112]).
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import attrs
import z3

from .dim import Dim, SymExpr, evaluate
from .graph import Graph
from .registry import ShapeConstraint, decide_constraint

Ranges = Mapping[str, Tuple[int, int]]
Multiples = Mapping[str, int]

#: A condition longer than this is shown with its dims evaluated at the counterexample instead.
MAX_CONDITION_CHARS = 80


@attrs.frozen
class Violation:
    node: str
    op: str
    constraint: ShapeConstraint
    values: Dict[str, int]          # a symbol assignment inside the ranges that breaks it

    def __str__(self):
        vals = ", ".join(f"{k} = {v}" for k, v in sorted(self.values.items()))
        cond = str(self.constraint)
        if len(cond) > MAX_CONDITION_CHARS:
            cond = self.condition_at_values() or cond[:MAX_CONDITION_CHARS - 3] + "..."
        text = f"{vals} makes {self.op} {self.node!r} need {cond}"
        # ``what`` repeats the whole shapes (4 kB on a detector's pyramid): shown only while it is short.
        return text + (f": {self.constraint.what}" if len(text) + len(self.constraint.what) <= 200 else "")

    def condition_at_values(self) -> Optional[str]:
        """The condition with its dims evaluated at the counterexample (``3 and 4 broadcast (at these
        values)``), or None when the values do not bind every symbol."""
        try:
            a, b = evaluate(self.constraint.a, self.values), evaluate(self.constraint.b, self.values)
        except (KeyError, ZeroDivisionError):
            return None
        return f"{ShapeConstraint(self.constraint.kind, a, b, self.constraint.what)} (its dims at these values)"


def to_z3(d: Dim, syms: Dict[str, z3.ArithRef]) -> z3.ArithRef:
    if isinstance(d, int):
        return z3.IntVal(d)
    total = z3.IntVal(0)
    for mono, coef in d.terms:
        term = z3.IntVal(coef)
        for atom in mono:
            term = term * _atom(atom, syms)
        total = total + term
    return total


def _atom(a, syms):
    if a.kind == "sym":
        name = a.args[0]
        if name not in syms:
            syms[name] = z3.Int(name)
        return syms[name]
    args = [to_z3(x, syms) for x in a.args]
    if a.kind == "floordiv":  # Z3's integer division is floor division for positive divisors
        return args[0] / args[1]
    if a.kind == "mod":
        return args[0] % args[1]
    out = args[0]
    for x in args[1:]:
        out = z3.If(x > out, x, out) if a.kind == "max" else z3.If(x < out, x, out)
    return out


def condition_holds(c: ShapeConstraint, syms) -> z3.BoolRef:
    """``c`` as a Z3 formula over the symbols (``syms`` collects their Z3 variables)."""
    a, b = to_z3(c.a, syms), to_z3(c.b, syms)
    if c.kind == "eq":
        return a == b
    if c.kind == "bcast":
        return z3.Or(a == b, a == 1, b == 1)
    if c.kind == "ge":
        return a >= b
    return z3.And(b != 0, a % b == 0)


def symbol_ranges(g: Graph, ranges: Optional[Ranges]) -> Dict[str, Tuple[int, int]]:
    """Every symbol's (min, max): the graph's, overridden by ``ranges``."""
    out = {s.name: (s.min, s.max) for s in g.symbols.values()}
    out.update(ranges or {})
    return out


def domain_facts(g: Graph, syms: Dict[str, z3.ArithRef], rng: Mapping[str, Tuple[int, int]], default_hi,
                 multiples: Optional[Multiples] = None):
    """The Z3 facts that bound ``syms``: each in its range, and a multiple of its symbol's ``multiple`` (or
    of ``multiples[name]`` where given)."""
    facts = []
    for name, var in syms.items():
        lo, hi = rng.get(name, (1, default_hi))
        facts.append(var >= lo)
        if hi is not None:
            facts.append(var <= hi)
        sym = g.symbols.get(name)
        multiple = (multiples or {}).get(name, sym.multiple if sym is not None else 1)
        if multiple > 1:
            facts.append(var % multiple == 0)
    return facts


def first_violation_at(g: Graph, values: Mapping[str, int]) -> Optional[str]:
    """The first recorded shape constraint that fails for these concrete symbol values, described, or None
    (no solver needed: every dim evaluates to an int)."""
    for n in g.nodes:
        for c in n.constraints:
            try:
                ok = decide_constraint(c.kind, evaluate(c.a, values), evaluate(c.b, values))
            except (KeyError, ZeroDivisionError):
                ok = False
            if not ok:
                vals = ", ".join(f"{k} = {v}" for k, v in sorted(values.items()))
                return f"{vals} makes {n.op} {n.name!r} need {c}: {c.what}"
    return None


def check_constraints(g: Graph, ranges: Optional[Ranges] = None, timeout_ms: int = 5000,
                      multiples: Optional[Multiples] = None) -> List[Violation]:
    """Every recorded shape constraint that fails for some symbol values inside ``ranges`` (default: the
    graph's symbol ranges; ``multiples`` overrides symbols' ``multiple``), with such values. Constraints Z3
    cannot settle in time count as violations with no values (never silently accepted)."""
    rng = symbol_ranges(g, ranges)
    out: List[Violation] = []
    for n in g.nodes:
        for c in n.constraints:
            values = counterexample(g, c, rng, multiples, timeout_ms)
            if values is not None:
                out.append(Violation(n.name, n.op, c, values))
    return out


def counterexample(g: Graph, c: ShapeConstraint, ranges: Ranges, multiples: Optional[Multiples] = None,
                   timeout_ms: int = 5000) -> Optional[Dict[str, int]]:
    """Symbol values inside ``ranges`` (and ``multiples``) that break ``c``; ``{}`` when Z3 cannot settle it
    in time (counted as broken); None when ``c`` holds everywhere there."""
    syms: Dict[str, z3.ArithRef] = {}
    cond = condition_holds(c, syms)
    s = z3.Solver()
    s.set("timeout", timeout_ms)
    s.add(*domain_facts(g, syms, ranges, None, multiples))
    s.add(z3.Not(cond))
    res = s.check()
    if res == z3.sat:
        m = s.model()
        return {k: m.eval(v, model_completion=True).as_long() for k, v in syms.items()}
    return {} if res == z3.unknown else None


def dim_ranges(g: Graph, ranges: Optional[Ranges] = None) -> Dict[str, Tuple[int, int]]:
    """The exact [min, max] of every symbolic dim of the graph's values, over the symbol ranges."""
    rng = symbol_ranges(g, ranges)
    out: Dict[str, Tuple[int, int]] = {}
    for v in g.values():
        for d in v.shape or ():
            if isinstance(d, SymExpr) and str(d) not in out:
                syms: Dict[str, z3.ArithRef] = {}
                e = to_z3(d, syms)
                bounds = []
                for goal in ("min", "max"):
                    o = z3.Optimize()
                    o.add(*domain_facts(g, syms, rng, 1 << 30))
                    h = o.minimize(e) if goal == "min" else o.maximize(e)
                    o.check()
                    bounds.append(o.lower(h).as_long() if goal == "min" else o.upper(h).as_long())
                out[str(d)] = (bounds[0], bounds[1])
    return out
