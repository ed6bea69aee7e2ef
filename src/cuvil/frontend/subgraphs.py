"""ONNX control flow (``If``, ``Loop``, ``Scan``) expanded into the data-flow graph as it is imported.

Cuvil's artifacts are kernel sequences (x86: the step table of ``model.c``, whose steps may be guarded; GPU: one
CUDA graph per shape bucket), so control flow becomes data flow as the importer meets it:

* ``If`` whose condition is known at compile time (a constant, a shape computation whose value is known, or
  a chain of nodes over constants, evaluated here by ``onnx.reference``) becomes the branch it takes; the
  other branch is never imported, so it may even be ill-typed for these shapes.
* ``If`` whose condition is known only at run time: both branches are imported and each output is
  ``Where(cond, then, else)``; their outputs must have equal types. Each branch's nodes are guarded by the
  condition (:attr:`cuvil.ir.graph.Node.guard`), so the x86 runtime skips the steps of the branch not taken.
* ``Loop`` with a constant trip count up to :data:`MAX_UNROLLED_TRIPS` is unrolled: the body is imported
  once per iteration with the iteration number as a constant (so an ``If`` on it folds) and the loop-carried
  values threaded through; scan outputs are stacked (``Unsqueeze`` + ``Concat``). A termination condition
  known only at run time is *predicated*: from the first iteration whose condition is dynamic on, each
  iteration's carried values are ``Where(running, new, old)`` and ``running`` is ``And``-ed with the body's
  condition; the iterations are guarded by ``running`` (skipped after the exit).
* Any other ``Loop`` (trip count known only at run time, a while loop, a long loop) is a *run-time loop*:
  the body imported once between a ``LoopState`` and a ``LoopBack`` node (:mod:`cuvil.ir.ops.control`),
  which the x86 backend runs as a backward branch (:mod:`cuvil.kernels.loops`).
* ``Scan`` (opset 8 with its batch axis, and 9+) is unrolled over a constant sequence length up to
  :data:`MAX_UNROLLED_TRIPS`, else (a symbolic or long sequence) run as a run-time loop whose scan outputs
  are accumulators with one row replaced per iteration; every direction and axis attribute is honoured.

Refused, each with one :class:`UnsupportedOpError` naming op, node and opset: a loop with neither trip count
nor condition, scan outputs of a ``Loop`` whose trip count is not constant or which has a run-time exit
(data-dependent length), run-time branches of different
types, loop-carried values whose type changes across iterations of a run-time loop, and expansions past
:data:`MAX_UNROLLED_NODES`.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import onnx
import onnx.helper

from ..errors import InvalidAttributeError, UnsupportedOpError
from ..ir.dtype import DType
from ..ir.graph import Graph, Value
from ..ir.types import TensorType
from ..ir.registry import CUSTOM_DOMAIN
from .canonical import add_canonical_node
from .static_eval import static_value

CONTROL_OPS = frozenset({"If", "Loop", "Scan"})

#: Most nodes one control-flow node may expand into (all iterations of its body together).
MAX_UNROLLED_NODES = 20_000
#: Loops with a constant trip count up to this many iterations are unrolled (fusion and folding see across
#: iterations); longer ones, and those whose trip count is known only at run time, run as run-time loops.
MAX_UNROLLED_TRIPS = 64


def expand(imp, node: onnx.NodeProto, inputs: List[Optional[Value]], where: str) -> List[Optional[Value]]:
    """The values of ``node``'s outputs, after its expansion into ``imp``'s graph (``imp``: the importer,
    which provides ``g``, ``opset`` and ``import_body``)."""
    x = _Expansion(imp, node, inputs, where)
    outs = {"If": x.if_, "Loop": x.loop, "Scan": x.scan}[node.op_type]()
    if len(outs) < len(node.output):
        x.fail(f"the subgraph gives {len(outs)} outputs for the node's {len(node.output)}")
    return outs[:len(node.output)]


class _Expansion:
    """One control-flow node being expanded: its attributes read, the nodes it adds counted against
    :data:`MAX_UNROLLED_NODES`, every refusal raised with its op, node and opset."""

    def __init__(self, imp, node: onnx.NodeProto, inputs, where: str):
        self.imp, self.node, self.inputs, self.where = imp, node, inputs, where
        self.g: Graph = imp.g
        self.opset = imp.opset
        self.attrs = {}
        for a in node.attribute:
            try:
                self.attrs[a.name] = onnx.helper.get_attribute_value(a)
            except Exception as e:  # an AttributeProto of an unknown type
                raise InvalidAttributeError(f"node {where!r} ({node.op_type}) attribute {a.name!r} cannot be read: "
                                            f"{e}") from None
        self.start = len(self.g.nodes)

    # --- helpers ---------------------------------------------------------------------------------------
    def fail(self, detail: str):
        raise UnsupportedOpError(self.node.op_type, self.where, self.opset, detail)

    def graph_attr(self, name: str) -> onnx.GraphProto:
        body = self.attrs.get(name)
        if not isinstance(body, onnx.GraphProto):
            raise InvalidAttributeError(f"node {self.where!r} ({self.node.op_type}) needs the graph attribute {name!r}")
        return body

    def body(self, gp: onnx.GraphProto, args: List[Optional[Value]]) -> List[Optional[Value]]:
        if len(gp.input) != len(args):
            self.fail(f"its subgraph {gp.name or '<body>'!r} takes {len(gp.input)} inputs, the node gives {len(args)}")
        for vi, v in zip(gp.input, args):
            declared = vi.type.tensor_type.elem_type if vi.type.HasField("tensor_type") else None
            if vi.type.WhichOneof("value") not in (None, "tensor_type"):
                self.fail(f"subgraph input {vi.name!r} is a {vi.type.WhichOneof('value')}; only tensors are supported")
            if declared and v is not None and declared != int(v.dtype):
                self.fail(f"subgraph input {vi.name!r} is declared {onnx.TensorProto.DataType.Name(declared)} but "
                          f"receives {v.dtype.name}")
        outs = self.imp.import_body(gp, {vi.name: v for vi, v in zip(gp.input, args)}, self.where)
        if len(self.g.nodes) - self.start > MAX_UNROLLED_NODES:
            self.fail(f"expanding it takes more than {MAX_UNROLLED_NODES} nodes; Cuvil unrolls loops at compile "
                      f"time: lower the trip count or the sequence length")
        return outs

    def guard(self, lo: int, hi: int, cond: Value, polarity: bool) -> None:
        """The nodes ``lo:hi`` of the graph (one branch, one iteration) are read only when ``cond`` is
        ``polarity``: a backend may skip them otherwise (:attr:`cuvil.ir.graph.Node.guard`). Nodes of a
        nested branch keep their own, inner guard."""
        for n in self.g.nodes[lo:hi]:
            if n.guard is None:
                n.guard = (cond, polarity)

    def add(self, op: str, inputs, attrs=None) -> Value:
        n = add_canonical_node(self.g, op, list(inputs), dict(attrs or {}), [f"{self.where}_{op.lower()}"],
                               self.where, self.opset)
        return n.outputs[0]

    def i64(self, values) -> Value:
        return self.g.const(np.asarray(values, np.int64), f"{self.where}_i")

    def scalar_bool(self, v: Value) -> Value:
        """``v`` (a one-element bool tensor) as a scalar, so a select broadcasts it over any shape."""
        if v.dtype != DType.BOOL:
            self.fail(f"its condition is {v.dtype.name}, not a bool tensor")
        if v.shape is not None and len(v.shape) == 0:
            return v
        return self.add("Reshape", [v, self.i64([])])

    def select(self, cond: Value, a: Value, b: Value, what: str) -> Value:
        if a is b:
            return a
        if a.type != b.type:
            self.fail(f"{what}: {a.type} and {b.type} differ; a condition known only at run time selects between "
                      f"both, which needs equal types: make the condition known at compile time (fix the inputs it "
                      f"reads with input_values=, or give the dims it reads static values in the model)")
        return self.add("Where", [cond, a, b])

    def stack(self, pieces: List[Value], axis: int, what: str) -> Value:
        """``pieces`` stacked along a new ``axis``."""
        ups = [self.add("Unsqueeze", [p, self.i64([axis])]) for p in pieces]
        if not ups:
            self.fail(f"{what}: no iteration runs, so its type is unknown")
        return ups[0] if len(ups) == 1 else self.add("Concat", ups, {"axis": axis})

    def empty_stack(self, like: Value, axis: int) -> Value:
        """An empty scan output (zero iterations) of the type one iteration's value ``like`` has."""
        shape = list(like.shape or [])
        if like.shape is None or not all(isinstance(d, int) for d in shape):
            self.fail("no iteration runs and a scan output's shape is not static")
        shape.insert(axis, 0)
        return self.g.const(np.zeros(shape, like.dtype.numpy), f"{self.where}_empty")

    # --- If --------------------------------------------------------------------------------------------
    def if_(self) -> List[Optional[Value]]:
        cond = self.inputs[0] if self.inputs else None
        if cond is None:
            self.fail("it has no condition")
        then_g, else_g = self.graph_attr("then_branch"), self.graph_attr("else_branch")
        known = static_value(self.g, cond)
        if known is not None:
            if known.size != 1:
                self.fail(f"its condition has {known.size} elements; it must have one")
            return self.body(then_g if bool(known.reshape(-1)[0]) else else_g, [])
        c = self.scalar_bool(cond)
        start = len(self.g.nodes)
        a = self.body(then_g, [])
        mid = len(self.g.nodes)
        b = self.body(else_g, [])
        self.guard(start, mid, c, True)
        self.guard(mid, len(self.g.nodes), c, False)
        if len(a) != len(b):
            self.fail(f"its branches give {len(a)} and {len(b)} outputs")
        return [self.select(c, x, y, f"output {k} of the branches") for k, (x, y) in enumerate(zip(a, b))]

    # --- Loop ------------------------------------------------------------------------------------------
    def loop(self) -> List[Optional[Value]]:
        body = self.graph_attr("body")
        m_in = self.inputs[0] if self.inputs else None
        c_in = self.inputs[1] if len(self.inputs) > 1 else None
        carried = list(self.inputs[2:])
        if any(v is None for v in carried):
            self.fail("a loop-carried initial value is missing")
        n_scan = len(body.output) - 1 - len(carried)
        if n_scan < 0 or len(body.input) != 2 + len(carried):
            self.fail(f"its body takes {len(body.input)} inputs and gives {len(body.output)} outputs for "
                      f"{len(carried)} loop-carried values")
        trip = None
        m = static_value(self.g, m_in) if m_in is not None else None
        if m is not None:
            trip = int(m.reshape(-1)[0])
        c = static_value(self.g, c_in) if c_in is not None else None
        if c is not None and not bool(c.reshape(-1)[0]):
            trip = 0
        if m_in is None and c_in is None:
            self.fail("it has neither a trip count M nor a condition, so it never ends")
        dynamic = (m_in is not None and m is None) or (trip is None and (c is None or not n_scan))
        long_ = trip is not None and trip > MAX_UNROLLED_TRIPS and (not n_scan or c_in is None)
        if trip != 0 and (dynamic or long_):
            # a trip count known only at run time, a run-time exit with no bound, or a long loop: compiled
            # once and run by the backend (a backward branch in the x86 step table)
            return self._loop_at_run_time(body, m_in, c_in, carried, n_scan, trip)
        running = None  # None: every iteration so far was taken for certain; else the run-time bool scalar
        if c_in is not None and c is None:
            running = self.scalar_bool(c_in)
        true = self.g.const(np.array(True), f"{self.where}_true")
        scans: List[List[Value]] = [[] for _ in range(n_scan)]
        i, first = 0, None
        while trip is None or i < trip:
            if trip is None and i >= MAX_UNROLLED_NODES:
                self.fail("its condition never becomes false at compile time")
            it = self.g.const(np.array(i, np.int64), f"{self.where}_iter{i}")
            start = len(self.g.nodes)
            outs = self.body(body, [it, true if running is None else running] + carried)
            if running is not None:
                self.guard(start, len(self.g.nodes), running, True)   # skipped once the loop has exited
            first = first or outs
            cond_out, new, scan_out = outs[0], outs[1:1 + len(carried)], outs[1 + len(carried):]
            if running is None:
                carried = list(new)
                for k, s in enumerate(scan_out):
                    scans[k].append(s)
            else:
                if n_scan:
                    self.fail("its condition is known only at run time, so the length of its scan outputs is "
                              "data-dependent; Cuvil needs it at compile time")
                carried = [self.select(running, x, y, f"loop-carried value {k}")
                           for k, (x, y) in enumerate(zip(new, carried))]
            i += 1
            if cond_out is None:
                self.fail("its body gives no condition output")
            c = static_value(self.g, cond_out)
            if c is not None and not bool(c.reshape(-1)[0]):
                break
            if c is None:
                cond_s = self.scalar_bool(cond_out)
                running = cond_s if running is None else self.add("And", [running, cond_s])
        out_scans = []
        for k, pieces in enumerate(scans):
            if pieces:
                out_scans.append(self.stack(pieces, 0, f"scan output {k}"))
            else:
                like = first or self.body(body, [self.g.const(np.array(0, np.int64)), true] + carried)
                out_scans.append(self.empty_stack(like[1 + len(carried) + k], 0))
        return carried + out_scans

    def _loop_at_run_time(self, body, m_in, c_in, carried, n_scan, trip) -> List[Optional[Value]]:
        """The loop as one copy of its body between a ``LoopState`` node (the state slots the body reads:
        iteration number, condition, carried values) and a ``LoopBack`` node (the values the body computes
        for the next iteration; its outputs are the final values), see :mod:`cuvil.ir.ops.control`. Scan
        outputs need a length known at compile time (a constant trip count and no run-time exit): each is an
        accumulator ``[trip, ...]`` whose row the iteration replaces."""
        if n_scan and (trip is None or c_in is not None):
            self.fail(f"its trip count is not a small constant known at compile time (M: "
                      f"{_describe(m_in) if m_in is not None else 'none'}"
                      f"{', and a run-time condition' if c_in is not None else ''}), so its {n_scan} scan output(s) "
                      f"would have a data-dependent length; Cuvil runs such loops at run time only without scan "
                      f"outputs: return the values as loop-carried ones, or make M a constant <= {MAX_UNROLLED_TRIPS}")
        m = None if m_in is None else self.add("Reshape", [m_in, self.i64([1])])
        c = None if c_in is None else self.add("Reshape", [self.scalar_bool(c_in), self.i64([1])])
        ys = []
        if n_scan:
            ys = self._trial_types(body, [TensorType(DType.INT64, ()), TensorType(DType.BOOL, ())]
                                   + [v.type for v in carried])[1 + len(carried):]
        zeros = self._accumulators(ys, self.i64([max(trip, 0)])) if n_scan else []
        loop_id = self.g.fresh_name(self.where)   # unique: an unrolled outer loop imports this node once per copy
        state = self.g.add_node("LoopState", [m, c] + carried + zeros, {"loop": loop_id}, name=f"{self.where}_state",
                                num_outputs=2 + len(carried) + n_scan, domain=CUSTOM_DOMAIN,
                                output_names=[f"{self.where}_iter", f"{self.where}_running"]
                                + [f"{self.where}_state{k}" for k in range(len(carried) + n_scan)])
        it, running, states = state.outputs[0], state.outputs[1], state.outputs[2:2 + len(carried)]
        outs = self.body(body, [it, running] + list(states))
        cond_out, new = outs[0], list(outs[1:1 + len(carried)])
        if cond_out is None:
            self.fail("its body gives no condition output")
        for k, (a, b) in enumerate(zip(states, new)):
            if b is None or a.type != b.type:
                self.fail(f"loop-carried value {k} is {a.type} before an iteration and "
                          f"{None if b is None else b.type} after it; a loop run at run time needs them equal")
        rows = self.i64(np.arange(max(trip or 0, 0))) if n_scan else None
        for k, (acc, y) in enumerate(zip(state.outputs[2 + len(carried):], outs[1 + len(carried):])):
            new.append(self._replace_row(acc, y, ys[k], rows, it, k))
        cond_next = None if c_in is None else self.add("Reshape", [self.scalar_bool(cond_out), self.i64([1])])
        back = self.g.add_node("LoopBack", [cond_next] + new, {"loop": loop_id}, name=f"{self.where}_back",
                               num_outputs=len(new), domain=CUSTOM_DOMAIN,
                               output_names=[f"{self.where}_final{k}" for k in range(len(new))])
        return list(back.outputs)

    def _trial_types(self, body, types) -> List[TensorType]:
        """The types of the body's outputs for inputs of ``types`` (a trial import, removed again): the
        per-iteration shapes of scan outputs, which size their accumulators before the loop."""
        start = len(self.g.nodes)
        outs = self.body(body, [Value(f"{self.where}_probe{k}", t) for k, t in enumerate(types)])
        self.g.remove_nodes(self.g.nodes[start:])
        return [o.type for o in outs]

    def _accumulators(self, ys: List[TensorType], n: Value) -> List[Value]:
        """For each per-iteration type in ``ys``, zeros ``[n, ...]`` (``n`` a one-element int64 value)."""
        zeros = []
        for k, t in enumerate(ys):
            if t.shape is None or not all(isinstance(d, int) for d in t.shape):
                self.fail(f"scan output {k} is {t} per iteration; a loop run at run time needs its per-iteration "
                          f"shape static")
            shape = self.add("Concat", [n, self.i64(list(t.shape))], {"axis": 0})
            zeros.append(self.add("Expand", [self.g.const(np.zeros((), t.dtype.numpy), f"{self.where}_zero"), shape]))
        return zeros

    def _replace_row(self, acc: Value, y: Value, expected: TensorType, rows: Value, row: Value, k: int) -> Value:
        """``acc`` with row ``row`` replaced by ``y`` (``rows``: the row indices 0..n-1)."""
        if y.type != expected:
            self.fail(f"scan output {k} is {y.type}, {expected} in a trial import")
        rank = len(y.shape) + 1
        hit = self.add("Equal", [self.add("Unsqueeze", [rows, self.i64(list(range(1, rank)))]), row])
        return self.add("Where", [hit, self.add("Unsqueeze", [y, self.i64([0])]), acc])

    # --- Scan ------------------------------------------------------------------------------------------
    def scan(self) -> List[Optional[Value]]:
        body = self.graph_attr("body")
        n_in = self.attrs.get("num_scan_inputs")
        if not isinstance(n_in, int) or n_in < 1:
            raise InvalidAttributeError(f"node {self.where!r} (Scan) needs num_scan_inputs >= 1")
        if self.opset < 9:
            return self._scan8(body, n_in)
        states, xs = list(self.inputs[:len(self.inputs) - n_in]), list(self.inputs[len(self.inputs) - n_in:])
        return self._scan_unrolled(body, states, xs, self.attrs.get("scan_input_axes"),
                                   self.attrs.get("scan_input_directions"), self.attrs.get("scan_output_axes"),
                                   self.attrs.get("scan_output_directions"))

    def _scan8(self, body, n_in: int) -> List[Optional[Value]]:
        """Opset 8: every input and output has a leading batch axis, the sequence axis is 1; each batch
        element is scanned on its own and the results stacked."""
        if self.inputs and self.inputs[0] is not None:
            self.fail("sequence_lens (opset-8 Scan) is not supported; leave it empty (every sequence full length)")
        rest = list(self.inputs[1:])
        states, xs = rest[:len(rest) - n_in], rest[len(rest) - n_in:]
        batch = _static_dim(xs[0], 0) if xs and xs[0] is not None else None
        if batch is None:
            self.fail("the batch size of its scan inputs is not static")
        dirs = self.attrs.get("directions")
        per_b = []
        for b in range(batch):
            pick = lambda v: self.add("Gather", [v, self.i64(b)], {"axis": 0})
            per_b.append(self._scan_unrolled(body, [pick(s) for s in states], [pick(x) for x in xs],
                                             None, dirs, None, None))
        return [self.stack([outs[k] for outs in per_b], 0, f"output {k}") for k in range(len(per_b[0]))]

    def _scan_unrolled(self, body, states, xs, in_axes, in_dirs, out_axes, out_dirs) -> List[Optional[Value]]:
        n_state, n_in = len(states), len(xs)
        n_out = len(body.output) - n_state
        if any(v is None for v in states + xs) or n_out < 0 or len(body.input) != n_state + n_in:
            self.fail(f"its body takes {len(body.input)} inputs and gives {len(body.output)} outputs for "
                      f"{n_state} state and {n_in} scan inputs")
        in_axes = self._list_attr(in_axes, n_in, "scan_input_axes")
        in_dirs = self._list_attr(in_dirs, n_in, "scan_input_directions")
        out_axes = self._list_attr(out_axes, n_out, "scan_output_axes")
        out_dirs = self._list_attr(out_dirs, n_out, "scan_output_directions")
        length, axes = None, []
        for k, (x, ax) in enumerate(zip(xs, in_axes)):
            rank = len(x.shape) if x.shape is not None else None
            if rank is None or not -rank <= ax < rank:
                self.fail(f"scan input {k} has axis {ax} outside its rank ({x.type})")
            ax %= rank
            axes.append(ax)
            n = x.shape[ax]
            if length is not None and n != length:
                self.fail(f"its scan inputs have sequence lengths {length} and {n}; they must be equal")
            length = n
        if not isinstance(length, int) or length > MAX_UNROLLED_TRIPS:
            return self._scan_at_run_time(body, states, xs, axes, in_dirs, out_axes, out_dirs)
        per_t: List[List[Value]] = [[] for _ in range(n_out)]
        first = None
        for t in range(length):
            slices = [self.add("Gather", [x, self.i64(length - 1 - t if d else t)], {"axis": ax})
                      for x, ax, d in zip(xs, axes, in_dirs)]
            outs = self.body(body, states + slices)
            first = first or outs
            states = list(outs[:n_state])
            for k, o in enumerate(outs[n_state:]):
                per_t[k].append(o)
        results = []
        for k, pieces in enumerate(per_t):
            if length == 0:
                self.fail("its sequence length is 0, so the types of its scan outputs are unknown")
            rank = len(pieces[0].shape) + 1 if pieces[0].shape is not None else None
            ax = out_axes[k]
            if rank is None or not -rank <= ax < rank:
                self.fail(f"scan output {k} has axis {ax} outside its rank ({rank})")
            results.append(self.stack(pieces[::-1] if out_dirs[k] else pieces, ax % rank, f"scan output {k}"))
        return states + results

    def _scan_at_run_time(self, body, states, xs, axes, in_dirs, out_axes, out_dirs) -> List[Optional[Value]]:
        """A Scan over a symbolic (or long) sequence as a run-time loop: iteration t reads each scan input at
        t (reversed: n-1-t) with a Gather, and each scan output is a loop-carried accumulator [n, ...] whose
        row t (reversed: n-1-t) the iteration replaces (a Where against the row index), moved to its output
        axis at the end."""
        n_state = len(states)
        n = self.add("Gather", [self.add("Shape", [xs[0]]), self.i64([axes[0]])], {"axis": 0})
        slice_types = [TensorType(x.dtype, tuple(d for k, d in enumerate(x.shape) if k != ax))
                       for x, ax in zip(xs, axes)]
        # the scan outputs' types (a trial import of the body) size their accumulators
        ys = self._trial_types(body, [v.type for v in states] + slice_types)[n_state:]
        zeros = self._accumulators(ys, n)
        loop_id = self.g.fresh_name(self.where)
        state = self.g.add_node("LoopState", [self.add("Reshape", [n, self.i64([1])]), None] + states + zeros,
                                {"loop": loop_id, "kind": "Scan"}, name=f"{self.where}_state",
                                num_outputs=2 + len(states) + len(zeros), domain=CUSTOM_DOMAIN)
        it, slots = state.outputs[0], state.outputs[2:]
        last = self.add("Sub", [self.add("Reshape", [n, self.i64([])]), self.i64(1)])
        rev = self.add("Sub", [last, it])
        slices = [self.add("Gather", [x, rev if d else it], {"axis": ax}) for x, ax, d in zip(xs, axes, in_dirs)]
        outs = self.body(body, list(slots[:n_state]) + slices)
        new = list(outs[:n_state])
        for k, (a, b) in enumerate(zip(slots, new)):
            if a.type != b.type:
                self.fail(f"state {k} is {a.type} before an iteration and {b.type} after it; a Scan run at run time "
                          f"needs them equal")
        rows = self.add("Range", [self.i64(0), self.add("Reshape", [n, self.i64([])]), self.i64(1)])
        for k, (acc, y, d) in enumerate(zip(slots[n_state:], outs[n_state:], out_dirs)):
            new.append(self._replace_row(acc, y, ys[k], rows, rev if d else it, k))
        back = self.g.add_node("LoopBack", [None] + new, {"loop": loop_id}, name=f"{self.where}_back",
                               num_outputs=len(new), domain=CUSTOM_DOMAIN)
        finals = list(back.outputs)
        for k, ax in enumerate(out_axes):
            v = finals[n_state + k]
            rank = len(v.shape)
            if not -rank <= ax < rank:
                self.fail(f"scan output {k} has axis {ax} outside its rank ({rank})")
            ax %= rank
            if ax:
                perm = list(range(1, ax + 1)) + [0] + list(range(ax + 1, rank))
                finals[n_state + k] = self.add("Transpose", [v], {"perm": perm})
        return finals

    def _list_attr(self, v, n: int, name: str) -> List[int]:
        if v is None:
            return [0] * n
        v = [int(x) for x in v]
        if len(v) != n:
            raise InvalidAttributeError(f"node {self.where!r} (Scan): {name} has {len(v)} entries for {n} values")
        return v


def _static_dim(v: Value, axis: int) -> Optional[int]:
    if v.shape is None or axis >= len(v.shape):
        return None
    d = v.shape[axis]
    return d if isinstance(d, int) else None


def _describe(v: Value) -> str:
    if v.producer is None and v.const is None:
        return f"graph input {v.name!r}"
    return f"{v.name!r}" + (f", from {v.producer.op} node {v.producer.name!r}" if v.producer is not None else "")


__all__ = ["CONTROL_OPS", "MAX_UNROLLED_NODES", "MAX_UNROLLED_TRIPS", "expand"]
