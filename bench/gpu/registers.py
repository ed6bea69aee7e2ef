"""Registers per thread and theoretical occupancy (sm_90, 256-thread blocks) of the nine light models'
kernels, from ``ptxas -v``, before and after the kernel-level passes (no GPU needed):

- ``before``: no kernel rules, no fma contraction, 64-bit element-index arithmetic (the code generator as it
  was);
- ``rules``: the built-in kernel rules (``rules/kernel.rule``) with fma contraction, 64-bit indices (the
  default now);
- ``after``: kernel rules + fma + 32-bit element-index unflattening (``narrow_index=True``, opt-in: fewer
  registers, but slower ResNet-50 on an H200, see RESULTS.md).

    python3 bench/gpu/registers.py [MODEL ...] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "src"))
sys.path.insert(0, HERE)

from occupancy import occupancy  # noqa: E402

CONFIGS = {"before": dict(fma=False, kernel_rules=False, narrow_index=False),
           "rules": dict(fma=True, narrow_index=False),
           "after": dict(fma=True, narrow_index=True)}


def measure(name: str, arch: str = "sm_90") -> dict:
    from cuvil import Pipeline
    from cuvil.targets.ptx import assemble
    from cuvil.targets.ptx.codegen import build_ptx
    from cuvil.kernels.schedule import schedule
    from cuvil.testing import light_model
    sched = schedule(Pipeline.from_onnx(light_model(name)).optimize().graph)
    row = {}
    for label, kw in CONFIGS.items():
        r = build_ptx(sched, arch, **kw)
        _, info = assemble(r.ptx, arch, jobs=0)
        regs = [info[d.name].registers for d in r.kernels]
        occ = [occupancy(x, d.block)["occupancy"] for x, d in zip(regs, r.kernels)]
        row[label] = {"registers": regs, "occupancy": occ,
                      "spill_stores": sum(info[d.name].spill_stores for d in r.kernels),
                      "fma_instructions": len(re.findall(r"\bfma\.rn\.f", r.ptx)),
                      "call_instructions": len(re.findall(r"\bcall(\.uni)?\b", r.ptx)),
                      "kernel_rules": {k: v for k, v in r.kernel_rule_counts.items() if v}}
    return row


def summary(rows: dict) -> str:
    lines = ["| model | kernels | registers max / median / mean: before | rules+fma (default) | +32-bit index (opt-in) "
             "| mean occupancy before → rules+fma → +32-bit | min occupancy before → +32-bit | fma instr. before → rules+fma | kernel rules fired |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        def s(k):
            r = row[k]["registers"]
            return f"{max(r)} / {statistics.median(r):g} / {statistics.mean(r):.1f}"
        b, a, m = row["before"], row["after"], row["rules"]
        fired = ", ".join(f"{k} ×{v}" for k, v in sorted(a["kernel_rules"].items()))
        lines.append(f"| {name} | {len(b['registers'])} | {s('before')} | {s('rules')} | {s('after')} "
                     f"| {100 * statistics.mean(b['occupancy']):.0f}% → {100 * statistics.mean(m['occupancy']):.0f}% → {100 * statistics.mean(a['occupancy']):.0f}% "
                     f"| {100 * min(b['occupancy']):.0f}% → {100 * min(a['occupancy']):.0f}% "
                     f"| {b['fma_instructions']} → {m['fma_instructions']} | {fired} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from cuvil.testing import LIGHT_MODELS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=list(LIGHT_MODELS))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = {}
    for name in args.models:
        rows[name] = measure(name)
        print(f"{name}: done", file=sys.stderr, flush=True)
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
