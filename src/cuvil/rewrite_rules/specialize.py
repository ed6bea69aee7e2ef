"""Specialising a graph: symbolic dims fixed to values, shapes propagated, shape computations folded."""
from __future__ import annotations

from typing import Mapping, Tuple

from ..errors import ShapeError
from ..ir.dim import evaluate
from ..ir.graph import Graph
from ..ir.types import TensorType
from .engine import RewriteReport, rewrite
from .shape_prop import propagate_shapes


def specialize_graph(graph: Graph, fixed: Mapping[str, int]) -> Tuple[Graph, RewriteReport]:
    """A copy of ``graph`` with the symbols of ``fixed`` (``{"N": 1}``) set to their values, and the report
    of the folding that follows. A symbol the graph lacks, or a value outside its range, is a ShapeError."""
    g = graph.clone()
    for name, val in fixed.items():
        sym = g.symbols.get(name)
        if sym is None:
            raise ShapeError(f"the model has no symbol {name!r} (it has {sorted(g.symbols) or 'none'})")
        if not sym.min <= int(val) <= sym.max:
            raise ShapeError(f"{name} = {val} is outside its range [{sym.min}, {sym.max}]")
    env = {k: int(v) for k, v in fixed.items()}
    for v in g.inputs:
        if v.shape is not None and any(not isinstance(d, int) for d in v.shape):
            dims = [d if isinstance(d, int) or not (d.free_symbols <= env.keys()) else evaluate(d, env)
                    for d in v.shape]
            v.type = TensorType(v.dtype, dims)
    for name in env:
        del g.symbols[name]
    propagate_shapes(g)
    return g, rewrite(g, [])
