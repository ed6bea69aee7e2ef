"""The graph IR: values, nodes and graphs, with use lists kept up to date by the mutation methods.

A :class:`Value` is produced by exactly one of: a graph input, a constant (``const`` holds the array), or a
node output (``producer``). Nodes refer to values directly; names exist only for printing and export.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import attrs
import numpy as np
from attrs import Factory

from ..errors import GraphError
from .dim import Dim, Symbol
from .dtype import DType
from .registry import infer_node
from .types import TensorType


@attrs.define(eq=False, repr=False)
class Value:
    name: str
    type: TensorType
    producer: Optional["Node"] = None
    const: Optional[np.ndarray] = None
    # For small integer tensors whose contents are known symbolically (shape computations): the
    # flattened elements as dimensions, e.g. Shape(x) of f32[N,3] gives (N, 3).
    sym_value: Optional[Tuple[Dim, ...]] = None
    uses: List[Tuple["Node", int]] = attrs.field(factory=list)
    # How a backend stores the value when the precision policy (cuvil.precision) decided it, "" its own dtype:
    # "bf16" for a value on a residual (skip) path that an explicit --precision bf16 rounds to bfloat16
    # (cuvil.kernels.bf16_storage). Set after the graph rewrites, like Node.precision.
    storage: str = ""

    @property
    def is_const(self) -> bool:
        return self.const is not None

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    @property
    def shape(self):
        return self.type.shape

    def __repr__(self):
        return f"%{self.name}: {self.type}"


@attrs.define(eq=False, repr=False)
class Node:
    op: str
    inputs: List[Optional[Value]]
    outputs: List[Value]
    attrs: Dict[str, Any] = attrs.field(factory=dict)
    name: str = ""
    domain: str = ""
    # Shape conditions inference could not decide (symbolic dims), see cuvil.ir.constraints
    constraints: list = Factory(list)
    # (cond, polarity): the node's outputs are read only when the bool scalar ``cond`` equals ``polarity`` (the
    # nodes of a run-time If's branch), so a backend may skip it otherwise. A hint, never needed for
    # correctness: a pass that cannot keep it true drops it (running a node is always correct).
    guard: Optional[Tuple["Value", bool]] = None
    # The torch module the node was exported from (cuvil.frontend.torch_scopes), "" when unknown: how passes
    # that pick layers by module (LoRA slots) name a layer whose weight lost its name. A hint like ``name``.
    scope: str = ""
    # The number format the node computes in, set by the precision policy (cuvil.precision) after the graph
    # rewrites and before kernel lowering: "" (float32, the default), "bf16", "fp16" or "int8". A narrowed
    # node rounds its float inputs to that format and accumulates in float32; its outputs stay float32
    # unless the policy narrowed the reader too. Only set where the target runs the op in that format.
    precision: str = ""
    # With ``precision`` "fp8": per input, the exponent ``e`` of the power-of-two scale the policy certified
    # (the input is rounded to E4M3 as ``x * 2^-e``; cuvil.precision.formats.Format.exponent), None for an
    # input not narrowed. Empty otherwise.
    precision_scales: Tuple[Optional[int], ...] = ()
    # The names of the nodes a rewrite after the precision policy fused into this one (an ``on x86`` rule's sum
    # of two narrowed convolutions as one: rules/conv_sum.rule), which carried their common ``precision`` over;
    # empty otherwise. The manifest's precision record reads them (cuvil.precision.policy.reconcile).
    fused_from: Tuple[str, ...] = ()

    def input(self, i: int) -> Optional[Value]:
        return self.inputs[i] if i < len(self.inputs) else None

    def __repr__(self):
        return f"<{self.op} {self.name!r}>"


@attrs.define(eq=False, repr=False)
class Graph:
    name: str = "main"
    inputs: List[Value] = attrs.field(factory=list)
    outputs: List[Value] = attrs.field(factory=list)
    # Public names of the outputs (the model's, kept across rewrites that swap the output values).
    output_names: List[str] = attrs.field(factory=list)
    nodes: List[Node] = attrs.field(factory=list)
    symbols: Dict[str, Symbol] = attrs.field(factory=dict)
    opset: int = 21
    _names: set = attrs.field(factory=set)
    _counter: Iterator[int] = attrs.field(factory=lambda: itertools.count())

    # --- names ---------------------------------------------------------------------------------------
    def fresh_name(self, base: str = "v") -> str:
        base = base or "v"
        if base not in self._names:
            self._names.add(base)
            return base
        while True:
            cand = f"{base}_{next(self._counter)}"
            if cand not in self._names:
                self._names.add(cand)
                return cand

    # --- construction ---------------------------------------------------------------------------------
    def add_input(self, name: str, type: TensorType) -> Value:
        v = Value(self.fresh_name(name), type)
        self.inputs.append(v)
        return v

    def add_output(self, v: Value, name: Optional[str] = None) -> None:
        name = name or v.name
        if any(i.name == name and i is not v for i in self.inputs) or name in self.output_names:
            raise GraphError(f"output name {name!r} is already taken by an input or another output")
        self.outputs.append(v)
        self.output_names.append(name)

    def const(self, array, name: str = "const") -> Value:
        """A new constant value holding ``array`` (kept as given; not copied)."""
        arr = np.asarray(array)
        return Value(self.fresh_name(name), TensorType(DType.from_numpy(arr.dtype), arr.shape), const=arr)

    def add_node(self, op: str, inputs: Sequence[Optional[Value]], attrs: Optional[Dict[str, Any]] = None,
                 *, name: str = "", outputs: Optional[Sequence[TensorType]] = None, num_outputs: int = 1,
                 output_names: Optional[Sequence[str]] = None, domain: str = "", index: Optional[int] = None,
                 infer: bool = True) -> Node:
        """Create a node, append it (or insert at ``index``), and infer its output types.

        Output types come from the op registry unless ``outputs`` gives them explicitly.
        """
        node = Node(op, list(inputs), [], dict(attrs or {}), name or self.fresh_name(op.lower()), domain)
        for i, v in enumerate(node.inputs):
            if v is not None:
                v.uses.append((node, i))
        if outputs is None:
            if infer:
                types, sym_values = infer_node(node, num_outputs)
            else:
                types, sym_values = [TensorType(DType.FLOAT, None)] * num_outputs, [None] * num_outputs
        else:
            types, sym_values = list(outputs), [None] * len(outputs)
        for j, t in enumerate(types):
            base = output_names[j] if output_names and j < len(output_names) else f"{node.name}_out{j}" if len(types) > 1 else node.name
            node.outputs.append(Value(self.fresh_name(base), t, producer=node, sym_value=sym_values[j]))
        if index is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(index, node)
        return node

    # --- mutation -----------------------------------------------------------------------------------
    def set_input(self, node: Node, i: int, v: Optional[Value]) -> None:
        old = node.inputs[i]
        if old is not None:
            old.uses.remove((node, i))
        node.inputs[i] = v
        if v is not None:
            v.uses.append((node, i))

    def replace_all_uses(self, old: Value, new: Value) -> None:
        """Every use of ``old`` (node inputs and graph outputs) now reads ``new``."""
        if old is new:
            return
        for node, i in list(old.uses):
            self.set_input(node, i, new)
        self.outputs = [new if o is old else o for o in self.outputs]

    def remove_node(self, node: Node) -> None:
        for o in node.outputs:
            if o.uses or o in self.outputs:
                raise GraphError(f"cannot remove node {node.name} ({node.op}): output {o.name} is still used")
        for i, v in enumerate(node.inputs):
            if v is not None:
                v.uses.remove((node, i))
        self.nodes.remove(node)

    def remove_nodes(self, dead: Iterable[Node]) -> None:
        dead = set(dead)
        for node in dead:
            for i, v in enumerate(node.inputs):
                if v is not None:
                    v.uses.remove((node, i))
        self.nodes = [n for n in self.nodes if n not in dead]

    # --- queries -------------------------------------------------------------------------------------
    def consumers(self, v: Value) -> List[Node]:
        seen, out = set(), []
        for n, _ in v.uses:
            if id(n) not in seen:
                seen.add(id(n))
                out.append(n)
        return out

    def num_uses(self, v: Value) -> int:
        return len(v.uses) + sum(1 for o in self.outputs if o is v)

    def values(self) -> Iterator[Value]:
        """Every value reachable from the nodes, inputs and outputs, each once."""
        seen = set()
        for v in itertools.chain(self.inputs, (i for n in self.nodes for i in n.inputs),
                                 (o for n in self.nodes for o in n.outputs), self.outputs):
            if v is not None and id(v) not in seen:
                seen.add(id(v))
                yield v

    def constants(self) -> List[Value]:
        return [v for v in self.values() if v.is_const]

    def toposort(self) -> None:
        """Order ``nodes`` so every node follows the producers of its inputs (stable for sorted graphs)."""
        indeg = {}
        for n in self.nodes:
            indeg[id(n)] = sum(1 for v in {id(i): i for i in n.inputs if i is not None and i.producer is not None}.values())
        order_index = {id(n): k for k, n in enumerate(self.nodes)}
        ready = [(order_index[id(n)], id(n), n) for n in self.nodes if indeg[id(n)] == 0]
        heapq.heapify(ready)
        out = []
        while ready:
            _, _, n = heapq.heappop(ready)
            out.append(n)
            # Each consumer once, however many of n's outputs it reads (a Concat of one Split's pieces): its
            # in-degree counts every distinct input n produced, and drops by all of them at once.
            consumers = {id(c): c for o in n.outputs for c in self.consumers(o)}
            for c in consumers.values():
                deps = {id(i) for i in c.inputs if i is not None and i.producer is n}
                if deps:
                    indeg[id(c)] -= len(deps)
                    if indeg[id(c)] == 0:
                        heapq.heappush(ready, (order_index[id(c)], id(c), c))
        if len(out) != len(self.nodes):
            stuck = [n.name for n in self.nodes if indeg[id(n)] > 0][:5]
            raise GraphError(f"graph has a cycle through nodes {stuck}")
        self.nodes = out

    def verify(self) -> None:
        """Check the invariants: use lists match inputs, every input is defined before use, no cycles."""
        defined = {id(v) for v in self.inputs}
        for n in self.nodes:
            for i, v in enumerate(n.inputs):
                if v is None:
                    continue
                if not (v.is_const or id(v) in defined):
                    raise GraphError(f"node {n.name} ({n.op}) input {i} ({v.name}) is used before it is defined")
                if (n, i) not in v.uses:
                    raise GraphError(f"use list of {v.name} misses node {n.name} input {i}")
            for o in n.outputs:
                if o.producer is not n:
                    raise GraphError(f"output {o.name} of {n.name} names another producer")
                defined.add(id(o))
        for v in self.values():
            for (n, i) in v.uses:
                if n not in self.nodes or n.inputs[i] is not v:
                    raise GraphError(f"stale use of {v.name} by {n.name}")
        for o in self.outputs:
            if not (o.is_const or id(o) in defined):
                raise GraphError(f"graph output {o.name} is never defined")

    def clone(self) -> "Graph":
        """A structural copy: new values and nodes; constant arrays are shared (never mutated in place)."""
        g = Graph(self.name, symbols=dict(self.symbols), opset=self.opset)
        g._names = set(self._names)
        vmap = {}

        def cp(v):
            if v is None:
                return None
            if id(v) not in vmap:
                vmap[id(v)] = Value(v.name, v.type, const=v.const, sym_value=v.sym_value, storage=v.storage)
            return vmap[id(v)]

        g.inputs = [cp(v) for v in self.inputs]
        for n in self.nodes:
            m = Node(n.op, [cp(v) for v in n.inputs], [], dict(n.attrs), n.name, n.domain, list(n.constraints),
                     None if n.guard is None else (cp(n.guard[0]), n.guard[1]), n.scope, n.precision,
                     tuple(n.precision_scales), tuple(n.fused_from))
            for i, v in enumerate(m.inputs):
                if v is not None:
                    v.uses.append((m, i))
            for o in n.outputs:
                c = cp(o)
                c.producer = m
                m.outputs.append(c)
            g.nodes.append(m)
        g.outputs = [cp(v) for v in self.outputs]
        g.output_names = list(self.output_names)
        return g

    def symbol_ranges(self) -> Dict[str, Tuple[int, int]]:
        return {s.name: (s.min, s.max) for s in self.symbols.values()}

    def __repr__(self):
        return f"<Graph {self.name}: {len(self.inputs)} inputs, {len(self.nodes)} nodes, {len(self.outputs)} outputs>"
