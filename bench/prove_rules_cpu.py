"""Per-rule CPU time of a from-scratch proof of every built-in rule (no cache read or written).

    PYTHONPATH=src python bench/prove_rules_cpu.py [--only NAME ...] [--out bench/results/FILE.md]

Prints one line per rule: thread CPU seconds, wall seconds, verdict, what proved it; slowest first at
the end, with the CPU model and the load average. Timings on a shared machine are noisy: compare runs
side by side, and read the CPU column (this thread's time) before the wall column.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from cuvil.rewrite_rules.prove import prove_rule
from cuvil.rewrite_rules.verdicts import builtin_rules
from cuvil.targets.x86 import cpu


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="rule names (default: every built-in rule)")
    ap.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    args = ap.parse_args(argv)
    rules = [r for r in builtin_rules() if not args.only or r.name in args.only]
    rows = []
    for r in rules:
        c0, w0 = time.thread_time(), time.perf_counter()
        v = prove_rule(r)
        cpu_s, wall_s = time.thread_time() - c0, time.perf_counter() - w0
        method = getattr(v, "method", "") or ""
        rows.append((cpu_s, wall_s, r.name, r.proof, v.status, method))
        print(f"{cpu_s:8.2f} {wall_s:8.2f}  {r.name:36s} {r.proof:5s} {v.status:8s} {method}", flush=True)
    rows.sort(reverse=True)
    total_cpu, total_wall = sum(x[0] for x in rows), sum(x[1] for x in rows)
    model = cpu.cpu_label()
    lines = [f"# Built-in rule proofs from scratch: per-rule CPU", "",
             f"CPU: {model}; load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
             f"command: PYTHONPATH=src python bench/prove_rules_cpu.py {' '.join(sys.argv[1:])}", "",
             f"{len(rows)} rules, {total_cpu:.1f} s CPU, {total_wall:.1f} s wall", "",
             "| rule | proof | verdict | proved by | CPU s | wall s |", "|---|---|---|---|---:|---:|"]
    lines += [f"| {n} | {p} | {s} | {m} | {c:.2f} | {w:.2f} |" for c, w, n, p, s, m in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
