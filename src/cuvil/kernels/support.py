"""What each registered op is supported by, and the ops the kernel layer does not lower (with the reason).

:data:`NOT_LOWERED` names the registered ops without a lowering, on purpose; :data:`EXPANDED_ON_IMPORT` the
control-flow ops that need none (the frontend expands them into other ops). Both targets (x86 and PTX)
schedule through :data:`cuvil.kernels.lower.LOWERINGS`, so an op without a lowering is refused by either at
scheduling time ("no x86 lowering"), and an op compiles for the GPU exactly when it compiles for x86 (but for
:data:`X86_ONLY`: sizes computed at run time); the PTX emitter refuses per scalar operation and element type
(an integer ``fma``, a call libdevice lacks), not per op.
``tests/test_op_registry.py`` fails for a registered op that has neither a lowering nor a row here.

:func:`support_matrix` (``cuvil ops`` prints it): for each registered op, whether it is imported from ONNX
models, has proof semantics, compiles for x86 and for the GPU, and its float16 class, each read from where
the fact lives: the op registry, the prover's semantics table and its
:data:`~cuvil.rewrite_rules.semantics.WITHOUT_SEMANTICS`, the lowerings and :data:`NOT_LOWERED`.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import attrs

from ..ir.registry import all_ops
from ..rewrite_rules.semantics import SEMANTICS, WITHOUT_SEMANTICS
from .lower import LOWERINGS


def _each(reason: str, *ops: str) -> Dict[str, str]:
    return {o: reason for o in ops}


NOT_LOWERED: Dict[str, str] = {
    **_each("not a function of its inputs: no random kernels", "RandomNormal", "RandomUniform", "RandomNormalLike",
            "RandomUniformLike", "Bernoulli", "Multinomial"),
    **_each("becomes a constant on import (never scheduled)", "Constant"),
    **_each("transforms constant weights: folded at compile time", "WinogradKernel"),
    **_each("every input decides the output's shape, so it is constant: folded at compile time", "MelWeightMatrix"),
    **_each("not lowered yet", "MaxRoiPool"),
    **_each("a run-time loop's state slots / back edge: no kernel of its own, the schedule makes them the loop's "
            "stages and backward branch (kernels/loops.py; x86 runs them, the GPU target refuses them)",
            "LoopState", "LoopBack"),
}

#: Registered ops that compile on both targets without a lowering of their own: the frontend expands them on
#: import into other ops (cuvil.frontend.subgraphs), with what each expansion needs.
EXPANDED_ON_IMPORT: Dict[str, str] = {
    "If": "branch inlined when the condition is known at compile time, else both branches and a Where per output "
          "(equal types needed)",
    "Loop": "body unrolled over a constant trip count <= 64 (a run-time exit predicated); otherwise (trip count "
            "from data, while loops, long loops) compiled once and run as a run-time loop (x86 only)",
    "Scan": "body unrolled over a constant sequence length <= 64; a symbolic or longer one runs as a run-time "
            "loop (x86 only)",
}


#: Lowered ops the GPU target refuses: their output's size depends on the input values (a run-time size the
#: x86 runtime computes, :mod:`cuvil.kernels.run_time_sizes`; the GPU target specialises every size).
#: TopK and Compress only need it with k or the condition computed at run time, so they are not listed.
X86_ONLY: Dict[str, str] = {
    "NonZero": "output size depends on the input values: sized at run time on x86 only",
    "Unique": "output size depends on the input values: sized at run time on x86 only",
    "NonMaxSuppression": "output size depends on the input values: sized at run time on x86 only",
}


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
        lowered = name in LOWERINGS or name in EXPANDED_ON_IMPORT
        why = {}
        if d.domain:
            why["import"] = f"Cuvil's own op (domain {d.domain}), introduced by rewrite rules"
        if name not in SEMANTICS:
            why["proof"] = WITHOUT_SEMANTICS.get(name, "no semantics and no reason given")
        if not lowered:
            why["x86"] = why["gpu"] = NOT_LOWERED.get(name, "no lowering and no reason given")
        elif name in X86_ONLY:
            why["gpu"] = X86_ONLY[name]
        rows.append(OpSupport(name, d.family, d.domain, not d.domain, name in SEMANTICS, lowered,
                              lowered and name not in X86_ONLY, d.half, d.elementwise, why))
    return sorted(rows, key=lambda r: (r.family, r.op))
