"""PyTorch in: modules, TorchScript files (``.pt``) and ExportedPrograms (``.pt2``) to ONNX, through torch's own
exporters.

Cuvil does not translate PyTorch itself: ``torch.onnx`` is the exporter users already trust, so a PyTorch model
becomes exactly the ONNX graph a user would have exported by hand, and everything after that (import, proofs,
kernels) is the ONNX path. The routes:

- an ``nn.Module`` (:func:`export_module`) and a ``.pt2`` ExportedProgram go through the dynamo exporter
  (opset 18); ``torch.export.Dim`` objects in ``dynamic_shapes`` become Cuvil symbols of the same name with the
  Dim's range as their profile;
- a ``.pt`` TorchScript file goes through the TorchScript exporter (opset 17), the only one that takes a
  ScriptModule; it stores no input shapes, so they are given per input (``input_shapes``, as
  ``cuvil compile --input-shape`` does), and a dim whose min and max differ becomes the symbol ``input.axis``.

torch is the optional ``torch`` extra (``pip install cuvil[torch]``) and is imported here alone, when one of these
functions runs.
"""
from __future__ import annotations

import io
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import onnx

from ..errors import CuvilError, ModelLoadError
from ..ir.dim import DEFAULT_MAX

DYNAMO_OPSET = 18
TORCHSCRIPT_OPSET = 17
TORCH_SUFFIXES = (".pt", ".pth", ".pt2")

Shape = Sequence[int]
ShapeProfile = Union[Shape, Tuple[Shape, Shape, Shape]]
SymbolRanges = Dict[str, Tuple[int, int]]


def _torch():
    try:
        import torch
    except ImportError:
        raise CuvilError("PyTorch input needs torch, which is not installed",
                         hint="pip install 'cuvil[torch]', or export to ONNX with torch.onnx.export and compile "
                              "the .onnx") from None
    return torch


def _dims_of(dynamic_shapes: Any) -> List[Any]:
    """Every ``torch.export.Dim`` in a ``dynamic_shapes`` structure (dicts, lists, tuples of them)."""
    if dynamic_shapes is None:
        return []
    if isinstance(dynamic_shapes, Mapping):
        return [d for v in dynamic_shapes.values() for d in _dims_of(v)]
    if isinstance(dynamic_shapes, (list, tuple)):
        return [d for v in dynamic_shapes for d in _dims_of(v)]
    return [dynamic_shapes] if hasattr(dynamic_shapes, "__name__") and hasattr(dynamic_shapes, "max") else []


def dim_ranges(dynamic_shapes: Any) -> SymbolRanges:
    """``{name: (min, max)}`` of the named Dims of a ``dynamic_shapes`` structure, clamped to Cuvil's symbol
    range ``[1, DEFAULT_MAX]`` (torch's unbounded Dims have a max near 2**63)."""
    out: SymbolRanges = {}
    for d in _dims_of(dynamic_shapes):
        lo = max(1, int(getattr(d, "min", 1) or 1))
        hi = int(getattr(d, "max", DEFAULT_MAX) or DEFAULT_MAX)
        out[d.__name__] = (lo, min(hi, max(lo, DEFAULT_MAX)))
    return out


def export_module(module, example_inputs: Sequence[Any], dynamic_shapes: Any = None, *,
                  input_names: Optional[Sequence[str]] = None,
                  output_names: Optional[Sequence[str]] = None) -> onnx.ModelProto:
    """An ``nn.Module`` (or a ``torch.export.ExportedProgram``) as ONNX, by the dynamo exporter at opset 18.

    ``example_inputs``: a tuple of tensors, as ``torch.export`` takes; ``dynamic_shapes``: ``torch.export``'s
    structure (``{"x": {0: Dim("batch", min=1, max=8)}}``). An exporter failure is a CuvilError with the
    exporter's first line."""
    torch = _torch()
    try:
        program = torch.onnx.export(module, tuple(example_inputs), dynamo=True, opset_version=DYNAMO_OPSET,
                                    dynamic_shapes=dynamic_shapes, input_names=input_names,
                                    output_names=output_names, external_data=False)
    except Exception as e:      # torch raises its own TorchExportError, UserError, ...: one clear line instead
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CuvilError(f"torch.onnx.export (dynamo) failed: {type(e).__name__}: {first}",
                         hint="make the module torch.export-able (see the exporter's message), or export it to "
                              "ONNX yourself and compile the .onnx") from None
    return program.model_proto


def _example(torch, shape: Shape, dtype) -> Any:
    return torch.zeros(tuple(int(d) for d in shape), dtype=dtype) if not dtype.is_floating_point else \
        torch.randn(tuple(int(d) for d in shape), dtype=dtype)


def _profile(name: str, prof: ShapeProfile) -> Tuple[Shape, Shape, Shape]:
    if prof and isinstance(prof[0], (list, tuple)):
        if len(prof) != 3:
            raise CuvilError(f"input shape of {name}: neither one shape nor (min, opt, max): {prof!r}",
                             hint=f"give --input-shape {name}=1x3x224x224 or MIN:OPT:MAX (three shapes)")
        lo, opt, hi = (tuple(int(d) for d in s) for s in prof)
        if not len(lo) == len(opt) == len(hi):
            raise CuvilError(f"input shape of {name}: min, opt and max have different ranks: {prof!r}",
                             hint="give three shapes of one rank")
        return lo, opt, hi
    s = tuple(int(d) for d in prof)
    return s, s, s


def export_torchscript(path: Union[str, os.PathLike], input_shapes: Mapping[str, ShapeProfile],
                       input_dtypes: Optional[Mapping[str, str]] = None) -> Tuple[onnx.ModelProto, SymbolRanges]:
    """A TorchScript file (``torch.jit.save``) as ONNX by the TorchScript exporter at opset 17, with its
    symbols' ranges. ``input_shapes`` names every input of ``forward`` (one shape, or ``(min, opt, max)``;
    a dim that differs between min and max becomes the symbol ``NAME.AXIS``); ``input_dtypes`` (default
    float32) takes torch dtype names such as ``"int64"``."""
    torch = _torch()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file", hint="check the path")
    try:
        module = torch.jit.load(path, map_location="cpu")
    except Exception as e:
        raise ModelLoadError(f"{path}: not a TorchScript file ({type(e).__name__})",
                             hint="a .pt must come from torch.jit.save (a state_dict or a pickled module holds no "
                                  "graph: script or trace the module first), a .pt2 from torch.export.save") from None
    args = [a.name for a in module.forward.schema.arguments[1:]]
    missing = [a for a in args if a not in input_shapes]
    unknown = sorted(set(input_shapes) - set(args))
    if missing or unknown:
        raise CuvilError(f"{path}: a TorchScript file stores no input shapes"
                         + (f"; missing: {', '.join(missing)}" if missing else "")
                         + (f"; not an input: {', '.join(unknown)}" if unknown else ""),
                         hint=f"give one per input of forward ({', '.join(args)}) with --input-shape "
                              f"NAME=1x3x224x224 (or MIN:OPT:MAX)")
    examples, dynamic_axes, ranges = [], {}, {}
    for name in args:
        lo, opt, hi = _profile(name, input_shapes[name])
        dtype = getattr(torch, (input_dtypes or {}).get(name, "float32"))
        examples.append(_example(torch, opt, dtype))
        axes = {ax: f"{name}.{ax}" for ax in range(len(opt)) if lo[ax] != hi[ax]}
        if axes:
            dynamic_axes[name] = axes
            ranges.update({f"{name}.{ax}": (lo[ax], hi[ax]) for ax in axes})
    buf = io.BytesIO()
    try:
        torch.onnx.export(module, tuple(examples), buf, dynamo=False, opset_version=TORCHSCRIPT_OPSET,
                          input_names=args, dynamic_axes=dynamic_axes or None)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CuvilError(f"torch.onnx.export (TorchScript) failed on {path}: {type(e).__name__}: {first}",
                         hint="save the module with torch.export.save (.pt2) instead, or export it to ONNX "
                              "yourself and compile the .onnx") from None
    model = onnx.ModelProto()
    model.ParseFromString(buf.getvalue())
    return model, ranges


def export_exported_program(path: Union[str, os.PathLike]) -> Tuple[onnx.ModelProto, SymbolRanges]:
    """A ``.pt2`` file (``torch.export.save``) as ONNX by the dynamo exporter, its symbolic dims kept with the
    ranges the ExportedProgram proved for them."""
    torch = _torch()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: no such file", hint="check the path")
    try:
        program = torch.export.load(path)
    except Exception as e:
        raise ModelLoadError(f"{path}: not an ExportedProgram ({type(e).__name__})",
                             hint="a .pt2 must come from torch.export.save") from None
    model = export_module(program, program.example_inputs[0] if program.example_inputs else ())
    ranges: SymbolRanges = {}
    names = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}
    for sym, vr in program.range_constraints.items():
        if str(sym) in names:
            lo = max(1, int(vr.lower)) if vr.lower.is_finite else 1
            hi = int(vr.upper) if vr.upper.is_finite else DEFAULT_MAX
            ranges[str(sym)] = (lo, min(hi, max(lo, DEFAULT_MAX)))
    return model, ranges
