"""Common-subexpression elimination: equal constants share one value; equal nodes on equal inputs, one node."""
from __future__ import annotations

import numpy as np

from ..ir.digest import array_digest
from ..ir.graph import Graph
from .fold import NONDETERMINISTIC


def const_key(arr: np.ndarray):
    return array_digest(arr)


def attr_key(v):
    if isinstance(v, np.ndarray):
        return ("tensor", const_key(v))
    if isinstance(v, (list, tuple)):
        return tuple(attr_key(x) for x in v)
    if isinstance(v, float) and v != v:
        return ("nan",)
    return v


def eliminate_common_subexpressions(g: Graph) -> int:
    merged = 0
    consts = {}
    for v in list(g.constants()):
        if not v.uses:
            continue
        key = const_key(v.const)
        first = consts.setdefault(key, v)
        if first is not v:
            g.replace_all_uses(v, first)
            merged += 1
    seen = {}
    for n in list(g.nodes):
        if n.op in NONDETERMINISTIC:
            continue
        key = (n.domain, n.op, tuple(id(v) if v is not None else None for v in n.inputs),
               tuple(sorted((k, attr_key(a)) for k, a in n.attrs.items())), len(n.outputs))
        first = seen.setdefault(key, n)
        if first is n:
            continue
        if first.guard != n.guard:
            first.guard = None  # it now serves readers under both guards: it must always run
        for a, b in zip(n.outputs, first.outputs):
            g.replace_all_uses(a, b)
        g.remove_node(n)
        merged += 1
    return merged
