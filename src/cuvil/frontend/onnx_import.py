"""ONNX ModelProto -> cuvil.ir.Graph, canonicalised into Cuvil's one form of each op.

Every opset from 7 to the installed onnx package's newest is accepted. Legacy forms are rewritten by
:mod:`cuvil.frontend.legacy`; constant inputs at an op's lifted positions become attributes.
"""
from __future__ import annotations

import os
import re
from typing import Dict, Optional, Union

import numpy as np
import onnx
import onnx.defs
import onnx.inliner
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from ..errors import ModelLoadError, ShapeError, UnsupportedDomainError, UnsupportedOpError
from ..ir.dim import SymExpr, Symbol
from ..ir.dtype import DType
from ..ir.graph import Graph, Value
from ..ir.registry import lookup
from ..ir.types import TensorType
from ..rewrite_rules.lifting import drop_default_attrs, lift_const_inputs
from . import legacy

MIN_OPSET = 7
DEFAULT_DOMAINS = ("", "ai.onnx")


def load_model(src: Union[str, os.PathLike, bytes, onnx.ModelProto]) -> onnx.ModelProto:
    """Read a model from a path, bytes or ModelProto, external data included; errors are ModelLoadError."""
    if isinstance(src, onnx.ModelProto):
        return src
    if isinstance(src, (bytes, bytearray)):
        m = onnx.ModelProto()
        try:
            m.ParseFromString(bytes(src))
        except DecodeError as e:
            raise ModelLoadError(f"not an ONNX model: protobuf parse failed ({e})") from None
        return _check_nonempty(m, "<bytes>")
    path = os.fspath(src)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file")
    try:
        m = onnx.load(path, load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelLoadError(f"{path}: not an ONNX model: protobuf parse failed ({e})") from None
    try:
        onnx.external_data_helper.load_external_data_for_model(m, os.path.dirname(os.path.abspath(path)))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read external weights: {e}") from None
    return _check_nonempty(m, path)


def _check_nonempty(m: onnx.ModelProto, where: str) -> onnx.ModelProto:
    if not m.HasField("graph") or (not m.graph.node and not m.graph.output):
        raise ModelLoadError(f"{where}: not an ONNX model: it has no graph")
    return m


def default_opset(model: onnx.ModelProto) -> int:
    versions = [o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS]
    if not versions:
        return 1 if model.ir_version < 3 else onnx.defs.onnx_opset_version()
    return max(versions)


def import_model(model: onnx.ModelProto, *, constant_initializer_inputs: bool = True) -> Graph:
    """Build the canonical Graph of ``model``.

    Graph inputs that also have an initializer are treated as constants when
    ``constant_initializer_inputs`` (the usual inference setting; old exporters list every weight as an
    input).
    """
    opset = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if opset < MIN_OPSET:
        raise ModelLoadError(f"opset {opset} is older than the oldest supported ({MIN_OPSET})")
    if opset > newest:
        raise ModelLoadError(f"opset {opset} is newer than the installed onnx package knows ({newest})")
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    return _Importer(model, opset, constant_initializer_inputs).run()


_IDENT = re.compile(r"[^0-9A-Za-z_]")


def symbol_name(text: str) -> str:
    """An identifier for an ONNX ``dim_param`` (which may be any string, e.g. 'batch size')."""
    s = _IDENT.sub("_", text.strip()) or "dim"
    return "_" + s if s[0].isdigit() else s


class _Importer:
    def __init__(self, model: onnx.ModelProto, opset: int, const_inits: bool):
        self.model, self.opset, self.const_inits = model, opset, const_inits
        self.g = Graph(name=model.graph.name or "main", opset=opset)
        self.env: Dict[str, Optional[Value]] = {"": None}
        self._checked = set()
        self.declared = {vi.name: vi for vi in list(model.graph.value_info) + list(model.graph.output)}

    def run(self) -> Graph:
        mg = self.model.graph
        for init in mg.initializer:
            arr = _to_array(init)
            self.env[init.name] = self.g.const(arr, init.name)
        for sp in mg.sparse_initializer:
            arr = onnx.numpy_helper.to_array(sp.values)
            dense = np.zeros(tuple(sp.dims), arr.dtype)
            idx = onnx.numpy_helper.to_array(sp.indices)
            dense.reshape(-1)[idx.reshape(-1)] = arr if idx.ndim == 1 else dense[tuple(idx.T)]
            self.env[sp.values.name] = self.g.const(dense, sp.values.name)
        for vi in mg.input:
            if vi.name in self.env and self.const_inits:
                continue
            self.env[vi.name] = self.g.add_input(vi.name, self._type(vi, vi.name))
        for node in _topological(mg):
            self._node(node)
        for vi in mg.output:
            v = self.env.get(vi.name)
            if v is None:
                raise ModelLoadError(f"graph output {vi.name!r} is not produced by any node")
            if vi.name not in self._checked:
                self._check_declared(vi.name, v, "graph output")
            self.g.add_output(v, vi.name)
        return self.g

    def _type(self, vi: onnx.ValueInfoProto, owner: str) -> TensorType:
        if not vi.type.HasField("tensor_type"):
            kind = vi.type.WhichOneof("value")
            raise UnsupportedOpError("<input>", owner, detail=f"input {vi.name!r} is a {kind}, only tensors are supported")
        tt = vi.type.tensor_type
        if tt.elem_type == 0:
            raise ShapeError(f"input {vi.name!r} has no element type")
        if not tt.HasField("shape"):
            return TensorType(tt.elem_type, None)
        dims = []
        for k, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                name = symbol_name(d.dim_param) if d.dim_param else symbol_name(f"{vi.name}_d{k}")
                self.g.symbols.setdefault(name, Symbol(name))
                dims.append(SymExpr.symbol(name))
        return TensorType(tt.elem_type, dims)

    def _node(self, np_: onnx.NodeProto):
        where = np_.name or (np_.output[0] if np_.output else np_.op_type)
        if np_.domain not in DEFAULT_DOMAINS:
            raise UnsupportedDomainError(
                f"node {where!r} ({np_.op_type}) is in domain {np_.domain!r}; only the default ONNX domain is supported")
        attrs = {}
        for a in np_.attribute:
            if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                raise UnsupportedOpError(np_.op_type, where, self.opset, "control flow with subgraphs is not supported")
            attrs[a.name] = _attr_value(a)
        inputs = []
        for name in np_.input:
            if name not in self.env:
                raise ModelLoadError(f"node {where!r} ({np_.op_type}) reads {name!r}, which nothing defines")
            inputs.append(self.env[name])
        outs = legacy.canonicalize(self.g, np_.op_type, inputs, attrs, list(np_.output), where, self.opset)
        for name, v in zip(np_.output, outs):
            if name and v is not None:
                self.env[name] = v
                self._check_declared(name, v, f"node {where!r} ({np_.op_type}) output")

    def _check_declared(self, name: str, v: Value, what: str):
        self._checked.add(name)
        vi = self.declared.get(name)
        if vi is None or not vi.type.HasField("tensor_type"):
            return
        tt = vi.type.tensor_type
        if tt.elem_type and tt.elem_type != int(v.dtype):
            raise ShapeError(f"{what} {name!r}: the model declares {DType(tt.elem_type).name} but "
                             f"Cuvil infers {v.dtype.name}")
        if tt.HasField("shape") and v.shape is not None:
            declared = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
            if len(declared) != len(v.shape) or any(
                    d is not None and isinstance(s, int) and d != s for d, s in zip(declared, v.shape)):
                shown = [d if d is not None else "?" for d in declared]
                raise ShapeError(f"{what} {name!r}: the model declares shape {shown} but "
                                 f"Cuvil infers {v.type}")


def _topological(mg: onnx.GraphProto):
    """Nodes in an order where each follows its producers (ONNX requires it; some exporters forget)."""
    produced = {o: k for k, n in enumerate(mg.node) for o in n.output if o}
    if all(produced.get(i, -1) < k for k, n in enumerate(mg.node) for i in n.input):
        return list(mg.node)
    order, state = [], {}

    def visit(k):
        if state.get(k) == 2:
            return
        if state.get(k) == 1:
            raise ModelLoadError(f"the graph has a cycle through node {mg.node[k].name or mg.node[k].op_type!r}")
        state[k] = 1
        for i in mg.node[k].input:
            if i in produced:
                visit(produced[i])
        state[k] = 2
        order.append(mg.node[k])

    for k in range(len(mg.node)):
        visit(k)
    return order


def _to_array(t: onnx.TensorProto) -> np.ndarray:
    try:
        arr = numpy_helper.to_array(t)
    except Exception as e:  # onnx raises several types for truncated or inconsistent tensors
        raise ModelLoadError(f"initializer {t.name!r} cannot be read: {e}") from None
    return arr


def _attr_value(a: onnx.AttributeProto):
    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, onnx.TensorProto):
        return _to_array(v)
    if isinstance(v, onnx.SparseTensorProto):
        vals, idx = numpy_helper.to_array(v.values), numpy_helper.to_array(v.indices)
        dense = np.zeros(tuple(v.dims), vals.dtype)
        dense.reshape(-1)[idx.reshape(-1)] = vals
        return dense
    if isinstance(v, list):
        return [x.decode("utf-8", "replace") if isinstance(x, bytes) else
                _to_array(x) if isinstance(x, onnx.TensorProto) else x for x in v]
    return v


def add_canonical_node(g: Graph, op: str, inputs, attrs, out_names, where: str, opset: int):
    """Create the canonical node: look the op up, infer types (errors name the node), lift constants."""
    lookup(op, node=where, opset=opset)
    n_out = max(1, len(out_names))
    node = g.add_node(op, list(inputs), attrs, name=where, num_outputs=n_out,
                      output_names=[n or f"{where}_unused{k}" for k, n in enumerate(out_names)])
    lift_const_inputs(g, node)
    drop_default_attrs(node)
    if len(node.outputs) < len(out_names):
        raise ShapeError(f"node {where!r} ({op}) declares {len(out_names)} outputs but the op has {len(node.outputs)}")
    del node.outputs[len(out_names):]  # optional outputs the model does not ask for
    return node


__all__ = ["load_model", "import_model", "symbol_name", "default_opset", "add_canonical_node", "lift_const_inputs"]
