"""The text of ``cuvil precision report``: per node its format, range and verdicts, the counterexamples, and the
table of overflow paths per layer type (nodes safe / refused / unknown in fp16, bf16 and int8)."""
from __future__ import annotations

from typing import List

from .policy import REFUSED, SAFE, UNKNOWN, PrecisionPlan
from .relative import RELATIVE

FORMAT_COLUMNS = ("fp16", "bf16", "fp8", "int8")


def format_table(plan: PrecisionPlan) -> List[str]:
    lines = ["overflow paths per layer type (nodes safe / refused / unknown):",
             f"  {'op':<22}" + "".join(f"{f:>16}" for f in FORMAT_COLUMNS)]
    for op, per in plan.table().items():
        lines.append(f"  {op:<22}" + "".join(
            f"{per[f][SAFE]:>6} /{per[f][REFUSED]:>3} /{per[f][UNKNOWN]:>3}" for f in FORMAT_COLUMNS))
    return lines


def format_report(plan: PrecisionPlan, model: str = "", every: bool = False, limit: int = 40) -> str:
    lines = [f"precision report{' of ' + model if model else ''}: --precision {plan.mode}, target {plan.target}"]
    for name, iv in plan.inputs.items():
        lines.append(f"  input {name} in {iv.text()} ({iv.origin})")
    if not plan.inputs:
        lines.append("  no input range declared: give --input-range NAME=LO:HI (or --calibrate DIR) to bound them")
    lines.append(f"  counterexample search: {plan.search}")
    counts = {}
    for n in plan.nodes:
        counts[n.format or "fp32"] = counts.get(n.format or "fp32", 0) + 1
    lines.append("  formats: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    relative = sum(1 for n in plan.nodes if n.certificate == RELATIVE)
    if relative:
        lines.append(f"  of which bf16 relative to float32 (explicit --precision bf16; range not certified): {relative}")
    if plan.bf16_stored:
        only = len(plan.bf16_stored) - len(plan.bf16_residual)
        lines.append(f"  bf16 activations: {only} values read only by bf16 convolutions are stored as "
                     "bfloat16 between them (no new rounding: each reader rounds its input to bf16)")
    if plan.bf16_residual or plan.residual_fp32:
        lines.append(f"  bf16 residual path (--precision bf16): {len(plan.bf16_residual)} values read by bf16 "
                     "convolutions and residual Adds stored as bfloat16, a new rounding of the skip path (at most "
                     f"2^-8 relative; their certified ranges finite in bf16), {len(plan.residual_fp32)} kept float32")
        for name, why in list(plan.residual_fp32.items())[:limit]:
            lines.append(f"    {name}: {why}")
    lines.append("")
    lines.append(f"{'node':<28} {'op':<20} {'format':<7} {'range':<28} {'/'.join(FORMAT_COLUMNS)}")
    shown = 0
    for n in plan.nodes:
        refused = any(v.status == REFUSED for v in n.verdicts.values())
        if not every and shown >= limit and not refused:
            continue
        shown += 1
        marks = "/".join(n.verdicts[f].status for f in FORMAT_COLUMNS)
        rng = f"{n.range.text()}" + (" m" if n.range is not None and n.range.origin == "measured" else "") \
            if n.range is not None else "-"
        lines.append(f"{n.name[:28]:<28} {n.op[:20]:<20} {n.format or 'fp32':<7} {rng:<28} {marks}")
        lines.append(f"    {n.reason}")
        lines.append("    by: " + ", ".join(f"{f} {n.verdicts[f].status} [{n.verdicts[f].method}]" for f in FORMAT_COLUMNS))
    if shown < len(plan.nodes):
        lines.append(f"... {len(plan.nodes) - shown} more nodes (--all lists them)")
    cex = [(n, f, v) for n in plan.nodes for f, v in n.verdicts.items() if v.status == REFUSED]
    if cex:
        lines.append("")
        lines.append("refused (counterexamples found by the search, reproducible by running the model on them):")
        for n, f, v in cex[:limit if not every else len(cex)]:
            lines.append(f"  {n.name} ({n.op}) in {f}: {v.detail}")
    lines.append("")
    lines.extend(format_table(plan))
    lines.append("(certified: from declared input ranges by sound interval rules, tightened by Z3 on elementwise "
                 "cones; measured (m): from calibration data only; refused: an input found (search, or Z3 then a run "
                 "of the model) or a constant/declared range the format cannot hold; unknown: the interval exceeds "
                 "the format and neither Z3 nor the search decided)")
    return "\n".join(lines)
