"""What a fuzz family found: counts per outcome and the first few failing cases, reproducible by seed."""
from __future__ import annotations

from typing import Dict, List

import attrs

# A case ends in exactly one of these. The first two are the only acceptable ones.
ACCEPTED = "accepted"          # the input was valid and the result matched the oracle (or there was none to check)
CLEAN_ERROR = "clean-error"    # refused with a CuvilError (Python) or a documented negative code (C ABI)
CRASH = "crash"                # the process died (signal, abort) or the interpreter failed
HANG = "hang"                  # over the case's time limit
WRONG = "wrong"                # accepted, but the result disagrees with the oracle
FOREIGN = "non-cuvil-exception"  # a Python exception that is not a CuvilError escaped
OUTCOMES = (ACCEPTED, CLEAN_ERROR, CRASH, HANG, WRONG, FOREIGN)
FAILURES = (CRASH, HANG, WRONG, FOREIGN)
KEEP_EXAMPLES = 5


@attrs.define
class FamilyReport:
    """One family's totals. ``examples`` keeps, per failing outcome, the first few cases' seeds and messages so
    ``python -m cuvil.fuzz --family NAME --seed SEED --budget 1`` replays one."""
    family: str
    counts: Dict[str, int] = attrs.field(factory=lambda: {o: 0 for o in OUTCOMES})
    examples: Dict[str, List[str]] = attrs.field(factory=dict)
    seconds: float = 0.0

    def add(self, outcome: str, seed: int, message: str = "") -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown fuzz outcome {outcome!r}")
        self.counts[outcome] += 1
        if outcome in FAILURES:
            kept = self.examples.setdefault(outcome, [])
            if len(kept) < KEEP_EXAMPLES:
                kept.append(f"seed {seed}: {message.strip().splitlines()[0] if message.strip() else '(no message)'}")

    @property
    def cases(self) -> int:
        return sum(self.counts.values())

    @property
    def failures(self) -> int:
        return sum(self.counts[o] for o in FAILURES)

    def to_json(self) -> dict:
        return {"family": self.family, "cases": self.cases, "counts": dict(self.counts),
                "examples": {k: list(v) for k, v in self.examples.items()}, "seconds": round(self.seconds, 2)}
