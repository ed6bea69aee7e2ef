"""Writes the golden test inputs tests/golden/models/*.onnx (small, seeded). Run from the repo root:
python3 tests/golden/make_models.py"""
import os

import numpy as np
from onnx import TensorProto, helper, numpy_helper, save

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
rng = np.random.default_rng(0)


def arr(name, *shape, positive=False):
    a = rng.uniform(0.5, 1.5, shape) if positive else rng.normal(0, 1, shape)
    return numpy_helper.from_array(a.astype(np.float32), name)


def model(name, nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="cuvil-golden")
    m.ir_version = 8
    save(m, os.path.join(HERE, f"{name}.onnx"))


F = TensorProto.FLOAT
x4 = helper.make_tensor_value_info("x", F, ["N", 3, 8, 8])

model("conv_bn_relu", [
    helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
    helper.make_node("BatchNormalization", ["c", "s", "beta", "mean", "var"], ["bn"]),
    helper.make_node("Relu", ["bn"], ["y"])],
    [x4], [helper.make_tensor_value_info("y", F, ["N", 4, 8, 8])],
    [arr("w", 4, 3, 3, 3), arr("b", 4), arr("s", 4, positive=True), arr("beta", 4), arr("mean", 4),
     arr("var", 4, positive=True)])

model("transpose_pair_dropout", [
    helper.make_node("Transpose", ["x"], ["t1"], perm=[0, 2, 3, 1]),
    helper.make_node("Transpose", ["t1"], ["t2"], perm=[0, 3, 1, 2]),
    helper.make_node("Dropout", ["t2"], ["d"]),
    helper.make_node("Identity", ["d"], ["i"]),
    helper.make_node("Relu", ["i"], ["r"]),
    helper.make_node("Relu", ["r"], ["y"])],
    [x4], [helper.make_tensor_value_info("y", F, ["N", 3, 8, 8])])

model("matmul_add_gemm", [
    helper.make_node("MatMul", ["a", "w"], ["m"]),
    helper.make_node("Add", ["m", "bias"], ["y"])],
    [helper.make_tensor_value_info("a", F, ["B", 16])], [helper.make_tensor_value_info("y", F, ["B", 8])],
    [arr("w", 16, 8), arr("bias", 8)])

model("symbolic_flatten", [
    helper.make_node("Shape", ["x"], ["s"]),
    helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
    helper.make_node("Unsqueeze", ["n", "ax"], ["n1"]),
    helper.make_node("Concat", ["n1", "m1"], ["shape"], axis=0),
    helper.make_node("Reshape", ["x", "shape"], ["y"])],
    [x4], [helper.make_tensor_value_info("y", F, ["N", 192])],
    [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array([0], np.int64), "ax"),
     numpy_helper.from_array(np.array([-1], np.int64), "m1")])

model("legacy_softmax_opset11", [helper.make_node("Softmax", ["x"], ["y"], axis=1)],
      [helper.make_tensor_value_info("x", F, [2, 3, 4])], [helper.make_tensor_value_info("y", F, [2, 3, 4])], opset=11)

model("algebra_identities", [
    helper.make_node("Mul", ["x", "one"], ["a"]),
    helper.make_node("Sub", ["a", "zero"], ["b"]),
    helper.make_node("Neg", ["b"], ["c"]),
    helper.make_node("Neg", ["c"], ["d"]),
    helper.make_node("Add", ["d", "zero"], ["y"])],     # x + 0 stays: not exact at x = -0.0
    [helper.make_tensor_value_info("x", F, ["N", 4])], [helper.make_tensor_value_info("y", F, ["N", 4])],
    [numpy_helper.from_array(np.ones(4, np.float32), "one"), numpy_helper.from_array(np.zeros(4, np.float32), "zero")])
print("wrote", sorted(os.listdir(HERE)))
