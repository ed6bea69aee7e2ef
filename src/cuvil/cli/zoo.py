"""``cuvil zoo NAME -o OUT``: an example model with seeded random weights (onnx's light architectures, a BERT
block); the models and their names are :mod:`cuvil.testing.zoo`'s."""
from __future__ import annotations

import difflib

import onnx

from ..errors import CuvilError
from ..testing.zoo import ZOO, zoo_model
from .flags import add_quiet_flag


def register(sub) -> None:
    sp = sub.add_parser("zoo", help="write an example model (onnx's light architectures, a BERT block) with seeded random weights",
                        description="Write NAME, a real architecture from onnx's light model set or a BERT-style encoder "
                                    "block (symbolic batch and sequence length), with seeded random weights, as an .onnx "
                                    "file to try Cuvil on without downloading anything. "
                                    "Example: cuvil zoo squeezenet -o squeezenet.onnx")
    sp.add_argument("name", metavar="NAME", help=", ".join(ZOO))
    sp.add_argument("-o", "--output", metavar="OUT", help="the .onnx file to write")
    sp.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    sp.add_argument("--softmax", action="store_true", help="keep a light model's final Softmax (default: logits)")
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_zoo)


def cmd_zoo(args) -> int:
    if args.name not in ZOO:
        nearest = difflib.get_close_matches(args.name, list(ZOO), n=1, cutoff=0.4)
        raise CuvilError(f"unknown model {args.name!r} (cuvil zoo)", details=[f"the models: {', '.join(ZOO)}"],
                         hint=f"cuvil zoo {nearest[0] if nearest else 'squeezenet'} -o {args.output or 'model.onnx'}")
    if not args.output:
        raise CuvilError("no output file named (-o/--output)", hint=f"cuvil zoo {args.name} -o {args.name}.onnx")
    onnx.save(zoo_model(args.name, seed=args.seed, softmax=args.softmax), args.output)
    print(f"wrote {args.output}: {ZOO[args.name]} (seed {args.seed})")
    return 0
