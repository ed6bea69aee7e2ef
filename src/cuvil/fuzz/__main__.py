"""``python -m cuvil.fuzz --budget 50000 [--family F] [--seed S] [--json OUT]``: run the fuzz families,
print each family's totals by outcome, exit 1 if any case crashed, hung, gave a wrong result or raised a
non-Cuvil exception. ``--seed S --budget 1 --family F`` replays case S of family F."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from typing import List

from . import FAMILIES
from .report import FAILURES, FOREIGN, OUTCOMES, FamilyReport

_LABEL = {FOREIGN: "non-cuvil"}


def _family_module(name: str):
    """The family's module, or None where it is not built (yet) in this tree."""
    if importlib.util.find_spec(f"{__package__}.{name}") is None:
        return None
    return importlib.import_module(f"{__package__}.{name}")


def _row(r: FamilyReport) -> str:
    return f"{r.family:<16}{r.cases:>8}" + "".join(f"{r.counts[o]:>12}" for o in OUTCOMES) + f"{r.seconds:>10.1f}s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuvil.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=50000, help="cases in all, split evenly over the families")
    ap.add_argument("--family", action="append", choices=FAMILIES, help="only this family (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="first case's seed; case k of a family has seed S + k")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per case before it counts as a hang")
    ap.add_argument("--json", help="write the per-family reports to this file")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    names = args.family or list(FAMILIES)
    built = {name: _family_module(name) for name in names}
    per_family = max(1, args.budget // max(1, sum(m is not None for m in built.values())))
    print(f"{'family':<16}{'cases':>8}" + "".join(f"{_LABEL.get(o, o):>12}" for o in OUTCOMES) + f"{'time':>11}")
    reports: List[FamilyReport] = []
    for name in names:
        mod = built[name]
        if mod is None:
            print(f"{name:<16}   not built in this tree: skipped")
            continue
        kw = {} if args.timeout is None else {"timeout_s": args.timeout}
        progress = None if args.quiet else (lambda r: print(f"  ... {_row(r)}", file=sys.stderr, flush=True))
        rep = mod.run(per_family, args.seed, progress=progress, **kw)     # every family: run(budget, seed, *, ...)
        reports.append(rep)
        print(_row(rep), flush=True)
        for outcome, seeds in rep.examples.items():
            for line in seeds:
                print(f"    {outcome}: {line}")
    failures = sum(r.failures for r in reports)
    print(f"{'total':<16}{sum(r.cases for r in reports):>8}" +
          "".join(f"{sum(r.counts[o] for r in reports):>12}" for o in OUTCOMES))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "budget": args.budget, "families": [r.to_json() for r in reports],
                       "failures": failures}, f, indent=1)
    print(f"{failures} failing case(s)" + ("" if failures else f": none {'/'.join(FAILURES)}"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
