"""Small hand-built graphs that reproduce, one cause each, what went wrong on real exports (issue 19):
each compiles on x86 and matches onnxruntime."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.testing.oracles import ort_session


def make(nodes, inputs, outputs=("y",), inits=(), opset=18):
    g = helper.make_graph(nodes, "g", inputs, [helper.make_empty_tensor_value_info(o) for o in outputs],
                          list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def const(name, arr):
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(arr), name))


def check(model, feeds, rtol=1e-4):
    """Compile for x86, run, compare every output with onnxruntime; the reference oracle must agree too."""
    want = ort_session(model).run(None, feeds)
    p = Pipeline.from_onnx(model)
    ref = p.run_reference(feeds)
    got = p.optimize().compile().run(feeds)
    for name, w in zip([o.name for o in model.graph.output], want):
        np.testing.assert_allclose(ref[name], w, rtol=rtol, atol=rtol * max(1.0, float(np.abs(w).max(initial=0))))
        np.testing.assert_allclose(got[name], w, rtol=rtol, atol=rtol * max(1.0, float(np.abs(w).max(initial=0))))
    return got


# --- GatherElements along a long axis (BERT's token_type_ids, dynamo export) ------------------------------

@pytest.mark.parametrize("axis,data_shape,index_shape", [(1, (1, 512), (1, 16)),   # BERT: buffer[1, 512] gathered by position_ids
                                                         (0, (100, 3), (5, 1)),     # one column: was silently wrong
                                                         (-1, (2, 3, 70), (2, 2, 9))])
def test_gather_elements_along_an_axis_longer_than_np_choose_allows(axis, data_shape, index_shape):
    # onnx.reference's GatherElements (np.choose) breaks past 32/64 choices: folding it raised a raw ValueError.
    rng = np.random.default_rng(0)
    n = data_shape[axis]
    data = rng.integers(-100, 100, data_shape).astype(np.int64)
    idx = rng.integers(-n, n, index_shape).astype(np.int64)
    x = helper.make_tensor_value_info("x", TensorProto.INT64, list(index_shape))
    nodes = [const("d", data), const("i", idx), helper.make_node("GatherElements", ["d", "i"], ["g"], axis=axis),
             helper.make_node("Add", ["x", "g"], ["y"])]
    m = make(nodes, [x])
    p = Pipeline.from_onnx(m).optimize()
    assert "GatherElements" not in [nd.op for nd in p.graph.nodes]  # folded, and folded right:
    check(m, {"x": np.zeros(index_shape, np.int64)})
    # computed at run time too (indices an input), against the same oracle
    xi = helper.make_tensor_value_info("i", TensorProto.INT64, list(index_shape))
    m2 = make([const("d", data), helper.make_node("GatherElements", ["d", "i"], ["y"], axis=axis)], [xi])
    check(m2, {"i": idx})
