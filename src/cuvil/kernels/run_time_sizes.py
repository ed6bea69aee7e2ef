"""Sizes that depend on tensor values: NonZero's count, TopK's k read from data, Compress's kept count,
Unique's distinct count, NonMaxSuppression's kept boxes.

Shape inference names such a size with a fresh symbol that no input dim gives (``fresh_dim``). For the ops
here, the scheduler makes it a **run-time symbol**: its range is ``[0, bound]`` with the bound taken from the
producer's input shapes at the profile's maxima (NonZero: the input's element count; TopK: the axis length;
Compress and Unique: the axis length, or the element count without an axis; NonMaxSuppression: batches x
classes x boxes), so buffers are planned at that bound as every symbolic buffer is; the producer's lowering
stores the actual value into the symbol's run-time slot (:meth:`cuvil.kernels.lower.core.LowerCtx.set_size`),
and every later kernel reads it like a symbol bound from an input dim. Any other producer of a fresh symbol
(Range or OneHot sized by tensor data) is refused naming its node, and targets that cannot write symbols at
run time (the GPU, which specialises every symbol) refuse all of them.
"""
from __future__ import annotations

from typing import Dict, List, Set, Tuple

from ..errors import UnsupportedOpError
from ..ir.dim import SymExpr, Symbol, bounds, product
from ..ir.graph import Graph, Node

# Ops whose lowering writes the run-time value of the size symbol of their output(s).
RUN_TIME_SIZE_OPS = ("NonZero", "TopK", "Compress", "Unique", "NonMaxSuppression")


def fresh_symbols(g: Graph, node: Node, known: Set[str]) -> List[str]:
    """The symbols in ``node``'s output shapes that are neither graph symbols, input dims' symbols (an
    unknown one of those is a ShapeError of its own) nor in ``known``."""
    out: Set[str] = set()
    for o in node.outputs:
        for d in o.shape or ():
            if isinstance(d, SymExpr):
                out |= set(d.free_symbols)
    inputs = set().union(*[d.free_symbols for v in g.inputs for d in v.shape or () if isinstance(d, SymExpr)])
    return sorted(out - set(g.symbols) - inputs - known)


def _max_of(d, ranges) -> int:
    return int(d) if not isinstance(d, SymExpr) else int(bounds(d, ranges)[1])


def size_limit(node: Node):
    """A dim expression over the input shapes that ``node``'s data-dependent size never exceeds (the length
    its kernel scans)."""
    s = node.inputs[0].shape
    if node.op == "NonMaxSuppression":   # every box of every (batch, class)
        return product([s[0], s[1], node.inputs[1].shape[1]])
    axis = node.attrs.get("axis")
    if node.op == "NonZero" or node.op == "Unique" and axis is None:
        return product(s)
    if node.op == "TopK":
        return s[(-1 if axis is None else int(axis)) % len(s)]
    if node.op == "Compress":   # the kept entries of the condition (its kernel scans the condition)
        return node.inputs[1].shape[0]
    return s[int(axis) % len(s)]   # Unique along an axis


def size_bound(node: Node, ranges) -> int:
    """The largest value ``node``'s data-dependent size can take over the profile ``ranges``."""
    n = _max_of(size_limit(node), ranges)
    if node.op == "Compress":   # also at most the axis (or the element count): a longer condition is cut
        s, axis = node.inputs[0].shape, node.attrs.get("axis")
        n = min(n, _max_of(product(s) if axis is None else s[int(axis) % len(s)], ranges))
    return n


def run_time_symbols(g: Graph, run_time_sizes: bool) -> Tuple[Dict[str, Symbol], Dict[int, str], Dict[str, object]]:
    """Each data-dependent size of ``g`` as a run-time symbol ``[0, bound]`` (name -> Symbol, in node order),
    the symbol each producer writes (id(node) -> name), and the dim each never exceeds (name -> dim, for the
    memory-safety prover: :func:`size_limit`). Refuses the first node making a size that no
    kernel writes, or any such node when ``run_time_sizes`` is False (a target that specialises symbols)."""
    found: Dict[str, Symbol] = {}
    writers: Dict[int, str] = {}
    limits: Dict[str, object] = {}
    for n in g.nodes:
        fresh = fresh_symbols(g, n, set(found))
        if not fresh:
            continue
        o = next(o for o in n.outputs if set().union(*[d.free_symbols for d in o.shape or ()
                                                        if isinstance(d, SymExpr)]) & set(fresh))
        if not run_time_sizes:
            why = "this target specialises every size before it runs (the x86 target sizes NonZero, TopK, " \
                  "Compress, Unique and NonMaxSuppression outputs at run time)"
        elif n.op not in RUN_TIME_SIZE_OPS or len(fresh) != 1:
            why = "Cuvil sizes such outputs at run time only for NonZero, TopK, Compress, Unique and " \
                  "NonMaxSuppression"
        else:
            ranges = {s.name: (s.min, s.max) for s in list(g.symbols.values()) + list(found.values())}
            bound = size_bound(n, ranges)
            found[fresh[0]] = Symbol(fresh[0], 0, bound, bound)
            writers[id(n)] = fresh[0]
            limits[fresh[0]] = size_limit(n)
            continue
        raise UnsupportedOpError(
            n.op, n.name, g.opset, detail=f"output {o.name!r} has shape {o.type}, whose size {fresh[0]} depends "
            f"on tensor values (not on input shapes); {why}: make that input a constant, or compute this part "
            "outside the library")
    return found, writers, limits
