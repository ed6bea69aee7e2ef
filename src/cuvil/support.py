"""The support matrix: for each registered op, whether it is imported from ONNX models, has proof semantics,
compiles for x86 and for the GPU, and its float16 class; ``cuvil ops`` prints it.

Every column is read from where the fact lives: the op registry (:mod:`cuvil.ir.registry`), the prover's
semantics table and its :data:`~cuvil.rewrite_rules.semantics.WITHOUT_SEMANTICS`, the kernel layer's
:data:`~cuvil.kernels.lower.LOWERINGS` and :data:`~cuvil.kernels.unsupported.NOT_LOWERED`. Both targets
schedule through the same lowerings, so an op compiles for the GPU exactly when it compiles for x86; the
PTX emitter refuses per scalar operation and element type (an integer ``fma``, a call libdevice lacks),
not per op.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import attrs

from .ir.registry import all_ops
from .kernels.lower import LOWERINGS
from .kernels.unsupported import NOT_LOWERED
from .rewrite_rules.semantics import SEMANTICS, WITHOUT_SEMANTICS

COLUMNS = ("import", "proof", "x86", "gpu", "half")


@attrs.frozen
class OpSupport:
    """One row of the matrix. ``half`` is the float16 class (GPU only), None where the op stays float32;
    ``why_not`` gives the reason for each column that is False."""
    op: str
    family: str
    domain: str
    imported: bool       # ONNX models may hold it (Cuvil's own ops are introduced by rewrite rules only)
    proof: bool          # the prover has Z3 semantics for it
    x86: bool
    gpu: bool
    half: Optional[str]
    elementwise: Optional[str]
    why_not: Dict[str, str]

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def support_matrix() -> List[OpSupport]:
    """One row per registered op, sorted by family, then name."""
    rows = []
    for name, d in all_ops().items():
        lowered = name in LOWERINGS
        why = {}
        if d.domain:
            why["import"] = f"Cuvil's own op (domain {d.domain}), introduced by rewrite rules"
        if name not in SEMANTICS:
            why["proof"] = WITHOUT_SEMANTICS.get(name, "no semantics and no reason given")
        if not lowered:
            why["x86"] = why["gpu"] = NOT_LOWERED.get(name, "no lowering and no reason given")
        rows.append(OpSupport(name, d.family, d.domain, not d.domain, name in SEMANTICS, lowered, lowered, d.half,
                              d.elementwise, why))
    return sorted(rows, key=lambda r: (r.family, r.op))
