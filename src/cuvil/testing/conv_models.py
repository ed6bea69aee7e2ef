"""Single-convolution models that the kernel tests sweep over geometries: seeded weights, opset 17.

One builder per family of tests, each keeping the exact models (names, seeds, scales) those tests were
written against: :func:`conv_relu_model` (the GPU convolution tests), :func:`conv_epilogue_model` (the x86
GEMM micro-kernels and their fused epilogues), :func:`winograd_conv_model` (Winograd F(2x2)/F(4x4)).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

#: Tolerance (normwise) of Winograd against a direct convolution: Winograd reassociates and scales sums
#: (F(4x4) multiplies by up to 8 and divides by 24), so results are not the direct convolution's rounding;
#: measured normwise errors are 1e-6 to 4e-6 for F(4x4) and below 1e-6 for F(2x2) (bench/winograd_layers.py).
WINOGRAD_TOL = 2e-5


def conv_relu_model(x_shape, w_shape, pads=(1, 1, 1, 1), strides=(1, 1), group=1, relu=True, dilations=None):
    """Conv (seeded weights and bias) -> Relu (``relu=False``: the Conv alone) on ``x[x_shape]``."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = numpy_helper.from_array((rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(w_shape[0]).astype(np.float32), "b")
    extra = {"dilations": list(dilations)} if dilations else {}
    nodes_ = [helper.make_node("Conv", ["x", "w", "b"], ["c" if relu else "y"], pads=list(pads), strides=list(strides),
                               group=group, kernel_shape=list(w_shape[2:]), **extra)]
    if relu:
        nodes_.append(helper.make_node("Relu", ["c"], ["y"]))
    return helper.make_model(helper.make_graph(nodes_, "conv", [x], [y], [w, b]), opset_imports=[helper.make_opsetid("", 17)])


def conv_epilogue_model(x_shape, w_shape, *, strides=None, pads=None, dilations=None, group=1, bias=True,
                        epilogue="relu", seed=0):
    """Conv on ``x[x_shape]`` with a fused epilogue: ``"relu"``, ``"residual"`` (a second Conv added, then
    Relu), ``"sigmoid"``, or None (the Conv alone)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(w_shape[0]).astype(np.float32), "b"))
        ins.append("b")
    attrs = {"kernel_shape": list(w_shape[2:]), "group": group}
    if strides:
        attrs["strides"] = strides
    if pads:
        attrs["pads"] = pads
    if dilations:
        attrs["dilations"] = dilations
    nodes = [helper.make_node("Conv", ins, ["y"], name="conv", **attrs)]
    out = "y"
    if epilogue in ("relu", "residual"):
        if epilogue == "residual":   # a second convolution with other weights (CSE would merge a copy)
            inits.append(numpy_helper.from_array(-w, "w2"))
            nodes.append(helper.make_node("Conv", ["x", "w2"] + ins[2:], ["y2"], name="conv2", **attrs))
            nodes.append(helper.make_node("Add", ["y", "y2"], ["s"]))
            out = "s"
        nodes.append(helper.make_node("Relu", [out], ["r"]))
        out = "r"
    elif epilogue == "sigmoid":      # exp: not a vector-epilogue op, so the tile is spilled first
        nodes.append(helper.make_node("Sigmoid", [out], ["r"]))
        out = "r"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def winograd_conv_model(c, k, h, w, pads, bias=True, residual=False, batch=1):
    """A 3x3 Conv ``c`` -> ``k`` channels on ``x[batch, c, h, w]`` -> Relu (``residual``: + an input ``r``
    first), weights seeded by the geometry: a Winograd candidate."""
    rng = np.random.default_rng(c * 1000 + k * 10 + h)
    inits = [numpy_helper.from_array((rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32), "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(k).astype(np.float32) * 0.1, "b"))
        ins.append("b")
    nodes = [helper.make_node("Conv", ins, ["c"], pads=pads, kernel_shape=[3, 3])]
    oh, ow = h + pads[0] + pads[2] - 2, w + pads[1] + pads[3] - 2
    inputs = [helper.make_tensor_value_info("x", 1, [batch, c, h, w])]
    if residual:
        inputs.append(helper.make_tensor_value_info("r", 1, [batch, k, oh, ow]))
        nodes.append(helper.make_node("Add", ["c", "r"], ["s"]))
        nodes.append(helper.make_node("Relu", ["s"], ["y"]))
    else:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", 1, [batch, k, oh, ow])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m
