"""``cuvil compile``: an ONNX (or PyTorch) model into a native x86-64 shared library or a GPU bundle."""
from __future__ import annotations

import os

from .. import progress
from ..dsl.parser import load_rules
from ..errors import CuvilError
from ..kernels.kernel_rules import builtin_kernel_rules
from ..pipeline import Pipeline
from ..targets import PTX_TARGET, make_options
from ..targets.ptx.archs import DEFAULT_ARCH, check_arch
from ..targets.ptx.buckets import parse_bucket_flag
from .flags import (add_allow_bounded_flag, add_opt_level_flag, add_precision_flags, add_progress_flag, add_quiet_flag,
                    add_shape_flags, add_target_flag, opt_level, precision_flags, resolve_target)
from .shape_flags import check_shape_flags, parse_input_shapes, shape_flags


def register(sub) -> None:
    sp = sub.add_parser("compile", help="compile a model into a native shared library or a GPU bundle",
                        description="Compile MODEL (.onnx; PyTorch .pt2/.pt with cuvil[torch]) into OUT: a native "
                                    "x86-64 shared library DIR/libNAME.so (with its C header and manifest beside "
                                    "it), or for --target nvptx64-nvidia-cuda a GPU bundle DIR/NAME.cuvil. The "
                                    "proved rewrite rules run first; symbolic dims are bound by --input-shape, "
                                    "--fix or --shape-profile. Example: cuvil compile model.onnx -o build/libmodel.so")
    sp.add_argument("model", nargs="?", metavar="MODEL",
                    help="the model: .onnx, or PyTorch: .pt2 (torch.export.save) or .pt (torch.jit.save; give "
                         "--input-shape for each input of forward), exported by torch.onnx (needs cuvil[torch])")
    sp.add_argument("--input", dest="input_alias", metavar="MODEL", help="the model, as MODEL (an older spelling)")
    sp.add_argument("-o", "--output", metavar="OUT", help="DIR/libNAME.so (the header and manifest go beside it); "
                    "DIR/NAME.cuvil (a bundle directory) for nvptx64-nvidia-cuda")
    add_target_flag(sp)
    add_opt_level_flag(sp)
    sp.add_argument("--arch", default=None,
                    help=f"GPU architecture for nvptx64-nvidia-cuda, sm_NN (default {DEFAULT_ARCH})")
    sp.add_argument("--cpu", default=None, help="x86: LLVM CPU name (default: this machine's)")
    sp.add_argument("--prefix", default="cuvil", help="prefix of the C ABI symbols (default cuvil_)")
    add_shape_flags(sp, "bind the symbolic dims of an input by its shape, whatever they are called: one "
                        "shape fixes them (x=1x3x640x640), three set their ranges (x=1x3x32x32:1x3x640x640:"
                        "1x3x1280x1280, min:opt:max; the library serves every shape in between; a /1x1x32x32 suffix "
                        "serves only multiples of 32 on the last two axes); a dim the model fixes must be given "
                        "its value (repeatable)")
    sp.add_argument("--rules", action="append", help="extra .rule file or directory (repeatable)")
    sp.add_argument("--enable-fp16", action="store_true",
                    help="GPU: compute float32 tensors in float16 (inputs/outputs stay float32, sums accumulate in float32)")
    sp.add_argument("--no-fma", action="store_true",
                    help="GPU: no fused multiply-add contraction (the 'prove real' kernel rules do not run)")
    sp.add_argument("--register-pass", action="store_true",
                    help="GPU: cap the registers (.maxnreg) of register-limited kernels where that saves a wave "
                         "without spills")
    sp.add_argument("--allow-tf32", action="store_true",
                    help="GPU: run float32 MatMul/Gemm and convolutions on TF32 tensor cores (inputs rounded to a "
                         "10-bit mantissa, about 1e-3 relative error; off: strict float32)")
    sp.add_argument("--concurrency", metavar="C", type=int, default=None,
                    help="GPU: size the kernels' grids for C inferences in flight at once (sessions on their own "
                         "streams; default 1: each call's grids fill the GPU alone)")
    sp.add_argument("--bucket-jobs", metavar="N", type=int, default=None,
                    help="GPU, with a shape profile: compile N bucket points at once, each in its own process "
                         "(0: one per CPU; default 1); the bundle is the same")
    sp.add_argument("--graph-buckets", metavar="V1,V2,...", default=None,
                    help="GPU, with a shape profile: the values of the profiled symbol compiled into the one bundle "
                         "(1,2,4,8,16,32,64; by symbol N=1,8,64;S=128,512; default: powers of two of each range "
                         "plus its min and max); a call between buckets runs the next one up, padded where the "
                         "graph allows it")
    add_allow_bounded_flag(sp)
    # low precision with certificates (issue 21, docs/precision.md)
    add_precision_flags(sp)
    sp.add_argument("--no-winograd", action="store_true",
                    help="x86: keep direct 3x3 convolutions (Winograd rounds differently; see docs/rules.md)")
    sp.add_argument("--tune", action="store_true",
                    help="x86: time each convolution layer's candidate schedules (register tile, Winograd) on this "
                         "machine and take the fastest; cached by CPU model and layer shape (docs/tuning.md)")
    sp.add_argument("--tune-budget", type=float, default=None, metavar="SECONDS",
                    help="x86, with --tune: seconds of measuring at most (largest layers first; the rest keep the "
                         "cost model's choices; default 600)")
    sp.add_argument("--tune-threads", type=int, default=None, metavar="N",
                    help="x86, with --tune: the thread count the candidates are timed at (default 1)")
    sp.add_argument("--no-batch-slices", action="store_true",
                    help="x86: run a batch layer by layer over all its rows, not slice by slice through the opt "
                         "point's kernels (docs/shapes.md)")
    # LoRA merged at compile time (issue 23, docs/lora.md)
    sp.add_argument("--lora", action="append", metavar="ADAPTER",
                    help="merge a LoRA adapter (PEFT directory or .onnx_adapter) into the weights (repeatable)")
    sp.add_argument("--lora-weight", action="append", type=float, metavar="W",
                    help="the weight of the n-th --lora (repeatable, in order; default 1.0)")
    sp.add_argument("--lora-map", metavar="FILE",
                    help="JSON/YAML module -> initializer (or node) name, for graphs whose names were lost")
    # weights outside the code (docs/weights.md)
    sp.add_argument("--external-weights", action="store_true",
                    help="x86: write the weights to libNAME.weights beside the library (mapped read-only, shared "
                         "between processes) instead of into it")
    sp.add_argument("--encrypt-weights", metavar="KEYFILE",
                    help="x86: encrypt libNAME.weights with this key file (AES-256-GCM; implies --external-weights; "
                         "make one with cuvil weights-key KEYFILE; load with weights_key=KEYFILE)")
    sp.add_argument("--lora-slots", type=int, default=0, metavar="RANK",
                    help="x86: give the --lora-targets layers a LoRA slot of rank RANK: the library then takes "
                         "adapters of rank <= RANK at run time (load_adapter / set_adapter; docs/lora.md)")
    sp.add_argument("--lora-targets", nargs="+", default=None, metavar="PATTERN",
                    help="x86, with --lora-slots: the layers that get a slot, as PEFT's target_modules: module-name "
                         "suffixes (query value) or a regex (default: the attention projections)")
    add_quiet_flag(sp)
    add_progress_flag(sp)
    sp.set_defaults(fn=cmd_compile)


#: Flags only the x86 target reads: (flag, args attribute), refused for the GPU (a bundle keeps weights.bin).
_X86_ONLY_FLAGS = (("--external-weights", "external_weights"), ("--encrypt-weights", "encrypt_weights"),
                   ("--tune", "tune"), ("--tune-budget", "tune_budget"), ("--tune-threads", "tune_threads"))

#: Flags only the GPU target reads: (flag, args attribute, what it controls), refused for x86 by one check.
_GPU_ONLY_FLAGS = (("--enable-fp16", "enable_fp16", "float16 compute; x86 computes float32"),
                   ("--no-fma", "no_fma", "GPU kernel rules"),
                   ("--register-pass", "register_pass", "GPU registers"),
                   ("--allow-tf32", "allow_tf32", "TF32 tensor cores; x86 computes float32"),
                   ("--graph-buckets", "graph_buckets", "GPU shape buckets; x86 kernels read the symbols at run time"),
                   ("--bucket-jobs", "bucket_jobs", "GPU shape buckets compiled in parallel"),
                   ("--concurrency", "concurrency", "GPU kernels' grid sizes; x86 sessions take num_threads"),
                   ("--arch", "arch", "GPU architectures"))


def cmd_compile(args) -> int:
    _check_flags(args)   # every flag's value is checked before the model is read
    if args.target == PTX_TARGET:
        if args.lora_slots or args.lora_targets:
            raise CuvilError(f"--lora-slots and --lora-targets apply to the x86 target only, not {PTX_TARGET}",
                             hint="drop them, or merge the adapter at compile time (--lora ADAPTER_DIR)")
        return _compile_gpu_bundle(args)
    for flag, given, what in _GPU_ONLY_FLAGS:
        if getattr(args, given) is not None and getattr(args, given) is not False:   # 0 is a value given
            raise CuvilError(f"{flag} applies to --target {PTX_TARGET} only ({what})",
                             hint=f"drop {flag}{' (x86 takes --cpu NAME)' if flag == '--arch' else ''}, or compile "
                                  f"for the GPU: --target {PTX_TARGET}")
    if not args.output.endswith(".so"):
        raise CuvilError(f"--output must name DIR/libNAME.so, got {args.output!r}",
                         hint=f"-o {os.path.join(os.path.dirname(args.output), 'lib' + _stem(args.output) + '.so')}"
                              + (f", or keep -o {args.output} and add --target {PTX_TARGET} for a GPU bundle"
                                 if args.output.rstrip(os.sep).endswith(".cuvil") else ""))
    # The one place --cpu is checked before the model is read: X86Options validates it (the cpu helper's
    # cuvil.targets.x86.cpu.validate_cpu refuses an unknown name with the nearest ones).
    options = make_options(args.target, opt_level=args.opt_level, cpu=args.cpu, prefix=args.prefix,
                           winograd=not args.no_winograd, external_weights=args.external_weights,
                           encrypt_weights=args.encrypt_weights, lora_slots=args.lora_slots,
                           lora_targets=args.lora_targets or (),
                           **({"batch_slices": False} if args.no_batch_slices else {}), **_tune_options(args))
    with _progress(args):
        p = _import_and_optimize(args)
        fixed, profiles = shape_flags(p, args)
        art = p.compile(options=options, fixed=fixed, shape_profiles=profiles, **_precision(args))
    out = art.save(args.output)
    m = art.manifest
    base = os.path.splitext(out)[0]
    print(f"wrote {out}, {base}.h, {base}.manifest.json"
          + (f", {base}.weights" + (" (encrypted)" if m["weights_file"]["encrypted"] else "")
             if m.get("weights_file") else "")
          + f", SBOM {base}.cdx.json, provenance {base}.intoto.json")
    print(f"  {m['kernels']} kernels, arena {m['arena_bytes']:,} B, weights {m['weights_bytes']:,} B, "
          f"target {m['target']['cpu']}" + (f", specialized {m['specialized']}" if m.get("specialized") else "")
          + (" (from cache)" if art.cached else f", compiled in {art.timings['compile_seconds']:.1f} s"))
    ms = m.get("memory_safety")
    if ms:
        print(f"  memory safety: {ms['summary']} ({ms['accesses']} accesses"
              + (f", {art.timings['proof_seconds']:.2f} s)" if art.timings else ")"))
        for k in ms["guarded"]:
            print(f"  guarded kernel {k['stage']} ({k['variant']}): {k['unproved'][0]}")
    if m.get("lora"):
        exact = sum(r["exact_decisions"] for r in m["lora"])
        print(f"  lora: {len(m['lora'])} weights merged (rules {', '.join(sorted(k for k in m['rules_applied'] if k.startswith('lora_merge')))}), "
              f"each correctly rounded ({exact} elements decided in exact arithmetic)")
    if m.get("lora_slots"):
        print(f"  LoRA slots of rank {args.lora_slots} on {len(m['lora_slots'])} layers: "
              f"{', '.join(s['module'] for s in m['lora_slots'][:3])}{', ...' if len(m['lora_slots']) > 3 else ''}")
    for name, prof in (m.get("symbols") or {}).items():
        print(f"  symbol {name} in [{prof['min']}, {prof['max']}] (opt {prof['opt']}): one library serves the range")
    for dim, (lo, hi) in sorted((m.get("derived_dims") or {}).items()):
        print(f"  derived dim {dim} in [{lo}, {hi}]")
    _print_precision(m)
    return 0


def _print_precision(m: dict) -> None:
    pr = m.get("precision")
    if pr:
        print(f"  precision {pr['mode']}: " + ", ".join(f"{k} {v} nodes" for k, v in pr["counts"].items())
              + " (reasons per node in the manifest's \"precision\"; cuvil precision report explains them)")


def _check_flags(args) -> None:
    """Resolves MODEL (positional or --input), OUT, --target (a triple or an alias), --arch and --opt-level in
    ``args``, refusing a bad value with the next step, before any work."""
    if args.model and args.input_alias:
        raise CuvilError(f"the model is given twice: {args.model!r} and --input {args.input_alias!r}",
                         hint=f"give it once: cuvil compile {args.model} -o OUT")
    args.model = args.model or args.input_alias
    if not args.model:
        raise CuvilError("no model to compile", hint="cuvil compile MODEL.onnx -o DIR/libNAME.so")
    if not args.output:
        raise CuvilError("no output named (-o/--output)",
                         hint=f"cuvil compile {args.model} -o build/lib{_stem(args.model)}.so (x86), or "
                              f"-o build/{_stem(args.model)}.cuvil with --target {PTX_TARGET}")
    args.target = resolve_target(args.target)
    if args.target == PTX_TARGET:
        args.arch = check_arch(args.arch or DEFAULT_ARCH)
    args.opt_level = opt_level(args.opt_level)
    check_shape_flags(args)
    check_lora_flags(args)
    args.precision_flags = precision_flags(args)


def _precision(args) -> dict:
    """The Pipeline.compile keywords of --precision / --input-range / --calibrate / --keep-fp32."""
    mode, ranges, calibration, keep = args.precision_flags
    return {"precision": mode, "input_ranges": ranges or None, "calibration": calibration, "keep_fp32": keep}


def check_lora_flags(args) -> None:
    weights, loras = getattr(args, "lora_weight", None) or [], getattr(args, "lora", None) or []
    if len(weights) > len(loras):
        raise CuvilError(f"{len(weights)} --lora-weight for {len(loras)} --lora adapter(s)",
                         hint="give one --lora-weight after each --lora it scales (the n-th weight scales the "
                              "n-th adapter; default 1.0)")
    if getattr(args, "lora_map", None) and not loras:
        raise CuvilError("--lora-map without --lora", hint="add --lora ADAPTER_DIR")


def with_lora_flags(p, args):
    """``p`` with the adapters of --lora / --lora-weight / --lora-map merged (``Pipeline.with_lora``)."""
    from ..lora import load_lora_map, read_adapter
    loras = getattr(args, "lora", None) or []
    if not loras:
        return p
    weights = (args.lora_weight or []) + [1.0] * (len(loras) - len(args.lora_weight or []))
    adapters = [read_adapter(path) for path in loras]
    lmap = load_lora_map(args.lora_map) if args.lora_map else {}
    stray = sorted(k for k in lmap if not any(k in a.modules for a in adapters))
    if stray:
        raise CuvilError(f"--lora-map names {len(stray)} module(s) that no --lora adapter has", details=stray,
                         hint="use the module names of the adapters' keys (less base_model.model. and "
                              ".lora_A.weight)")
    for adapter, weight in zip(adapters, weights):
        p = p.with_lora(adapter, weight, lora_map={k: v for k, v in lmap.items() if k in adapter.modules} or None)
    return p


def _stem(path: str) -> str:
    name = os.path.basename(path.rstrip(os.sep))
    for suffix in (".onnx", ".pt2", ".pt", ".so", ".cuvil"):
        name = name.removesuffix(suffix)
    return name.removeprefix("lib") or "model"


def _progress(args):
    """Each stage on stderr (the LLVM stage kernel by kernel) when it is a terminal or with --progress, never
    with -q."""
    return progress.enabled(progress.wanted(args.quiet, args.progress))


def _tune_options(args) -> dict:
    """``--tune``'s options; --tune-budget / --tune-threads without it are refused (they would do nothing)."""
    for flag, given in (("--tune-budget", args.tune_budget), ("--tune-threads", args.tune_threads)):
        if given is not None and not args.tune:
            raise CuvilError(f"{flag} without --tune: nothing is measured", hint=f"add --tune, or drop {flag}")
    if not args.tune:
        return {}
    return {"tune": True, "tune_budget": args.tune_budget,
            **({} if args.tune_threads is None else {"tune_threads": args.tune_threads})}


def _import_and_optimize(args):
    """The steps both compile targets share: import and optimize (each reports its own progress)."""
    p = Pipeline.from_file(args.model, input_shapes=parse_input_shapes(getattr(args, "input_shape", None)))
    p = with_lora_flags(p, args)
    return p.optimize(rules=args.rules or None, allow_bounded=args.allow_bounded_rules)


def _compile_gpu_bundle(args) -> int:
    """``--target nvptx64-nvidia-cuda``: a bundle directory DIR/NAME.cuvil (PTX, weights, plan, manifest)."""
    out_path = args.output.rstrip(os.sep)
    if not out_path.endswith(".cuvil"):
        raise CuvilError(f"--output must name DIR/NAME.cuvil for --target {args.target}, got {args.output!r}",
                         hint=f"-o {os.path.join(os.path.dirname(out_path), _stem(out_path) + '.cuvil')}")
    if args.cpu:
        raise CuvilError("--cpu applies to the x86 target; use --arch for GPUs",
                         hint=f"drop --cpu; --arch {args.arch} picks the GPU architecture")
    for flag, given in _X86_ONLY_FLAGS:
        if getattr(args, given):
            raise CuvilError(f"{flag} applies to the x86 target only: a GPU bundle keeps its weights in its own "
                             f"weights.bin file", hint=f"drop {flag} for --target {args.target}")
    kernel_rules = None   # the built-in ones; plus any `on kernel` rules in the --rules files
    if args.rules:
        mine = [r for r in load_rules(args.rules) if r.on == "kernel"]
        kernel_rules = builtin_kernel_rules() + mine if mine else None
    options = make_options(args.target, opt_level=args.opt_level, prefix=args.prefix, arch=args.arch,
                           fma=not args.no_fma, enable_fp16=args.enable_fp16, kernel_rules=kernel_rules,
                           register_pass=args.register_pass, allow_tf32=args.allow_tf32,
                           jobs=1 if args.bucket_jobs is None else args.bucket_jobs,
                           concurrency=1 if args.concurrency is None else args.concurrency,
                           graph_buckets=parse_bucket_flag(args.graph_buckets) if args.graph_buckets else None)
    with _progress(args):
        p = _import_and_optimize(args)
        fixed, profiles = shape_flags(p, args)
        bundle = p.compile(options=options, fixed=fixed, shape_profiles=profiles, **_precision(args))
    out = bundle.save(out_path)
    m = bundle.manifest
    regs = [k["registers"] for k in ((m.get("ptxas") or {}).get("kernels") or {}).values() if k.get("registers")]
    print(f"wrote {out}/ (kernels.ptx, weights.bin, plan.json, manifest.json"
          + (f", {m['ptxas']['cubin']}" if m.get("ptxas") else "") + ", sbom.cdx.json, provenance.intoto.json)")
    print(f"  {m['kernels']} kernels for {m['target']['arch']}, arena {m['arena_bytes']:,} B, weights {m['weights_bytes']:,} B"
          + (f", registers/thread max {max(regs)}" if regs else ", ptxas not found: registers not checked")
          + (f", specialized {m['specialized']}" if m.get("specialized") else "")
          + (" (from cache)" if bundle.cached else f", compiled in {bundle.timings['compile_seconds']:.1f} s"))
    for name, prof in (m.get("profile") or {}).items():
        print(f"  profile {name} in [{prof['min']}, {prof['max']}]: one bundle, buckets "
              f"{','.join(map(str, prof['buckets']))}; "
              + ("a value between buckets runs the next one up, padded" if prof["paddable"]
                 else f"only the bucket values run ({prof.get('not_paddable')})"))
    rp = m.get("register_pass") or {}
    if rp.get("kernels"):
        print(f"  register pass: {len(rp['kernels'])} multi-wave kernels limited by registers; "
              f"{rp['capped']} capped without spills (assuming {rp['sms']} SMs)")
    fired = {k: v["applied"] for k, v in (m.get("kernel_rules") or {}).items() if v.get("applied")}
    print("  kernel rules fired: " + (", ".join(f"{k} x{v}" for k, v in sorted(fired.items())) or "none")
          + ("" if m.get("fma", True) else " (--no-fma)")
          + (f"; float16: {len(m['float16_tensors'])} tensors" if m.get("enable_fp16") else ""))
    _print_precision(m)
    return 0
