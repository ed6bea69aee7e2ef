"""Shape- and attribute-generic proofs of structured rules (placeholder: the `generic` helper's module
replaces this file; until then no rule is in the generic fragment)."""
from __future__ import annotations

from typing import Optional

import attrs

from ..dsl.ast import Rule


@attrs.frozen
class GenericResult:
    status: str                      # "proved" or "refuted"
    coverage: str                    # what the proof covers
    counterexample: Optional[str] = None


def prove_generic(rule: Rule, timeout_ms: int) -> Optional[GenericResult]:
    """None when the rule is outside the generic fragment or Z3 answers unknown."""
    return None
