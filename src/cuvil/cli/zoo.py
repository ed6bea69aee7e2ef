"""``cuvil zoo NAME -o OUT``: an example model with seeded random weights (onnx's light architectures, a BERT
block); the models and their names are :mod:`cuvil.testing.zoo`'s."""
from __future__ import annotations

import onnx

from ..testing.zoo import ZOO, zoo_model


def register(sub) -> None:
    sp = sub.add_parser("zoo", help="write an example model (onnx's light architectures, a BERT block) with seeded random weights")
    sp.add_argument("name", help=", ".join(ZOO))
    sp.add_argument("--output", "-o", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--softmax", action="store_true", help="keep a light model's final Softmax (default: logits)")
    sp.set_defaults(fn=cmd_zoo)


def cmd_zoo(args) -> int:
    onnx.save(zoo_model(args.name, seed=args.seed, softmax=args.softmax), args.output)
    print(f"wrote {args.output}: {ZOO[args.name]} (seed {args.seed})")
    return 0
