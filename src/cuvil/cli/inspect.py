"""``cuvil inspect MODEL``: inputs/outputs, symbols, op histogram, parameters and FLOPs of a model."""
from __future__ import annotations

import sys

from ..errors import UnsupportedOpError
from ..frontend.survey import unsupported_error
from ..ir.constraints import check_constraints, dim_ranges
from ..ir.dim import evaluate, free_symbols
from ..ir.stats import cost_terms
from ..pipeline import Pipeline
from .counts import fmt_count
from .flags import add_allow_bounded_flag, add_model_arg, add_quiet_flag, add_shape_flags
from .shape_flags import bind_shapes, check_shape_flags


def register(sub) -> None:
    sp = sub.add_parser("inspect", help="inputs/outputs, op histogram, parameters and FLOPs of a model",
                        description="Show what MODEL is: its inputs and outputs with their symbolic dims (the "
                                    "names --fix and --shape-profile take, and each symbol's range), the op "
                                    "histogram after folding (or --raw, or --optimize), parameters, and MACs/FLOPs "
                                    "(a formula when dims are symbolic). A model with ops Cuvil cannot import is "
                                    "shown as its file declares it, every such op is listed, and the exit status "
                                    "is 1. Example: cuvil inspect model.onnx --input-shape x=1x3x224x224")
    add_model_arg(sp, "an .onnx file")
    sp.add_argument("--ir", action="store_true", help="also print the IR")
    sp.add_argument("--raw", action="store_true", help="as imported, before folding/CSE/DCE")
    sp.add_argument("--optimize", action="store_true", help="after the built-in rules too (BN folded, ...)")
    add_allow_bounded_flag(sp)
    sp.add_argument("--shapes", action="store_true", help="check the shape conditions on symbolic dims with Z3")
    add_shape_flags(sp, "an input's shape (x=1x3x640x640: its symbols fixed) or min:opt:max shapes (their "
                        "ranges): the cost is shown at that point, --shapes checks that range (repeatable)")
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_inspect)


def cmd_inspect(args) -> int:
    check_shape_flags(args)
    try:
        p = Pipeline.from_onnx(args.model)
    except UnsupportedOpError as e:
        if not e.nodes:      # an attribute value or a body Cuvil lacks: the error says which
            raise
        return _show_unsupported(args)
    if not args.raw:
        p = p.optimize(builtin=args.optimize, allow_bounded=args.allow_bounded_rules)
    p, fixed = bind_shapes(p, args, check=not args.shapes)   # --shapes reports failing conditions instead
    g = p.graph
    st = p.stats()
    state = "as imported" if args.raw else "after the proved rules and folding" if args.optimize else "after folding/CSE/DCE"
    print(f"model: {args.model}  (opset {g.opset}, {state})")
    for kind, vals, names in (("input", g.inputs, [v.name for v in g.inputs]), ("output", g.outputs, g.output_names)):
        for v, name in zip(vals, names):
            print(f"  {kind:6} {name}: {v.type}")
    for s in g.symbols.values():
        axes = ", ".join(f"{v.name} axis {k}" for v in g.inputs for k, d in enumerate(v.shape or ())
                         if str(d) == s.name)
        print(f"  symbol {s.name} in {s.profile_text()}, opt {s.tuned}" + (f": {axes}" if axes else ""))
    if fixed:
        print("  fixed  " + ", ".join(f"{k} = {v}" for k, v in fixed.items()))
    print(f"nodes: {len(g.nodes)}")
    for op, n in st.op_histogram.items():
        print(f"  {op:24} {n}")
    print(f"parameters: {fmt_count(st.parameters)} ({st.parameters:,} elements of constants the graph reads, "
          f"{st.parameter_bytes:,} bytes; the model file has {p.initializer_elements:,} initializer elements)")
    print("compute: " + _cost_text(g, st))
    if args.shapes:
        ranges = g.symbol_ranges()
        n_cons = sum(len(n.constraints) for n in g.nodes)
        bad = check_constraints(g, ranges)
        print(f"shape conditions on symbols: {n_cons}, violated somewhere in range: {len(bad)}")
        for v in bad:
            print(f"  {v}")
        if bad:
            print(f"  next: {p.shape_conditions_error(bad).hint}")
        for d, (lo, hi) in sorted(dim_ranges(g, ranges).items()):
            print(f"  dim {d} in [{lo}, {hi}]")
    if args.ir:
        print(p.print_ir(), end="")
    return 0


def _show_unsupported(args) -> int:
    """A model Cuvil cannot import, as its file declares it, then every op Cuvil lacks (on stderr, as the
    error it is); exit status 1: the model was shown, and it does not compile."""
    sv = Pipeline.survey(args.model)
    print(f"model: {args.model}  (opset {sv.opset}, as the file declares it: Cuvil cannot import it)")
    for kind, items in (("input", sv.inputs), ("output", sv.outputs)):
        for name, typ in items:
            print(f"  {kind:6} {name}: {typ}")
    print(f"nodes: {sum(sv.op_histogram.values())}")
    lacking = {u.qualified for u in sv.unsupported}
    for op, n in sv.op_histogram.items():
        print(f"  {op:24} {n}" + ("  (unsupported)" if op in lacking else ""))
    print(f"parameters: the model file has {sv.initializer_elements:,} initializer elements")
    if any(getattr(args, f, None) for f in ("shapes", "input_shape", "shape_profile", "fix", "ir")):
        print("(shape flags, --shapes and --ir need the model imported: not applied)")
    sys.stdout.flush()
    print(f"cuvil: error: {unsupported_error(sv.unsupported, inspecting=True)}", file=sys.stderr)
    return 1


def _cost_text(g, st) -> str:
    """MACs and FLOPs: numbers for a static graph; with symbols, a formula of a few terms and its value at
    the opt point (each symbol's opt, else min) and at the profile's max."""
    def by_op(env) -> str:
        return ", ".join(f"{op} {fmt_count(evaluate(f, env))}" for op, f in st.flops_by_op.items())

    if not g.symbols:
        return (f"{fmt_count(st.macs)} MACs = {fmt_count(st.flops)} FLOPs"
                + (f"  ({by_op({})} FLOPs)" if st.flops_by_op else ""))
    opt = {s.name: s.tuned for s in g.symbols.values()}
    top = {s.name: s.max for s in g.symbols.values()}
    # The formula's terms are ranked (and max() resolved) at the opt point, or at the max for a symbol
    # without one: its min (1 by default) would rank constant terms first.
    rank_at = {s.name: s.opt if s.opt is not None else s.max for s in g.symbols.values()}
    point = ", ".join(f"{k}={v}" for k, v in opt.items())
    if not free_symbols(st.flops) <= g.symbols.keys():   # a size no input binds (data-dependent): no values
        return f"{st.macs} MACs"
    return (f"{cost_terms(st.macs, rank_at)} MACs\n"
            f"  at the opt point ({point}): {fmt_count(evaluate(st.macs, opt))} MACs = "
            f"{fmt_count(evaluate(st.flops, opt))} FLOPs" + (f"  ({by_op(opt)} FLOPs)" if st.flops_by_op else "")
            + f"\n  at the profile's max: {fmt_count(evaluate(st.macs, top))} MACs")
