"""``cuvil verify MODEL``: fuzz the optimized model (and optionally a compiled library) against the
original through onnx.reference."""
from __future__ import annotations

import os

import numpy as np

from .. import progress
from ..errors import CuvilError
from ..pipeline import Pipeline
from .flags import add_model_arg, add_progress_flag, add_quiet_flag, add_shape_flags, add_threads_flag, threads
from .shape_flags import bind_shapes, check_shape_flags


def register(sub) -> None:
    sp = sub.add_parser("verify", help="fuzz the optimized model (or a compiled library) against the original",
                        description="Check that the proved rewrites did not change MODEL's results: run the "
                                    "original and the optimized model through onnx.reference on random inputs "
                                    "(Hypothesis; a difference is shrunk to a minimal input). With --artifact, "
                                    "fuzz a compiled library against the original instead. Exit 0 if they agree, "
                                    "1 if not. Example: cuvil verify model.onnx --artifact build/libmodel.so")
    add_model_arg(sp, "an .onnx file")
    sp.add_argument("--rules", action="append", help="extra .rule file or directory (repeatable)")
    sp.add_argument("--examples", type=int, default=50, help="random inputs to try (default 50)")
    sp.add_argument("--artifact", help="fuzz this compiled library (libNAME.so) or bundle (NAME.cuvil) against the "
                                       "original model")
    add_shape_flags(sp, "an input's shape (x=1x3x640x640: its symbols fixed) or min:opt:max shapes (the range "
                        "the random inputs are drawn from) (repeatable)")
    add_threads_flag(sp)
    add_quiet_flag(sp)
    add_progress_flag(sp)
    sp.set_defaults(fn=cmd_verify)


def cmd_verify(args) -> int:
    # imported here: cuvil.verify brings Hypothesis, which no other command needs, into every `cuvil` process
    from ..verify import NATIVE_RTOL, verify, verify_artifact
    if args.examples < 1:
        raise CuvilError(f"--examples {args.examples}: at least one example is needed", hint="--examples 50 (the default)")
    n_threads = threads(args.threads)
    check_shape_flags(args)
    if args.artifact and not os.path.exists(args.artifact):
        raise CuvilError(f"--artifact {args.artifact}: no such file",
                         hint=f"compile it first: cuvil compile {args.model} -o {args.artifact}")
    # each stage, then each example with the largest error so far, on stderr (a terminal, or --progress; never -q)
    with progress.enabled(progress.wanted(args.quiet, args.progress)):
        source, _ = bind_shapes(Pipeline.from_onnx(args.model), args)
        if args.artifact:
            res = verify_artifact(source, args.artifact, examples=args.examples, num_threads=n_threads,
                                  model=args.model)
        else:
            res = verify(source, rules=args.rules or (), examples=args.examples)
    if args.artifact:
        print(f"compared {args.artifact} with the original model (onnx.reference) on {res.examples} inputs, "
              f"within rel. tolerance {NATIVE_RTOL}")
        return _verdict(res, "the compiled library")
    fired = ", ".join(f"{k} x{v}" for k, v in sorted(res.rules_fired.items())) or "none"
    print(f"rules fired: {fired}")
    print(f"compared {'bit for bit' if res.exact else 'within tolerance (prove real rules fired)'} on {res.examples} inputs")
    return _verdict(res, "the optimized model")


def _verdict(res, what: str) -> int:
    print(res.error_line())   # always, with -q too: the figure the verdict rests on
    if res.ok:
        print(f"verify passed: {what} agrees with the original")
        return 0
    print(f"verify FAILED: {res.failure}")
    for name, arr in (res.failing_input or {}).items():
        print(f"  minimal input {name} {arr.dtype}{list(arr.shape)} = {np.array2string(arr, threshold=64)}")
    return 1
