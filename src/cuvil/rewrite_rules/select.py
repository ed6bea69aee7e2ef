"""Selects whose condition became a constant: ``Where(c, a, b)`` with ``c`` all true (all false) is ``a``
(``b``) where that side already has the select's type.

A run-time ``If`` is imported as a ``Where`` over both branches (:mod:`cuvil.frontend.subgraphs`); when its
condition reads symbolic dims that are later fixed (``fixed=``, the opt-point kernels), folding makes the
condition a constant, and this pass then drops the select, so the untaken branch becomes dead code.
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Graph


def fold_constant_selects(g: Graph) -> int:
    """Replace every ``Where`` whose constant condition picks one side everywhere; returns how many."""
    done = 0
    for n in list(g.nodes):
        if n.op != "Where" or len(n.inputs) != 3 or not n.outputs:
            continue
        c, a, b = n.inputs
        if c is None or not c.is_const or np.asarray(c.const).size == 0:
            continue
        cond = np.asarray(c.const).astype(bool)
        side = a if cond.all() else b if not cond.any() else None
        out = n.outputs[0]
        if side is None or side.type != out.type or (not out.uses and out not in g.outputs):
            continue
        g.replace_all_uses(out, side)
        done += 1
    return done
