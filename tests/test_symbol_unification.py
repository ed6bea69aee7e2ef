"""Anonymous dims that the model's ops require equal become one symbol on import: an LSTM's X batch
(``x.1``) and its initial state's batch (``h.1``) can only be one size, and the kernel reads the state at X's
batch rows, so two independent symbols there fail its memory-safety proof. Dims that only broadcast stay two
symbols (docs/shapes.md, "Anonymous dims that must be equal")."""
import pathlib

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.testing.oracles import max_rel_error, ort_session

HIDDEN, FEATURES = 5, 3
PACKAGED = pathlib.Path(__file__).parent / "fixtures" / "packaged"


def lstm_model():
    """X [S, ?, 3] and initial_h / initial_c [1, ?, 5]: three anonymous batch dims the LSTM requires equal."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((0.5 * rng.standard_normal(s)).astype(np.float32), n) for n, s in
             (("W", (1, 4 * HIDDEN, FEATURES)), ("R", (1, 4 * HIDDEN, HIDDEN)), ("B", (1, 8 * HIDDEN)))]
    node = helper.make_node("LSTM", ["x", "W", "R", "B", "", "h", "c"], ["y", "hn", "cn"], hidden_size=HIDDEN)
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([node], "lstm", [vi("x", TensorProto.FLOAT, ["S", "?", FEATURES]),
                                               vi("h", TensorProto.FLOAT, [1, -1, HIDDEN]),
                                               vi("c", TensorProto.FLOAT, [1, "", HIDDEN])],
                              [vi(n, TensorProto.FLOAT, None) for n in ("y", "hn", "cn")], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def feeds(rng, s, b):
    return {"x": rng.standard_normal((s, b, FEATURES)).astype(np.float32),
            "h": rng.standard_normal((1, b, HIDDEN)).astype(np.float32),
            "c": rng.standard_normal((1, b, HIDDEN)).astype(np.float32)}


def test_dims_an_op_requires_equal_become_one_symbol():
    p = Pipeline.from_onnx(lstm_model())
    assert sorted(p.graph.symbols) == ["S", "x.1"]
    assert [str(v.type) for v in p.graph.inputs] == ["f32[S,x.1,3]", "f32[1,x.1,5]", "f32[1,x.1,5]"]


def test_one_library_serves_every_batch():
    model = lstm_model()
    p = Pipeline.from_onnx(model)
    art = p.compile(shape_profiles={"S": (1, 4, 16), "x.1": (1, 2, 4)})
    sess = ort_session(model)
    rng = np.random.default_rng(1)
    for s, b in ((1, 1), (4, 2), (7, 3), (16, 4)):
        f = feeds(rng, s, b)
        got = art.run(f)
        for name, want in zip(("y", "hn", "cn"), sess.run(None, f)):
            assert max_rel_error(got[name], want) <= 1e-5, (name, s, b)
    with pytest.raises(Exception, match="h.1|x.1"):     # the inputs disagree on the batch
        art.run(dict(feeds(rng, 2, 2), h=np.zeros((1, 3, HIDDEN), np.float32)))


def test_binding_by_the_old_names_still_works():
    # A user who bound the dims as the model spells them (fixed={"h.1": "x.1"}, --input-shape h=...) is served
    p = Pipeline.from_onnx(lstm_model())
    art = p.compile(fixed={"h.1": "x.1", "c.1": "x.1", "S": 3},
                    input_shapes={"h": ([1, 1, HIDDEN], [1, 2, HIDDEN], [1, 4, HIDDEN])})
    assert art.manifest["symbols"] == {"x.1": {"min": 1, "opt": 2, "max": 4}}
    assert str(p.specialize({"h.1": 2}).graph.inputs[0].type) == "f32[S,2,3]"


def test_dims_that_only_broadcast_stay_two_symbols():
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "add",
                              [vi("a", TensorProto.FLOAT, [-1, 4]), vi("b", TensorProto.FLOAT, ["?", 4])],
                              [vi("y", TensorProto.FLOAT, None)])
    p = Pipeline.from_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert sorted(p.graph.symbols) == ["a.0", "b.0"]


@pytest.mark.parametrize("rate,chunk", [(16000, 512), (8000, 256)])
def test_silero_vad_one_library_for_batch_1_to_4(rate, chunk):
    # silero_vad.onnx declares input [?, ?] and state [2, ?, 128]: its LSTM makes input.0 and state.1 one
    # symbol. The sample rate is fixed (input_values) and the chunk static: the decoder's "squeeze when the
    # length is 1" If is then decided at compile time. The state carries over between calls.
    model = onnx.load(PACKAGED / "silero_vad.onnx")
    static = onnx.load(PACKAGED / "silero_vad.onnx")
    static.graph.input[0].type.tensor_type.shape.dim[1].dim_value = chunk
    p = Pipeline.from_onnx(static, input_values={"sr": rate})
    assert [str(v.type) for v in p.graph.inputs] == [f"f32[input.0,{chunk}]", "f32[2,input.0,128]"]
    art = p.optimize().compile(shape_profiles={"input.0": (1, 1, 4)})
    sess = ort_session(model)
    for batch in (1, 3, 4):
        rng = np.random.default_rng(batch)
        state = (0.1 * rng.standard_normal((2, batch, 128))).astype(np.float32)
        for _ in range(2):
            f = {"input": (0.2 * rng.standard_normal((batch, chunk))).astype(np.float32), "state": state}
            got = art.run(f)
            want = sess.run(None, dict(f, sr=np.array(rate, np.int64)))
            for o, w in zip(model.graph.output, want):
                assert max_rel_error(got[o.name], w) <= 1e-4, (o.name, batch)
            state = got["stateN"]
