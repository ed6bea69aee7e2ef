"""Constant folding: nodes whose inputs are all constant are evaluated by ``onnx.reference``.

Cuvil has no second interpreter: a foldable node is exported on its own and run through ONNX's reference
implementation (:mod:`cuvil.reference`), so folded values mean exactly what ONNX says. Shape computations whose elements are known
(``sym_value`` with only ints, e.g. ``Shape`` of a static tensor) fold too, without running anything.
"""
from __future__ import annotations

import numpy as np
from onnx import helper

from ..frontend.onnx_export import export_opset, node_proto, value_info
from ..ir.dim import product
from ..ir.graph import Graph, Node
from ..ir.lifting import lift_const_inputs
from ..ir.registry import CUSTOM_OPSET, infer_node, ops_with
from ..reference import run_reference

# Ops never folded: their result is not a function of their inputs.
NONDETERMINISTIC = ops_with("nondeterministic")
# Largest folded output, in elements: folding must not blow a small graph up into a huge constant.
MAX_FOLD_ELEMENTS = 1 << 26


def fold_constants(g: Graph) -> int:
    """Fold every foldable node, in order; returns how many nodes were replaced by constants."""
    folded = 0
    for n in list(g.nodes):
        if n not in g.nodes:
            continue
        if lift_const_inputs(g, n):
            _reinfer(n)
        if _fold_sym_values(g, n) or _fold_node(g, n):
            folded += 1
    return folded


def _reinfer(n: Node) -> None:
    types, syms = infer_node(n)
    for o, t, s in zip(n.outputs, types, syms):
        o.type, o.sym_value = t, s


def _foldable(n: Node) -> bool:
    if n.op in NONDETERMINISTIC or not n.outputs:
        return False
    if not all(v is None or v.is_const for v in n.inputs):
        return False
    for o in n.outputs:
        if not o.type.is_static or product(o.type.shape) > MAX_FOLD_ELEMENTS:
            return False
    return True


def _fold_sym_values(g: Graph, n: Node) -> bool:
    outs = n.outputs
    if not all(o.sym_value is not None and all(isinstance(d, int) for d in o.sym_value) and o.type.is_static
               and len(o.sym_value) == int(np.prod(o.type.shape, dtype=np.int64)) for o in outs):
        return False
    for o in outs:
        arr = np.asarray(o.sym_value, dtype=o.dtype.numpy).reshape(o.type.shape)
        g.replace_all_uses(o, g.const(arr, o.name))
    g.remove_node(n)
    return True


def _fold_node(g: Graph, n: Node) -> bool:
    if not _foldable(n):
        return False
    try:
        results = evaluate_node(g, n)
        arrays = [np.asarray(arr, dtype=o.dtype.numpy).reshape(o.type.shape) for o, arr in zip(n.outputs, results)]
    except Exception:  # noqa: BLE001
        # The reference refused the node (inputs that fit its declared shapes but not its semantics, e.g. a
        # GatherElements index off the data's shape) or gave a result that contradicts inference: folding is
        # an optimisation, so the node stays as it is and compilation reports it where it must.
        return False
    if len(arrays) != len(n.outputs):
        return False
    for o, arr in zip(n.outputs, arrays):
        g.replace_all_uses(o, g.const(arr, o.name))
    g.remove_node(n)
    return True


def evaluate_node(g: Graph, n: Node, inputs=None):
    """Run ``n`` through ``onnx.reference`` on its constant inputs (or on ``inputs`` by position)."""
    names, feeds, vis = {}, {}, []
    for k, v in enumerate(n.inputs):
        if v is None or id(v) in names:
            continue  # the same value may feed two inputs: one name
        names[id(v)] = f"i{k}"
        feeds[f"i{k}"] = v.const if inputs is None else inputs[k]
        vis.append(value_info(f"i{k}", v.type))
    for j, o in enumerate(n.outputs):
        names[id(o)] = f"o{j}"
    inits = []
    proto = node_proto(n, names, inits)
    graph = helper.make_graph([proto], "fold", vis, [value_info(f"o{j}", o.type) for j, o in enumerate(n.outputs)], inits)
    opsets = [helper.make_opsetid("", export_opset(g))]
    if n.domain:
        opsets.append(helper.make_opsetid(n.domain, CUSTOM_OPSET))
    model = helper.make_model(graph, opset_imports=opsets)
    return run_reference(model, feeds)
