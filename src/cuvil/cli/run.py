"""``cuvil run ARTIFACT``: run a compiled model (a libNAME.so or a NAME.cuvil bundle, through ``cuvil.load``) on
.npy inputs or seeded random values, and print or save its outputs."""
from __future__ import annotations

import difflib
import os
import types

import numpy as np

from .. import bench
from ..artifact import load
from ..errors import CuvilError
from ..targets import PTX_TARGET
from ..targets.ptx.runtime import NoGpuError
from .flags import add_input_shape_flag, add_quiet_flag, add_threads_flag, threads
from .shape_flags import parse_input_shapes

#: The first bytes of every .npy file (numpy.lib.format).
NPY_MAGIC = b"\x93NUMPY"


def register(sub) -> None:
    sp = sub.add_parser("run", help="run a compiled model on .npy inputs or seeded random values",
                        description="Run ARTIFACT (a libNAME.so, or a NAME.cuvil GPU bundle) once, loaded through "
                                    "cuvil.load: each input from a NumPy .npy file (--input NAME=FILE.npy) or as "
                                    "seeded random values of a shape (--input-shape NAME=DIMS); print each output, "
                                    "or save it as NAME.npy (--output-dir). Example: cuvil run build/libmodel.so "
                                    "--input-shape x=1x3x224x224")
    sp.add_argument("artifact", metavar="ARTIFACT", help="DIR/libNAME.so or DIR/NAME.cuvil (from cuvil compile)")
    sp.add_argument("--input", action="append", metavar="NAME=FILE.npy",
                    help="an input from a .npy file (numpy.save) (repeatable)")
    add_input_shape_flag(sp, "run on seeded random values of this shape for an input not given by --input "
                             "(x=1x3x640x640; repeatable)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the --input-shape random values")
    sp.add_argument("--output-dir", help="write each output as NAME.npy here (default: print)")
    sp.add_argument("--weights-key", metavar="KEYFILE",
                    help="the key of a library compiled with --encrypt-weights KEYFILE")
    sp.add_argument("--max-graphs", type=int, default=None, metavar="N",
                    help="GPU bundle: keep at most N shape buckets' CUDA graphs alive (LRU; default 4)")
    add_threads_flag(sp)
    add_quiet_flag(sp)
    sp.set_defaults(fn=cmd_run)


def cmd_run(args) -> int:
    path = args.artifact
    if not os.path.exists(path):
        raise CuvilError(f"{path}: no such file",
                         hint=f"compile one first: cuvil compile MODEL.onnx -o {path}"
                              + (f" --target {PTX_TARGET}" if path.rstrip(os.sep).endswith(".cuvil") else ""))
    try:
        m = load(path, num_threads=threads(args.threads),
                 **({"weights_key": args.weights_key} if args.weights_key else {}),
                 **({"max_graphs": args.max_graphs} if args.max_graphs is not None else {}))
    except NoGpuError as e:
        if e.hint:
            raise
        raise CuvilError(f"{path}: {e.message}", details=e.details,
                         hint="run the bundle where an NVIDIA GPU, its driver and cuda-python are (pip install "
                              "'cuvil[gpu]'), or compile the model for this CPU: cuvil compile MODEL -o "
                              "build/libNAME.so") from None
    specs = {spec.name: spec for spec in m.inputs}
    named = {}
    for item in args.input or ():
        name, eq, file = item.partition("=")
        if not eq or not name or not file:
            raise CuvilError(f"--input takes NAME=FILE.npy, got {item!r}",
                             hint=f"--input {next(iter(specs), 'x')}=FILE.npy")
        if name not in specs:
            raise CuvilError(f"--input {item}: {path} has no input {name!r}", details=[_inputs_text(m)],
                             hint=f"--input {_nearest(name, specs)}={file}")
        named[name] = _checked_array(m, specs[name], file, item)
    shapes = parse_input_shapes(args.input_shape)
    for name, spec in shapes.items():
        if bench.is_profile(spec):
            raise CuvilError(f"cuvil run takes one shape per input, got three for {name!r}",
                             hint=f"--input-shape {name}=" + "x".join(map(str, spec[1])))
        if name in named:
            raise CuvilError(f"input {name!r} is given by both --input and --input-shape",
                             hint=f"give one: --input {name}=FILE.npy or --input-shape {name}=...")
        if name not in specs:
            raise CuvilError(f"--input-shape {name}: {path} has no input {name!r}", details=[_inputs_text(m)],
                             hint=f"--input-shape {_nearest(name, specs)}=" + "x".join(map(str, spec)))
    missing = [spec for spec in m.inputs if spec.name not in named and spec.name not in shapes]
    if missing:
        spec = missing[0]
        raise CuvilError(f"input {spec.name!r} is not given" + (f" (nor {len(missing) - 1} more)" if missing[1:] else ""),
                         details=[_inputs_text(m)],
                         hint=f"--input {spec.name}=FILE.npy, or --input-shape {spec.name}={_example_dims(m, spec)} "
                              f"for seeded random values")
    if shapes:   # seeded random values; the library checks the shapes against its inputs and profile
        want = [spec for spec in m.inputs if spec.name in shapes]
        arrays = bench.random_inputs(types.SimpleNamespace(inputs=want), [shapes[s.name] for s in want], args.seed)
        named.update({spec.name: a for spec, a in zip(want, arrays)})
    outs = m.run(**named)
    for spec, arr in zip(m.outputs, outs):
        if args.output_dir:
            os.makedirs(args.output_dir, exist_ok=True)
            out = os.path.join(args.output_dir, "".join(c if c.isalnum() or c in "-_." else "_" for c in spec.name) + ".npy")
            np.save(out, arr)
            print(f"{spec.name}: {arr.dtype}{list(arr.shape)} -> {out}")
        else:
            print(f"{spec.name}: {arr.dtype}{list(arr.shape)} = {np.array2string(arr, threshold=20, precision=5)}")
    return 0


def _checked_array(m, spec, file: str, item: str) -> np.ndarray:
    """The array in ``file`` for input ``spec``: a readable .npy of the input's dtype and rank, its fixed dims
    equal (symbolic dims are checked against the profile by the model)."""
    dims, example = _dims_text(spec), _example_dims(m, spec)
    dtype = np.dtype(spec.dtype).name if spec.dtype is not None else f"ONNX type {spec.code}"
    make = f"numpy.save('{_npy_name(file)}', array)  # array: {dtype}, shape {dims}"
    if not os.path.isfile(file):
        raise CuvilError(f"--input {item}: no such file", hint=f"write it with {make}; or --input-shape "
                                                               f"{spec.name}={example} for seeded random values")
    with open(file, "rb") as f:
        head = f.read(len(NPY_MAGIC))
    if head != NPY_MAGIC:
        raw = f"numpy.fromfile('{file}', numpy.{dtype}).reshape({example.replace('x', ', ')})"
        raise CuvilError(f"--input {item}: not a .npy file (cuvil run reads numpy.save's format, which records "
                         f"the dtype and shape)",
                         hint=f"python3 -c \"import numpy; numpy.save('{_npy_name(file)}', {raw})\" if it holds "
                              f"raw {dtype} values")
    try:
        arr = np.load(file, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise CuvilError(f"--input {item}: cannot read the .npy file: {e}", hint=f"write it again with {make}") from None
    if spec.dtype is not None and arr.dtype != spec.dtype:
        raise CuvilError(f"--input {item}: the array is {arr.dtype}, input {spec.name!r} is {dtype}",
                         hint=f"convert it: numpy.save('{file}', numpy.load('{file}').astype(numpy.{dtype}))")
    fits = arr.ndim == len(spec.shape) and all(d is None or d == n for d, n in zip(spec.shape, arr.shape))
    if not fits:
        raise CuvilError(f"--input {item}: the array's shape is {'x'.join(map(str, arr.shape)) or 'scalar'}, input "
                         f"{spec.name!r} is {dims}", hint=f"save an array of shape {example}"
                         + (f" (or another size in the range of {dims}: cuvil inspect shows it)" if dims != example else ""))
    return arr


def _dims_text(spec) -> str:
    """``Nx3x16x16``: the input's dims, a symbol by its name."""
    return "x".join(str(d) for d in spec.dims)


def _example_dims(m, spec) -> str:
    """``2x3x16x16``: a shape the model takes, each symbol at its profile's opt."""
    return "x".join(str(m.symbols[d].opt) if isinstance(d, str) and d in m.symbols else str(d) for d in spec.dims)


def _npy_name(file: str) -> str:
    return os.path.splitext(file)[0] + ".npy"


def _inputs_text(m) -> str:
    return "inputs: " + ", ".join(f"{s.name} {np.dtype(s.dtype).name if s.dtype is not None else s.code}"
                                  f"[{_dims_text(s)}]" for s in m.inputs)


def _nearest(name: str, names) -> str:
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.0)
    return close[0] if close else name
