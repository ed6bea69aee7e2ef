"""The ``cuvil`` command line: ``inspect``, ``demo``, ``zoo``."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from typing import List, Optional

import numpy as np
import onnx
import onnx.defs

from . import bench
from .artifact import load
from .dsl.parser import load_rules
from .errors import CuvilError
from .ir.constraints import check_constraints, dim_ranges
from .ir.dim import evaluate, free_symbols, is_symbol_name
from .ir.stats import cost_terms
from .frontend.functions import expandable_ops
from .kernels.support import support_matrix
from .kernels.kernel_rules import builtin_kernel_rules
from .pipeline import Pipeline
from .rewrite_rules.proved_rewrite import applied_rules
from .rewrite_rules.verdicts import builtin_rules_dir, verdicts, write_shipped
from .targets import PTX_TARGET, get_target, make_options
from .testing.zoo import ZOO, zoo_model
from .verify import NATIVE_RTOL, verify, verify_artifact
from .version import __version__


def _fmt_count(n) -> str:
    if not isinstance(n, int):
        return str(n)
    for unit, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def cmd_inspect(args) -> int:
    p = Pipeline.from_onnx(args.model)
    if not args.raw:
        p = p.optimize(builtin=args.optimize, allow_bounded=args.allow_bounded_rules)
    p, fixed = _bind_shapes(p, args, check=not args.shapes)   # --shapes reports failing conditions instead
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
    print(f"parameters: {_fmt_count(st.parameters)} ({st.parameters:,} elements of constants the graph reads, "
          f"{st.parameter_bytes:,} bytes; the model file has {p.initializer_elements:,} initializer elements)")
    print("compute: " + _cost_text(g, st))
    if args.shapes:
        ranges = g.symbol_ranges()
        n_cons = sum(len(n.constraints) for n in g.nodes)
        bad = check_constraints(g, ranges)
        print(f"shape conditions on symbols: {n_cons}, violated somewhere in range: {len(bad)}")
        for v in bad:
            print(f"  {v}")
        for d, (lo, hi) in sorted(dim_ranges(g, ranges).items()):
            print(f"  dim {d} in [{lo}, {hi}]")
    if args.ir:
        print(p.print_ir(), end="")
    return 0


def _cost_text(g, st) -> str:
    """MACs and FLOPs: numbers for a static graph; with symbols, a formula of a few terms and its value at
    the opt point (each symbol's opt, else min) and at the profile's max."""
    def by_op(env) -> str:
        return ", ".join(f"{op} {_fmt_count(evaluate(f, env))}" for op, f in st.flops_by_op.items())

    if not g.symbols:
        return (f"{_fmt_count(st.macs)} MACs = {_fmt_count(st.flops)} FLOPs"
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
            f"  at the opt point ({point}): {_fmt_count(evaluate(st.macs, opt))} MACs = "
            f"{_fmt_count(evaluate(st.flops, opt))} FLOPs" + (f"  ({by_op(opt)} FLOPs)" if st.flops_by_op else "")
            + f"\n  at the profile's max: {_fmt_count(evaluate(st.macs, top))} MACs")


def _shape_flags(p: Pipeline, args):
    """``(fixed, shape_profiles)`` from ``--fix``, ``--shape-profile`` and ``--input-shape`` (where the
    command has them), by symbol name."""
    return p.resolve_shapes(_parse_fixed(getattr(args, "fix", None)),
                            _parse_profiles(getattr(args, "shape_profile", None)),
                            _parse_input_shapes(getattr(args, "input_shape", None)))


def _bind_shapes(p: Pipeline, args, check: bool = True):
    """``p`` with the shape flags applied (ranges set, fixed symbols specialised), and the fixed values."""
    fixed, profiles = _shape_flags(p, args)
    p = p.specialize(fixed) if fixed else p
    return (p.with_profiles(profiles, check=check) if profiles else p), fixed


def _parse_input_shapes(items, flag: str = "--input-shape") -> dict:
    """``x=1x3x640x640`` -> {"x": (1, 3, 640, 640)}; ``x=1x3x32x32:1x3x640x640:1x3x1280x1280`` -> {"x": (min,
    opt, max)}, as trtexec's ``--shapes``; a ``/1x1x32x32`` suffix gives each axis's multiple (``{"multiple":
    (1, 1, 32, 32)}`` after the three shapes)."""
    out = {}
    for item in items or ():
        name, _, spec = item.rpartition("=")
        spec, slash, mult = spec.partition("/")
        shapes = [part.lower().split("x") for part in spec.split(":")]
        mults = mult.lower().split("x") if slash else []
        if (not name or len(shapes) not in (1, 3) or not all(d.isdigit() for sh in shapes + [mults] for d in sh)
                or (slash and (len(shapes) != 3 or not mults))):
            raise CuvilError(f"{flag} takes INPUT=D0xD1x... (one shape) or INPUT=MIN:OPT:MAX (three shapes, "
                             f"e.g. x=1x3x32x32:1x3x640x640:1x3x1280x1280), optionally followed by /MULTIPLES "
                             f"(one per axis, e.g. /1x1x32x32), got {item!r}")
        if name in out:
            raise CuvilError(f"{flag} {name}: the input is given twice")
        dims = [tuple(int(d) for d in sh) for sh in shapes]
        out[name] = dims[0] if len(dims) == 1 else tuple(dims)
        if slash:
            out[name] += ({"multiple": tuple(int(d) for d in mults)},)
    return out


def _parse_profiles(items) -> dict:
    """``N=1:8:64`` (min:opt:max) -> {"N": (1, 8, 64)}; ``N=1:64`` -> {"N": (1, 64)} (min, max);
    ``H=32:640:1280/32`` -> {"H": (32, 640, 1280, {"multiple": 32})} (only multiples of 32)."""
    out = {}
    for item in items or ():
        name, _, spec = item.partition("=")
        spec, slash, mult = spec.partition("/")
        parts = spec.split(":")
        if (not name or len(parts) not in (2, 3) or not all(x.isdigit() for x in parts)
                or (slash and not mult.isdigit())):
            raise CuvilError(f"--shape-profile takes NAME=MIN:OPT:MAX, or NAME=MIN:OPT:MAX/MULTIPLE, got {item!r}")
        vals = tuple(int(x) for x in parts)
        if not 1 <= vals[0] <= vals[-1] or not vals[0] <= vals[len(vals) // 2] <= vals[-1]:
            raise CuvilError(f"--shape-profile {item!r}: need 1 <= MIN <= OPT <= MAX")
        out[name] = vals + (({"multiple": int(mult)},) if slash else ())
    return out


def demo_model_path() -> str:
    return os.path.join(os.path.dirname(__file__), "data", "demo_cnn.onnx")


def cmd_demo(args) -> int:
    """Cuvil's main job on a small bundled CNN: import, proved rewrites, native compile, run, compare."""
    path = demo_model_path()
    print(f"cuvil {__version__} demo: {os.path.basename(path)} (bundled)")
    t0 = time.perf_counter()
    src = Pipeline.from_onnx(path)
    t1 = time.perf_counter()
    opt = src.optimize()
    t2 = time.perf_counter()
    before, after = src.stats(), opt.stats()
    print(f"imported   {len(src.graph.nodes):3} nodes in {1e3 * (t1 - t0):4.0f} ms: "
          + ", ".join(f"{k} {v}" for k, v in before.op_histogram.items()))
    print(f"optimized  {len(opt.graph.nodes):3} nodes in {1e3 * (t2 - t1):4.0f} ms: "
          + ", ".join(f"{k} {v}" for k, v in after.op_histogram.items()))
    fired = ", ".join(f"{k} x{r['applied']} (prove {r['obligation']}: {r['verdict']})"
                      for k, r in applied_rules(opt.report).items())
    print(f"rules fired (each checked by Z3 before running; verdict after the colon): {fired}")
    print(f"parameters {after.parameters:,}; {_fmt_count(after.flops)} FLOPs per inference")
    batch = 2
    art = opt.compile(fixed={s: batch for s in opt.graph.symbols})
    t3 = time.perf_counter()
    m = art.manifest
    print(f"compiled   {m['kernels']} kernels into {os.path.basename(art.path)} "
          f"({'cached' if art.cached else f'{t3 - t2:.1f} s'}; arena {m['arena_bytes']:,} B, weights {m['weights_bytes']:,} B, "
          f"specialized {m['specialized']}, deps {', '.join(os.path.basename(d) for d in m['dependencies'])})")
    rng = np.random.default_rng(0)
    x = src.graph.inputs[0]
    shape = tuple(evaluate(d, {s: batch for s in x.type.free_symbols}) for d in x.shape)
    feeds = {x.name: rng.standard_normal(shape).astype(np.float32)}
    ref = src.run_reference(feeds)
    native = art.run(feeds)
    t4 = time.perf_counter()
    for _ in range(20):
        art.run(feeds)
    per_run = (time.perf_counter() - t4) / 20
    worst = 0.0
    for name in src.graph.output_names:
        a, b = native[name], ref[name]
        worst = max(worst, float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)))
        print(f"output {name}: {a.dtype}{list(a.shape)}; native vs onnx.reference of the original: max rel. error {worst:.2e}"
              f" ({1e6 * per_run:.0f} us per run)")
    try:
        import onnxruntime as ort
        sess = ort.InferenceSession(src.to_onnx().SerializeToString(), providers=["CPUExecutionProvider"])
        o = sess.run(None, feeds)
        err = max(float(np.max(np.abs(o[k] - native[n])) / (np.max(np.abs(o[k])) + 1e-30))
                  for k, n in enumerate(src.graph.output_names))
        print(f"native vs onnxruntime: max rel. error {err:.2e}")
    except ImportError:
        pass
    # dynamic shapes: one library for a whole batch range, checked against the reference at several sizes
    if opt.graph.symbols:
        profile = {s: (1, batch, 8) for s in opt.graph.symbols}
        t5 = time.perf_counter()
        dyn = opt.compile(shape_profiles=profile)
        t6 = time.perf_counter()
        errs = []
        for n in (1, 5, 8):
            shape = tuple(evaluate(d, {s: n for s in x.type.free_symbols}) for d in x.shape)
            f = {x.name: rng.standard_normal(shape).astype(np.float32)}
            r, got = src.run_reference(f), dyn.run(f)
            errs.append(max(float(np.max(np.abs(got[k] - r[k])) / (np.max(np.abs(r[k])) + 1e-30)) for k in r))
        prof = ", ".join(f"{k}={a}:{o}:{b}" for k, (a, o, b) in profile.items())
        print(f"dynamic    one library for {prof} ({'cached' if dyn.cached else f'{t6 - t5:.1f} s'}): batches 1, 5, 8 "
              f"vs onnx.reference: max rel. error {max(errs):.2e}")
        worst = max(worst, max(errs))
    ok = worst <= 1e-5
    print("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def cmd_zoo(args) -> int:
    onnx.save(zoo_model(args.name, seed=args.seed, softmax=args.softmax), args.output)
    print(f"wrote {args.output}: {ZOO[args.name]} (seed {args.seed})")
    return 0


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
    return v.shapes + (f"; dtypes: {types}" if v.dtypes else "")


def cmd_rules_list(args) -> int:
    rules = load_rules(_rule_paths(args))
    for r, (v, _) in zip(rules, verdicts(rules, timeout_ms=args.timeout_ms)):
        print(f"{r.name:32} benefit {r.benefit:<3} on {r.on:6} prove {r.proof:5}  {_verdict_label(v):11}  "
              f"{_coverage(v)}  {r.loc}")
    return 0


def _input_shape_flag(sp, text: str) -> None:
    sp.add_argument("--input-shape", action="append", metavar="INPUT=SHAPE", help=text)


def _allow_bounded_flag(sp) -> None:
    sp.add_argument("--allow-bounded-rules", action="store_true",
                    help="also run 'prove exact' rules checked only on bounded instances whose ops sum (their "
                         "bits may depend on the summation order on larger shapes; off by default)")


def cmd_verify(args) -> int:
    if args.artifact:
        res = verify_artifact(args.model, args.artifact, examples=args.examples)
        print(f"compared {args.artifact} with the original model (onnx.reference) on {res.examples} inputs, "
              f"within rel. tolerance {NATIVE_RTOL}")
        return _verdict(res, "the compiled library")
    res = verify(args.model, rules=args.rules or (), examples=args.examples)
    fired = ", ".join(f"{k} x{v}" for k, v in sorted(res.rules_fired.items())) or "none"
    print(f"rules fired: {fired}")
    print(f"compared {'bit for bit' if res.exact else 'within tolerance (prove real rules fired)'} on {res.examples} inputs")
    return _verdict(res, "the optimized model")


def _verdict(res, what: str) -> int:
    if res.ok:
        print(f"verify passed: {what} agrees with the original")
        return 0
    print(f"verify FAILED: {res.failure}")
    for name, arr in (res.failing_input or {}).items():
        print(f"  minimal input {name} {arr.dtype}{list(arr.shape)} = {np.array2string(arr, threshold=64)}")
    return 1


def _parse_fixed(items) -> dict:
    out = {}
    for item in items or ():
        name, _, val = item.rpartition("=")
        if name and is_symbol_name(val):
            out[name] = val   # another symbol: the two become one
            continue
        if not name or not val.lstrip("-").isdigit():
            raise CuvilError(f"--fix takes NAME=INT, or NAME=OTHER to make two symbols one, got {item!r}")
        out[name] = int(val)
    return out


def cmd_compile(args) -> int:
    target = get_target(args.target)   # an unknown target fails before the model is read
    if target.triple == PTX_TARGET:
        return _compile_gpu_bundle(args)
    if args.enable_fp16:
        raise CuvilError(f"--enable-fp16 is supported for --target {PTX_TARGET} only; {args.target} computes float32")
    if args.no_fma:
        raise CuvilError(f"--no-fma applies to --target {PTX_TARGET} only (GPU kernel rules)")
    if args.register_pass:
        raise CuvilError(f"--register-pass applies to --target {PTX_TARGET} only (GPU registers)")
    if not args.output.endswith(".so"):
        raise CuvilError(f"--output must name DIR/libNAME.so, got {args.output!r}")
    options = make_options(args.target, opt_level=_opt_level(args), cpu=args.cpu, prefix=args.prefix,
                           winograd=not args.no_winograd)
    progress, p = _import_and_optimize(args)
    fixed, profiles = _shape_flags(p, args)
    art = p.compile(options=options, fixed=fixed, progress=progress, shape_profiles=profiles)
    out = art.save(args.output)
    m = art.manifest
    base = os.path.splitext(out)[0]
    print(f"wrote {out}, {base}.h, {base}.manifest.json")
    print(f"  {m['kernels']} kernels, arena {m['arena_bytes']:,} B, weights {m['weights_bytes']:,} B, "
          f"target {m['target']['cpu']}" + (f", specialized {m['specialized']}" if m.get("specialized") else "")
          + (" (from cache)" if art.cached else f", compiled in {m['compile_seconds']:.1f} s"))
    ms = m.get("memory_safety")
    if ms:
        print(f"  memory safety: {ms['summary']} ({ms['accesses']} accesses, {ms['proof_seconds']:.2f} s)")
        for k in ms["guarded"]:
            print(f"  guarded kernel {k['stage']} ({k['variant']}): {k['unproved'][0]}")
    for name, prof in (m.get("symbols") or {}).items():
        print(f"  symbol {name} in [{prof['min']}, {prof['max']}] (opt {prof['opt']}): one library serves the range")
    for dim, (lo, hi) in sorted((m.get("derived_dims") or {}).items()):
        print(f"  derived dim {dim} in [{lo}, {hi}]")
    return 0


def _opt_level(args) -> int:
    level = {"O0": 0, "O1": 1, "O2": 2, "O3": 3}.get(args.opt_level.upper())
    if level is None:
        raise CuvilError(f"--opt-level takes O0, O1, O2 or O3, got {args.opt_level!r}")
    return level


def _import_and_optimize(args):
    """The steps both compile targets share: a timed progress printer, import and optimize."""
    t0 = time.perf_counter()
    progress = (lambda msg: print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True))
    progress(f"importing {args.input}")
    p = Pipeline.from_file(args.input, input_shapes=_parse_input_shapes(getattr(args, "input_shape", None)))
    progress(f"optimizing {len(p.graph.nodes)} nodes")
    return progress, p.optimize(rules=args.rules or None, allow_bounded=args.allow_bounded_rules)


def _compile_gpu_bundle(args) -> int:
    """``--target nvptx64-nvidia-cuda``: a bundle directory DIR/NAME.cuvil (PTX, weights, plan, manifest)."""
    out_path = args.output.rstrip(os.sep)
    if not out_path.endswith(".cuvil"):
        raise CuvilError(f"--output must name DIR/NAME.cuvil for --target {args.target}, got {args.output!r}")
    if args.cpu:
        raise CuvilError("--cpu applies to the x86 target; use --arch for GPUs")
    kernel_rules = None   # the built-in ones; plus any `on kernel` rules in the --rules files
    if args.rules:
        mine = [r for r in load_rules(args.rules) if r.on == "kernel"]
        kernel_rules = builtin_kernel_rules() + mine if mine else None
    options = make_options(args.target, opt_level=_opt_level(args), prefix=args.prefix, arch=args.arch,
                           fma=not args.no_fma, enable_fp16=args.enable_fp16, kernel_rules=kernel_rules,
                           register_pass=args.register_pass)
    progress, p = _import_and_optimize(args)
    fixed, profiles = _shape_flags(p, args)
    bundle = p.compile(options=options, fixed=fixed, progress=progress, shape_profiles=profiles)
    out = bundle.save(out_path)
    m = bundle.manifest
    regs = [k["registers"] for k in ((m.get("ptxas") or {}).get("kernels") or {}).values() if k.get("registers")]
    print(f"wrote {out}/ (kernels.ptx, weights.bin, plan.json, manifest.json"
          + (f", {m['ptxas']['cubin']}" if m.get("ptxas") else "") + ")")
    print(f"  {m['kernels']} kernels for {m['target']['arch']}, arena {m['arena_bytes']:,} B, weights {m['weights_bytes']:,} B"
          + (f", registers/thread max {max(regs)}" if regs else ", ptxas not found: registers not checked")
          + (f", specialized {m['specialized']}" if m.get("specialized") else "")
          + (" (from cache)" if bundle.cached else f", compiled in {m['compile_seconds']:.1f} s"))
    rp = m.get("register_pass") or {}
    if rp.get("kernels"):
        print(f"  register pass: {len(rp['kernels'])} multi-wave kernels limited by registers; "
              f"{rp['capped']} capped without spills (assuming {rp['sms']} SMs)")
    fired = {k: v["applied"] for k, v in (m.get("kernel_rules") or {}).items() if v.get("applied")}
    print("  kernel rules fired: " + (", ".join(f"{k} x{v}" for k, v in sorted(fired.items())) or "none")
          + ("" if m.get("fma", True) else " (--no-fma)")
          + (f"; float16: {len(m['float16_tensors'])} tensors" if m.get("enable_fp16") else ""))
    return 0


def cmd_run(args) -> int:
    m = load(args.library, num_threads=args.threads)
    named = {}
    for item in args.input or ():
        name, _, path = item.partition("=")
        if not path:
            raise CuvilError(f"--input takes NAME=FILE.npy, got {item!r}")
        named[name] = np.load(path)
    shapes = _parse_input_shapes(args.input_shape)
    for name, spec in shapes.items():
        if bench.is_profile(spec):
            raise CuvilError(f"cuvil run takes one shape per input: --input-shape {name}="
                             + "x".join(map(str, spec[1])))
        if name in named:
            raise CuvilError(f"input {name!r} is given by both --input and --input-shape; give one")
    known = {spec.name for spec in m.inputs}
    unknown = sorted(set(shapes) - known)
    if unknown:
        raise CuvilError(f"--input-shape {unknown[0]}: the library has no input {unknown[0]!r}; its inputs are "
                         + ", ".join(sorted(known)))
    missing = [spec for spec in m.inputs if spec.name not in named and spec.name not in shapes]
    if missing and shapes:
        spec = missing[0]
        raise CuvilError(f"input {spec.name!r} is not given: --input {spec.name}=FILE.npy, or --input-shape "
                         f"{spec.name}=" + "x".join(str(d if d is not None else "D") for d in spec.shape)
                         + " for random values")
    if shapes:   # seeded random values; the library checks the shapes against its inputs and profile
        want = [spec for spec in m.inputs if spec.name in shapes]
        arrays = bench.random_inputs(types.SimpleNamespace(inputs=want), [shapes[s.name] for s in want], args.seed)
        named.update({spec.name: a for spec, a in zip(want, arrays)})
    outs = m.run(**named)
    for spec, arr in zip(m.outputs, outs):
        if args.output_dir:
            os.makedirs(args.output_dir, exist_ok=True)
            path = os.path.join(args.output_dir, "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name) + ".npy")
            np.save(path, arr)
            print(f"{spec.name}: {arr.dtype}{list(arr.shape)} -> {path}")
        else:
            print(f"{spec.name}: {arr.dtype}{list(arr.shape)} = {np.array2string(arr, threshold=20, precision=5)}")
    return 0


def cmd_ops(args) -> int:
    """The support matrix (op x import / proof semantics / x86 / GPU / float16 class), then the ONNX
    default-domain ops Cuvil does not register; ``--json``: the matrix as JSON."""
    rows = support_matrix()
    onnx_ops = {s.name for s in onnx.defs.get_all_schemas() if s.domain == "" and not s.deprecated}
    registered = {r.op for r in rows}
    # Not registered but defined by an ONNX function: imported as the body's ops (frontend/functions.py).
    bodies = {op: how for op, how in expandable_ops(onnx.defs.onnx_opset_version()).items()
              if op in onnx_ops and op not in registered}
    missing = sorted(onnx_ops - registered - set(bodies))
    if args.json:
        print(json.dumps({"ops": [r.as_dict() for r in rows], "onnx_function_bodies": bodies,
                          "onnx_not_covered": missing}, indent=1))
        return 0
    mark = lambda ok: "yes" if ok else "-"  # noqa: E731
    print(f"{'op':26} {'family':12} {'import':6} {'proof':5} {'x86':3} {'gpu':3} half")
    for r in rows:
        print(f"{r.op:26} {r.family:12} {mark(r.imported):6} {mark(r.proof):5} {mark(r.x86):3} {mark(r.gpu):3} "
              f"{r.half or '-'}")
    count = lambda pred: sum(1 for r in rows if pred(r))  # noqa: E731
    print(f"{len(rows)} ops: {count(lambda r: r.proof)} with proof semantics, {count(lambda r: r.x86)} on x86, "
          f"{count(lambda r: r.gpu)} on the GPU, {count(lambda r: r.half and r.half != 'float32')} in float16 "
          f"(GPU, --enable-fp16); why an op lacks one: cuvil ops --json")
    print(f"{len(registered & onnx_ops)} of {len(onnx_ops)} ONNX default-domain ops are registered; "
          f"{len(bodies)} more are imported as their ONNX function bodies (they compile when the body's ops do): "
          f"{' '.join(bodies)}")
    print(f"not covered ({len(missing)}): {' '.join(missing)}")
    return 0


def cmd_bench(args) -> int:
    """Latency percentiles, throughput, error rate, cold start and peak RSS; optionally beside onnxruntime;
    exit 0 when the SLA held (or none was given), 1 when not."""
    cfg = bench.load_config(args.config) if args.config else {}
    if args.runs is not None and args.duration is not None:
        raise CuvilError("give --runs or --duration, not both")
    slas = dict(cfg.get("slas", {}))
    for item in args.sla or ():
        name, _, val = item.partition("=")
        try:
            slas[name] = float(val)
        except ValueError:
            raise CuvilError(f"--sla takes NAME=NUMBER, got {item!r}") from None
    if args.runs is not None or args.duration is not None:
        runs = args.runs
        try:
            duration = bench.parse_duration(args.duration) if args.duration is not None else None
        except ValueError as e:
            raise CuvilError(f"--duration: {e}") from None
    else:
        runs, duration = cfg.get("runs"), cfg.get("duration")
    pick = lambda flag, key, default: flag if flag is not None else cfg.get(key, default)
    vs = pick(args.vs, "vs", None)
    cold_runs = args.cold_runs
    bench.sla_requirements(slas, vs, cold_runs)
    if args.plot:
        bench.require_matplotlib()
    if args.runs is not None and args.runs < 1:
        raise CuvilError(f"--runs must be >= 1, got {args.runs}")
    for flag, val, lo in (("--warmup", args.warmup, 0), ("--threads", args.threads, 0),
                          ("--concurrency", args.concurrency, 1), ("--cold-runs", cold_runs, 0),
                          ("--pause-ms", args.pause_ms, 0)):
        if val is not None and val < lo:
            raise CuvilError(f"{flag} must be >= {lo}, got {val}")
    opts = bench.BenchOptions(
        args.model, onnx=args.onnx, vs=vs, threads=pick(args.threads, "threads", 1), runs=runs, duration=duration,
        warmup=pick(args.warmup, "warmup", bench.DEFAULT_WARMUP), concurrency=pick(args.concurrency, "concurrency", 1),
        opt_level=bench.parse_opt_level(pick(args.opt_level, "opt_level", "O3")), shapes=_bench_shapes(args),
        seed=args.seed, cold_runs=cold_runs, pause_ms=args.pause_ms,
        progress=True if args.progress else "auto" if sys.stderr.isatty() else False,
        log=lambda msg: print(f"cuvil bench: {msg}", file=sys.stderr, flush=True))
    res = bench.run_benchmark(opts)
    checks = bench.check_slas(res, slas)
    res["slas"], res["sla_held"] = checks, all(c["held"] for c in checks)
    print(bench.format_report(res, checks))
    if args.json:
        bench.write_json(res, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        bench.plot(res, args.plot)
        print(f"wrote {args.plot}")
    return 0 if res["sla_held"] else 1


def _bench_shapes(args) -> dict:
    shapes = bench.parse_shapes(args.shape)
    for name, spec in _parse_input_shapes(args.input_shape).items():
        if name in shapes:
            raise CuvilError(f"input {name!r} is given by both --shape and --input-shape; give one")
        shapes[name] = spec
    return shapes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cuvil", description="Compile ONNX inference graphs into native artifacts.")
    p.add_argument("--version", action="version", version=f"cuvil {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sp = sub.add_parser("inspect", help="inputs/outputs, op histogram, parameters and FLOPs of a model")
    sp.add_argument("model", help="an .onnx file")
    sp.add_argument("--ir", action="store_true", help="also print the IR")
    sp.add_argument("--raw", action="store_true", help="as imported, before folding/CSE/DCE")
    sp.add_argument("--optimize", action="store_true", help="after the built-in rules too (BN folded, ...)")
    _allow_bounded_flag(sp)
    sp.add_argument("--shapes", action="store_true", help="check the shape conditions on symbolic dims with Z3")
    _input_shape_flag(sp, "an input's shape (x=1x3x640x640: its symbols fixed) or min:opt:max shapes (their "
                          "ranges): the cost is shown at that point, --shapes checks that range (repeatable)")
    sp.add_argument("--shape-profile", action="append", metavar="NAME=MIN:OPT:MAX[/MULTIPLE]",
                    help="a symbol's range, by name: the cost's opt point, the range --shapes checks")
    sp.add_argument("--fix", action="append", metavar="NAME=INT",
                    help="a symbol's value, by name; NAME=OTHER makes it the symbol OTHER (repeatable)")
    sp.set_defaults(fn=cmd_inspect)
    sp = sub.add_parser("demo", help="run Cuvil's main job on a small bundled model")
    sp.set_defaults(fn=cmd_demo)
    sp = sub.add_parser("zoo", help="write an example model (onnx's light architectures, a BERT block) with seeded random weights")
    sp.add_argument("name", help=", ".join(ZOO))
    sp.add_argument("--output", "-o", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--softmax", action="store_true", help="keep the final Softmax (default: logits)")
    sp.set_defaults(fn=cmd_zoo)
    sp = sub.add_parser("rules", help="prove or list rewrite rules")
    rsub = sp.add_subparsers(dest="rules_command", metavar="ACTION")
    rc = rsub.add_parser("check", help="prove every rule (default: the built-in rules/); exit 0 unless one is refuted or unknown")
    rc.add_argument("paths", nargs="*", help=".rule files or directories")
    rc.add_argument("--no-cache", action="store_true", help="prove again, ignoring shipped and cached verdicts")
    rc.add_argument("--timeout-ms", type=int, default=20_000, help="Z3 time limit per proof")
    rc.add_argument("--write-verdicts", action="store_true", help=argparse.SUPPRESS)  # maintainers: refresh rules/verdicts.json
    rc.set_defaults(fn=cmd_rules_check)
    rl = rsub.add_parser("list", help="list rules with benefit, level, obligation and verdict (what the proof covers)")
    rl.add_argument("paths", nargs="*")
    rl.add_argument("--timeout-ms", type=int, default=20_000, help="Z3 time limit per proof (rules not yet proved)")
    rl.set_defaults(fn=cmd_rules_list)
    sp.set_defaults(fn=lambda a: (sp.print_help(), 2)[1])
    sp = sub.add_parser("compile", help="compile an ONNX model into a native shared library")
    sp.add_argument("--input", required=True,
                    help="the model: .onnx, or PyTorch: .pt2 (torch.export.save) or .pt (torch.jit.save; give "
                         "--input-shape for each input of forward), exported by torch.onnx (needs cuvil[torch])")
    sp.add_argument("--target", default="x86_64-linux-gnu", help="x86_64-linux-gnu (default) or nvptx64-nvidia-cuda")
    sp.add_argument("--opt-level", default="O3", help="O0, O1, O2 or O3")
    sp.add_argument("--output", required=True, help="DIR/libNAME.so (the header and manifest go beside it); "
                    "DIR/NAME.cuvil (a bundle directory) for nvptx64-nvidia-cuda")
    sp.add_argument("--arch", default="sm_90", help="GPU architecture for nvptx64-nvidia-cuda (default sm_90)")
    sp.add_argument("--cpu", default=None, help="LLVM CPU name (default: this machine's)")
    sp.add_argument("--prefix", default="cuvil", help="prefix of the C ABI symbols (default cuvil_)")
    _input_shape_flag(sp, "bind the symbolic dims of an input by its shape, whatever they are called: one "
                          "shape fixes them (x=1x3x640x640), three set their ranges (x=1x3x32x32:1x3x640x640:"
                          "1x3x1280x1280, min:opt:max; the library serves every shape in between; a /1x1x32x32 suffix "
                          "serves only multiples of 32 on the last two axes); a dim the model fixes must be given "
                          "its value (repeatable)")
    sp.add_argument("--fix", action="append", metavar="NAME=INT",
                    help="specialise a symbolic dim by its name, as `cuvil inspect` lists it; NAME=OTHER makes it "
                         "the symbol OTHER (two anonymous dims that must be equal: --fix s.0=x.0) (repeatable)")
    sp.add_argument("--shape-profile", action="append", metavar="NAME=MIN:OPT:MAX[/MULTIPLE]",
                    help="a symbolic dim's range, by name (repeatable); the library serves every shape in it "
                         "(default range [1, 4096])")
    sp.add_argument("--rules", action="append", help="extra .rule file or directory (repeatable)")
    sp.add_argument("--enable-fp16", action="store_true",
                    help="GPU: compute float32 tensors in float16 (inputs/outputs stay float32, sums accumulate in float32)")
    sp.add_argument("--no-fma", action="store_true",
                    help="GPU: no fused multiply-add contraction (the 'prove real' kernel rules do not run)")
    sp.add_argument("--register-pass", action="store_true",
                    help="GPU: cap the registers (.maxnreg) of register-limited kernels where that saves a wave "
                         "without spills")
    _allow_bounded_flag(sp)
    sp.add_argument("--no-winograd", action="store_true",
                    help="x86: keep direct 3x3 convolutions (Winograd rounds differently; see docs/rules.md)")
    sp.set_defaults(fn=cmd_compile)
    sp = sub.add_parser("run", help="run a compiled library on .npy inputs")
    sp.add_argument("library")
    sp.add_argument("--input", action="append", metavar="NAME=FILE.npy")
    _input_shape_flag(sp, "run on seeded random values of this shape for an input not given by --input "
                          "(x=1x3x640x640; repeatable)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the --input-shape random values")
    sp.add_argument("--output-dir", help="write each output as NAME.npy here (default: print)")
    sp.add_argument("--threads", type=int, default=0, help="0 = all cores")
    sp.set_defaults(fn=cmd_run)
    sp = sub.add_parser("verify", help="fuzz the optimized model against the original through onnx.reference")
    sp.add_argument("model")
    sp.add_argument("--rules", action="append", help="extra .rule file or directory (repeatable)")
    sp.add_argument("--examples", type=int, default=50)
    sp.add_argument("--artifact", help="also fuzz this compiled library (libNAME.so) against the original")
    sp.set_defaults(fn=cmd_verify)
    sp = sub.add_parser("ops", help="support matrix: each op's import, proof semantics, x86, GPU and float16 support")
    sp.add_argument("--json", action="store_true", help="the matrix (with the reason for each gap) as JSON")
    sp.set_defaults(fn=cmd_ops)
    sp = sub.add_parser("bench", help="latency, throughput, cold start and memory of a model, against an SLA",
                        description="Benchmark a model (an .onnx, compiled first; or a compiled .so): p50/p90/p99/max "
                                    "latency, throughput, error rate, cold start, peak RSS, artifact size; optionally "
                                    "beside onnxruntime. Exit 0 if the SLA held (or none was given), 1 if not, "
                                    "2 for usage errors. Flags override the config.")
    sp.add_argument("model", help="MODEL.onnx (compiled through the artifact cache) or LIB.so")
    sp.add_argument("--config", help="YAML file: concurrency, duration or runs, warmup, threads, opt_level, vs, slas")
    sp.add_argument("--vs", choices=["onnxruntime"], help="also run onnxruntime, alternating run by run; print ratios")
    sp.add_argument("--onnx", help="the ONNX model onnxruntime runs when MODEL is a .so")
    sp.add_argument("--threads", type=int, help="threads per session, both engines (default 1; 0 = all cores)")
    sp.add_argument("--runs", type=int, help="timed runs per engine, over all workers (default 100)")
    sp.add_argument("--duration", help="time instead of a run count: seconds, or 10s, 500ms, 2m")
    sp.add_argument("--warmup", type=int, help="untimed runs per engine and worker first (default 5)")
    sp.add_argument("--concurrency", type=int, help="parallel workers, each with its own session (default 1)")
    sp.add_argument("--opt-level", help="O0-O3 for an .onnx (default O3)")
    sp.add_argument("--shape", action="append", metavar="NAME=DIM",
                    help="a symbolic dim's size (NAME=DIM) or an input's shape (INPUT=1x3x224x224) (repeatable)")
    _input_shape_flag(sp, "an input's shape to time (x=1x3x640x640), or for an .onnx three shapes "
                          "(x=1x3x32x32:1x3x640x640:1x3x1280x1280): compile for that range, time its opt shape "
                          "(repeatable)")
    sp.add_argument("--sla", action="append", metavar="NAME=LIMIT", help="an SLA, e.g. p99_latency_ms=50 (repeatable)")
    sp.add_argument("--cold-runs", type=int, default=3,
                    help="fresh processes per engine for cold start and peak RSS (default 3; 0 = skip)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    sp.add_argument("--pause-ms", type=float, default=0.0,
                    help="untimed sleep after each timed run, so spinning worker threads go idle first (default 0; with "
                         "--vs onnxruntime and several threads use ~150: its workers spin 50-100 ms after a run)")
    sp.add_argument("--json", metavar="OUT", help="write every figure as JSON")
    sp.add_argument("--plot", metavar="OUT.png", help="latency histogram and CDF (needs matplotlib)")
    sp.add_argument("--progress", action="store_true", help="progress bar on stderr even when it is not a terminal")
    sp.set_defaults(fn=cmd_bench)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return 2
    try:
        return args.fn(args)
    except CuvilError as e:
        print(f"cuvil: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
