#!/usr/bin/env python3
"""Regenerate ``tests/conformance_expected_pass.txt``: run every ONNX node test case through
``cuvil.onnx_backend`` (the harness of ``tests/test_onnx_conformance.py``) and list those that pass.

    PYTHONPATH=src python scripts/update_conformance_list.py             # rewrite the list
    PYTHONPATH=src python scripts/update_conformance_list.py --check     # only compare with the list
    PYTHONPATH=src python scripts/update_conformance_list.py -k resize --report /tmp/r.tsv

``--report`` writes one line per case (name, outcome, seconds, first line of the error).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
if os.path.isdir(os.path.join(ROOT, "src")):
    sys.path.insert(0, os.path.join(ROOT, "src"))

import test_onnx_conformance as conf  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="do not write the list; exit 1 if a listed case fails")
    ap.add_argument("-k", dest="pattern", default="", help="only cases whose name contains this (implies --check)")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="worker processes (default: CPU count, at most 8)")
    ap.add_argument("--report", help="write name<TAB>outcome<TAB>seconds<TAB>detail for every case run")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each case as it finishes")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    cases = conf.collect_cases()
    names = [n for n in cases if args.pattern in n]
    progress = (lambda n, r: print(f"{r.seconds:6.2f}s {r.status:11s} {n}", flush=True)) if args.verbose else None
    results = conf.run_all(cases, names, jobs=args.jobs, progress=progress)
    elapsed = time.perf_counter() - t0

    passed = sorted(n for n, r in results.items() if r.status == "pass")
    listed = conf.expected_pass()
    counts = {}
    for r in results.values():
        counts[r.status] = counts.get(r.status, 0) + 1
    print(f"ONNX node conformance: {len(passed)}/{len(names)} cases pass ({elapsed:.0f} s; "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ")")
    regressed = sorted(n for n in listed if n in results and results[n].status != "pass")
    new = sorted(set(passed) - set(listed))
    for n in regressed:
        print(f"REGRESSED {n}: {results[n].status}: {results[n].detail.splitlines()[0] if results[n].detail else ''}")
    if new:
        print(f"newly passing ({len(new)}): {' '.join(new)}")
    for n, r in sorted(results.items()):
        if r.status in ("error", "crash", "timeout"):
            print(f"{r.status.upper()} {n}: {r.detail.splitlines()[0] if r.detail else ''}")
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            for n in names:
                r = results[n]
                first = r.detail.splitlines()[0] if r.detail else ""
                f.write(f"{n}\t{r.status}\t{r.seconds:.2f}\t{first}\n")
    if args.check or args.pattern:
        return 1 if regressed else 0
    with open(conf.LIST_PATH, "w", encoding="utf-8") as f:
        f.writelines(n + "\n" for n in passed)
    print(f"wrote {len(passed)} names to {os.path.relpath(conf.LIST_PATH, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
