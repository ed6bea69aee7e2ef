"""Sequential kernels: a loop over steps that carries state from one step to the next (recurrent layers).

A tensor expression computes each output element independently; a recurrence cannot: step t reads every
element step t-1 wrote. :func:`sequential` is the one kernel node that runs a small program instead, for one
*row* (its indices are the node's arguments, e.g. one direction and batch row of an LSTM): the ``init``
assignments, then for ``step`` = 0 .. ``steps``-1 the ``body`` assignments, in order. Each :class:`Assign` is
a loop nest storing an expression into a buffer; an assignment sees everything the earlier ones stored
(state buffers are updated in place, element by element). Rows are independent, so the stage holding the
node runs its rows in parallel like any stage's elements; what a row writes it writes into its own slice of
each buffer.

Both targets emit the node through the shared LLVM emitter (:meth:`LLVMEmitter.sequential`), the bounds
prover checks each assignment's store and loads (:func:`cuvil.kernels.bounds.stage_accesses`), and the
memory plan sees every buffer read or written (:func:`cuvil.kernels.schedule._reads`).
"""
from __future__ import annotations

from typing import List, Sequence

import attrs

from ..ir.dim import evaluate, product
from ..ir.dtype import DType
from .texpr import E, Buf, nodes


@attrs.define(eq=False)
class Assign:
    """``buf[index] = value`` for every value of ``loop_vars`` (each ranging over its ``extents``)."""
    buf: Buf
    index: List[E]
    value: E
    loop_vars: List[E] = attrs.field(factory=list)
    extents: List[object] = attrs.field(factory=list)


@attrs.define(eq=False)
class Sequential:
    """The program of a :func:`sequential` node: ``row_vars`` are bound to the node's arguments, ``step`` runs
    over ``[0, steps)``."""
    row_vars: List[E]
    init: List[Assign]
    step: E
    steps: object
    body: List[Assign]

    def assigns(self) -> List[Assign]:
        return list(self.init) + list(self.body)

    def written(self) -> List[Buf]:
        """The buffers the program stores into (distinct)."""
        out: List[Buf] = []
        for a in self.assigns():
            if all(a.buf is not b for b in out):
                out.append(a.buf)
        return out

    def exprs(self) -> List[E]:
        """Every expression the program evaluates (values and store indices)."""
        return [x for a in self.assigns() for x in [a.value, *a.index]]

    def work(self, env) -> int:
        """Expression evaluations of one row (every assignment's points, reductions' terms included), the
        symbols at ``env``: what a scheduler weighs a row by."""
        per_step = 0
        for a in self.body:
            terms = [product(x.attr[2]) for x in nodes(a.value) if x.op == "reduce"]
            per_step += evaluate(product(a.extents), env) * max([evaluate(t, env) for t in terms], default=1)
        return max(1, evaluate(self.steps, env) * per_step)

    def flops(self, env) -> int:
        """Floating-point operations of one row's sums of products (2 per multiply-add, as
        :func:`cuvil.kernels.schedule._flops` counts a stage's), the symbols at ``env``."""
        total = 0
        for a in self.init + self.body:
            sums = [product(x.attr[2]) for x in nodes(a.value) if x.op == "reduce" and x.attr[0] == "sum"]
            n = evaluate(product(a.extents), env) * sum(evaluate(t, env) for t in sums)
            total += 2 * n * (evaluate(self.steps, env) if any(a is b for b in self.body) else 1)
        return total

    def loads(self) -> List[Buf]:
        """The buffers the program's expressions load from."""
        return [x.attr for e in self.exprs() for x in nodes(e) if x.op == "load"]


def sequential(row: Sequence[E], program: Sequential, dtype: DType) -> E:
    """The node running ``program`` for the row at indices ``row``; its value is 0 of ``dtype`` (the stage
    holding it stores a flag per row; the results are in the buffers the program writes)."""
    return E("sequential", list(row), dtype, program)
