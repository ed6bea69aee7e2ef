"""Seed models the ONNX families mutate: the bundled demo CNN and small graphs built with onnx.helper that
between them touch every op family the importer canonicalises (constants to fold, shape arithmetic,
windows, reductions, integer and boolean tensors, a symbolic batch dim)."""
from __future__ import annotations

import functools
from importlib import resources
from typing import List

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

OPSET = 17


def _model(name, nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    g = h.make_graph(nodes, name, inputs, outputs, list(inits))
    m = h.make_model(g, opset_imports=[h.make_opsetid("", OPSET)], producer_name="cuvil-fuzz")
    m.ir_version = 8
    return m


def _vi(name, shape, dt=T.FLOAT):
    return h.make_tensor_value_info(name, dt, shape)


def _init(name, arr):
    return nh.from_array(np.asarray(arr), name)


def _mlp():
    r = np.random.default_rng(1)
    return _model("mlp", [h.make_node("MatMul", ["x", "w1"], ["h"]), h.make_node("Add", ["h", "b1"], ["a"]),
                          h.make_node("Relu", ["a"], ["r"]), h.make_node("Gemm", ["r", "w2", "b2"], ["y"], transB=1)],
                  [_vi("x", ["N", 4])], [_vi("y", ["N", 3])],
                  [_init("w1", r.standard_normal((4, 8)).astype(np.float32)), _init("b1", np.ones(8, np.float32)),
                   _init("w2", r.standard_normal((3, 8)).astype(np.float32)), _init("b2", np.zeros(3, np.float32))])


def _conv():
    r = np.random.default_rng(2)
    return _model("conv", [
        h.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        h.make_node("BatchNormalization", ["c", "s", "beta", "mean", "var"], ["bn"], epsilon=1e-5),
        h.make_node("Relu", ["bn"], ["r"]),
        h.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        h.make_node("GlobalAveragePool", ["p"], ["g"]),
        h.make_node("Flatten", ["g"], ["y"], axis=1)],
        [_vi("x", [1, 2, 6, 6])], [_vi("y", [1, 4])],
        [_init("w", r.standard_normal((4, 2, 3, 3)).astype(np.float32)), _init("b", np.zeros(4, np.float32)),
         _init("s", np.ones(4, np.float32)), _init("beta", np.zeros(4, np.float32)),
         _init("mean", np.zeros(4, np.float32)), _init("var", np.ones(4, np.float32))])


def _shapes():
    return _model("shapes", [
        h.make_node("Shape", ["x"], ["s"]),
        h.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        h.make_node("Concat", ["n", "m1"], ["ns"], axis=0),
        h.make_node("Reshape", ["x", "ns"], ["r"]),
        h.make_node("Transpose", ["r"], ["t"], perm=[1, 0]),
        h.make_node("Slice", ["t", "st", "en", "ax"], ["sl"]),
        h.make_node("Unsqueeze", ["sl", "ax"], ["u"]),
        h.make_node("Squeeze", ["u", "ax"], ["y"])],
        [_vi("x", ["B", 2, 3])], [_vi("y", None)],
        [_init("i0", np.array([0], np.int64)), _init("m1", np.array([-1], np.int64)),
         _init("st", np.array([1], np.int64)), _init("en", np.array([5], np.int64)), _init("ax", np.array([0], np.int64))])


def _folding():
    return _model("fold", [
        h.make_node("Constant", [], ["c"], value=_init("cv", np.arange(6, dtype=np.float32).reshape(2, 3))),
        h.make_node("Mul", ["c", "two"], ["c2"]),
        h.make_node("Sqrt", ["c2"], ["c3"]),
        h.make_node("Add", ["x", "c3"], ["a"]),
        h.make_node("Mul", ["a", "one"], ["m"]),
        h.make_node("Sub", ["m", "zero"], ["y"])],
        [_vi("x", [2, 3])], [_vi("y", [2, 3])],
        [_init("two", np.float32(2.0)), _init("one", np.float32(1.0)), _init("zero", np.float32(0.0))])


def _reduce():
    return _model("reduce", [
        h.make_node("Softmax", ["x"], ["s"], axis=-1),
        h.make_node("ReduceSum", ["s", "axes"], ["r"], keepdims=1),
        h.make_node("Div", ["s", "r"], ["d"]),
        h.make_node("ReduceMax", ["d"], ["y"], axes=[1], keepdims=0)],
        [_vi("x", [2, 5])], [_vi("y", [2])], [_init("axes", np.array([1], np.int64))])


def _ints():
    return _model("ints", [
        h.make_node("Cast", ["x"], ["xi"], to=T.INT32),
        h.make_node("Greater", ["xi", "k"], ["g"]),
        h.make_node("Where", ["g", "xi", "k"], ["w"]),
        h.make_node("Cast", ["w"], ["wf"], to=T.FLOAT),
        h.make_node("Neg", ["wf"], ["y"])],
        [_vi("x", [3, 4])], [_vi("y", [3, 4])], [_init("k", np.array(1, np.int32))])


def _elementwise():
    return _model("elementwise", [
        h.make_node("Abs", ["x"], ["a"]), h.make_node("Relu", ["a"], ["r"]), h.make_node("Relu", ["r"], ["r2"]),
        h.make_node("Sigmoid", ["r2"], ["s"]), h.make_node("Mul", ["s", "x"], ["m"]), h.make_node("Tanh", ["m"], ["t"]),
        h.make_node("Clip", ["t", "lo", "hi"], ["c"]), h.make_node("Exp", ["c"], ["e"]),
        h.make_node("Max", ["e", "x"], ["y"])],
        [_vi("x", [4, 3])], [_vi("y", [4, 3])], [_init("lo", np.float32(-0.5)), _init("hi", np.float32(0.5))])


def _demo():
    data = resources.files("cuvil.data").joinpath("demo_cnn.onnx").read_bytes()
    return onnx.load_from_string(data)


@functools.lru_cache(maxsize=None)
def seed_models() -> List[bytes]:
    """The serialized seed models (cached: every case copies from these)."""
    return [m.SerializeToString() for m in (_demo(), _mlp(), _conv(), _shapes(), _folding(), _reduce(), _ints(),
                                             _elementwise())]


def seed_model(rng: np.random.Generator) -> onnx.ModelProto:
    return onnx.load_from_string(seed_models()[int(rng.integers(len(seed_models())))])
