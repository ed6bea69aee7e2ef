"""Shape propagation: re-infer every node's output types in order, after rewrites changed their inputs.

Output dims and symbolic values are simplified over the symbols' ranges as they are inferred: ``max(1, S)``
is ``S`` and ``min(S, 512)`` is ``S`` when ``S`` ranges over ``[1, 512]``; a symbol whose profile takes only
multiples (``H`` of 32) makes ``((H + 1)/2 + 1)/2`` and ``2*(H/8)`` the one size ``H/4``. Every node is
re-inferred from its inputs, so a graph propagated again under other ranges (a wider profile) never keeps a stale simplification.
"""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

from ..errors import ShapeError
from ..ir.dim import Atom, Dim, SymExpr, bounds, dmax, dmin, floordiv, map_atoms, mod, with_multiples
from ..ir.graph import Graph
from ..ir.registry import infer_node
from ..ir.types import TensorType

Ranges = Mapping[str, Tuple[int, int]]
Multiples = Mapping[str, int]


def propagate_shapes(g: Graph) -> int:
    """Refresh output types and symbolic values; returns how many outputs changed."""
    g.toposort()
    ranges = g.symbol_ranges()
    multiples = {s.name: s.multiple for s in g.symbols.values() if s.multiple > 1}
    changed = 0
    for n in g.nodes:
        types, syms = infer_node(n)
        for o, t, s in zip(n.outputs, types, syms):
            t, s = simplify_type(t, ranges, multiples), simplify_values(s, ranges, multiples)
            if o.type.shape is not None and t.shape is not None and len(o.type.shape) != len(t.shape):
                raise ShapeError(f"node {n.name!r} ({n.op}): output {o.name} changed rank from {o.type} to {t}")
            if o.type != t or o.sym_value != s:
                o.type, o.sym_value = t, s
                changed += 1
    return changed


def simplify_type(t: TensorType, ranges: Ranges, multiples: Optional[Multiples] = None) -> TensorType:
    if t.shape is None or all(isinstance(d, int) for d in t.shape):
        return t
    return TensorType(t.dtype, [simplify_dim(d, ranges, multiples) for d in t.shape])


def simplify_values(s: Optional[Tuple[Dim, ...]], ranges: Ranges,
                    multiples: Optional[Multiples] = None) -> Optional[Tuple[Dim, ...]]:
    if s is None or all(isinstance(d, int) for d in s):
        return s
    return tuple(simplify_dim(d, ranges, multiples) for d in s)


def simplify_dim(d: Dim, ranges: Ranges, multiples: Optional[Multiples] = None) -> Dim:
    """``d`` with each max/min argument that can never be the extremum over ``ranges`` dropped (and floor
    divisions and modulos of the simplified arguments rebuilt, so they simplify in turn), in the canonical
    form of :func:`cuvil.ir.dim.with_multiples` for the symbols ``multiples`` lists."""
    if multiples:
        d = with_multiples(d, multiples)
    if isinstance(d, int) or not any(a.kind != "sym" for mono, _ in d.terms for a in mono):
        return d
    return map_atoms(d, lambda a: _simplify_atom(a, ranges))


def _simplify_atom(a: Atom, ranges: Ranges) -> Dim:
    if a.kind == "sym":
        return SymExpr.symbol(a.args[0])
    args = [simplify_dim(x, ranges) for x in a.args]
    if a.kind == "floordiv":
        return floordiv(*args)
    if a.kind == "mod":
        return mod(*args)
    try:
        bs = [bounds(x, ranges) for x in args]
    except (KeyError, ValueError):   # a symbol without a range, or an atom bounds() cannot bound
        return dmax(*args) if a.kind == "max" else dmin(*args)
    if a.kind == "max":   # x is never above the argument with the largest lower bound: dropped
        j = max(range(len(args)), key=lambda i: bs[i])
        kept = [x for i, x in enumerate(args) if i == j or bs[i][1] > bs[j][0]]
        return dmax(*kept)
    j = min(range(len(args)), key=lambda i: (bs[i][1], bs[i][0]))
    kept = [x for i, x in enumerate(args) if i == j or bs[i][0] < bs[j][1]]
    return dmin(*kept)
