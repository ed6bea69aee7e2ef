"""Shape propagation: re-infer every node's output types in order, after rewrites changed their inputs."""
from __future__ import annotations

from ..errors import ShapeError
from ..ir.graph import Graph
from ..ir.registry import infer_node


def propagate_shapes(g: Graph) -> int:
    """Refresh output types and symbolic values; returns how many outputs changed."""
    g.toposort()
    changed = 0
    for n in g.nodes:
        types, syms = infer_node(n)
        for o, t, s in zip(n.outputs, types, syms):
            if o.type.shape is not None and t.shape is not None and len(o.type.shape) != len(t.shape):
                raise ShapeError(f"node {n.name!r} ({n.op}): output {o.name} changed rank from {o.type} to {t}")
            if o.type != t or o.sym_value != s:
                o.type, o.sym_value = t, s
                changed += 1
    return changed
