"""ONNX function bodies: an op Cuvil does not register is imported as the ops of its schema's function body.

Many ONNX ops are defined by a function of other ONNX ops (``Swish``, ``SwiGLU``, the window ops), some by a
function built for the node at hand, from its attributes and input types (``Attention``, ``RotaryEmbedding``,
``SoftmaxCrossEntropyLoss``, ``CenterCropPad``): onnxruntime and onnx-mlir support such ops the same way. The body
is taken at the model's opset (the newest function version not newer than it), its values renamed under the
node's name, its attribute references bound to the node's attributes (or the op's defaults), and its nodes
imported one by one at the opset the body declares, so a body op that is itself a function expands in turn.

A registered op is never expanded: its own shape inference and kernel win. :func:`expandable_ops` lists the ops
this module covers, for ``cuvil ops``.
"""
from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence

import onnx
import onnx.defs

from ..errors import UnsupportedOpError
from ..ir.graph import Value

DEFAULT_DOMAIN_NAMES = ("", "ai.onnx")


def _schema(op: str, opset: int, domain: str = ""):
    try:
        return onnx.defs.get_schema(op, opset, domain)
    except onnx.defs.SchemaError:
        return None


def has_function_body(op: str, opset: int, domain: str = "") -> bool:
    """Whether ``op`` of ``domain`` at ``opset`` (that domain's version) is defined by a function (plain or
    context-dependent)."""
    s = _schema(op, opset, domain)
    return s is not None and bool(_versions(s, opset, False) or _versions(s, opset, True))


def _versions(schema, opset: int, context_dependent: bool) -> List[int]:
    vs = schema.context_dependent_function_opset_versions if context_dependent else schema.function_opset_versions
    return sorted(v for v in vs if v <= opset)


def _input_type(v: Optional[Value]) -> onnx.TypeProto:
    """The TypeProto a context-dependent function builder reads: element type and (symbolic) dims."""
    tp = onnx.TypeProto()
    if v is None:
        return tp  # an omitted optional input: the builder sees no type, as onnx's own expansion passes it
    tt = tp.tensor_type
    tt.elem_type = int(v.dtype)
    if v.shape is not None:
        tt.shape.SetInParent()
        for d in v.shape:
            dim = tt.shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            else:
                dim.dim_param = str(d)
    return tp


def function_body(node: onnx.NodeProto, inputs: Sequence[Optional[Value]], opset: int,
                  where: str, domain: str = "") -> onnx.FunctionProto:
    """The FunctionProto that defines ``node`` at ``opset``: the op's plain function, or the one its builder
    makes for this node's attributes and input types (``opset``: the version of the node's ``domain``).
    UnsupportedOpError when the op has none, or when the builder refuses the node (it then gives no reason; the
    node's attributes or input types do not fit)."""
    schema = _schema(node.op_type, opset, domain)
    if schema is None:
        raise UnsupportedOpError(node.op_type, where, opset, "the op has no schema at this opset")
    plain, context = _versions(schema, opset, False), _versions(schema, opset, True)
    if not plain and not context:
        raise UnsupportedOpError(node.op_type, where, opset)
    # The newest definition not newer than the model's opset, a plain one where both exist at that version.
    if plain and (not context or plain[-1] >= context[-1]):
        data = schema.get_function_with_opset_version(plain[-1])
    else:
        with_defaults = onnx.NodeProto()
        with_defaults.CopyFrom(node)
        _add_defaults(with_defaults, schema)
        try:
            data = schema.get_context_dependent_function_with_opset_version(
                context[-1], with_defaults.SerializeToString(), [_input_type(v).SerializeToString() for v in inputs])
        except Exception as e:  # onnx raises a bare Exception/RuntimeError/ValidationError from the C++ builder
            raise UnsupportedOpError(node.op_type, where, opset,
                                     f"onnx cannot build its function body for this node ({_one_line(e)})") from None
    fn = onnx.FunctionProto()
    fn.ParseFromString(data)
    if not fn.node:
        raise UnsupportedOpError(node.op_type, where, opset,
                                 "onnx builds no function body for this node (its attributes or input types do not "
                                 "fit the op)")
    return fn


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _add_defaults(node: onnx.NodeProto, schema) -> None:
    have = {a.name for a in node.attribute}
    for name, spec in schema.attributes.items():
        if name not in have and spec.default_value is not None and spec.default_value.type != 0:
            a = onnx.AttributeProto()
            a.CopyFrom(spec.default_value)
            a.name = name
            node.attribute.append(a)


def body_opset(fn: onnx.FunctionProto, fallback: int) -> int:
    """The default-domain opset the body's nodes are written in."""
    return max((o.version for o in fn.opset_import if o.domain in DEFAULT_DOMAIN_NAMES), default=fallback)


def inline_body(node: onnx.NodeProto, fn: onnx.FunctionProto, schema_opset: int, prefix: str,
                domain: str = "") -> List[onnx.NodeProto]:
    """The body's nodes with its formal inputs/outputs renamed to the node's actual ones, every other value to
    ``prefix + name``, and attribute references bound to the node's attributes (then the op's defaults; a
    reference to an attribute that is neither drops the inner attribute, so the inner op's default applies)."""
    schema = _schema(node.op_type, schema_opset, domain)
    attrs: Dict[str, onnx.AttributeProto] = {}
    if schema is not None:
        for name, spec in schema.attributes.items():
            if spec.default_value is not None and spec.default_value.type != 0:
                attrs[name] = spec.default_value
    attrs.update({a.name: a for a in node.attribute})
    names: Dict[str, str] = {"": ""}
    for k, formal in enumerate(fn.input):
        names[formal] = node.input[k] if k < len(node.input) else ""
    for k, formal in enumerate(fn.output):
        # An output the node does not ask for stays internal: the body may still use it.
        if k < len(node.output) and node.output[k]:
            names[formal] = node.output[k]

    def rename(name: str) -> str:
        return names[name] if name in names else prefix + name

    out = []
    for inner in fn.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in inner.attribute):
            raise UnsupportedOpError(node.op_type, prefix.rstrip("/"), schema_opset,
                                     f"its function body holds a {inner.op_type} with a subgraph, which Cuvil "
                                     f"does not import")
        n = onnx.NodeProto()
        n.CopyFrom(inner)
        n.ClearField("input")
        n.ClearField("output")
        n.ClearField("attribute")
        n.input.extend(rename(x) for x in inner.input)
        n.output.extend(rename(x) for x in inner.output)
        n.name = prefix + (inner.name or (inner.output[0] if inner.output else inner.op_type))
        for a in inner.attribute:
            if a.ref_attr_name:
                if a.ref_attr_name in attrs:
                    b = onnx.AttributeProto()
                    b.CopyFrom(attrs[a.ref_attr_name])
                    b.name = a.name
                    n.attribute.append(b)
            else:
                n.attribute.append(a)
        out.append(n)
    return out


def _tensor_only(schema) -> bool:
    """Every input and output may be a tensor (Cuvil imports no sequences or optionals: SequenceMap's body
    would not help)."""
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    return all(any(t.startswith("tensor(") for t in allowed.get(f.type_str, [f.type_str]))
               for f in list(schema.inputs) + list(schema.outputs))


@functools.lru_cache(maxsize=None)
def expandable_ops(opset: int) -> Dict[str, str]:
    """The default-domain ops at ``opset`` defined by a function body, each with how: ``"function"`` (one body
    for every node) or ``"context-dependent function"`` (a body built per node). Whether a given node then
    compiles depends on the ops of its body. Ops over sequences or optionals are left out: Cuvil imports
    tensors only."""
    out = {}
    for s in onnx.defs.get_all_schemas_with_history():
        if s.domain not in DEFAULT_DOMAIN_NAMES or s.deprecated:
            continue
        cur = _schema(s.name, opset)
        if cur is None or cur.name in out or not _tensor_only(cur):
            continue
        if _versions(cur, opset, False):
            out[cur.name] = "function"
        elif _versions(cur, opset, True):
            out[cur.name] = "context-dependent function"
    return dict(sorted(out.items()))


__all__ = ["has_function_body", "function_body", "inline_body", "body_opset", "expandable_ops"]
