"""Real architectures for tests and benchmarks: the onnx package's ``backend/test/data/light`` models.

Their weights are made by ``ConstantOfShape`` (every weight 0.02); :func:`light_model` replaces them by
seeded random ones scaled so activations stay in range through deep networks, and can cut the final
Softmax so comparisons look at logits (with random weights a Softmax output is nearly one-hot).

Beside them, small seeded models the tests share: :func:`small_cnn`, :func:`symbolic_batch_cnn` and
:func:`transformer_block` (symbolic dims, with the shape profiles the dynamic-shape tests compile them for).
"""
from __future__ import annotations

import os
from typing import Dict, List

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

LIGHT_MODELS = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet",
                "squeezenet", "vgg19", "zfnet512")


def light_model_path(name: str) -> str:
    if name not in LIGHT_MODELS:
        raise ValueError(f"unknown light model {name!r}; choose from {', '.join(LIGHT_MODELS)}")
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", f"light_{name}.onnx")


def light_model(name: str, seed: int = 0, logits: bool = True, bn_scale=(0.5, 1.5)) -> onnx.ModelProto:
    """The light model ``name`` with seeded random weights; ``logits`` drops a final Softmax. ``bn_scale``:
    the range of the BatchNormalization scales (uniform). With the default, ResNet-50's and ShuffleNet's
    activations grow through the residual / channel-shuffle stages to 2.4e5 / 1.6e7, past float16's 65,504;
    ``(0.25, 0.75)`` keeps them below 20 / 120 (for float16 runs)."""
    m = with_random_weights(onnx.load(light_model_path(name)), seed, bn_scale=bn_scale)
    return strip_final_softmax(m) if logits else m


def _consumers(g: onnx.GraphProto) -> Dict[str, List[tuple]]:
    uses: Dict[str, List[tuple]] = {}
    for n in g.node:
        for k, i in enumerate(n.input):
            uses.setdefault(i, []).append((n, k))
    return uses


def _attr(n: onnx.NodeProto, name: str, default):
    for a in n.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def with_random_weights(model: onnx.ModelProto, seed: int = 0, bn_scale=(0.5, 1.5)) -> onnx.ModelProto:
    """Replace each ``ConstantOfShape`` of a constant shape by a random initializer of that shape
    (``bn_scale``: the uniform range of BatchNormalization scales)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    rng = np.random.default_rng(seed)
    inits = {t.name: t for t in g.initializer}
    uses = _consumers(g)
    keep, new_inits = [], []
    for n in g.node:
        if n.op_type != "ConstantOfShape" or n.input[0] not in inits:
            keep.append(n)
            continue
        shape = tuple(int(x) for x in numpy_helper.to_array(inits[n.input[0]]))
        arr = _random_weight(rng, shape, uses.get(n.output[0], []), bn_scale)
        new_inits.append(numpy_helper.from_array(arr.astype(np.float32, copy=False), n.output[0]))
    del g.node[:]
    g.node.extend(keep)
    used = {i for n in keep for i in n.input} | {o.name for o in g.output}
    survivors = [t for t in g.initializer if t.name in used] + new_inits
    del g.initializer[:]
    g.initializer.extend(survivors)
    init_names = {t.name for t in g.initializer}
    real_inputs = [vi for vi in g.input if vi.name not in init_names and vi.name in used]
    del g.input[:]
    g.input.extend(real_inputs)
    m.ir_version = max(m.ir_version, 4)  # initializers that are not inputs need IR version 4
    return m


def _random_weight(rng, shape, uses, bn_scale=(0.5, 1.5)) -> np.ndarray:
    """float32 directly (VGG-19 has 143M weights): normal(0, std) or uniform(lo, hi) by role."""
    op, k = (uses[0][0].op_type, uses[0][1]) if uses else ("", -1)

    def normal(std):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def uniform(lo, hi):
        return rng.random(shape, dtype=np.float32) * np.float32(hi - lo) + np.float32(lo)
    if op == "BatchNormalization":
        # scale (bn_scale) and variance positive around 1; bias and mean small
        return uniform(*bn_scale) if k == 1 else uniform(0.5, 1.5) if k == 4 else normal(0.1)
    if op in ("Conv", "ConvTranspose") and k == 1:
        fan_in = int(np.prod(shape[1:])) or 1
        return normal(np.sqrt(2.0 / fan_in))
    if op == "Gemm" and k == 1:
        fan_in = shape[1] if _attr(uses[0][0], "transB", 0) else shape[0]
        return normal(np.sqrt(2.0 / fan_in))
    if op == "Mul":
        return uniform(0.5, 1.5)
    return normal(0.05)


def with_batch(model: onnx.ModelProto, n: int) -> onnx.ModelProto:
    """``model`` with batch ``n``: dim 0 of every graph input and output set to ``n``, and a constant
    ``Reshape`` target whose first entry is the batch (the light models flatten ``[1, C, 1, 1]`` to ``[1, C]``)
    made to copy it (``0``). For models whose only batch-dependent constants are such reshapes."""
    if n < 1:
        raise ValueError(f"batch must be >= 1, got {n}")
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    for node in g.node:
        if node.op_type == "Reshape" and len(node.input) > 1 and node.input[1] in inits:
            shape = numpy_helper.to_array(inits[node.input[1]]).copy()
            if shape.size and shape[0] == 1:
                shape[0] = 0
                inits[node.input[1]].CopyFrom(numpy_helper.from_array(shape, node.input[1]))
    for vi in list(g.input) + list(g.output):
        dims = vi.type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_value = n
    return m


def strip_final_softmax(model: onnx.ModelProto) -> onnx.ModelProto:
    """Make each graph output that a Softmax produces the Softmax's input instead."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    producers = {o: n for n in g.node for o in n.output}
    for out in g.output:
        n = producers.get(out.name)
        if n is not None and n.op_type == "Softmax" and len(_consumers(g).get(out.name, [])) == 0:
            src = n.input[0]
            g.node.remove(n)
            out.name = src
    return m


def small_cnn() -> onnx.ModelProto:
    """A seeded four-node CNN (Conv -> Relu -> Add(bias) -> Softmax, input [2, 3, 10, 10]): small enough to
    compile in well under a second, enough to exercise a fused convolution stage and a row reduction."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 10, 10])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 10, 10])
    w = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal((8, 1, 1)).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Add", ["r", "b"], ["a"]),
             helper.make_node("Softmax", ["a"], ["y"], axis=1)]
    g = helper.make_graph(nodes, "small", [x], [y], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def symbolic_batch_cnn(batch="N", seed: int = 0) -> onnx.ModelProto:
    """Conv/Relu/MaxPool/Conv stride 2/GlobalAveragePool/Flatten/Gemm/Softmax on x[batch, 3, 16, 16] -> y[batch, 10]."""
    rng = np.random.default_rng(seed)
    init = lambda name, shape: numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 16, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10])
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Conv", ["p", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
             helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("Gemm", ["f", "fw", "fb"], ["z"], transB=1),
             helper.make_node("Softmax", ["z"], ["y"], axis=1)]
    inits = [init("w", (8, 3, 3, 3)), init("b", (8,)), init("w2", (16, 8, 3, 3)), init("fw", (10, 16)), init("fb", (10,))]
    g = helper.make_graph(nodes, "dyncnn", [x], [y], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


#: The shape profiles (min, opt, max of each symbol) the dynamic-shape tests compile these models for.
SYMBOLIC_CNN_PROFILE = {"N": (1, 4, 16)}
TRANSFORMER_PROFILE = {"B": (1, 2, 8), "S": (1, 16, 64)}


def transformer_block(d_model: int = 32, heads: int = 4, d_ff: int = 64, batch="B", seq="S",
                      seed: int = 0) -> onnx.ModelProto:
    """A seeded pre-norm transformer encoder block over ``x[batch, seq, d_model]`` (symbolic dims by
    default): LayerNormalization, Q/K/V projections (MatMul + bias), heads split by Reshape([0, 0, H, Dh])
    and Transpose, scaled dot-product attention with Softmax, heads merged back, output projection and
    residual, then LayerNormalization, a GELU (Erf form) feed-forward layer and a second residual. Opset 17."""
    rng = np.random.default_rng(seed)
    dh = d_model // heads
    inits = []

    def weight(name, shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[0])
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def const(name, values, dtype=np.float32):
        inits.append(numpy_helper.from_array(np.asarray(values, dtype=dtype), name))
        return name

    nodes = []

    def node(op, ins, out, **attrs):
        nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    def dense(x, name, d_in, d_out):
        y = node("MatMul", [x, weight(f"{name}_w", (d_in, d_out))], f"{name}_mm")
        return node("Add", [y, weight(f"{name}_b", (d_out,), 0.1)], name)

    def layer_norm(x, name):
        return node("LayerNormalization", [x, const(f"{name}_g", 1 + 0.1 * rng.standard_normal(d_model)),
                                           const(f"{name}_beta", 0.1 * rng.standard_normal(d_model))], name, axis=-1)

    split = const("heads_shape", [0, 0, heads, dh], np.int64)
    merge = const("model_shape", [0, 0, d_model], np.int64)
    h = layer_norm("x", "ln1")
    q, k, v = (node("Reshape", [dense(h, n, d_model, d_model), split], f"{n}_heads") for n in ("q", "k", "v"))
    q = node("Transpose", [q], "q_t", perm=[0, 2, 1, 3])          # [B, H, S, Dh]
    k = node("Transpose", [k], "k_t", perm=[0, 2, 3, 1])          # [B, H, Dh, S]
    v = node("Transpose", [v], "v_t", perm=[0, 2, 1, 3])
    scores = node("Mul", [node("MatMul", [q, k], "qk"), const("scale", 1.0 / np.sqrt(dh))], "scores")
    attn = node("Softmax", [scores], "attn", axis=-1)             # [B, H, S, S]
    ctx = node("Transpose", [node("MatMul", [attn, v], "ctx_h")], "ctx_t", perm=[0, 2, 1, 3])
    ctx = node("Reshape", [ctx, merge], "ctx")
    x1 = node("Add", ["x", dense(ctx, "proj", d_model, d_model)], "res1")
    f = dense(layer_norm(x1, "ln2"), "ff1", d_model, d_ff)
    gelu = node("Mul", [node("Mul", [f, const("half", 0.5)], "ff_half"),
                        node("Add", [node("Erf", [node("Mul", [f, const("inv_sqrt2", 1 / np.sqrt(2))], "ff_s")],
                                          "ff_erf"), const("one", 1.0)], "ff_1p")], "gelu")
    node("Add", [x1, dense(gelu, "ff2", d_ff, d_model)], "y")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, seq, d_model])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, seq, d_model])
    g = helper.make_graph(nodes, "transformer_block", [x], [y], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
