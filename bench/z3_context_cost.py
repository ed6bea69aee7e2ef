"""What earlier proofs in the same process cost a later one: the generic refutation of the wrong variant
``conv_bn_scale_on_input_channels`` (tests/test_generic_proofs.py), alone and after SECONDS of CPU spent proving
built-in rules (as in the gate's xdist worker that runs test_verdicts first). Z3's one global context holds both.

    PYTHONPATH=src python bench/z3_context_cost.py [SECONDS]      # default 60

Prints process CPU seconds (Z3 runs in this thread), the verdicts, the CPU model and the load average."""
from __future__ import annotations

import os
import sys
import time

from cuvil.dsl.parser import parse_rules
from cuvil.rewrite_rules.generic import prove_generic
from cuvil.rewrite_rules.prove import prove_rule
from cuvil.rewrite_rules.verdicts import builtin_rules
from cuvil.targets.x86.cpu import cpu_label

WRONG = ("rule w BatchNormalization(Conv(x, w, b, ..conv), s, beta, mean, var, epsilon=eps, momentum=_) "
         "when const(w, b, s, beta, mean, var), rank(w) == 4 => Conv(x, w * Unsqueeze(s / Sqrt(var + eps), "
         "axes=[0, 2, 3]), (b - mean) * s / Sqrt(var + eps) + beta, ..conv) prove real")
TIMEOUT_MS = 20_000         # the test's


def refute() -> str:
    rule = parse_rules(WRONG)[0]
    c = time.process_time()
    res = prove_generic(rule, TIMEOUT_MS)
    return f"{time.process_time() - c:.2f} s CPU, {res.status if res else None}"


def main(seconds: float) -> None:
    print(cpu_label(), "load", os.getloadavg())
    print("alone:", refute(), flush=True)
    c, n = time.process_time(), 0
    for r in builtin_rules():
        if time.process_time() - c > seconds:
            break
        prove_rule(r)
        n += 1
    print(f"proved {n} built-in rules in {time.process_time() - c:.1f} s CPU", flush=True)
    print("after:", refute())
    print("load", os.getloadavg())


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
