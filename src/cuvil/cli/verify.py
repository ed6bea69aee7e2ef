"""``cuvil verify MODEL``: fuzz the optimized model (and optionally a compiled library) against the
original through onnx.reference."""
from __future__ import annotations

import numpy as np

from ..verify import NATIVE_RTOL, verify, verify_artifact


def register(sub) -> None:
    sp = sub.add_parser("verify", help="fuzz the optimized model against the original through onnx.reference")
    sp.add_argument("model")
    sp.add_argument("--rules", action="append", help="extra .rule file or directory (repeatable)")
    sp.add_argument("--examples", type=int, default=50)
    sp.add_argument("--artifact", help="also fuzz this compiled library (libNAME.so) against the original")
    sp.set_defaults(fn=cmd_verify)


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
