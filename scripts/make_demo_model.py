"""Builds src/cuvil/data/demo_cnn.onnx: a small CNN with a symbolic batch, BatchNorm, Dropout and Softmax,
old-style (opset 11) so import canonicalisation and folding have work to do. Run from the repo root."""
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

rng = np.random.default_rng(7)
inits = []


def w(name, *shape, scale=None, positive=False):
    arr = rng.uniform(0.5, 1.5, shape) if positive else rng.normal(0, scale or np.sqrt(2 / np.prod(shape[1:] or (1,))), shape)
    inits.append(numpy_helper.from_array(arr.astype(np.float32), name))
    return name


nodes = []
x = "image"
for i, (cin, cout) in enumerate(((3, 8), (8, 16))):
    nodes += [
        helper.make_node("Conv", [x, w(f"c{i}_w", cout, cin, 3, 3), w(f"c{i}_b", cout, scale=0.1)], [f"c{i}"],
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1], name=f"conv{i}"),
        helper.make_node("BatchNormalization", [f"c{i}", w(f"bn{i}_s", cout, positive=True), w(f"bn{i}_b", cout, scale=0.1),
                                                w(f"bn{i}_m", cout, scale=0.1), w(f"bn{i}_v", cout, positive=True)],
                         [f"bn{i}"], epsilon=1e-5, name=f"bn{i}"),
        helper.make_node("Relu", [f"bn{i}"], [f"r{i}"], name=f"relu{i}"),
        helper.make_node("MaxPool", [f"r{i}"], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2], name=f"pool{i}"),
    ]
    x = f"p{i}"
nodes += [
    helper.make_node("GlobalAveragePool", [x], ["gap"], name="gap"),
    # A shape computation a dynamic-batch exporter would write: reshape to [N, -1] from Shape(x)[0].
    helper.make_node("Shape", ["gap"], ["gap_shape"], name="shape"),
    helper.make_node("Gather", ["gap_shape", "zero"], ["batch"], axis=0, name="batch"),
    helper.make_node("Unsqueeze", ["batch"], ["batch1"], axes=[0], name="batch1"),
    helper.make_node("Concat", ["batch1", "minus_one"], ["flat_shape"], axis=0, name="flat_shape"),
    helper.make_node("Reshape", ["gap", "flat_shape"], ["flat"], name="flatten"),
    helper.make_node("Gemm", ["flat", w("fc_w", 10, 16), w("fc_b", 10, scale=0.1)], ["logits"], transB=1, name="fc"),
    helper.make_node("Dropout", ["logits"], ["drop"], name="dropout"),
    helper.make_node("Identity", ["drop"], ["ident"], name="identity"),
    helper.make_node("Softmax", ["ident"], ["probs"], axis=1, name="softmax"),
]
inits += [numpy_helper.from_array(np.array(0, np.int64), "zero"),
          numpy_helper.from_array(np.array([-1], np.int64), "minus_one")]
graph = helper.make_graph(nodes, "demo_cnn", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["N", 10])], inits)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)], producer_name="cuvil-demo")
model.ir_version = 6
onnx.checker.check_model(model, full_check=True)
onnx.save(model, "src/cuvil/data/demo_cnn.onnx")
print("wrote src/cuvil/data/demo_cnn.onnx")
