"""``cuvil doctor [--json]``: the CPU, ISA features and kernel width Cuvil will use, LLVM, the CUDA tools and GPU,
the optional extras installed (:mod:`cuvil.doctor`): the first thing to paste into a bug report."""
from __future__ import annotations

import json

from ..doctor import collect, report_text
from .flags import add_quiet_flag


def register(sub) -> None:
    sp = sub.add_parser(
        "doctor", help="what Cuvil finds on this machine (CPU, ISA features, LLVM, CUDA, extras): "
                       "paste it into bug reports",
        description="Report this machine as Cuvil sees it: the CPU (brand string, cpuid family/model/stepping), "
                    "the ISA features libraries built here will use and require, the kernels' vector width, the "
                    "LLVM and llvmlite versions, the C compiler, Python and package versions, ptxas and libdevice, "
                    "the GPU and driver (through cuda-python, if installed), the optional extras installed and the "
                    "cache directory.")
    sp.add_argument("--json", action="store_true", help="the same facts as one JSON object")
    add_quiet_flag(sp)   # every command takes -q; doctor prints only its report anyway
    sp.set_defaults(fn=cmd_doctor)


def cmd_doctor(args) -> int:
    info = collect()
    print(json.dumps(info, indent=1) if args.json else report_text(info))
    return 0
