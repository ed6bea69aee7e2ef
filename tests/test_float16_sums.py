"""float16 sums on x86 accumulate in float32, each product of two float16 values formed exactly in float32
(LLVMEmitter.wide_term): a float16 MatMul equals numpy's bit for bit (numpy accumulates float16 products in
float32), in the plain reduction and in the row schedule, and long float16 sums do not drift."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from cuvil.onnx_backend import prepare


@pytest.mark.parametrize("sa,sb", [((2, 3, 4, 8), (2, 3, 8, 6)), ((5, 300), (300, 7)), ((1, 64, 33), (33, 40))])
def test_float16_matmul_matches_numpy_bit_for_bit(sa, sb):
    g = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "mm",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT16, list(sa)),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT16, list(sb))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(sa) * 2).astype(np.float16)
    b = (rng.standard_normal(sb) * 2).astype(np.float16)
    (y,) = prepare(m, opt_level=1).run([a, b])
    np.testing.assert_array_equal(y, np.matmul(a, b))


def test_long_float16_sum_does_not_drift():
    x = np.full((4, 4096), 0.1, np.float16)    # a float16 accumulator stalls at 256 (0.1 is below half an ulp)
    g = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], "rs",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [4, 4096])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)],
                          initializer=[helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    g.node[0].input.append("axes")
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    (y,) = prepare(m, opt_level=1).run([x])
    np.testing.assert_allclose(y.astype(np.float64), x.astype(np.float64).sum(1), rtol=1e-3)
