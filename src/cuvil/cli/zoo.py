"""``cuvil zoo NAME -o OUT``: a real architecture (onnx's light models) with seeded random weights."""
from __future__ import annotations

import onnx

from ..errors import CuvilError
from ..testing.models import LIGHT_MODELS, light_model


def register(sub) -> None:
    sp = sub.add_parser("zoo", help="write a real architecture (onnx's light models) with seeded random weights")
    sp.add_argument("name", help="bvlc_alexnet, densenet121, inception_v1, inception_v2, resnet50, shufflenet, squeezenet, vgg19, zfnet512")
    sp.add_argument("--output", "-o", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--softmax", action="store_true", help="keep the final Softmax (default: logits)")
    sp.set_defaults(fn=cmd_zoo)


def cmd_zoo(args) -> int:
    if args.name not in LIGHT_MODELS:
        raise CuvilError(f"unknown model {args.name!r}; choose from {', '.join(LIGHT_MODELS)}")
    m = light_model(args.name, seed=args.seed, logits=not args.softmax)
    onnx.save(m, args.output)
    print(f"wrote {args.output}: light {args.name} with seeded random weights (seed {args.seed})")
    return 0
