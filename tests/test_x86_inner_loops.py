"""The x86 generic loop nest keeps a long last dim as its inner loop (``KernelModule.parallel_dims``): a
LayerNormalization or a broadcasting elementwise op over a fixed [1, 32, 768] ran as one flattened loop of
24,576 scalar elements, each unflattening its index by division (58 us, against 5.5 us vectorised). The dims
chosen for the parallel range at and around the thresholds (INNER_MIN, OUTER_MIN, SMALL_STAGE), and the
results of such stages at those shapes against onnxruntime at 1 and 2 threads."""
from unittest import mock

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from cuvil import Pipeline
from cuvil.targets.x86 import codegen
from cuvil.targets.x86.codegen import KernelModule
from cuvil.testing import replay
from cuvil.testing.oracles import ort_session


def _model(shape, kind):
    """``kind`` "layernorm": LayerNormalization over the last axis; "bias_gelu": x * sigmoid(x + b) with a
    bias along the last axis and a per-row scale (two broadcasting operands, one along each side)."""
    x = h.make_tensor_value_info("x", T.FLOAT, list(shape))
    y = h.make_tensor_value_info("y", T.FLOAT, list(shape))
    rng = np.random.default_rng(0)
    last, rows = shape[-1], list(shape[:-1]) + [1]
    if kind == "layernorm":
        inits = [h.make_tensor("g", T.FLOAT, [last], rng.uniform(0.5, 1.5, last).astype(np.float32)),
                 h.make_tensor("b", T.FLOAT, [last], rng.standard_normal(last).astype(np.float32))]
        nodes = [h.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    else:
        inits = [h.make_tensor("b", T.FLOAT, [last], rng.standard_normal(last).astype(np.float32)),
                 h.make_tensor("s", T.FLOAT, rows, rng.uniform(0.5, 2, rows).astype(np.float32).ravel())]
        nodes = [h.make_node("Add", ["x", "b"], ["xb"]), h.make_node("Sigmoid", ["xb"], ["sg"]),
                 h.make_node("Mul", ["x", "sg"], ["g1"]), h.make_node("Mul", ["g1", "s"], ["y"])]
    return h.make_model(h.make_graph(nodes, kind, [x], [y], inits), opset_imports=[h.make_opsetid("", 17)])


def _parallel_dims(model, elementwise=False, **compile_kw):
    """{output buffer name: (loop shape, parallel dims)} of the stages x86 emits for ``model`` (with
    ``elementwise``: (loop shape, parallel dims, whether the stage is plain elementwise))."""
    seen = {}
    real = KernelModule.add_stage

    def spy(self, st, sym, lead=None):
        dims = self.parallel_dims(st) if lead is None else lead
        seen[st.buf.name] = (list(self.loop_shape(st)), dims) + ((codegen._elementwise(st.expr),) if elementwise else ())
        return real(self, st, sym, lead)
    with mock.patch.object(KernelModule, "add_stage", spy):
        replay._capture(Pipeline.from_onnx(model).optimize(), "x86", **compile_kw)
    return seen


def _flattened(shape):
    """The parallel dims before the inner-loop rule: leading dims until PARALLEL_MIN points (static shapes)."""
    k, extent = 0, 1
    while k < len(shape) and extent < codegen.PARALLEL_MIN:
        extent *= shape[k]
        k += 1
    return k


@pytest.mark.parametrize("shape, lead", [
    ((1, 32, 768), 2),      # BERT's rows at S = 32: 32 row units, 768 columns an inner loop
    ((1, 8, 16), 2),        # OUTER_MIN rows, INNER_MIN columns
    ((1, 1, 768), 2),       # a decode step's one row: too little work to share, so vectorised whole
    ((1, 4, 15), 3),        # a last dim shorter than INNER_MIN: flattened as before
    ((1, 1, 65536), 3),     # one long row past SMALL_STAGE: flattened so that the threads share it
    ((1, 8, 8192), 2),      # past SMALL_STAGE, but OUTER_MIN rows for the threads
    ((1, 4, 8192), 2),      # exactly SMALL_STAGE elements
    ((1, 1, 32769), 3),     # one past it
])
def test_a_long_last_dim_stays_the_inner_loop(shape, lead):
    dims = _parallel_dims(_model(shape, "bias_gelu"))
    assert dims["y"] == (list(shape), lead), dims


def test_layernorm_normalises_rows_with_its_columns_inner():
    dims = _parallel_dims(_model((1, 32, 768), "layernorm"))
    assert dims["y"] == ([1, 32, 768], 2), dims


def test_a_symbolic_last_dim_is_flattened_as_before():
    # its length at run time is unknown: one unit per row could leave a long row to one thread
    x = h.make_tensor_value_info("x", T.FLOAT, [1, 4, "T"])
    y = h.make_tensor_value_info("y", T.FLOAT, [1, 4, "T"])
    m = h.make_model(h.make_graph([h.make_node("Sigmoid", ["x"], ["s"]), h.make_node("Mul", ["x", "s"], ["y"])],
                                  "silu", [x], [y]), opset_imports=[h.make_opsetid("", 17)])
    dims = _parallel_dims(m, shape_profiles={"T": (1, 64, 4096)})
    assert dims["y"][1] == 3, dims


def test_stages_whose_elements_loop_keep_their_elements_parallel():
    # an LSTM's batch rows each run the whole sequence (a sequential program per element): not one unit
    seq, batch, inp, hid = 5, 32, 16, 24
    rng = np.random.default_rng(2)
    w = lambda *s: h.make_tensor(f"w{len(s)}_{s[-1]}", T.FLOAT, list(s), rng.standard_normal(s).astype(np.float32).ravel() * 0.3)  # noqa: E731
    W, R, B = w(1, 4 * hid, inp), w(1, 4 * hid, hid), w(1, 8 * hid)
    node = h.make_node("LSTM", ["x", W.name, R.name, B.name], ["y"], hidden_size=hid)
    m = h.make_model(h.make_graph([node], "lstm", [h.make_tensor_value_info("x", T.FLOAT, [seq, batch, inp])],
                                  [h.make_tensor_value_info("y", T.FLOAT, [seq, 1, batch, hid])], [W, R, B]),
                     opset_imports=[h.make_opsetid("", 17)])
    dims = _parallel_dims(m, elementwise=True)
    looping = {name: d for name, d in dims.items() if not d[2]}
    assert looping, dims                      # the recurrence is such a stage
    for name, (shape, lead, _) in looping.items():
        if all(isinstance(d, int) for d in shape):
            assert lead == _flattened(shape), (name, shape, lead)


def test_the_thresholds_are_the_module_constants():
    # the cases above sit on these values; a change of them must revisit the cases
    assert (codegen.INNER_MIN, codegen.OUTER_MIN, codegen.SMALL_STAGE) == (16, 8, 32768)
    dims = _parallel_dims(_model((1, 7, 4096), "bias_gelu"))       # 7 rows, 28,672 elements: small, kept
    assert dims["y"][1] == 2
    dims = _parallel_dims(_model((1, 7, 8192), "bias_gelu"))       # 7 rows, 57,344 elements: flattened
    assert dims["y"][1] == 3


@pytest.mark.parametrize("kind", ["layernorm", "bias_gelu"])
@pytest.mark.parametrize("shape", [(1, 32, 768), (1, 8, 16), (1, 1, 768), (1, 4, 15), (1, 7, 8192),
                                   (1, 8, 8192), (2, 3, 17), (1, 9, 33)])
def test_results_match_onnxruntime(kind, shape):
    m = _model(shape, kind)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32) * 3
    want = ort_session(m).run(None, {"x": x})[0]
    lib = Pipeline.from_onnx(m).optimize().compile().model()
    for threads in (1, 2):
        got = lib.run(x, num_threads=threads)
        got = got[0] if isinstance(got, (list, tuple)) else got
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
