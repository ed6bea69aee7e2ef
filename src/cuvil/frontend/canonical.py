"""One node in Cuvil's canonical form: the op looked up in the registry, its types inferred, constant inputs at
the op's lifted positions turned into attributes, default attributes dropped.

Every imported node is built here, through :func:`cuvil.frontend.legacy.canonicalize` (directly for an op in its
current form, by an opset adapter for an older one); a module of its own so that the importer and the adapters
do not import each other.
"""
from __future__ import annotations

from ..errors import ShapeError
from ..ir.graph import Graph
from ..ir.lifting import drop_default_attrs, lift_const_inputs
from ..ir.registry import lookup
from .static_eval import static_value


def add_canonical_node(g: Graph, op: str, inputs, attrs, out_names, where: str, opset: int):
    """Create the canonical node: look the op up, infer types (errors name the node), lift constants."""
    opdef = lookup(op, node=where, opset=opset)
    inputs = list(inputs)
    for _, k, _ in opdef.lifted:
        # A lifted input computed from constants (a Pad's pads built by Concat/Slice/Cast of constants) is
        # evaluated now, so the node's output shape is known at once (shape inference, an enclosing If).
        v = inputs[k] if k < len(inputs) else None
        if v is not None and not v.is_const and v.producer is not None:
            known = static_value(g, v)
            if known is not None:
                inputs[k] = g.const(known, v.name)
    n_out = max(1, len(out_names))
    node = g.add_node(op, list(inputs), attrs, name=where, num_outputs=n_out,
                      output_names=[n or f"{where}_unused{k}" for k, n in enumerate(out_names)])
    lift_const_inputs(g, node)
    drop_default_attrs(node)
    if len(node.outputs) < len(out_names):
        raise ShapeError(f"node {where!r} ({op}) declares {len(out_names)} outputs but the op has {len(node.outputs)}")
    del node.outputs[len(out_names):]  # optional outputs the model does not ask for
    return node
