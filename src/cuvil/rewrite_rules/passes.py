"""The pass pipeline: code passes (fold, CSE, DCE) to a fixpoint, then shape propagation.

The rule engine (``.rule`` files) runs inside the same loop once rules are given.
"""
from __future__ import annotations

from typing import Dict

import attrs

from ..ir.graph import Graph
from .cse import eliminate_common_subexpressions
from .dce import eliminate_dead_code
from .fold import fold_constants
from .shape_prop import propagate_shapes

MAX_ROUNDS = 32


@attrs.define
class PassReport:
    rounds: int = 0
    counts: Dict[str, int] = attrs.field(factory=dict)

    def add(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


def run_code_passes(g: Graph, report: PassReport | None = None) -> PassReport:
    report = report or PassReport()
    g.toposort()
    for _ in range(MAX_ROUNDS):
        report.rounds += 1
        changed = 0
        for name, fn in (("fold", fold_constants), ("cse", eliminate_common_subexpressions),
                         ("dce", eliminate_dead_code)):
            n = fn(g)
            report.add(name, n)
            changed += n
        if not changed:
            break
    propagate_shapes(g)
    g.verify()
    return report
