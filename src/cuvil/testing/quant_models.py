"""Quantized models for the int8 tests and benchmarks: QDQ models written by onnxruntime's quantizer
(:func:`qdq_model`, ``quantize_static`` with per-channel weights, needs onnxruntime) from float models
(:func:`qdq_cnn_float`, :func:`matmul_block_float`, or any other such as ``light_model("resnet50")``), and
single integer ops built with ``onnx.helper`` (:func:`qlinear_conv_model`, :func:`qlinear_matmul_model`,
:func:`conv_integer_model`, :func:`matmul_integer_model`): seeded weights, zero points and scales.
"""
from __future__ import annotations

import os
import tempfile
from typing import Dict, Iterable, List, Optional, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_NP = {TensorProto.UINT8: np.uint8, TensorProto.INT8: np.int8}


def random_feeds(model: onnx.ModelProto, seed: int = 0, n: int = 1) -> List[Dict[str, np.ndarray]]:
    """``n`` seeded standard-normal float32 inputs for a model whose inputs have static shapes."""
    rng = np.random.default_rng(seed)
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input}
    return [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(n)]


def qdq_model(model: onnx.ModelProto, calibration: Optional[Iterable[Dict[str, np.ndarray]]] = None, *,
              per_channel: bool = True, activations: str = "uint8", seed: int = 0,
              calibration_count: int = 8) -> onnx.ModelProto:
    """``model`` quantized by onnxruntime's ``quantize_static`` in QDQ format: int8 weights (per output channel
    unless ``per_channel=False``), ``activations`` uint8 (onnxruntime's default) or int8, calibrated on
    ``calibration`` (feeds) or ``calibration_count`` seeded random inputs (:func:`random_feeds`). A model of
    opset < 13 is converted to 13 first (per-channel DequantizeLinear needs it)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    feeds = list(calibration) if calibration is not None else random_feeds(model, seed, calibration_count)
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=0)
    if opset < 13:   # per-channel DequantizeLinear (its axis) needs opset 13
        from onnx import version_converter
        model = version_converter.convert_version(model, 13)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self._it = iter(feeds)

        def get_next(self):
            return next(self._it, None)

    act = {"uint8": QuantType.QUInt8, "int8": QuantType.QInt8}[activations]
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "f.onnx"), os.path.join(d, "q.onnx")
        onnx.save(model, src)
        quantize_static(src, dst, Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                        activation_type=act, weight_type=QuantType.QInt8)
        return onnx.load(dst)


def _conv(rng, name: str, x: str, cin: int, cout: int, k: int, stride: int = 1, relu: bool = True, group: int = 1):
    w = numpy_helper.from_array((rng.standard_normal((cout, cin // group, k, k)) / np.sqrt(cin // group * k * k))
                                .astype(np.float32), name + "_w")
    b = numpy_helper.from_array((0.1 * rng.standard_normal(cout)).astype(np.float32), name + "_b")
    out = name + "_c" if relu else name
    ns = [helper.make_node("Conv", [x, name + "_w", name + "_b"], [out], pads=[k // 2] * 4, strides=[stride] * 2,
                           kernel_shape=[k, k], group=group)]
    if relu:
        ns.append(helper.make_node("Relu", [out], [name]))
    return ns, [w, b]


def qdq_cnn_float(seed: int = 0, hw: Sequence[int] = (15, 13)) -> onnx.ModelProto:
    """A small float CNN for quantization: Conv 3x3 (3 -> 16) / Relu, Conv 3x3 stride 2 (16 -> 24) / Relu,
    Conv 1x1 (24 -> 20) / Relu, a residual Add, MaxPool, Conv 3x3 without Relu, GlobalAveragePool, Flatten,
    Gemm (20 -> 10), on x[1, 3, H, W] (odd sizes by default)."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    for ns, ii in (_conv(rng, "c1", "x", 3, 16, 3), _conv(rng, "c2", "c1", 16, 24, 3, 2),
                   _conv(rng, "c3", "c2", 24, 20, 1), _conv(rng, "c4", "c3", 20, 20, 3)):
        nodes += ns
        inits += ii
    nodes += [helper.make_node("Add", ["c4", "c3"], ["r"]), helper.make_node("Relu", ["r"], ["rr"]),
              helper.make_node("MaxPool", ["rr"], ["mp"], kernel_shape=[2, 2], strides=[1, 1])]
    ns, ii = _conv(rng, "c5", "mp", 20, 20, 3, relu=False)
    nodes += ns
    inits += ii
    nodes += [helper.make_node("GlobalAveragePool", ["c5"], ["g"]), helper.make_node("Flatten", ["g"], ["f"])]
    inits += [numpy_helper.from_array((rng.standard_normal((20, 10)) / 4).astype(np.float32), "fc_w"),
              numpy_helper.from_array((0.1 * rng.standard_normal(10)).astype(np.float32), "fc_b")]
    nodes.append(helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["y"]))
    g = helper.make_graph(nodes, "qdq_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, *hw])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def matmul_block_float(seq: int = 13, d: int = 48, ff: int = 72, seed: int = 0) -> onnx.ModelProto:
    """A BERT-like feed-forward block for quantization: ``x[1, seq, d] @ W1 + b1 -> Relu -> @ W2 + b2``."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((d, ff)) / np.sqrt(d)).astype(np.float32), "w1"),
             numpy_helper.from_array((0.1 * rng.standard_normal(ff)).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((ff, d)) / np.sqrt(ff)).astype(np.float32), "w2"),
             numpy_helper.from_array((0.1 * rng.standard_normal(d)).astype(np.float32), "b2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["hr"]), helper.make_node("MatMul", ["hr", "w2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["y"])]
    g = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, seq, d])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _q(rng, shape, dt) -> np.ndarray:
    info = np.iinfo(_NP[dt])
    return rng.integers(info.min, info.max + 1, size=shape).astype(_NP[dt])


def _zp(rng, dt, n=None) -> np.ndarray:
    lo, hi = (100, 156) if dt == TensorProto.UINT8 else (-20, 20)
    return rng.integers(lo, hi, size=n if n else ()).astype(_NP[dt])


def qlinear_conv_model(x_shape, w_shape, *, x_type=TensorProto.UINT8, w_type=TensorProto.INT8, per_channel=True,
                       bias=True, strides=(1, 1), pads=(1, 1, 1, 1), group=1, dilations=(1, 1), seed=0):
    """QLinearConv on ``x`` (an input of ``x_type``) with constant weights, scales, non-zero zero points and an
    int32 bias; output of ``x_type``."""
    rng = np.random.default_rng(seed)
    m = w_shape[0]
    k = int(np.prod(w_shape[1:]))
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "xs"),
             numpy_helper.from_array(_zp(rng, x_type), "xzp"),
             numpy_helper.from_array(_q(rng, w_shape, w_type), "w"),
             numpy_helper.from_array(((rng.uniform(0.5, 1.5, m) if per_channel else np.array(1.0)) * 0.01)
                                     .astype(np.float32), "ws"),
             numpy_helper.from_array(_zp(rng, w_type, m if per_channel else None) if w_type == TensorProto.UINT8
                                     else np.zeros(m if per_channel else (), np.int8), "wzp"),
             # y scale: +-3 standard deviations of the sums span the output's 256 steps (little saturation)
             numpy_helper.from_array(np.array(0.025 * np.sqrt(k), np.float32), "ys"),
             numpy_helper.from_array(_zp(rng, x_type), "yzp")]
    ins = ["x", "xs", "xzp", "w", "ws", "wzp", "ys", "yzp"]
    if bias:
        inits.append(numpy_helper.from_array(rng.integers(-5000, 5000, m).astype(np.int32), "b"))
        ins.append("b")
    node = helper.make_node("QLinearConv", ins, ["y"], strides=list(strides), pads=list(pads), group=group,
                            dilations=list(dilations), kernel_shape=list(w_shape[2:]))
    g = helper.make_graph([node], "qlinear_conv", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
                          [helper.make_tensor_value_info("y", x_type, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def qlinear_matmul_model(a_shape, b_shape, *, a_type=TensorProto.UINT8, b_type=TensorProto.INT8, seed=0):
    """QLinearMatMul of an input ``a`` and a constant ``b`` (per-tensor scales, non-zero zero points)."""
    rng = np.random.default_rng(seed)
    k = a_shape[-1]
    inits = [numpy_helper.from_array(np.array(0.03, np.float32), "as"),
             numpy_helper.from_array(_zp(rng, a_type), "azp"),
             numpy_helper.from_array(_q(rng, b_shape, b_type), "b"),
             numpy_helper.from_array(np.array(0.01, np.float32), "bs"),
             numpy_helper.from_array(_zp(rng, b_type), "bzp"),
             numpy_helper.from_array(np.array(0.037 * np.sqrt(k), np.float32), "ys"),
             numpy_helper.from_array(_zp(rng, a_type), "yzp")]
    node = helper.make_node("QLinearMatMul", ["a", "as", "azp", "b", "bs", "bzp", "ys", "yzp"], ["y"])
    g = helper.make_graph([node], "qlinear_matmul", [helper.make_tensor_value_info("a", a_type, list(a_shape))],
                          [helper.make_tensor_value_info("y", a_type, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def matmul_integer_model(a_shape, b_shape, *, a_type=TensorProto.UINT8, b_type=TensorProto.INT8, seed=0):
    """MatMulInteger (int32 output) of an input ``a`` and a constant ``b``, non-zero zero points."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(_q(rng, b_shape, b_type), "b"),
             numpy_helper.from_array(_zp(rng, a_type), "azp"),
             numpy_helper.from_array(_zp(rng, b_type), "bzp")]
    node = helper.make_node("MatMulInteger", ["a", "b", "azp", "bzp"], ["y"])
    g = helper.make_graph([node], "matmul_integer", [helper.make_tensor_value_info("a", a_type, list(a_shape))],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def conv_integer_model(x_shape, w_shape, *, x_type=TensorProto.UINT8, w_type=TensorProto.UINT8, pads=(1, 1, 1, 1),
                       strides=(1, 1), seed=0):
    """ConvInteger (int32 output) of an input ``x`` and constant weights, non-zero zero points."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(_q(rng, w_shape, w_type), "w"),
             numpy_helper.from_array(_zp(rng, x_type), "xzp"),
             numpy_helper.from_array(_zp(rng, w_type), "wzp")]
    node = helper.make_node("ConvInteger", ["x", "w", "xzp", "wzp"], ["y"], pads=list(pads), strides=list(strides),
                            kernel_shape=list(w_shape[2:]))
    g = helper.make_graph([node], "conv_integer", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
                          [helper.make_tensor_value_info("y", TensorProto.INT32, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def quantized_feeds(model: onnx.ModelProto, seed: int = 0) -> Dict[str, np.ndarray]:
    """Seeded inputs over the full range of each integer (or float32) input of ``model``."""
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        t = vi.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        out[vi.name] = _q(rng, shape, t.elem_type) if t.elem_type in _NP else \
            rng.standard_normal(shape).astype(np.float32)
    return out


def output_step(model: onnx.ModelProto, index: int = 0) -> float:
    """One quantization step of a QDQ model's output: the scale of the DequantizeLinear that produces it."""
    out = model.graph.output[index].name
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    node = next(n for n in model.graph.node if out in n.output)
    if node.op_type != "DequantizeLinear":
        raise ValueError(f"output {out} is made by {node.op_type}, not a DequantizeLinear")
    return float(inits[node.input[1]])
