"""BatchNormalization's training form (batch statistics, running statistics updated with momentum), compiled
for x86 and run against onnx's reference at several shapes, including a batch of one and a 2-D input."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from cuvil.onnx_backend import prepare


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 4, 7), (5, 2), (3, 1, 2, 2, 2)])
@pytest.mark.parametrize("momentum", [0.9, 0.25])
def test_training_mode_matches_reference(shape, momentum):
    c = shape[1]
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"], training_mode=1,
                            momentum=momentum, epsilon=1e-3)
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))] + \
          [helper.make_tensor_value_info(n, TensorProto.FLOAT, [c]) for n in "sbmv"]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))] + \
           [helper.make_tensor_value_info(n, TensorProto.FLOAT, [c]) for n in ("rm", "rv")]
    m = helper.make_model(helper.make_graph([node], "bn", ins, outs), opset_imports=[helper.make_opsetid("", 15)])
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal(shape).astype(np.float32) * 3 + 1] + \
            [rng.standard_normal(c).astype(np.float32) for _ in range(3)] + [rng.random(c).astype(np.float32) + 0.5]
    want = ReferenceEvaluator(m).run(None, dict(zip(["x", "s", "b", "m", "v"], feeds)))
    got = prepare(m, opt_level=1).run(feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
