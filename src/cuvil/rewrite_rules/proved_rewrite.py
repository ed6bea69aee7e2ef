"""Running proved rules on a graph, and the record of what ran: the one path the pipeline's optimisation and
a target's algorithm choices (``on x86`` rules) share, so both record their rules the same way in manifests."""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from ..dsl.ast import Rule
from ..ir.graph import Graph
from .engine import Accept, RewriteReport, rewrite
from .verdicts import proved_rules


def proof_record(v) -> dict:
    """A verdict as the manifest records it: status, what the proof covers, the element types covered."""
    return {"verdict": v.status, "coverage": v.shapes, "dtypes": list(v.dtypes)}


def proved_rewrite(g: Graph, rules: Sequence[Rule], *, phase: str = "graph", accept: Optional[Accept] = None,
                   on_unproved: str = "error", allow_bounded: bool = False) -> RewriteReport:
    """Rewrite ``g`` in place with the rules of ``rules`` that are proved (see
    :func:`cuvil.rewrite_rules.verdicts.proved_rules`), to a fixpoint with folding, CSE and DCE. The report
    records each runnable rule's obligation (``verdicts``) and verdict (``proofs``)."""
    proofs: dict = {}
    runnable = proved_rules(rules, on_unproved=on_unproved, allow_bounded=allow_bounded, proofs=proofs)
    report = rewrite(g, runnable, phase=phase, accept=accept)
    report.verdicts = {r.name: r.proof for r in runnable}
    report.proofs = {name: proof_record(v) for name, v in proofs.items()}
    return report


def applied_rules(report: Optional[RewriteReport]) -> Dict[str, dict]:
    """The manifest's record of the rules a rewrite applied: name -> times applied, obligation, verdict."""
    if report is None:
        return {}
    verdicts = getattr(report, "verdicts", {})
    proofs = getattr(report, "proofs", {})
    return {name: {"applied": n, "obligation": verdicts.get(name), **proofs.get(name, {"verdict": "proved"})}
            for name, n in report.applied.items() if n}
