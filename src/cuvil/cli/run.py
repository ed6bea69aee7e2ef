"""``cuvil run ARTIFACT``: run a compiled library on .npy inputs or seeded random values."""
from __future__ import annotations

import os
import types

import numpy as np

from .. import bench
from ..artifact import load
from ..errors import CuvilError
from .flags import add_input_shape_flag
from .shape_flags import parse_input_shapes


def register(sub) -> None:
    sp = sub.add_parser("run", help="run a compiled library on .npy inputs")
    sp.add_argument("library")
    sp.add_argument("--input", action="append", metavar="NAME=FILE.npy")
    add_input_shape_flag(sp, "run on seeded random values of this shape for an input not given by --input "
                          "(x=1x3x640x640; repeatable)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the --input-shape random values")
    sp.add_argument("--output-dir", help="write each output as NAME.npy here (default: print)")
    sp.add_argument("--threads", type=int, default=0, help="0 = all cores")
    sp.set_defaults(fn=cmd_run)


def cmd_run(args) -> int:
    m = load(args.library, num_threads=args.threads)
    named = {}
    for item in args.input or ():
        name, _, path = item.partition("=")
        if not path:
            raise CuvilError(f"--input takes NAME=FILE.npy, got {item!r}")
        named[name] = np.load(path)
    shapes = parse_input_shapes(args.input_shape)
    for name, spec in shapes.items():
        if bench.is_profile(spec):
            raise CuvilError(f"cuvil run takes one shape per input: --input-shape {name}="
                             + "x".join(map(str, spec[1])))
        if name in named:
            raise CuvilError(f"input {name!r} is given by both --input and --input-shape; give one")
    known = {spec.name for spec in m.inputs}
    unknown = sorted(set(shapes) - known)
    if unknown:
        raise CuvilError(f"--input-shape {unknown[0]}: the library has no input {unknown[0]!r}; its inputs are "
                         + ", ".join(sorted(known)))
    missing = [spec for spec in m.inputs if spec.name not in named and spec.name not in shapes]
    if missing and shapes:
        spec = missing[0]
        raise CuvilError(f"input {spec.name!r} is not given: --input {spec.name}=FILE.npy, or --input-shape "
                         f"{spec.name}=" + "x".join(str(d if d is not None else "D") for d in spec.shape)
                         + " for random values")
    if shapes:   # seeded random values; the library checks the shapes against its inputs and profile
        want = [spec for spec in m.inputs if spec.name in shapes]
        arrays = bench.random_inputs(types.SimpleNamespace(inputs=want), [shapes[s.name] for s in want], args.seed)
        named.update({spec.name: a for spec, a in zip(want, arrays)})
    outs = m.run(**named)
    for spec, arr in zip(m.outputs, outs):
        if args.output_dir:
            os.makedirs(args.output_dir, exist_ok=True)
            path = os.path.join(args.output_dir, "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name) + ".npy")
            np.save(path, arr)
            print(f"{spec.name}: {arr.dtype}{list(arr.shape)} -> {path}")
        else:
            print(f"{spec.name}: {arr.dtype}{list(arr.shape)} = {np.array2string(arr, threshold=20, precision=5)}")
    return 0
