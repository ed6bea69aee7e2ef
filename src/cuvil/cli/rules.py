"""``cuvil rules check|list [PATHS]``: prove rewrite rules with Z3, or list them with their verdicts."""
from __future__ import annotations

import argparse
import time

from ..dsl.parser import load_rules
from ..rewrite_rules.verdicts import builtin_rules_dir, verdicts, write_shipped
from .flags import add_actions


def register(sub) -> None:
    _, rsub = add_actions(sub, "rules", help="prove or list rewrite rules",
                          description="The rewrite rules (.rule files): `check` proves them with Z3, `list` shows "
                                      "them with their verdicts. Example: cuvil rules check my_rules/")
    rc = rsub.add_parser("check", help="prove every rule (default: the built-in rules/); exit 0 unless one is refuted or unknown",
                         description="Prove each rule of PATHS (default: the built-in rules) with Z3 and print its "
                                     "obligation, verdict, time and what the proof covers; a refuted rule shows a "
                                     "counterexample. Exit 0 unless a rule is refuted or unknown.")
    rc.add_argument("paths", nargs="*", help=".rule files or directories")
    rc.add_argument("--no-cache", action="store_true", help="prove again, ignoring shipped and cached verdicts")
    rc.add_argument("--timeout-ms", type=int, default=20_000, help="Z3 time limit per proof")
    rc.add_argument("--write-verdicts", action="store_true", help=argparse.SUPPRESS)  # maintainers: refresh rules/verdicts.json
    rc.set_defaults(fn=cmd_rules_check)
    rc.add_argument("-q", "--quiet", action="store_true", help="no progress output: only the results and errors")
    rl = rsub.add_parser("list", help="list rules with benefit, level, obligation and verdict (what the proof covers)",
                         description="One line per rule of PATHS (default: the built-in rules): name, benefit, the "
                                     "level it runs on, its proof obligation and verdict (proved on first use and "
                                     "cached), what the proof covers, and where it is defined.")
    rl.add_argument("paths", nargs="*", help=".rule files or directories")
    rl.add_argument("-q", "--quiet", action="store_true", help="no progress output: only the results and errors")
    rl.add_argument("--timeout-ms", type=int, default=20_000, help="Z3 time limit per proof (rules not yet proved)")
    rl.set_defaults(fn=cmd_rules_list)


def _rule_paths(args):
    return args.paths or [builtin_rules_dir()]


def cmd_rules_check(args) -> int:
    rules = load_rules(_rule_paths(args))
    t0 = time.perf_counter()
    if args.write_verdicts:
        results = [(v, False) for v in write_shipped(rules, timeout_ms=args.timeout_ms)]
    else:
        results = verdicts(rules, use_cache=not args.no_cache, timeout_ms=args.timeout_ms)
    total = time.perf_counter() - t0
    width = max([len(r.name) for r in rules] + [4])
    print(f"{'rule':{width}}  {'obligation':11}  {'verdict':12}  {'ms':>8}  covers")
    for r, (v, cached) in zip(rules, results):
        ms = "cached" if cached else f"{v.ms:.0f}"
        print(f"{r.name:{width}}  {'prove ' + v.obligation:11}  {_verdict_label(v):12}  {ms:>8}  {_coverage(v)}")
        if v.counterexample:
            print(f"{'':{width}}  counterexample: {v.counterexample}")
        elif v.detail and v.status in ("refuted", "unknown"):
            print(f"{'':{width}}  {v.detail}")
    counts = {k: sum(1 for v, _ in results if v.status == k) for k in ("proved", "bounded", "refuted", "unknown")}
    off = sum(1 for v, _ in results if v.status == "bounded" and not v.on_by_default)
    print(f"{len(rules)} rules in {total:.2f} s{'' if args.no_cache else ' (cache on)'}: {counts['proved']} proved, "
          f"{counts['bounded']} bounded ({counts['bounded'] - off} on, {off} off by default: exact and order-dependent; "
          f"--allow-bounded-rules), {counts['refuted']} refuted, {counts['unknown']} unknown")
    return 0 if counts["refuted"] == counts["unknown"] == 0 else 1


def _verdict_label(v) -> str:
    if v.status == "bounded":
        return "bounded/on" if v.on_by_default else "bounded/off"
    return v.status


def _coverage(v) -> str:
    types = "every dtype" if tuple(v.dtypes) == ("*",) else ", ".join(v.dtypes)
    return v.shapes + (f"; dtypes: {types}" if v.dtypes else "") + (f"; by {v.method}" if v.method else "")


def cmd_rules_list(args) -> int:
    rules = load_rules(_rule_paths(args))
    for r, (v, _) in zip(rules, verdicts(rules, timeout_ms=args.timeout_ms)):
        print(f"{r.name:32} benefit {r.benefit:<3} on {r.on:6} prove {r.proof:5}  {_verdict_label(v):11}  "
              f"{_coverage(v)}  {r.loc}")
    return 0
