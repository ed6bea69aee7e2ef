"""Which symbols of a graph are *batch-like*: every output row depends on the input rows of the same index
alone. Two targets use it. A GPU profile bundle (issue 22) may then pad: a call with ``N = 5`` may run the
bucket ``N = 8`` on its 5 rows plus 3 padding rows, and keep the first 5 rows of each output. An x86 library
may then slice (:func:`batch_row_symbol`): a call whose ``N`` is a multiple of the symbol's opt runs the opt
point's kernels once per slice of that many rows, so one slice's activations stay in cache where the generic
kernels would take each layer over the whole batch through memory (SqueezeNet 1.0 at N = 8, 2-core Xeon, one
thread, CPU time per image: 16.4 ms layer by layer, 12.2 ms by slices, 13.3 ms at N = 1;
``python3 bench/batch_slices.py``). :func:`batch_like` checks the property on the symbolic graph, node by node,
before any specialisation:

* every graph input and output that has the symbol has it exactly once, as its dim 0 (so the real rows are
  a prefix of the padded buffer), and no dim is an expression of it (``2*N``, ``N-1``);
* a value whose contents are computed from it (``Shape``, shape arithmetic) is read only as a shape: by more
  shape arithmetic or as the target shape of a Reshape or Expand (whose data is checked as below), never as
  data (``ConstantOfShape``, ``Range``, a graph output);
* every node that reads or writes a value with the symbol keeps the rows apart along its axis: elementwise
  ops with the axis aligned under broadcasting, convolutions and pools and per-channel normalisations on
  axis 0, MatMul/Gemm with the symbol off the contracted axis, softmax/normalisations/reductions over other
  axes, reshapes that keep it as dim 0, transposes, squeezes, slices with a positive step along it, gathers
  and concats along another axis, FusedAttention with it as the batch (dim 0) of every operand.

Any other op that touches the symbol makes it not batch-like: the bundle then runs only its bucket values
exactly, the x86 library its generic kernels over the whole batch (conservative: a false "no" costs speed, a
false "yes" would give wrong rows). The GPU result, with the reason of each "no", goes into the manifest's
``profile``; the x86 one into its ``batch_slices``.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from ..ir.dim import SymExpr
from ..ir.graph import Graph, Node, Value
from ..ir.registry import BROADCAST, PER_CHANNEL, lookup

#: Ops that read one batched tensor (input 0) and write one (output 0), both with the symbol as dim 0, and
#: mix only within a sample: their other inputs are weights/parameters that must not have the symbol.
_PER_SAMPLE = frozenset({"Conv", "ConvTranspose", "MaxPool", "AveragePool", "LpPool", "GlobalAveragePool",
                         "GlobalMaxPool", "GlobalLpPool", "InstanceNormalization", "LRN", "GroupNormalization",
                         "DepthToSpace", "SpaceToDepth", "WinogradConv", "BatchNormalization"})
#: Pure data movement whose output has the symbol's dim exactly once: the rows go where the dim goes.
_MOVES = frozenset({"Transpose", "Squeeze", "Unsqueeze", "Identity", "Dropout", "Cast", "CastLike"})


class _No(Exception):
    pass


#: The "axis" of a small integer tensor whose values are computed from the symbol (a shape as data): allowed
#: only where it is read as a shape (Reshape's, Expand's) or by more shape arithmetic.
SHAPE = "shape"


def _axis(v: Value, sym: SymExpr, name: str):
    """The axis of ``v`` whose dim is the symbol, None if none is, :data:`SHAPE` for a shape computed from
    it as data; :class:`_No` for a dim that is an expression of it or two such dims."""
    if v.sym_value is not None and any(not isinstance(d, int) and name in d.free_symbols for d in v.sym_value):
        return SHAPE
    shape = v.shape
    if shape is None:
        raise _No(f"{v.name} has an unknown rank")
    found = None
    for i, d in enumerate(shape):
        if isinstance(d, int):
            continue
        if d == sym:
            if found is not None:
                raise _No(f"{v.name} has {name} at two axes ({found} and {i})")
            found = i
        elif name in d.free_symbols:
            raise _No(f"{v.name} has the dim {d}, an expression of {name}")
    return found


def _norm(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _check_node(n: Node, ax: Dict[int, Optional[int]], name: str) -> None:
    """Raise :class:`_No` unless ``n`` keeps the rows of the symbol apart (``ax``: id(value) -> axis)."""
    ins = [(i, v, ax.get(id(v))) for i, v in enumerate(n.inputs) if v is not None]
    outs = [(v, ax.get(id(v))) for v in n.outputs]
    carried = [(i, v, a) for i, v, a in ins if a is not None]
    out_axes = [a for _, a in outs]
    if not carried and all(a is None for a in out_axes):
        return
    op = n.op
    why = f"{op} node {n.name or n.outputs[0].name!r}"
    shapes_in = [i for i, _, a in carried if a == SHAPE]
    if any(a == SHAPE for a in out_axes) or shapes_in:
        # shape arithmetic: a shape read (Shape) or computed from shapes, giving shapes (or nothing of the symbol)
        if all(a in (None, SHAPE) for a in out_axes) and (op in ("Shape", "Size") or len(shapes_in) == len(carried)):
            return
        if op in ("Reshape", "Expand") and shapes_in == [1]:
            carried = [c for c in carried if c[0] != 1]          # the target shape; the data is checked below
        else:
            raise _No(f"{why} uses values computed from {name} (a shape) as data")
        if not carried and op == "Expand":
            return
    if not carried:
        if op == "Expand":
            return            # the same row repeated: rows stay apart
        raise _No(f"{why} makes a tensor with {name} from none that has it")
    try:
        opdef = lookup(op, domain=n.domain)
    except Exception:  # noqa: BLE001 - an op the registry does not know is simply not cleared
        opdef = None
    if opdef is not None and opdef.shape_only:
        raise _No(f"{why} reads the shape of a tensor with {name}")
    o_ax = out_axes[0] if out_axes else None
    o_rank = len(n.outputs[0].shape) if n.outputs and n.outputs[0].shape is not None else None

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise _No(f"{why}: {what}")

    if opdef is not None and opdef.elementwise in (BROADCAST, PER_CHANNEL) and op not in ("BatchNormalization",):
        need(o_ax is not None and len(outs) == 1, f"the output loses {name}")
        for _, v, a in carried:
            need(a + (o_rank - len(v.shape)) == o_ax, f"{name} is not one axis under broadcasting")
        return
    if op in _PER_SAMPLE:
        need(len(carried) == 1 and carried[0][0] == 0 and carried[0][2] == 0, f"{name} is not dim 0 of its data input alone")
        need(o_ax == 0 and all(a in (None, 0) for a in out_axes[1:]), f"{name} is not dim 0 of its output")
        if op == "BatchNormalization":
            need(not n.attrs.get("training_mode"), "batch statistics (training mode) mix the rows")
        return
    if op in _MOVES:
        need(len(carried) == 1 and carried[0][0] == 0 and o_ax is not None, f"{name} does not move with the data")
        return
    if op in ("Softmax", "LogSoftmax", "Hardmax"):
        a = carried[0][2]
        need(len(carried) == 1 and _norm(int(n.attrs.get("axis", -1)), len(n.inputs[0].shape)) != a and o_ax == a,
             f"it normalises along {name}")
        return
    if op in ("LayerNormalization", "RMSNormalization"):
        a = carried[0][2]
        need(len(carried) == 1 and carried[0][0] == 0 and o_ax == a
             and _norm(int(n.attrs.get("axis", -1)), len(n.inputs[0].shape)) > a, f"it normalises over {name}")
        return
    if op.startswith("Reduce") or op in ("ArgMax", "ArgMin"):
        need(len(carried) == 1 and carried[0][0] == 0 and o_ax is not None, f"it reduces over {name}")
        rank, a = len(n.inputs[0].shape), carried[0][2]
        axes = n.attrs.get("axes") if op.startswith("Reduce") else [n.attrs.get("axis", 0)]
        need(axes is not None and len(axes) > 0, f"it reduces over every axis, {name} among them")
        need(a not in {_norm(int(x), rank) for x in axes}, f"it reduces over {name}")
        return
    if op == "MatMul":
        a_ax, b_ax = ax.get(id(n.inputs[0])), ax.get(id(n.inputs[1]))
        ra, rb = len(n.inputs[0].shape), len(n.inputs[1].shape)
        need(a_ax is None or a_ax < ra - 1, f"{name} is the contracted axis of A")
        need(b_ax is None or (rb >= 3 and b_ax < rb - 2), f"{name} is a matrix axis of B")
        need(o_ax is not None, f"the output loses {name}")
        return
    if op == "Gemm":
        need(len(carried) >= 1 and carried[0][0] == 0 and ax.get(id(n.inputs[1])) is None and o_ax == 0,
             f"{name} is not the rows of A alone")
        c = n.inputs[2] if len(n.inputs) > 2 else None
        need(c is None or ax.get(id(c)) in (None, 0), f"the bias has {name} off the rows")
        return
    if op in ("Reshape", "Flatten"):
        need(carried[0][2] == 0 and o_ax == 0, f"{name} is not dim 0 before and after")
        return
    if op in ("Concat", "Split"):
        a = carried[0][2]
        need(all(x == a for _, _, x in carried) and all(x == a for x in out_axes),
             f"{name} is not one axis of every operand")
        need(_norm(int(n.attrs.get("axis", 0)), len(n.inputs[0].shape)) != a, f"it joins or splits along {name}")
        return
    if op == "Slice":
        a = carried[0][2]
        need(len(carried) == 1 and carried[0][0] == 0 and o_ax == a, f"it slices along {name}")
        starts, axes, steps = n.attrs.get("starts"), n.attrs.get("axes"), n.attrs.get("steps")
        need(starts is not None, "its starts are not known")
        rank = len(n.inputs[0].shape)
        axes = [_norm(int(x), rank) for x in (axes if axes is not None else range(len(starts)))]
        if a in axes:
            step = int(steps[axes.index(a)]) if steps is not None else 1
            need(step > 0, f"it reverses {name}")
        return
    if op == "Gather":
        data_ax, idx_ax = ax.get(id(n.inputs[0])), ax.get(id(n.inputs[1]))
        axis = _norm(int(n.attrs.get("axis", 0)), len(n.inputs[0].shape))
        need((data_ax is None) != (idx_ax is None), f"both data and indices have {name}")
        need(data_ax is None or data_ax != axis, f"it gathers along {name}")
        need(o_ax is not None, f"the output loses {name}")
        return
    if op == "Pad":
        a = carried[0][2]
        pads = n.attrs.get("pads")
        rank = len(n.inputs[0].shape)
        need(len(carried) == 1 and carried[0][0] == 0 and o_ax == a and pads is not None
             and n.attrs.get("axes") is None and int(pads[a]) == 0 and int(pads[a + rank]) == 0,
             f"it pads along {name}")
        return
    if op == "Expand":
        need(len(carried) == 1 and carried[0][0] == 0 and o_ax is not None
             and carried[0][2] + (o_rank - len(n.inputs[0].shape)) == o_ax, f"{name} moves under the expand")
        return
    if op == "FusedAttention":
        need(all(a == 0 for _, _, a in carried) and o_ax == 0, f"{name} is not the batch (dim 0) of every operand")
        return
    raise _No(f"{why}: {op} is not known to keep the rows of {name} apart")


def batch_like(g: Graph, name: str) -> Tuple[bool, str]:
    """(True, "") when symbol ``name`` of graph ``g`` may be padded (see the module docstring), else (False,
    the first reason why not)."""
    sym = SymExpr.symbol(name)
    try:
        ax: Dict[int, Optional[int]] = {}
        for v in list(g.inputs) + list(g.outputs):
            a = _axis(v, sym, name)
            if a == SHAPE:
                raise _No(f"{'input' if v in g.inputs else 'output'} {v.name} holds values computed from {name}")
            if a not in (None, 0):
                raise _No(f"{'input' if v in g.inputs else 'output'} {v.name} has {name} at axis {a}, not 0")
            ax[id(v)] = a
        for n in g.nodes:
            for v in n.inputs:
                if v is not None and id(v) not in ax:
                    ax[id(v)] = _axis(v, sym, name)
            for v in n.outputs:
                ax[id(v)] = _axis(v, sym, name)
            # taint: what a node computes from a shape of the symbol (Shape, Size) or from such values is
            # itself a value computed from the symbol, whatever its own shape says (a Cast drops sym_value),
            # unless its contents are known as dims free of the symbol (Gather of the sequence length of a shape)
            got = [ax.get(id(v)) for v in n.inputs if v is not None]
            if SHAPE in got or (n.op in ("Shape", "Size") and any(a is not None for a in got)):
                for v in n.outputs:
                    if ax[id(v)] is None and v.sym_value is None:
                        ax[id(v)] = SHAPE
            _check_node(n, ax, name)
        for v in g.outputs:
            if ax.get(id(v)) == SHAPE:
                raise _No(f"output {v.name} holds values computed from {name}")
        if not any(ax.get(id(v)) == 0 for v in g.inputs):
            raise _No(f"no input has {name}")
    except _No as e:
        return False, str(e)
    return True, ""


def batch_row_symbol(g: Graph) -> Optional[str]:
    """The symbol an x86 library may slice a call along: the symbolic dim 0 of the graph's first input when it
    is a plain symbol and :func:`batch_like`, else None."""
    first = g.inputs[0].shape if g.inputs else None
    if not first or not isinstance(first[0], SymExpr) or len(first[0].free_symbols) != 1:
        return None
    (name,) = first[0].free_symbols
    if first[0] != SymExpr.symbol(name) or name not in g.symbols:
        return None
    return name if batch_like(g, name)[0] else None


__all__ = ["batch_like", "batch_row_symbol"]
