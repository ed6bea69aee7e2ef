"""If, Loop and Scan: ONNX control flow over subgraphs, and the two nodes of a run-time loop.

``If``, ``Loop`` and ``Scan`` are declared here so that the registry (and ``cuvil ops``) knows them, but no
node of these ops ever reaches a graph: the frontend rewrites each one as it imports it
(:mod:`cuvil.frontend.subgraphs`): an ``If`` whose condition is known at compile time becomes its branch,
one whose condition is known only at run time becomes both branches (guarded) and a ``Where`` per output, a
``Loop`` or ``Scan`` with a small trip count known at compile time becomes its body repeated, and any other
``Loop``/``Scan`` becomes a *run-time loop*: its body imported once between the two Cuvil ops below.

* ``LoopState(M?, cond?, init_0, ..., init_n; loop=id)`` -> ``(iter, cond, state_0, ..., state_n)``: the
  loop's state slots (iteration number int64, running condition bool, the loop-carried values), set to
  ``(0, cond or true, init...)`` before the loop. The body reads them; the backend re-enters the body while
  ``cond and iter < M``.
* ``LoopBack(cond_next?, next_0, ..., next_n; loop=id)`` -> ``(final_0, ..., final_n)``: the back edge. While
  the loop runs, ``next_k`` (computed by the body from the state) becomes ``state_k`` (the iteration number
  grows by one, ``cond_next`` becomes the condition); once it stops, the outputs are the state slots.

Both are stateful (``nondeterministic``: never folded nor merged); the x86 backend runs them as a backward
branch in its step table (:mod:`cuvil.kernels.loops`), the GPU backend refuses them.
"""
from __future__ import annotations

import onnx.defs
import onnx.helper

from ...errors import UnsupportedOpError
from ..dtype import DType
from ..registry import CUSTOM_DOMAIN, InferCtx, op, register_custom_schema
from ..types import TensorType

LOOP_OPS = ("LoopState", "LoopBack")


@op("If", "Loop", "Scan")
def control_flow(ctx: InferCtx):
    # Reached only by a graph built by hand (the importer never creates these nodes): say where they go.
    raise UnsupportedOpError(ctx.node.op, ctx.node.name, detail="control flow is expanded when an ONNX model is "
                             "imported (cuvil.frontend.subgraphs); a graph node of this op cannot be compiled")


def _schemas():
    S = onnx.defs.OpSchema
    FP = S.FormalParameter
    opt, var = S.FormalParameterOption.Optional, S.FormalParameterOption.Variadic
    loop = S.Attribute("loop", S.AttrType.STRING, "the loop's id (pairs a LoopState with its LoopBack)")
    kind = S.Attribute("kind", onnx.helper.make_attribute("kind", "Loop"), "the ONNX op it comes from: Loop or Scan")
    any_t = [("V", [f"tensor({t})" for t in ("float", "double", "float16", "int8", "int16", "int32", "int64",
                                              "uint8", "uint16", "uint32", "uint64", "bool")], "any tensor")]
    yield S("LoopState", CUSTOM_DOMAIN, 1, "a run-time loop's state slots: iteration, condition, carried values",
            inputs=[FP("M", "I", param_option=opt), FP("cond", "B", param_option=opt),
                    FP("init", "V", param_option=var, is_homogeneous=False, min_arity=0)],
            outputs=[FP("iter", "I"), FP("running", "B"),
                     FP("state", "V", param_option=var, is_homogeneous=False, min_arity=0)],
            type_constraints=any_t + [("I", ["tensor(int64)"], "int64"), ("B", ["tensor(bool)"], "bool")],
            attributes=[loop, kind])
    yield S("LoopBack", CUSTOM_DOMAIN, 1, "a run-time loop's back edge: next values in, final values out",
            inputs=[FP("cond", "B", param_option=opt),
                    FP("next", "V", param_option=var, is_homogeneous=False, min_arity=0)],
            outputs=[FP("final", "V", param_option=var, is_homogeneous=False, min_arity=0)],
            type_constraints=any_t + [("B", ["tensor(bool)"], "bool")], attributes=[loop])


for _s in _schemas():
    register_custom_schema(_s)


@op("LoopState", domain=CUSTOM_DOMAIN, nondeterministic=True)
def loop_state(ctx: InferCtx):
    for k, what in ((0, "trip count M"), (1, "condition")):
        if ctx.has_input(k):
            want = DType.INT64 if k == 0 else DType.BOOL
            if ctx.dtype(k) != want or any(d != 1 for d in ctx.shape(k) if isinstance(d, int)):
                ctx.fail(f"its {what} must be one {want.name} element, got {ctx.node.inputs[k].type}")
    inits = ctx.node.inputs[2:]
    return ([TensorType(DType.INT64, ()), TensorType(DType.BOOL, ())]
            + [TensorType(v.dtype, v.shape) for v in inits])


@op("LoopBack", domain=CUSTOM_DOMAIN, nondeterministic=True)
def loop_back(ctx: InferCtx):
    return [TensorType(v.dtype, v.shape) for v in ctx.node.inputs[1:]]


def hoist_out_of_loops(nodes: list) -> None:
    """Reorder ``nodes`` (topologically sorted) so that between each ``LoopState`` and its ``LoopBack`` lie
    only nodes that depend on the loop's state: any other node there (an outer node the sort interleaved,
    a loop-invariant part of the body) moves before the ``LoopState``. The body's steps are skipped when the
    loop runs no iteration, so a node that outer consumers need must not be among them; it also runs once
    instead of once per iteration. Order among the moved nodes is kept, so the order stays topological."""
    k = 0
    while k < len(nodes):
        s = nodes[k]
        if s.op == "LoopState":
            ends = [j for j in range(k + 1, len(nodes))
                    if nodes[j].op == "LoopBack" and nodes[j].attrs.get("loop") == s.attrs.get("loop")]
            if ends:
                j = ends[0]
                dependent = {id(v) for v in s.outputs}
                keep, hoist = [], []
                for n in nodes[k + 1:j + 1]:
                    if n is nodes[j] or any(v is not None and id(v) in dependent for v in n.inputs):
                        keep.append(n)
                        dependent.update(id(o) for o in n.outputs)
                    else:
                        hoist.append(n)
                nodes[k:j + 1] = hoist + [s] + keep
                k += len(hoist)
        k += 1
