"""cuvil.ir.Graph -> ONNX ModelProto (lifted attributes go back to inputs; opset >= the canonical one)."""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import onnx
import onnx.defs
from onnx import helper, numpy_helper

from ..ir.dim import SymExpr
from ..ir.graph import Graph, Node
from ..ir.ops.control import LOOP_OPS, hoist_out_of_loops
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
    order = list(g.nodes)
    hoist_out_of_loops(order)
    nodes.extend(_node_protos(order, names, inits))
    outputs = []
    for k, (v, want) in enumerate(zip(g.outputs, g.output_names)):
        if names[id(v)] != want:
            nodes.append(helper.make_node("Identity", [names[id(v)]], [want], name=f"{want}_out"))
        outputs.append(value_info(want, v.type))
    graph = helper.make_graph(nodes, g.name, [value_info(names[id(v)], v.type) for v in g.inputs], outputs, inits)
    opsets = [helper.make_opsetid("", opset)]
    if any(n.domain == CUSTOM_DOMAIN and n.op not in LOOP_OPS for n in g.nodes):
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


def _node_protos(order: List[Node], names: Dict[int, str], inits: List[onnx.TensorProto]) -> List[onnx.NodeProto]:
    """The NodeProtos of ``order`` (loops hoisted: :func:`cuvil.ir.ops.control.hoist_out_of_loops`); each
    run-time loop, a ``LoopState`` .. ``LoopBack`` run, goes back to an ONNX ``Loop`` whose body holds the
    nodes between (nested loops within)."""
    out, k = [], 0
    while k < len(order):
        n = order[k]
        if n.op != "LoopState":
            out.append(node_proto(n, names, inits))
            k += 1
            continue
        j = next(i for i in range(k + 1, len(order))
                 if order[i].op == "LoopBack" and order[i].attrs.get("loop") == n.attrs.get("loop"))
        out.append(_loop_proto(n, order[k + 1:j], order[j], names, inits))
        k = j + 1
    return out


def _loop_proto(state: Node, body: List[Node], back: Node, names, inits) -> onnx.NodeProto:
    """``LoopState`` + body + ``LoopBack`` as the ``Loop`` they stand for: the slots are the body's inputs
    (iteration number, condition, carried values), the next values its outputs (each through an Identity,
    since a subgraph output must be produced inside it)."""
    nodes = _node_protos(body, names, inits)
    nexts = [back.inputs[0] if back.inputs[0] is not None else state.outputs[1]] + list(back.inputs[1:])
    outs = []
    for k, v in enumerate(nexts):
        name = f"{back.name}__next{k}"
        nodes.append(helper.make_node("Identity", [names[id(v)]], [name], name=name))
        outs.append(value_info(name, TensorType(v.dtype, ()) if k == 0 else v.type))
    if back.inputs[0] is not None:   # the condition slot is a scalar, the next condition one element
        nodes[-len(nexts)] = helper.make_node("Reshape", [names[id(nexts[0])], f"{back.name}__scalar"],
                                              [f"{back.name}__next0"], name=f"{back.name}__next0")
        inits.append(numpy_helper.from_array(np.zeros(0, np.int64), f"{back.name}__scalar"))
    graph = helper.make_graph(nodes, f"{state.attrs.get('loop', state.name)}_body",
                              [value_info(names[id(v)], v.type) for v in state.outputs], outs)
    ins = [names[id(v)] if v is not None else "" for v in state.inputs]
    if state.inputs[1] is None:   # onnx.reference's Loop runs no iteration for an empty condition: give true
        ins[1] = f"{back.name}__true"
        inits.append(numpy_helper.from_array(np.ones(1, np.bool_), ins[1]))
    return helper.make_node("Loop", ins, [names[id(o)] for o in back.outputs], name=state.attrs.get("loop"),
                            body=graph)


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
        # named after the node's first output (unique; node names need not be: expanded control flow)
        init_name = f"{names[id(n.outputs[0])]}__{name}" if n.outputs else f"{n.name}__{name}"
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
