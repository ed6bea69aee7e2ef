"""Specialising a graph: symbolic dims fixed to values, shapes propagated, shape computations folded."""
from __future__ import annotations

from typing import Mapping, Tuple, Union

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
    for v in g.inputs:
        if v.shape is not None and any(not isinstance(d, int) for d in v.shape):
            v.type = TensorType(v.dtype, [substitute(d, env) for d in v.shape])
    for name in env:
        del g.symbols[name]
    propagate_shapes(g)
    return g, rewrite(g, [])
