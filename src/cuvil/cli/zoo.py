"""``cuvil zoo NAME -o OUT``: a real architecture (onnx's light models) with seeded random weights."""
from __future__ import annotations

import difflib

import onnx

from ..errors import CuvilError
from ..testing.models import LIGHT_MODELS, light_model
from .flags import add_quiet_flag


def register(sub) -> None:
    sp = sub.add_parser("zoo", help="write a real architecture (onnx's light models) with seeded random weights",
                        description="Write NAME, a real architecture from onnx's light model set with seeded random "
                                    "weights, as an .onnx file to try Cuvil on without downloading anything. "
                                    "Example: cuvil zoo squeezenet -o squeezenet.onnx")
    sp.add_argument("name", metavar="NAME", help=", ".join(LIGHT_MODELS))
    sp.add_argument("-o", "--output", metavar="OUT", help="the .onnx file to write")
    sp.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    sp.add_argument("--softmax", action="store_true", help="keep the final Softmax (default: logits)")
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_zoo)


def cmd_zoo(args) -> int:
    if args.name not in LIGHT_MODELS:
        nearest = difflib.get_close_matches(args.name, list(LIGHT_MODELS), n=1, cutoff=0.4)
        raise CuvilError(f"unknown model {args.name!r} (cuvil zoo)", details=[f"the models: {', '.join(LIGHT_MODELS)}"],
                         hint=f"cuvil zoo {nearest[0] if nearest else 'squeezenet'} -o {args.output or 'model.onnx'}")
    if not args.output:
        raise CuvilError("no output file named (-o/--output)", hint=f"cuvil zoo {args.name} -o {args.name}.onnx")
    m = light_model(args.name, seed=args.seed, logits=not args.softmax)
    onnx.save(m, args.output)
    print(f"wrote {args.output}: light {args.name} with seeded random weights (seed {args.seed})")
    return 0
