"""Flags several subcommands share, defined once so that each is spelled, defaulted and explained the same way
in every command: the model positional, the shape flags, ``-O/--opt-level``, ``--threads``, ``--target``,
``-q/--quiet`` and ``--progress``; and the checks that refuse a bad value before any work."""
from __future__ import annotations

import difflib

from .. import bench
from ..errors import CuvilError
from ..targets import PTX_TARGET, TARGETS, X86_TARGET

#: Friendlier names for the target triples (``--target cuda``).
TARGET_ALIASES = {"x86_64": X86_TARGET, "x86-64": X86_TARGET, "x86": X86_TARGET, "cpu": X86_TARGET,
                  "nvptx64": PTX_TARGET, "nvptx": PTX_TARGET, "ptx": PTX_TARGET, "cuda": PTX_TARGET,
                  "gpu": PTX_TARGET}

#: What ``--threads 0`` means, the same in every command and in onnxruntime beside it.
THREADS_HELP = "threads per session (default 0 = all cores)"


def add_actions(sub, name: str, help: str, description: str):
    """A command whose work is done by its actions (``cuvil rules check``): its parser and the parsers of the
    actions; without an action it prints its help (which lists them) and exits 2."""
    sp = sub.add_parser(name, help=help, description=description)
    actions = sp.add_subparsers(dest=f"{name}_command", metavar="ACTION")
    sp.set_defaults(fn=lambda a: (sp.print_help(), 2)[1])
    return sp, actions


def add_model_arg(sp, text: str) -> None:
    sp.add_argument("model", metavar="MODEL", help=text)


def add_shape_flags(sp, input_shape_text: str) -> None:
    """``--input-shape`` (by input), ``--fix`` and ``--shape-profile`` (by symbol name, as inspect lists it)."""
    add_input_shape_flag(sp, input_shape_text)
    sp.add_argument("--fix", action="append", metavar="SYMBOL=INT",
                    help="a symbolic dim's value, by name as `cuvil inspect` lists it; SYMBOL=OTHER makes it the "
                         "symbol OTHER (two anonymous dims that must be equal: --fix s.0=x.0) (repeatable)")
    sp.add_argument("--shape-profile", action="append", metavar="SYMBOL=MIN:OPT:MAX[/MULTIPLE]",
                    help="a symbolic dim's range, by name (repeatable; default range [1, 4096])")


def add_input_shape_flag(sp, text: str) -> None:
    sp.add_argument("--input-shape", action="append", metavar="INPUT=DIMS[:DIMS:DIMS][/MULTIPLES]", help=text)


def add_allow_bounded_flag(sp) -> None:
    sp.add_argument("--allow-bounded-rules", action="store_true",
                    help="also run 'prove exact' rules checked only on bounded instances whose ops sum (their "
                         "bits may depend on the summation order on larger shapes; off by default)")


def add_opt_level_flag(sp) -> None:
    sp.add_argument("-O", "--opt-level", default="O3", metavar="LEVEL",
                    help="optimisation level: O0, O1, O2 or O3, or 0-3 (default O3; -O2 works too)")


def add_threads_flag(sp) -> None:
    sp.add_argument("--threads", type=int, default=0, metavar="N", help=THREADS_HELP)


def add_quiet_flag(sp) -> None:
    sp.add_argument("-q", "--quiet", action="store_true",
                    help="no progress output: only the results and errors")


def add_progress_flag(sp) -> None:
    sp.add_argument("--progress", action="store_true",
                    help="progress on stderr even when it is not a terminal (default: only on a terminal)")


def add_target_flag(sp) -> None:
    sp.add_argument("--target", default=X86_TARGET, metavar="TARGET",
                    help=f"{X86_TARGET} (default; also x86_64) or {PTX_TARGET} (also cuda)")


def opt_level(text) -> int:
    """``O0``..``O3`` or ``0``..``3`` -> 0..3."""
    try:
        return bench.parse_opt_level(text)
    except CuvilError:
        raise CuvilError(f"unknown optimisation level {text!r} (--opt-level)",
                         hint="-O3 (the default), or O0, O1, O2; 0-3 work too") from None


def threads(n: int) -> int:
    """``--threads``: 0 (all cores) or a positive count."""
    if n < 0:
        raise CuvilError(f"--threads {n}: a thread count cannot be negative",
                         hint="--threads 0 (all cores, the default) or a positive count such as --threads 1")
    return n


def resolve_target(text: str) -> str:
    """The target triple ``--target`` names (a triple or an alias); an unknown one is refused with the nearest
    names, before any model is read."""
    name = str(text).strip()
    if name in TARGETS:
        return name
    if name.lower() in TARGET_ALIASES:
        return TARGET_ALIASES[name.lower()]
    names = list(TARGETS) + list(TARGET_ALIASES)
    nearest = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.4)
    triples = list(dict.fromkeys(TARGET_ALIASES.get(n, n) for n in nearest))
    raise CuvilError(f"unknown target {text!r} (--target)",
                     details=[f"the targets are {X86_TARGET} (a native .so; alias x86_64) and {PTX_TARGET} (a GPU "
                              f"bundle for NVIDIA GPUs; alias cuda)"],
                     hint=f"--target {triples[0]}" if triples else f"--target {X86_TARGET} (the default)")


def add_precision_flags(sp, default: str = "fp32") -> None:
    """``--precision``, ``--input-range`` and ``--calibrate`` (docs/precision.md)."""
    sp.add_argument("--precision", default=default, metavar="FORMAT",
                    help=f"fp32, bf16, fp16, fp8, int8 or auto: narrow the nodes whose ranges are proved safe in that "
                         f"format (auto: the narrowest safe one per node the target runs, never fp8; fp8: the "
                         f"GPU's E4M3 tensor cores on sm_89+, scaled by powers of two) (default {default})")
    sp.add_argument("--input-range", action="append", metavar="INPUT=LO:HI",
                    help="an input's declared range, the start of the proof (x=-3:3) (repeatable)")
    sp.add_argument("--calibrate", metavar="DIR",
                    help="measure the input ranges from calibration data: DIR of INPUT.npy files, or an .npz "
                         "(measured, not certified)")
    sp.add_argument("--keep-fp32", metavar="NAMES",
                    help="node names or op types kept float32 whatever their ranges, comma-separated (Gemm,n12); "
                         "`none` keeps none (default: the model's output layers, such as a classifier's last Gemm)")


def precision_flags(args):
    """``(mode, input_ranges, calibration, keep_fp32)`` from the precision flags, checked before the model is
    read (``keep_fp32`` None: the policy's default)."""
    from ..precision.inputs import parse_input_range
    from ..precision.policy import check_mode
    mode = check_mode(getattr(args, "precision", None))
    ranges = dict(parse_input_range(t) for t in getattr(args, "input_range", None) or ())
    keep = getattr(args, "keep_fp32", None)
    if keep is not None:
        if keep.strip().lower() == "none":
            keep = []
        else:
            keep = [k.strip() for k in keep.split(",") if k.strip()]
            if not keep:
                raise CuvilError(f"--keep-fp32 {args.keep_fp32!r} names no node or op type",
                                 hint="--keep-fp32 Gemm,n12, or --keep-fp32 none to narrow the output layers too; "
                                      "leave the flag out for the default (the output layers stay float32)")
    return mode, ranges, getattr(args, "calibrate", None), keep
