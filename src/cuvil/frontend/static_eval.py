"""Values known at import time: a constant, a shape computation whose elements are all known, or a node over
such values, evaluated by ``onnx.reference`` (the evaluator constant folding uses later, so a value means
exactly what ONNX says).

The importer needs some values before the optimiser runs: an ``If``'s condition and a ``Loop``'s trip count
decide what is imported (:mod:`.subgraphs`), and an input at an op's lifted position (a ``Pad``'s pads, a
``Reshape``'s shape) computed by a chain of constant nodes decides the node's output shape, which shape
inference (and an enclosing ``If``'s choice) needs at once (:mod:`.canonical`).
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import onnx
import onnx.helper
from onnx.reference import ReferenceEvaluator

from ..ir.graph import Graph, Value
from ..ir.registry import ops_with
from .onnx_export import export_opset, node_proto, value_info

#: Largest value evaluated at import (elements): conditions, trip counts and shape vectors are small.
MAX_STATIC_ELEMENTS = 1 << 16
_NONDETERMINISTIC = ops_with("nondeterministic")


def static_value(g: Graph, v: Optional[Value], _depth: int = 0,
                 _memo: Optional[Dict[int, Optional[np.ndarray]]] = None) -> Optional[np.ndarray]:
    """The value of ``v`` if it is known at compile time: a constant, a shape computation whose elements are
    all known (``sym_value``), or a node over such values, evaluated by ``onnx.reference``; else None."""
    if v is None:
        return None
    memo = {} if _memo is None else _memo
    if id(v) not in memo:
        memo[id(v)] = _static_value(g, v, _depth, memo)
    return memo[id(v)]


def _static_value(g: Graph, v: Value, _depth: int, memo) -> Optional[np.ndarray]:
    if v.const is not None:
        return np.asarray(v.const)
    shape = v.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    size = int(np.prod(shape, dtype=np.int64))
    if v.sym_value is not None and all(isinstance(d, int) for d in v.sym_value) and len(v.sym_value) == size:
        return np.asarray(v.sym_value, dtype=v.dtype.numpy).reshape(shape)
    n = v.producer
    if n is None or _depth > 64 or n.op in _NONDETERMINISTIC or n.domain or size > MAX_STATIC_ELEMENTS:
        return None
    feeds = []
    for i in n.inputs:
        if i is None:
            feeds.append(None)
            continue
        a = static_value(g, i, _depth + 1, memo)
        if a is None:
            return None
        feeds.append(a)
    try:
        results = _evaluate(g, n, feeds)
        return np.asarray(results[n.outputs.index(v)], dtype=v.dtype.numpy).reshape(shape)
    except Exception:  # noqa: BLE001 -- the reference refused the node: the value stays unknown
        return None


def _evaluate(g: Graph, n, feeds) -> list:
    names, inputs, vis = {}, {}, []
    for k, (v, a) in enumerate(zip(n.inputs, feeds)):
        if v is None or id(v) in names:
            continue
        names[id(v)] = f"i{k}"
        inputs[f"i{k}"] = a
        vis.append(value_info(f"i{k}", v.type))
    for j, o in enumerate(n.outputs):
        names[id(o)] = f"o{j}"
    inits: list = []
    proto = node_proto(n, names, inits)
    graph = onnx.helper.make_graph([proto], "static", vis,
                                   [value_info(f"o{j}", o.type) for j, o in enumerate(n.outputs)], inits)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", export_opset(g))])
    return ReferenceEvaluator(model).run(None, inputs)


__all__ = ["MAX_STATIC_ELEMENTS", "static_value"]
