"""cuvil.ir.Graph -> ONNX ModelProto (lifted attributes go back to inputs; opset >= the canonical one)."""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import onnx
import onnx.defs
from onnx import helper, numpy_helper

from ..ir.dim import SymExpr
from ..ir.graph import Graph, Node
from ..ir.registry import CANON_OPSET, CUSTOM_DOMAIN, CUSTOM_OPSET, lookup
from ..ir.types import TensorType


def export_opset(g: Graph) -> int:
    return min(max(CANON_OPSET, g.opset), onnx.defs.onnx_opset_version())


def value_info(name: str, t: TensorType) -> onnx.ValueInfoProto:
    shape = None if t.shape is None else [d if isinstance(d, int) else str(d) for d in t.shape]
    return helper.make_tensor_value_info(name, int(t.dtype), shape)


def export_model(g: Graph, *, producer: str = "cuvil") -> onnx.ModelProto:
    """A ModelProto computing what ``g`` computes; onnxruntime and onnx.reference both run it."""
    opset = export_opset(g)
    names = _names(g)
    inits: List[onnx.TensorProto] = []
    nodes: List[onnx.NodeProto] = []
    for v in g.constants():
        inits.append(numpy_helper.from_array(np.require(v.const, requirements="C"), names[id(v)]))
    for n in g.nodes:
        nodes.append(node_proto(n, names, inits))
    outputs = []
    for k, (v, want) in enumerate(zip(g.outputs, g.output_names)):
        if names[id(v)] != want:
            nodes.append(helper.make_node("Identity", [names[id(v)]], [want], name=f"{want}_out"))
        outputs.append(value_info(want, v.type))
    graph = helper.make_graph(nodes, g.name, [value_info(names[id(v)], v.type) for v in g.inputs], outputs, inits)
    opsets = [helper.make_opsetid("", opset)]
    if any(n.domain == CUSTOM_DOMAIN for n in g.nodes):
        opsets.append(helper.make_opsetid(CUSTOM_DOMAIN, CUSTOM_OPSET))
    model = helper.make_model(graph, opset_imports=opsets, producer_name=producer)
    model.ir_version = helper.find_min_ir_version_for(opsets[:1])
    return model


def _names(g: Graph) -> Dict[int, str]:
    """Export names: each value's own, except that an output produced by a node takes the public name."""
    names = {id(v): v.name for v in g.values()}
    taken = set(names.values())
    claimed = set()
    for v, want in zip(g.outputs, g.output_names):
        if v.name == want or id(v) in claimed or v in g.inputs or v.is_const:
            continue
        if want not in taken:
            taken.discard(names[id(v)])
            names[id(v)] = want
            taken.add(want)
            claimed.add(id(v))
    return names


def node_proto(n: Node, names: Dict[int, str], inits: List[onnx.TensorProto]) -> onnx.NodeProto:
    """The NodeProto of ``n``; lifted attributes become initializers appended to ``inits``."""
    opdef = lookup(n.op)
    ins: List[str] = [names[id(v)] if v is not None else "" for v in n.inputs]
    attrs = {k: v for k, v in n.attrs.items() if not k.startswith("_")}
    for name, idx, kind in opdef.lifted:
        if name not in attrs:
            continue
        val = attrs.pop(name)
        dt = {"i64": np.int64, "f32": np.float32}.get(kind)
        if dt is None:
            dt = n.inputs[0].dtype.numpy if n.inputs and n.inputs[0] is not None else np.float32
        arr = np.asarray(val, dt)
        init_name = f"{n.name}__{name}"
        inits.append(numpy_helper.from_array(arr, init_name))
        while len(ins) <= idx:
            ins.append("")
        ins[idx] = init_name
    while ins and ins[-1] == "":
        ins.pop()
    return helper.make_node(n.op, ins, [names[id(o)] for o in n.outputs], name=n.name, domain=n.domain or None,
                            **{k: _attr(v) for k, v in attrs.items()})


def _attr(v):
    if isinstance(v, np.ndarray):
        return numpy_helper.from_array(v)
    if isinstance(v, SymExpr):
        raise TypeError(f"symbolic attribute value {v} cannot be exported")
    return v
