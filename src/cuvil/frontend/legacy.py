"""Opset differences, rewritten on import into Cuvil's canonical form (ONNX opset 21 semantics).

Each adapter takes the node as the model states it (op, input values, attributes, opset) and builds the
canonical nodes. Ops whose form did not change, or changed only by moving constant attributes to inputs
(the registry's ``lifted`` table undoes that), need no adapter.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np

from ..errors import UnsupportedOpError
from ..ir.graph import Graph, Value
from .canonical import add_canonical_node

#: A legacy form Cuvil does not rewrite: onnx's converter rewrites it into the current one.
UPGRADE_HINT = ("convert the model to a newer opset: onnx.save(onnx.version_converter.convert_version(onnx.load("
                "'MODEL.onnx'), 13), 'MODEL13.onnx'), then compile that")


def canonicalize(g: Graph, op: str, inputs: List[Optional[Value]], attrs: dict, out_names: List[str],
                 where: str, opset: int) -> List[Optional[Value]]:
    if op == "Constant":
        return [g.const(_constant_value(attrs, where, opset), out_names[0] or where)]
    adapter = ADAPTERS.get(op)
    if adapter is not None:
        res = adapter(g, inputs, attrs, out_names, where, opset)
        if res is not None:
            return res
    node = add_canonical_node(g, op, inputs, attrs, out_names, where, opset)
    return list(node.outputs)


def _constant_value(attrs: dict, where: str, opset: int) -> np.ndarray:
    if "value" in attrs:
        return np.asarray(attrs["value"])
    for key, dt in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                    ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dt)
    if "sparse_value" in attrs:
        return np.asarray(attrs["sparse_value"])
    if "value_string" in attrs or "value_strings" in attrs:
        raise UnsupportedOpError("Constant", where, opset, "string constants are not supported")
    raise UnsupportedOpError("Constant", where, opset, "no value attribute")


def _add(g, op, inputs, attrs, out_names, where, opset):
    return list(add_canonical_node(g, op, inputs, attrs, out_names, where, opset).outputs)


def _batchnorm(g, inputs, attrs, out_names, where, opset):
    if opset < 9 and attrs.pop("spatial", 1) != 1:
        raise UnsupportedOpError("BatchNormalization", where, opset, "spatial=0 is not supported", hint=UPGRADE_HINT)
    attrs.pop("is_test", None)
    attrs.pop("consumed_inputs", None)
    if opset < 14 and len(out_names) > 1:
        # Before opset 14 the training outputs could be listed in inference graphs; they are unused there.
        out_names = out_names[:1]
    return _add(g, "BatchNormalization", inputs, attrs, out_names, where, opset) + [None] * 4


def _dropout(g, inputs, attrs, out_names, where, opset):
    attrs.pop("is_test", None)
    if opset < 12 and "ratio" in attrs:
        inputs = [inputs[0], g.const(np.asarray(attrs.pop("ratio"), np.float32), f"{where}_ratio")]
    return _add(g, "Dropout", inputs, attrs, out_names, where, opset)


def _softmax_family(op):
    def adapt(g, inputs, attrs, out_names, where, opset):
        if opset >= 13:
            return None
        x = inputs[0]
        axis = attrs.get("axis", 1)
        if x.shape is None:
            raise UnsupportedOpError(op, where, opset, "pre-13 semantics need the input rank", hint=UPGRADE_HINT)
        rank = len(x.shape)
        axis = axis + rank if axis < 0 else axis
        if axis == rank - 1:
            return _add(g, op, inputs, {"axis": -1}, out_names, where, opset)
        # Before opset 13 the input was coerced to 2-D at `axis` and normalised over the second dim.
        flat = _add(g, "Flatten", [x], {"axis": axis}, [f"{where}_flat"], f"{where}_flat", opset)[0]
        y = _add(g, op, [flat], {"axis": 1}, [f"{where}_2d"], f"{where}_2d", opset)[0]
        shape = _add(g, "Shape", [x], {}, [f"{where}_shape"], f"{where}_shape", opset)[0]
        return _add(g, "Reshape", [y, shape], {}, out_names, where, opset)
    return adapt


def _pad(g, inputs, attrs, out_names, where, opset):
    if opset < 11:
        if "paddings" in attrs:
            attrs["pads"] = attrs.pop("paddings")
        if "value" in attrs:
            attrs["constant_value"] = float(attrs.pop("value"))
    return None if opset >= 11 else _add(g, "Pad", inputs, attrs, out_names, where, opset)


def _upsample(g, inputs, attrs, out_names, where, opset):
    mode = attrs.get("mode", "nearest")
    scales = attrs.get("scales")
    ins = [inputs[0], None, None]
    if scales is None:
        ins[2] = inputs[1]  # opset 9: scales is an input (lifted when constant)
    new = {"mode": "linear" if mode in ("linear", "bilinear") else mode,
           "coordinate_transformation_mode": "asymmetric"}
    if mode == "nearest":
        new["nearest_mode"] = "floor"
    if scales is not None:
        new["scales"] = [float(s) for s in scales]
    return _add(g, "Resize", ins, new, out_names, where, opset)


def _resize(g, inputs, attrs, out_names, where, opset):
    if opset >= 11:
        return None
    # Opset 10: Resize(X, scales) with the asymmetric transform and floor rounding of Upsample.
    return _upsample(g, [inputs[0], inputs[1]], dict(attrs), out_names, where, opset)


def _scatter(g, inputs, attrs, out_names, where, opset):
    return _add(g, "ScatterElements", inputs, attrs, out_names, where, opset)


def _dft(g, inputs, attrs, out_names, where, opset):
    # Before opset 20 the axis was an attribute defaulting to 1 (now an input defaulting to -2).
    if opset < 20:
        attrs.setdefault("axis", 1)
    return None


def _drop_attrs(*names):
    def adapt(g, inputs, attrs, out_names, where, opset):
        for n in names:
            attrs.pop(n, None)
        return None
    return adapt


def _legacy_broadcast(op):
    def adapt(g, inputs, attrs, out_names, where, opset):
        if attrs.pop("broadcast", 0) and "axis" in attrs:
            raise UnsupportedOpError(op, where, opset, "legacy axis broadcasting is not supported", hint=UPGRADE_HINT)
        attrs.pop("axis", None)
        attrs.pop("consumed_inputs", None)
        return None
    return adapt


ADAPTERS: Dict[str, Callable] = {
    "BatchNormalization": _batchnorm,
    "DFT": _dft,
    "Dropout": _dropout,
    "Softmax": _softmax_family("Softmax"),
    "LogSoftmax": _softmax_family("LogSoftmax"),
    "Hardmax": _softmax_family("Hardmax"),
    "Pad": _pad,
    "Upsample": _upsample,
    "Resize": _resize,
    "Scatter": _scatter,
    "Gemm": _drop_attrs("broadcast"),
    "Clip": _drop_attrs("consumed_inputs"),
    "InstanceNormalization": _drop_attrs("consumed_inputs"),
    **{op: _legacy_broadcast(op) for op in ("Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal",
                                            "Less", "Greater", "PRelu")},
}
