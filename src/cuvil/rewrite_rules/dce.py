"""Dead-code elimination: drop nodes none of whose outputs reach a graph output."""
from __future__ import annotations

from ..ir.graph import Graph


def eliminate_dead_code(g: Graph) -> int:
    live = {id(v) for v in g.outputs}
    keep = []
    for n in reversed(g.nodes):
        if any(id(o) in live for o in n.outputs):
            keep.append(n)
            live.update(id(v) for v in n.inputs if v is not None)
    dead = [n for n in g.nodes if not any(n is k for k in keep)]
    if dead:
        g.remove_nodes(dead)
    return len(dead)
