"""The float16 precision pass (``cuvil compile --enable-fp16``, ``Pipeline.compile(..., enable_fp16=True)``
for the GPU): a graph rewrite that computes float32 tensors in float16.

:func:`to_half` returns a retyped copy of a (static-shaped, optimized) graph:

- every node whose op is in :data:`HALF_OPS` (the ops whose ``half`` trait in the op registry is computed in
  half, exact, or accumulating) and whose float tensors are all float32 computes in float16:
  its float32 outputs become float16, its float32 inputs are read as float16 (constants converted once, here,
  at compile time; other values through one ``Cast`` each);
- other nodes (:data:`FLOAT32_OPS` such as LRN, whose sum of squares overflows half, and every op without a
  ``half`` trait) stay float32 and read half values through a ``Cast`` back to float32;
- graph inputs and outputs keep float32: inputs are cast to half where half nodes read them, half outputs are
  cast back before they leave;
- an exact op that passes a float32 graph input through to a graph output (a KV cache's ``present =
  Concat(past, new)``), and the exact ops reading it, stay float32 (:func:`state_nodes`): the state is not
  rounded on each call, and only its new rows are converted.

Reductions accumulate in float32: the PTX code generator widens every float16 ``sum`` (convolutions, Gemm,
pooling averages, Softmax's denominator) to a float32 accumulator and rounds the result to half once
(:func:`cuvil.targets.ptx.codegen.widen_half_reductions`). ``reference=True`` writes that explicitly for
``onnx.reference``: accumulating ops get float32 Casts around them, so running the returned graph (exported
with :func:`cuvil.frontend.export_model`) on the CPU shows the drift of half storage and elementwise math with
float32 accumulation, the GPU's numerics up to the order of summation.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

from ..errors import CuvilError
from ..ir.dtype import DType
from ..ir.graph import Graph, Node, Value
from ..ir.registry import HALF_ACCUMULATE, HALF_COMPUTE, HALF_EXACT, HALF_FLOAT32, ops_with
from ..ir.types import TensorType
from .shape_prop import propagate_shapes

F32, F16 = DType.FLOAT, DType.FLOAT16

# The float16 classes of the op registry's ``half`` trait, declared with each op.
HALF_OPS = ops_with("half", HALF_COMPUTE, HALF_EXACT, HALF_ACCUMULATE)
# Accumulating ops (the float32 Casts of the reference form go around them).
ACCUMULATING = ops_with("half", HALF_ACCUMULATE)
# Kept in float32 on purpose (the ops without a ``half`` trait simply are not in HALF_OPS).
FLOAT32_OPS = ops_with("half", HALF_FLOAT32)


# The exact ops (data movement, max/min): the same numbers in either format.
EXACT_OPS = ops_with("half", HALF_EXACT)


def _half_node(n: Node, kept) -> bool:
    if n.op not in HALF_OPS or n.domain not in ("", "ai.onnx") or id(n) in kept:
        return False
    floats = [v for v in list(n.inputs) + list(n.outputs) if v is not None and v.dtype.is_float]
    return bool(floats) and all(v.dtype == F32 for v in floats) and any(o.dtype == F32 for o in n.outputs)


def state_nodes(g: Graph) -> set:
    """The ids of the exact ops that stay float32 because they move a state: one reading a float32 graph input
    and writing a graph output (a KV cache: ``present = Concat(past, new)``), and the exact ops reading what
    those wrote (the cache's transpose for the scores). In float16 the pass would round the whole state on every
    call and convert it twice (the input to half, the output back); in float32 it passes through unrounded, only
    its new rows (computed in half) are widened, exactly, on their way in, and a reader that computes in half
    converts what it reads, as it would have converted the input. Expects ``g`` in topological order."""
    ins, outs = {id(v) for v in g.inputs}, {id(v) for v in g.outputs}
    kept, state = set(), set()
    for n in g.nodes:
        if n.op not in EXACT_OPS:
            continue
        moves = (any(v is not None and id(v) in ins and v.dtype == F32 for v in n.inputs)
                 and any(id(o) in outs for o in n.outputs))
        if moves or any(v is not None and id(v) in state for v in n.inputs):
            kept.add(id(n))
            state.update(id(o) for o in n.outputs)
    return kept


def to_half(graph: Graph, *, reference: bool = False) -> Tuple[Graph, List[str]]:
    """(half copy of ``graph``, names of the tensors now float16: activations and converted weights);
    ``reference=True``: its reference form for onnx.reference (float32 accumulators written as Casts)."""
    for v in graph.values():
        if not v.type.is_static:
            raise CuvilError(f"--enable-fp16 needs static shapes: {v.name!r} has shape {v.type}")
    g = graph.clone()
    g.toposort()
    kept = state_nodes(g)
    half_nodes = [n for n in g.nodes if _half_node(n, kept)]
    half_ids = {id(n) for n in half_nodes}
    half_vals: Dict[int, Value] = {}
    lowered: List[str] = []
    for n in half_nodes:
        for o in n.outputs:
            if o.dtype == F32:
                o.type = TensorType(F16, o.shape)
                half_vals[id(o)] = o
                lowered.append(o.name)
    to_half_cache: Dict[int, Value] = {}
    to_float_cache: Dict[int, Value] = {}

    def cast(v: Value, to: DType, cache) -> Value:
        if id(v) not in cache:
            c = g.add_node("Cast", [v], {"to": int(to)}, name=g.fresh_name(f"{v.name}_to_{to.name.lower()}"),
                           output_names=[f"{v.name}_{'f16' if to == F16 else 'f32'}"])
            cache[id(v)] = c.outputs[0]
        return cache[id(v)]

    def half_const(v: Value) -> Value:
        if id(v) not in to_half_cache:
            arr = np.asarray(v.const)
            with np.errstate(over="ignore"):
                h = arr.astype(np.float16)
            c = g.const(h, f"{v.name}_f16")
            to_half_cache[id(v)] = c
            lowered.append(c.name)
        return to_half_cache[id(v)]

    for n in list(g.nodes):
        for i, v in enumerate(n.inputs):
            if v is None:
                continue
            if id(n) in half_ids and v.dtype == F32:
                g.set_input(n, i, half_const(v) if v.is_const else cast(v, F16, to_half_cache))
            elif id(n) not in half_ids and id(v) in half_vals:
                g.set_input(n, i, cast(v, F32, to_float_cache))
    for j, o in enumerate(list(g.outputs)):
        if id(o) in half_vals:
            g.outputs[j] = cast(o, F32, to_float_cache)
    if reference:
        _explicit_accumulators(g, [n for n in half_nodes if n.op in ACCUMULATING])
    g.toposort()
    propagate_shapes(g)
    g.verify()
    return g, lowered


def _explicit_accumulators(g: Graph, nodes: List[Node]) -> None:
    """Reference form: an accumulating half node reads float32 copies of its half inputs and writes float32,
    rounded to half once by a Cast (what the GPU's widened reductions compute)."""
    for n in nodes:
        for i, v in enumerate(n.inputs):
            if v is not None and v.dtype == F16:
                if v.is_const:
                    g.set_input(n, i, g.const(np.asarray(v.const).astype(np.float32), f"{v.name}_f32"))
                else:
                    c = g.add_node("Cast", [v], {"to": int(F32)}, name=g.fresh_name(f"{v.name}_acc32"))
                    g.set_input(n, i, c.outputs[0])
        for o in n.outputs:
            if o.dtype != F16:
                continue
            uses, outs = list(o.uses), [k for k, x in enumerate(g.outputs) if x is o]
            o.type = TensorType(F32, o.shape)
            c = g.add_node("Cast", [o], {"to": int(F16)}, name=g.fresh_name(f"{o.name}_round16"))
            for node, i in uses:
                g.set_input(node, i, c.outputs[0])
            for k in outs:
                g.outputs[k] = c.outputs[0]

