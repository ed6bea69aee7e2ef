"""``cuvil ops``: the support matrix, each op's import, proof semantics, x86, GPU and float16 support."""
from __future__ import annotations

import json

import onnx
import onnx.defs

from ..frontend.functions import expandable_ops
from ..kernels.support import support_matrix
from .flags import add_quiet_flag


def register(sub) -> None:
    sp = sub.add_parser("ops", help="support matrix: each op's import, proof semantics, x86, GPU and float16 support",
                        description="List every op Cuvil registers with what it supports: ONNX import, proof "
                                    "semantics (rules over it can be proved), x86 and GPU code, float16 on the GPU; "
                                    "then the ONNX default-domain ops imported as their function bodies and those "
                                    "not covered. Example: cuvil ops | grep Conv")
    sp.add_argument("--json", action="store_true", help="the matrix (with the reason for each gap) as JSON")
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_ops)


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
