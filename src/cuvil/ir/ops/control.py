"""If, Loop and Scan: ONNX control flow over subgraphs.

They are declared here so that the registry (and ``cuvil ops``) knows them, but no node of these ops ever
reaches a graph: the frontend expands each one as it imports it (:mod:`cuvil.frontend.subgraphs`): an ``If``
whose condition is known at compile time becomes its branch, one whose condition is known only at run time
becomes both branches and a ``Where`` per output, a ``Loop`` or ``Scan`` becomes its body repeated over
the trip count. What the expansion cannot do is refused there, with the op, node and opset.
"""
from __future__ import annotations

from ...errors import UnsupportedOpError
from ..registry import InferCtx, op


@op("If", "Loop", "Scan")
def control_flow(ctx: InferCtx):
    # Reached only by a graph built by hand (the importer never creates these nodes): say where they go.
    raise UnsupportedOpError(ctx.node.op, ctx.node.name, detail="control flow is expanded when an ONNX model is "
                             "imported (cuvil.frontend.subgraphs); a graph node of this op cannot be compiled")
