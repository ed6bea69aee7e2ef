"""Run-time loops in the schedule: the stages of a ``LoopState`` / ``LoopBack`` pair (:mod:`cuvil.ir.ops.control`)
and the :class:`LoopRegion` a backend turns into a backward branch.

The body's nodes lie between the two (every one reads a state slot or feeds the back edge), so their stages
do too. The stages made here:

* ``LoopState``: one store per state slot (iteration 0, the initial condition, each initial carried value),
  then the *head*: ``go = running and iter < M`` (a bool scalar in its own buffer). The body re-enters at the
  head; when ``go`` is false after it, the run jumps past the back edge.
* ``LoopBack``: each next value stored in a buffer of its own first, then copied into its state slot (two
  steps, so a body that swaps carried values, or passes one through as a view of another's slot, reads
  every old value before any slot is written), the iteration number plus one, the next condition; after the
  last of these copies (the *back* stage) the run jumps to the head. A slot whose next value is
  ``Where(c, a, slot)`` read by nothing else, and which nothing else reads (a scan output's accumulator with
  one row replaced), is updated in place after the other next values are stored: one pass instead of three.
  The outputs are the state slots.

Stages between the head and the back stage run once per iteration, and not at all when the loop runs none:
before lowering, :func:`cuvil.ir.ops.control.hoist_out_of_loops` moves every node there that does not
depend on the loop's state (outer nodes the topological sort interleaved, loop-invariant parts of the body,
which CSE may share with outer consumers) before the ``LoopState``. The memory plan keeps every buffer that
is written before the head and read inside the loop alive until the back stage (its bytes must survive
every iteration), which covers the state slots and values read by the body from outside.
"""
from __future__ import annotations

from typing import List

import attrs

from ..ir.dtype import DType
from .texpr import Buf, cmp, const, load, logic


@attrs.define(eq=False)
class LoopRegion:
    """One run-time loop in a schedule's stage list: the body runs from ``head`` (which computes ``go``)
    through ``back``; after ``head``, ``go`` false jumps past ``back``; after ``back``, the run jumps to
    ``head``."""

    name: str        # the ONNX Loop/Scan node's name
    head: object     # Stage
    go: Buf
    back: object     # Stage


def _first(t) -> object:
    """Element 0 of a one-element tensor function."""
    return t.fn([const(0, DType.INT64)] * len(t.shape))


def _store(builder, v, t) -> Buf:
    """``v`` stored in an arena buffer of its own (a state slot: never inlined, never a view)."""
    builder.fns[id(v)] = builder.materialize(v.name, v.shape, v.dtype, t)
    buf = builder.stages[-1].buf
    builder.bufs[id(v)] = buf
    builder.expensive[id(v)] = False
    builder.contracting[id(v)] = False
    return buf


def lower_loop_state(builder, node) -> None:
    ins = builder._inputs(node)
    m, c = ins[0], ins[1]
    it = _store(builder, node.outputs[0], lambda idx: const(0, DType.INT64))
    run = _store(builder, node.outputs[1], (lambda idx: _first(c)) if c is not None else
                 (lambda idx: const(True, DType.BOOL)))
    states = [_store(builder, v, t.fn) for v, t in zip(node.outputs[2:], ins[2:])]

    def go(idx):
        running = load(run, [])
        if m is None:
            return running
        return logic("and", running, cmp("lt", load(it, []), _first(m)))

    builder.materialize(f"{node.name}_go", (), DType.BOOL, go)
    head = builder.stages[-1]
    builder.open_loops[node.attrs["loop"]] = (node, head, head.buf, it, run, states)


def lower_loop_back(builder, node) -> None:
    name = node.attrs["loop"]
    state, head, go, it, run, states = builder.open_loops.pop(name)
    ins = builder._inputs(node)
    cond_next, nexts = ins[0], ins[1:]
    in_place = [_in_place(state, node, k) for k in range(len(states))]
    # every next value first into a buffer of its own, then into the slots; a slot only its own row update
    # reads (a scan output's accumulator) is updated in place, after the others' next values are stored
    temps = [None if in_place[k] else builder.materialize(f"{node.name}_next{k}", s.shape, s.dtype, t.fn)
             for k, (s, t) in enumerate(zip(states, nexts))]
    for k, (slot, t) in enumerate(zip(states, nexts)):
        if in_place[k]:
            builder.store_into(f"{node.name}_update{k}", slot, t.fn)
    it_next = builder.materialize(f"{node.name}_iter_next", (), DType.INT64,
                                  lambda idx: load(it, []) + const(1, DType.INT64))
    run_next = None
    if cond_next is not None:
        run_next = builder.materialize(f"{node.name}_running_next", (), DType.BOOL, lambda idx: _first(cond_next))
    for k, (slot, t) in enumerate(zip(states, temps)):
        if t is not None:
            _copy(builder, f"{node.name}_carry{k}", slot, t)
    _copy(builder, f"{node.name}_carry_iter", it, it_next)
    if run_next is not None:
        _copy(builder, f"{node.name}_carry_running", run, run_next)
    builder.loops.append(LoopRegion(name, head, go, builder.stages[-1]))
    for o, slot in zip(node.outputs, states):
        builder.place_stored(node, o, slot)


def _in_place(state, back, k: int) -> bool:
    """Slot ``k``'s next value is ``Where(c, a, slot)`` and nothing else reads the slot (a scan output's
    accumulator with one row replaced): each element of the update reads the slot at its own index only,
    and no other next value reads it, so the update may write the slot directly (one pass, not three)."""
    slot, nxt = state.outputs[2 + k], back.inputs[1 + k]
    w = nxt.producer if nxt is not None else None
    return (w is not None and w.op == "Where" and w.inputs[2] is slot and w.inputs[0] is not slot
            and w.inputs[1] is not slot and all(u is w for u, _ in slot.uses)
            and all(u is back for u, _ in nxt.uses) and nxt.type == slot.type)


def _copy(builder, name: str, slot: Buf, t) -> None:
    builder.store_into(name, slot, t.fn)


def extend_lifetimes(loops: List[LoopRegion], stages, first: dict, last: dict) -> None:
    """Buffers written before a loop's head and read inside it stay alive through its back stage (inner
    loops first: their back stages come first)."""
    index = {id(s): k for k, s in enumerate(stages)}
    for lp in loops:
        h, e = index[id(lp.head)], index[id(lp.back)]
        for r in first:
            if first[r] < h and h <= last[r] < e:
                last[r] = e
