"""``cuvil precision report MODEL``: per node the number format the policy gives it, its certified range and
the proof or the counterexample; then the overflow paths per layer type (docs/precision.md)."""
from __future__ import annotations

import json

from ..errors import CuvilError
from ..pipeline import Pipeline
from ..precision.policy import plan_precision
from ..precision.report import format_report
from ..targets import get_target, make_options
from ..targets.base import precision_ops, stores_bf16, transformed_rounding
from .flags import (add_actions, add_precision_flags, add_quiet_flag, add_shape_flags, add_target_flag,
                    precision_flags, resolve_target)
from .shape_flags import bind_shapes, check_shape_flags


def register(sub) -> None:
    _, psub = add_actions(sub, "precision", help="low precision with certificates: the range analysis and its report",
                          description="Low precision with certificates (docs/precision.md). "
                                      "Example: cuvil precision report model.onnx --input-range x=0:1")
    rp = psub.add_parser("report", help="per node: format, certified range, proof or counterexample",
                         description="Bound every tensor of MODEL from its inputs' ranges, decide each node's number "
                                     "format under --precision, and print per node the format, the range and the "
                                     "proof or the counterexample input; then the overflow paths per layer type "
                                     "(nodes safe / refused / unknown in fp16, bf16 and int8).")
    rp.add_argument("model", metavar="MODEL", help="the model (.onnx)")
    add_precision_flags(rp, default="auto")
    add_target_flag(rp)
    add_shape_flags(rp, "fix an input's symbolic dims (x=1x3x224x224) so that the counterexample search can run "
                        "the model; symbols left free are taken at their opt (else min) value (repeatable)")
    rp.add_argument("--search", type=int, default=24, metavar="N",
                    help="model evaluations the counterexample search may spend (default 24; 0: none)")
    rp.add_argument("--all", action="store_true", help="list every node (default: the first 40 and every refusal)")
    rp.add_argument("--json", metavar="FILE", help="also write the report (the manifest's precision entry) as JSON")
    add_quiet_flag(rp)
    rp.set_defaults(fn=cmd_report)


def cmd_report(args) -> int:
    mode, ranges, calibration, keep = precision_flags(args)
    triple = resolve_target(args.target)
    check_shape_flags(args)
    if args.search < 0:
        raise CuvilError(f"--search {args.search}: a count cannot be negative", hint="--search 24 (or 0: none)")
    tgt = get_target(triple)
    p = Pipeline.from_file(args.model).optimize()
    p, _ = bind_shapes(p, args)
    if p.graph.symbols:
        p = p.specialize({name: s.tuned for name, s in p.graph.symbols.items()})
    options = make_options(triple)
    plan = plan_precision(p.graph, mode, input_ranges=ranges, calibration=calibration,
                          target_ops=precision_ops(tgt, options), target=triple,
                          search_budget=args.search, stores_bf16=stores_bf16(tgt), keep_fp32=keep,
                          transformed=transformed_rounding(tgt, options, p.graph))
    print(format_report(plan, args.model, every=args.all))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.manifest(), f, indent=1)
        print(f"wrote {args.json}")
    return 0
