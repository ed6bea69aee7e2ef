"""Canonical form: constant inputs at an op's lifted positions become attributes (and back, on export)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..ir.graph import Graph, Node
from ..ir.registry import lookup


def lifted_value(arr: np.ndarray) -> Any:
    """The attribute form of a lifted constant: a scalar for 0-d arrays, else a (nested) list."""
    arr = np.asarray(arr)
    return arr.item() if arr.ndim == 0 else arr.tolist()


def lift_const_inputs(graph: Graph, node: Node) -> bool:
    """Move constant inputs at lifted positions into attributes; True if the node changed."""
    changed = False
    for name, idx, _kind in lookup(node.op).lifted:
        v = node.input(idx)
        if v is not None and v.is_const and name not in node.attrs:
            node.attrs[name] = lifted_value(v.const)
            graph.set_input(node, idx, None)
            changed = True
    while node.inputs and node.inputs[-1] is None:
        node.inputs.pop()
    return changed
