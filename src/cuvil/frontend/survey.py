"""What an ONNX model holds, read from the file as it is, and every op in it that Cuvil cannot import.

Import stops at a model it cannot represent; a user who wants to know what the model is, or everything Cuvil
lacks for it, needs the file read without importing it. :func:`unsupported_nodes` walks every node (subgraphs
of If/Loop/Scan included) and decides each op as the importer would (registered, rewritten from a legacy form,
control flow, or an ONNX function body); :func:`survey_model` adds the inputs and outputs as the model declares
them (its dim names, ``?`` for unknown dims), the op histogram and the parameter count.
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, Iterator, List, Optional, Tuple

import attrs
import numpy as np
import onnx

from ..errors import UnsupportedOpError
from ..ir.dtype import DType
from ..ir.registry import all_ops
from . import functions, legacy, subgraphs

DEFAULT_DOMAINS = ("", "ai.onnx")


@attrs.frozen
class UnsupportedNode:
    """One node whose op Cuvil cannot import: ``op``, its ``domain`` ("" for ONNX's), the node's name (or first
    output), the ``opset`` of that domain the model imports (None when it imports none), and ``scope``: the
    control-flow node whose subgraph holds it ("" at the top level)."""

    op: str
    domain: str
    node: str
    opset: Optional[int]
    scope: str = ""

    @property
    def qualified(self) -> str:
        """``BiasGelu`` of ``com.microsoft`` as ``com.microsoft::BiasGelu``; ONNX's own ops by name alone."""
        return f"{self.domain}::{self.op}" if self.domain not in DEFAULT_DOMAINS else self.op


def _walk(graph: onnx.GraphProto, scope: str = "") -> Iterator[Tuple[onnx.NodeProto, str]]:
    """Every node of ``graph`` and of its nodes' subgraphs, each with the control-flow node it sits in."""
    for n in graph.node:
        yield n, scope
        for a in n.attribute:
            inner = f"{scope}/{_where(n)}" if scope else _where(n)
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                        list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []):
                yield from _walk(sub, inner)


def _where(n: onnx.NodeProto) -> str:
    """A node as errors name it: its name, else its first output, else its op."""
    return n.name or (n.output[0] if n.output else n.op_type)


def _opsets(model: onnx.ModelProto) -> Dict[str, int]:
    out = {o.domain: o.version for o in model.opset_import}
    default = max([v for d, v in out.items() if d in DEFAULT_DOMAINS], default=onnx.defs.onnx_opset_version())
    out.update({d: default for d in DEFAULT_DOMAINS})
    return out


def is_supported(op: str, domain: str, opset: Optional[int]) -> bool:
    """Whether the importer has a way in for ``op`` of ``domain`` at that domain's ``opset``: an ONNX op Cuvil
    registers, rewrites from a legacy form, expands (control flow) or imports as its function body; an op of
    another domain only through its function body. Attribute values the op does not support are still
    refused on import, node by node."""
    if domain in DEFAULT_DOMAINS:
        return (op in all_ops() or op in legacy.ADAPTERS or op == "Constant" or op in subgraphs.CONTROL_OPS
                or functions.has_function_body(op, opset))
    return opset is not None and functions.has_function_body(op, opset, domain)


def unsupported_nodes(model: onnx.ModelProto) -> List[UnsupportedNode]:
    """Every node of ``model`` (subgraphs included) whose op Cuvil cannot import, in graph order."""
    opsets = _opsets(model)
    out = []
    for n, scope in _walk(model.graph):
        opset = opsets.get(n.domain)
        if not is_supported(n.op_type, n.domain, opset):
            out.append(UnsupportedNode(n.op_type, n.domain, _where(n), opset, scope))
    return out


def refuse_unsupported(model: onnx.ModelProto) -> None:
    """One :class:`UnsupportedOpError` listing every unsupported op of ``model``, if it has any."""
    bad = unsupported_nodes(model)
    if bad:
        raise unsupported_error(bad)


def unsupported_error(bad: List[UnsupportedNode], *, inspecting: bool = False) -> UnsupportedOpError:
    """The error for these nodes: the count and the ops in the message, one detail line per op with its
    nodes, and what to do next (``inspecting``: for ``cuvil inspect``, which has shown the model already)."""
    by_op: Dict[str, List[UnsupportedNode]] = {}
    for b in bad:
        by_op.setdefault(b.qualified, []).append(b)
    names = list(by_op)
    first = bad[0]
    opset = f"opset {first.opset}" if first.opset is not None else f"domain {first.domain!r} not imported"
    if len(bad) == 1:
        message = f"unsupported op {first.qualified} (node {first.node!r}, {opset})"
    elif len(names) == 1:
        message = f"unsupported op {first.qualified} in {len(bad)} nodes ({opset})"
    else:
        message = f"{len(names)} unsupported ops in the model: " + ", ".join(names)
    details = [_detail_line(op, nodes) for op, nodes in by_op.items()]
    hint = ("export the model without these ops (ONNX's own ops, another opset or exporter option), or replace "
            "them in the ONNX file; `cuvil ops` lists the ops Cuvil imports"
            + ("" if inspecting else "; `cuvil inspect MODEL` shows the rest of the model"))
    return UnsupportedOpError(first.op, first.node, first.opset, domain=first.domain, message=message, hint=hint,
                              details=details, nodes=bad)


def _detail_line(op: str, nodes: List[UnsupportedNode]) -> str:
    """``com.microsoft::BiasGelu (opset 1): 2 nodes: 'gelu1', 'gelu2'``, with where a subgraph holds one."""
    opset = nodes[0].opset
    shown = ", ".join(repr(n.node) + (f" (in {n.scope!r})" if n.scope else "") for n in nodes[:4])
    more = f" and {len(nodes) - 4} more" if len(nodes) > 4 else ""
    version = f"opset {opset}" if opset is not None else f"domain {nodes[0].domain!r} not imported by the model"
    return f"{op} ({version}): {len(nodes)} node{'s' if len(nodes) > 1 else ''}: {shown}{more}"


@attrs.frozen
class ModelSurvey:
    """A model as its file declares it: ``inputs`` / ``outputs`` as ``(name, type)`` (``f32[p2o.DynamicDimension
    .0,?,8]``), the default-domain ``opset``, ``op_histogram`` (every node, subgraphs included, by qualified op),
    ``initializer_elements`` and the ``unsupported`` nodes."""

    inputs: List[Tuple[str, str]]
    outputs: List[Tuple[str, str]]
    opset: int
    op_histogram: Dict[str, int]
    initializer_elements: int
    unsupported: List[UnsupportedNode]


def declared_type(vi: onnx.ValueInfoProto) -> str:
    """A value's type as the model declares it: ``f32[p2o.DynamicDimension.0,3,?,?]``; ``f32[*]`` without a
    shape; the kind for a non-tensor (``sequence``)."""
    if not vi.type.HasField("tensor_type"):
        return vi.type.WhichOneof("value") or "?"
    tt = vi.type.tensor_type
    try:
        short = DType(tt.elem_type).short
    except ValueError:
        short = onnx.TensorProto.DataType.Name(tt.elem_type).lower() if tt.elem_type else "?"
    if not tt.HasField("shape"):
        return f"{short}[*]"
    dims = [str(d.dim_value) if d.HasField("dim_value") and d.dim_value >= 0 else d.dim_param or "?"
            for d in tt.shape.dim]
    return f"{short}[{','.join(dims)}]"


def survey_model(model: onnx.ModelProto) -> ModelSurvey:
    """The :class:`ModelSurvey` of ``model``, without importing it."""
    inits = {t.name for t in model.graph.initializer}
    hist = Counter(UnsupportedNode(n.op_type, n.domain, "", None).qualified for n, _ in _walk(model.graph))
    return ModelSurvey(
        inputs=[(vi.name, declared_type(vi)) for vi in model.graph.input if vi.name not in inits],
        outputs=[(vi.name, declared_type(vi)) for vi in model.graph.output],
        opset=_opsets(model)[""],
        op_histogram=dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))),
        initializer_elements=sum(int(np.prod(t.dims)) for t in model.graph.initializer),
        unsupported=unsupported_nodes(model))


__all__ = ["UnsupportedNode", "ModelSurvey", "unsupported_nodes", "refuse_unsupported", "unsupported_error",
           "survey_model", "declared_type", "is_supported"]
