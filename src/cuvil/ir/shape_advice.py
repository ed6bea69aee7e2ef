"""The next step when a graph's shape conditions fail inside a profile, found by Z3.

A PP-OCR text detector halves H and W five times and adds upsampled maps back to finer ones: only H and W
that are multiples of 32 make the maps the same size. :func:`required_multiples` finds that divisibility
(for each symbol the smallest M such that every condition holds for all multiples of M in its range), and
:func:`advise` turns it into profiles a user can give (``--input-shape x=1x3x32x32:1x3x640x640:1x3x960x960/
1x1x32x32``). When no divisibility helps (a Reshape that needs N <= 4), :func:`satisfying_point` gives symbol
values at which every condition holds, to fix them to. Callers check a suggestion by binding it and proving
the conditions again before they show it (``Pipeline.with_profiles``).
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import attrs
import z3

from .constraints import (Violation, check_constraints, condition_holds, counterexample, domain_facts,
                          first_violation_at, symbol_ranges)
from .dim import SymExpr, evaluate, free_symbols
from .graph import Graph

#: Candidate multiples tried with the solver per condition (candidates a counterexample rules out are free).
MAX_MULTIPLE_TRIES = 64


def symbol_places(g: Graph) -> Dict[str, List[Tuple[str, int]]]:
    """Where each symbol is a whole input dim: ``{"p2o.DynamicDimension.1": [("x", 2)]}``."""
    out: Dict[str, List[Tuple[str, int]]] = {}
    for v in g.inputs:
        for axis, d in enumerate(v.shape or ()):
            if isinstance(d, SymExpr) and str(d) in g.symbols:
                out.setdefault(str(d), []).append((v.name, axis))
    return out


def symbol_text(g: Graph, name: str) -> str:
    """A symbol as the user can find it in the model: ``p2o.DynamicDimension.1 (x axis 2)``; an anonymous dim
    (``?`` in the model) is named after its place, ``x.2 (x axis 2, '?' in the model)``."""
    places = symbol_places(g).get(name, [])
    where = ", ".join(f"{i} axis {a}" for i, a in places)
    if any(name == f"{i}.{a}" for i, a in places):
        where += ", '?' in the model"
    return f"{name} ({where})" if where else name


def required_multiples(g: Graph, violations: Sequence[Violation]) -> Optional[Dict[str, int]]:
    """For the symbols of the failing conditions, the smallest multiples that make every shape condition of
    ``g`` hold over the symbols' ranges (``{"H": 32, "W": 32}``), or None when no divisibility does (or the
    solver cannot tell). Symbols that share a failing condition get one multiple; the others each their own."""
    rng = symbol_ranges(g, None)
    mult = {name: s.multiple for name, s in g.symbols.items()}
    conds = []
    for v in violations:
        names = frozenset(free_symbols(v.constraint.a) | free_symbols(v.constraint.b))
        if not names or any(n not in rng for n in names):
            return None
        conds.append((v, names))
    for group in _groups([names for _, names in conds]):
        found = _smallest_multiple(g, [(v, n) for v, n in conds if n <= group], sorted(group), rng, mult)
        if found is None:
            return None
        mult.update(found)
    if check_constraints(g, None, multiples=mult):
        return None
    return {n: m for n, m in mult.items() if m > 1}


def _groups(sets) -> List[frozenset]:
    """The connected components of symbols that share a condition."""
    groups: List[frozenset] = []
    for s in sets:
        joined = [x for x in groups if x & s]
        groups = [x for x in groups if not x & s] + [frozenset(s.union(*joined))]
    return groups


def _smallest_multiple(g: Graph, conds, names, rng, mult) -> Optional[Dict[str, int]]:
    """The multiples of ``names`` (each the lcm of what ``mult`` has and one common M, M smallest) under which
    every condition of ``conds`` holds; a counterexample to M rules out every M' dividing its values."""
    failing = [(n, v.values) for v, n in conds if v.values]
    tries = 0
    for m in range(2, min(rng[n][1] for n in names) + 1):
        trial = {n: math.lcm(mult.get(n, 1), m) for n in names}
        if any(all(vals.get(n, 0) % trial[n] == 0 for n in cn) for cn, vals in failing):
            continue
        if any(-(-rng[n][0] // trial[n]) * trial[n] + trial[n] > rng[n][1] for n in names):
            continue      # a range would keep one multiple of M or none: that is a fixed value, not divisibility
        tries += 1
        if tries > MAX_MULTIPLE_TRIES:
            return None
        for v, cn in conds:
            ce = counterexample(g, v.constraint, rng, {**mult, **trial})
            if ce is not None:
                if not ce:      # the solver could not settle it
                    return None
                failing.append((cn, ce))
                break
        else:
            return trial
    return None


def narrowed_maxima(g: Graph, violations: Sequence[Violation]) -> Optional[Dict[str, int]]:
    """For the symbols of the failing conditions, the largest maxima (each found by bisection, in turn) under
    which every shape condition of ``g`` holds over ``[min, max]`` (a Slice that needs S <= 512); None when
    even the minima fail."""
    names = sorted({n for v in violations for n in free_symbols(v.constraint.a) | free_symbols(v.constraint.b)})
    rng = dict(symbol_ranges(g, None))
    if any(n not in rng for n in names) or check_constraints(g, {n: (rng[n][0], rng[n][0]) for n in names}):
        return None
    for name in names:
        lo, hi = rng[name][0], rng[name][1]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if check_constraints(g, {**rng, name: (rng[name][0], mid)}):
                hi = mid - 1
            else:
                lo = mid
        rng[name] = (rng[name][0], lo)
    if check_constraints(g, rng):
        return None
    return {n: rng[n][1] for n in names}


def satisfying_point(g: Graph) -> Optional[Dict[str, int]]:
    """Values of every symbol, inside their ranges, at which every shape condition holds: the symbols' opt
    values when they do, else a point Z3 finds; None when there is none."""
    tuned = {name: s.tuned for name, s in g.symbols.items()}
    if first_violation_at(g, tuned) is None:
        return tuned
    syms: Dict[str, z3.ArithRef] = {}
    conds = [condition_holds(c, syms) for n in g.nodes for c in n.constraints]
    for name in g.symbols:
        syms.setdefault(name, z3.Int(name))
    s = z3.Solver()
    s.set("timeout", 5000)
    s.add(*domain_facts(g, syms, symbol_ranges(g, None), None), *conds)
    if s.check() != z3.sat:
        return None
    m = s.model()
    point = {k: m.eval(v, model_completion=True).as_long() for k, v in syms.items()}
    return point if first_violation_at(g, point) is None else None


@attrs.frozen
class ShapeAdvice:
    """Profiles under which every shape condition holds: ``input_shapes`` (``Pipeline.compile(input_shapes=)``)
    and ``shape_profiles`` (by symbol, for symbols no input dim carries), and the flags that say the same."""

    input_shapes: Dict[str, object]
    shape_profiles: Dict[str, tuple]
    flags: List[str]


def rounded_profile(g: Graph, name: str, multiple: int) -> Tuple[int, int, int]:
    """Symbol ``name``'s (min, opt, max) moved onto multiples of ``multiple``: min up, max down, opt to the
    nearest one between them."""
    s = g.symbols[name]
    lo = -(-s.min // multiple) * multiple
    hi = s.max // multiple * multiple
    opt = min(max(round(s.tuned / multiple) * multiple, lo), hi)
    return lo, opt, hi


def advise(g: Graph, multiples: Mapping[str, int] = {}, point: Optional[Mapping[str, int]] = None,
           maxima: Mapping[str, int] = {}) -> Optional[ShapeAdvice]:
    """The profiles that give each symbol of ``g`` its range rounded to ``multiples``, cut at ``maxima`` (or,
    with ``point``, the value it gives; the others keep their ranges), as ``--input-shape`` for the inputs whose dims carry them and
    ``--shape-profile`` / ``--fix`` for the others. None when an input's dim cannot be given (a derived dim of
    an unbound symbol)."""
    prof = {}
    for name, sym in g.symbols.items():
        if point is not None and name in point:
            prof[name] = (point[name],) * 3
        elif name in maxima:
            hi = maxima[name]
            prof[name] = (sym.min, min(sym.tuned, hi), hi)
        else:
            prof[name] = rounded_profile(g, name, multiples.get(name, 1))
    input_shapes: Dict[str, object] = {}
    flags = []
    bound = set()
    for v in g.inputs:
        if v.shape is None or v.type.is_static:
            continue
        points = []
        for k in range(3):
            try:
                points.append([d if isinstance(d, int) else evaluate(d, {n: p[k] for n, p in prof.items()})
                               for d in v.shape])
            except KeyError:
                return None
        mults = [multiples.get(str(d), 1) if isinstance(d, SymExpr) and str(d) in g.symbols else 1 for d in v.shape]
        bound |= {str(d) for d in v.shape if isinstance(d, SymExpr) and str(d) in g.symbols}
        if points[0] == points[2]:
            input_shapes[v.name] = points[0]
            flags.append(f"--input-shape {v.name}=" + "x".join(map(str, points[0])))
        else:
            text = ":".join("x".join(map(str, p)) for p in points)
            if any(m > 1 for m in mults):
                input_shapes[v.name] = tuple(points) + ({"multiple": mults},)
                text += "/" + "x".join(map(str, mults))
            else:
                input_shapes[v.name] = tuple(points)
            flags.append(f"--input-shape {v.name}={text}")
    profiles: Dict[str, tuple] = {}
    for name in sorted(set(g.symbols) - bound):
        lo, opt, hi = prof[name]
        m = multiples.get(name, 1)
        if lo == hi:
            flags.append(f"--fix {name}={lo}")
            profiles[name] = (lo, lo, lo)
        else:
            profiles[name] = (lo, opt, hi) + (({"multiple": m},) if m > 1 else ())
            flags.append(f"--shape-profile {name}={lo}:{opt}:{hi}" + (f"/{m}" if m > 1 else ""))
    return ShapeAdvice(input_shapes, profiles, flags)


__all__ = ["required_multiples", "narrowed_maxima", "satisfying_point", "advise", "ShapeAdvice", "symbol_places", "symbol_text",
           "rounded_profile"]
