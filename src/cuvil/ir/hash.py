"""Structural hash of a graph: equal for graphs that compute the same thing the same way, whatever the
value names or the order of independent nodes."""
from __future__ import annotations

import hashlib
from typing import Dict

from .digest import array_digest
from .graph import Graph, Value
from .printer import format_attr


def _h(*parts) -> str:
    m = hashlib.blake2b(digest_size=16)
    for p in parts:
        m.update(str(p).encode())
        m.update(b"\x00")
    return m.hexdigest()


def structural_hash(g: Graph) -> str:
    memo: Dict[int, str] = {}
    for k, v in enumerate(g.inputs):
        memo[id(v)] = _h("input", k, v.type)

    def value_hash(v: Value | None) -> str:
        if v is None:
            return "none"
        key = id(v)
        if key in memo:
            return memo[key]
        if v.is_const:
            memo[key] = _h("const", array_digest(v.const))
            return memo[key]
        # Producers come before consumers in a sorted graph, so this recursion is shallow in practice.
        n = v.producer
        attrs = sorted((k, format_attr(a)) for k, a in n.attrs.items() if not k.startswith("_"))
        node_h = _h("node", n.domain, n.op, attrs, *(value_hash(i) for i in n.inputs))
        for j, o in enumerate(n.outputs):
            memo[id(o)] = _h(node_h, j, o.type)
        return memo[key]

    g.toposort()
    for n in g.nodes:
        for o in n.outputs:
            value_hash(o)
    return _h("graph", *(value_hash(v) for v in g.outputs), *(str(v.type) for v in g.inputs))
