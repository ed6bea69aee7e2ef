"""The compute cost `cuvil inspect` reports (ir/stats.py): recurrences, spectral ops and ops imported as function
bodies count their multiply-accumulates, with symbolic dims as formulas."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.ir.dim import evaluate

RNG = np.random.default_rng(0)


def model(nodes, inputs, inits=(), opset=22, outputs=("y",)):
    g = helper.make_graph(nodes, "m", inputs, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                          [numpy_helper.from_array(a, k) for k, a in inits])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def const(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("op,gates", [("LSTM", 4), ("GRU", 3), ("RNN", 1)])
@pytest.mark.parametrize("direction,dirs", [("forward", 1), ("bidirectional", 2)])
@pytest.mark.parametrize("layout", [0, 1])
def test_recurrent_macs(op, gates, direction, dirs, layout):
    hidden, inp = 5, 3
    x_shape = ["B", "S", inp] if layout else ["S", "B", inp]
    node = helper.make_node(op, ["x", "W", "R"], ["y"], hidden_size=hidden, direction=direction, layout=layout)
    m = model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
              [("W", const(dirs, gates * hidden, inp)), ("R", const(dirs, gates * hidden, hidden))])
    macs = Pipeline.from_onnx(m).stats().macs
    for s, b in ((1, 1), (7, 3)):
        assert evaluate(macs, {"S": s, "B": b}) == s * b * dirs * gates * hidden * (inp + hidden)


def test_dft_and_stft_macs():
    dft = helper.make_node("DFT", ["x", "", "axis"], ["y"], onesided=1)
    m = model([dft], [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16, 1])],
              [("axis", np.array(1, np.int64))], opset=20)
    # 9 one-sided frequencies, each a sum of 16 real samples times a complex twiddle (2 real MACs)
    assert evaluate(Pipeline.from_onnx(m).stats().macs, {"B": 3}) == 3 * 9 * 16 * 2
    stft = helper.make_node("STFT", ["x", "step", "", "flen"], ["y"])
    m = model([stft], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64, 1])],
              [("step", np.array(8, np.int64)), ("flen", np.array(16, np.int64))], opset=17)
    # 7 frames of 16 samples, 9 frequencies each
    assert Pipeline.from_onnx(m).stats().macs == 2 * 7 * 9 * 16 * 2


def test_attention_counts_through_its_function_body():
    # opset-23 Attention is imported as its function body: Q K^T and P V are MatMuls, B*H*S*T*(D + Dv) MACs
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"])
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", 2, s, d]) for n, s, d in
          (("q", "S", 8), ("k", "T", 8), ("v", "T", 4))]
    p = Pipeline.from_onnx(model([node], vi, opset=23))
    macs = p.stats().macs
    for b, s, t in ((1, 1, 1), (2, 5, 7)):
        assert evaluate(macs, {"B": b, "S": s, "T": t}) == b * 2 * s * t * (8 + 4)
