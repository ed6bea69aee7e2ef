"""Specialising a graph: symbolic dims fixed to values, shapes propagated, shape computations folded."""
from __future__ import annotations

from typing import Dict, Mapping, Tuple, Union

from ..errors import ShapeError
from ..ir.dim import SymExpr, substitute
from ..ir.graph import Graph
from ..ir.types import TensorType
from .engine import RewriteReport, rewrite
from .shape_prop import propagate_shapes


def specialize_graph(graph: Graph, fixed: Mapping[str, Union[int, str, SymExpr]]) -> Tuple[Graph, RewriteReport]:
    """A copy of ``graph`` with the symbols of ``fixed`` set to their values (``{"N": 1}``) or made another
    symbol (``{"s.0": "x.0"}``: two dims the model leaves unnamed that must be equal), and the report of the
    folding that follows. A symbol the graph lacks, or a value outside its range, is a ShapeError."""
    g = graph.clone()
    env = {}
    for name, val in fixed.items():
        sym = g.symbols.get(name)
        if sym is None:
            raise ShapeError(f"the model has no symbol {name!r} (it has {sorted(g.symbols) or 'none'})")
        if isinstance(val, (str, SymExpr)):
            other = str(val)
            if other not in g.symbols or isinstance(fixed.get(other), (str, SymExpr)):
                raise ShapeError(f"{name} = {other}: the model has no symbol {other!r} to make it equal to (it has "
                                 f"{sorted(k for k in g.symbols if not isinstance(fixed.get(k), (str, SymExpr)))})")
            env[name] = SymExpr.symbol(other)
            continue
        if not sym.admits(int(val)):
            raise ShapeError(f"{name} = {val} is outside its range {sym.profile_text()}")
        env[name] = int(val)
    env = {k: substitute(d, env) for k, d in env.items()}   # s.0 = x.0 with x.0 = 2 fixed too: s.0 = 2
    _substitute_symbols(g, env)
    return g, rewrite(g, [])


def _substitute_symbols(g: Graph, env: Mapping[str, object]) -> None:
    """The symbols of ``env`` replaced in ``g``'s inputs by their dims, dropped, and shapes propagated."""
    for v in g.inputs:
        if v.shape is not None and any(not isinstance(d, int) for d in v.shape):
            v.type = TensorType(v.dtype, [substitute(d, env) for d in v.shape])
    for name in env:
        del g.symbols[name]
    propagate_shapes(g)


def required_aliases(g: Graph) -> Dict[str, str]:
    """Symbols that ``g``'s ops require equal: an "eq" shape condition between two plain symbols (an LSTM's
    state batch ``state.1`` and its X's batch ``input.0``; MatMul's inner dims) can only hold when they are one
    size, so the graph has one symbol there. ``{symbol: the one it becomes}``: each group of such symbols
    becomes the one first met among the inputs' dims."""
    order: Dict[str, int] = {}
    for v in g.inputs:
        for d in v.shape or ():
            if isinstance(d, SymExpr) and str(d) in g.symbols:
                order.setdefault(str(d), len(order))
    parent: Dict[str, str] = {}

    def find(x: str) -> str:
        while parent.get(x, x) != x:
            x = parent[x]
        return x
    for n in g.nodes:
        for c in n.constraints:
            if c.kind != "eq" or not all(isinstance(d, SymExpr) and str(d) in g.symbols for d in (c.a, c.b)):
                continue
            a, b = find(str(c.a)), find(str(c.b))
            if a != b:
                keep, drop = sorted((a, b), key=lambda s: (order.get(s, len(order)), s))
                parent[drop] = keep
    return {s: find(s) for s in parent}


def unify_required_equal(g: Graph) -> Dict[str, str]:
    """Make the symbols :func:`required_aliases` finds one, in place (repeated: one unification may expose
    another); returns every alias made. Nothing is folded (the graph stays as imported otherwise)."""
    made: Dict[str, str] = {}
    while True:
        aliases = required_aliases(g)
        if not aliases:
            return made
        _substitute_symbols(g, {k: SymExpr.symbol(v) for k, v in aliases.items()})
        made = {k: aliases.get(v, v) for k, v in made.items()}
        made.update(aliases)
