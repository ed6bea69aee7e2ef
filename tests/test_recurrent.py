"""LSTM, GRU and RNN compiled natively against onnxruntime: every attribute of the ONNX ops (directions,
activations with alpha/beta, clip, input_forget, linear_before_reset, peepholes, biases, sequence_lens with
padding, initial states, both layouts, optional outputs), each model compiled once with symbolic sequence
length and batch and run at several (seq, batch) shapes; the GPU kernels generated and assembled by ptxas.

onnxruntime's CPU kernels refuse layout 1, so a layout-1 model is checked against the same model in layout
0 with its inputs and outputs transposed.
"""
from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from cuvil import Pipeline
from cuvil.errors import CuvilError

pytest.importorskip("onnxruntime")
from cuvil.testing.oracles import ort_session  # noqa: E402  (after the skip: it imports onnxruntime)

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
DIRS = {"forward": 1, "reverse": 1, "bidirectional": 2}
# (seq, batch) shapes every library is run at: one library serves them all
SHAPES = [(5, 3), (1, 1), (9, 4), (2, 6)]
INPUT = 10    # >= 8: the x86 input projection takes the packed GEMM micro-kernel
HIDDEN = 12


def _spec(op, direction="forward", **kw):
    return dict(op=op, direction=direction, **kw)


def _layer(rng, op, name, direction="forward", layout=0, bias=True, lens=False, init_h=False, init_c=False,
           peepholes=False, outputs=("Y", "Y_h", "Y_c"), weights_as_inputs=False, hidden=HIDDEN, **attrs):
    """One recurrent node reading graph input X (and L, h0/c0, W/R when asked): (node, initializers,
    extra graph inputs, output value names)."""
    d, g = DIRS.get(direction, 1), GATES[op]
    inits, extra = [], []

    def tensor(tname, shape, scale=0.4):
        arr = rng.normal(0, scale, shape).astype(np.float32)
        inits.append(onnx.numpy_helper.from_array(arr, tname))
        return tname
    w_name, r_name = f"{name}_W", f"{name}_R"
    if weights_as_inputs:
        extra += [helper.make_tensor_value_info(w_name, TensorProto.FLOAT, [d, g * hidden, INPUT]),
                  helper.make_tensor_value_info(r_name, TensorProto.FLOAT, [d, g * hidden, hidden])]
    else:
        tensor(w_name, (d, g * hidden, INPUT))
        tensor(r_name, (d, g * hidden, hidden))
    ins = ["X", w_name, r_name, tensor(f"{name}_B", (d, 2 * g * hidden)) if bias else ""]
    ins.append("L" if lens else "")
    state = ["N", d, hidden] if layout else [d, "N", hidden]
    if init_h:
        extra.append(helper.make_tensor_value_info(f"{name}_h0", TensorProto.FLOAT, state))
    ins.append(f"{name}_h0" if init_h else "")
    if op == "LSTM":
        if init_c:
            extra.append(helper.make_tensor_value_info(f"{name}_c0", TensorProto.FLOAT, state))
        ins.append(f"{name}_c0" if init_c else "")
        ins.append(tensor(f"{name}_P", (d, 3 * hidden)) if peepholes else "")
    while ins and ins[-1] == "":
        ins.pop()
    kinds = ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    outs = [f"{name}_{k}" if k in outputs else "" for k in kinds]
    while outs and outs[-1] == "":
        outs.pop()
    node = helper.make_node(op, ins, outs, name=name, hidden_size=hidden, direction=direction, layout=layout,
                            **attrs)
    return node, inits, extra, [o for o in outs if o]


def _model(layers, layout=0, lens=False, seed=0):
    """A model of the given layers (dicts of _layer's arguments) over one X[seq, batch, input] (layout 0) or
    X[batch, seq, input] (layout 1), with symbolic seq T and batch N; weights from ``seed``."""
    rng = np.random.default_rng(seed)
    nodes, inits, extra, outs = [], [], [], []
    for k, spec in enumerate(layers):
        spec = dict(spec)
        op = spec.pop("op")
        node, i, e, o = _layer(rng, op, f"{op.lower()}{k}", layout=layout, lens=lens, **spec)
        nodes.append(node)
        inits += i
        extra += e
        outs += o
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", "T", INPUT] if layout else ["T", "N", INPUT])
    ins = [x] + ([helper.make_tensor_value_info("L", TensorProto.INT32, ["N"])] if lens else []) + extra
    graph = helper.make_graph(nodes, "recurrent", ins, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None)
                                                       for o in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def _feeds(model, layout, T, N, seed):
    """Random inputs at (T, N); sequence lengths mixed (full, 1, 0 and between) when the model has them."""
    rng = np.random.default_rng(seed)
    out = {}
    for vi in model.graph.input:
        dims = [{"T": T, "N": N}.get(d.dim_param, d.dim_value) for d in vi.type.tensor_type.shape.dim]
        if vi.name == "L":
            lens = rng.integers(0, T + 1, size=N)
            lens[0] = T
            if N > 1:
                lens[1] = 1
            out["L"] = lens.astype(np.int32)
        else:
            out[vi.name] = rng.normal(0, 1, dims).astype(np.float32)
    return out


def _to_layout0(model):
    """The same model in layout 0 (onnxruntime's CPU kernels refuse layout 1)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for node in m.graph.node:
        for a in node.attribute:
            if a.name == "layout":
                a.i = 0
    for vi in m.graph.input:
        dims = vi.type.tensor_type.shape.dim
        if vi.name == "X" or vi.name.endswith(("_h0", "_c0")):
            a, b = onnx.TensorShapeProto.Dimension(), onnx.TensorShapeProto.Dimension()
            a.CopyFrom(dims[0])
            b.CopyFrom(dims[1])
            dims[0].CopyFrom(b)
            dims[1].CopyFrom(a)
    return m


def _reference(model, layout, feeds):
    """onnxruntime's outputs (by name); layout 1 through the layout-0 model, transposing in and out."""
    names = [o.name for o in model.graph.output]
    if layout == 0:
        return dict(zip(names, ort_session(model).run(None, feeds)))
    sess = ort_session(_to_layout0(model))
    f0 = {k: (v.transpose(1, 0, 2) if k == "X" or k.endswith(("_h0", "_c0")) else v) for k, v in feeds.items()}
    out = {}
    for name, v in zip(names, sess.run(None, f0)):
        out[name] = v.transpose(2, 0, 1, 3) if name.endswith("_Y") else v.transpose(1, 0, 2)
    return out


def _check(model, layout=0, shapes=SHAPES, atol=2e-5):
    art = Pipeline.from_onnx(model).compile(opt_level=2)
    safety = art.manifest["memory_safety"]
    assert safety["kernels_proved"] == safety["kernels"], safety["summary"]
    for k, (T, N) in enumerate(shapes):
        feeds = _feeds(model, layout, T, N, seed=100 + k)
        want = _reference(model, layout, feeds)
        got = art.run(feeds)
        assert set(got) == set(want)
        for name in want:
            assert got[name].shape == want[name].shape, (name, T, N)
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=atol, err_msg=f"{name} at T={T}, N={N}")


# --- every direction and layout, with every optional input -----------------------------------------------

@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_lstm_full(direction, layout):
    """Biases, peepholes, initial h and c, sequence lengths with padding; all three outputs."""
    m = _model([_spec("LSTM", direction, init_h=True, init_c=True, peepholes=True)], layout, lens=True)
    _check(m, layout)


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_gru_full(direction, layout):
    """Both forms of the reset gate (linear_before_reset 0 and 1) in one model, initial h, padding."""
    m = _model([_spec("GRU", direction, init_h=True, linear_before_reset=0),
                _spec("GRU", direction, init_h=True, linear_before_reset=1)], layout, lens=True)
    _check(m, layout)


@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_rnn_full(direction, layout):
    m = _model([_spec("RNN", direction, init_h=True), _spec("RNN", direction, bias=False)], layout, lens=True)
    _check(m, layout)


# --- activations, clip, input_forget -------------------------------------------------------------------

def test_rnn_every_activation():
    """Each of ONNX's eleven recurrent activations, with alpha/beta where it takes them, bidirectional (one
    per direction) and under a clip."""
    pairs = [("Relu", "Tanh"), ("Sigmoid", "Affine"), ("LeakyRelu", "ThresholdedRelu"), ("ScaledTanh", "HardSigmoid"),
             ("Elu", "Softsign"), ("Softplus", "Relu")]
    params = {"Affine": (0.7, 0.2), "LeakyRelu": (0.3, None), "ThresholdedRelu": (0.4, None),
              "ScaledTanh": (1.3, 0.6), "HardSigmoid": (0.25, 0.45), "Elu": (0.8, None)}
    layers = []
    for k, (a, b) in enumerate(pairs):
        alphas = [params[x][0] for x in (a, b) if x in params]
        betas = [params[x][1] for x in (a, b) if x in params and params[x][1] is not None]
        extra = {"clip": 2.5} if k % 2 else {}
        if alphas:
            extra["activation_alpha"] = alphas
        if betas:
            extra["activation_beta"] = betas
        layers.append(_spec("RNN", "bidirectional", activations=[a, b], **extra))
    _check(_model(layers, lens=True), shapes=[(5, 3), (1, 2)])


def test_lstm_activations_clip_input_forget():
    """Non-default f, g, h per direction with alpha/beta; the cell clip; input and forget gates coupled."""
    m = _model([_spec("LSTM", "bidirectional", peepholes=True, init_c=True, clip=0.9, input_forget=1,
                      activations=["HardSigmoid", "Tanh", "Softsign", "Sigmoid", "ScaledTanh", "Elu"],
                      activation_alpha=[0.3, 0.9, 1.1], activation_beta=[0.4, 0.7]),
                _spec("LSTM", "forward", clip=0.5)], lens=True)
    _check(m, shapes=[(5, 3), (2, 1), (7, 2)])


def test_gru_activations_and_clip():
    m = _model([_spec("GRU", "bidirectional", linear_before_reset=1, clip=1.5,
                      activations=["HardSigmoid", "LeakyRelu", "Sigmoid", "Tanh"],
                      activation_alpha=[0.15, 0.2], activation_beta=[0.55]),
                _spec("GRU", "reverse", activations=["Sigmoid", "Affine"], activation_alpha=[0.5],
                      activation_beta=[0.1])])
    _check(m, shapes=[(4, 2), (1, 1)])


# --- optional inputs and outputs -------------------------------------------------------------------------

def test_optional_outputs():
    """Y omitted, Y_h omitted, only Y_c, only Y: each layer computes what is asked."""
    m = _model([_spec("LSTM", outputs=("Y_h", "Y_c")), _spec("LSTM", "reverse", outputs=("Y", "Y_c")),
                _spec("LSTM", outputs=("Y_c",)), _spec("GRU", outputs=("Y",)), _spec("RNN", outputs=("Y_h",)),
                _spec("GRU", "bidirectional", outputs=("Y_h",))], lens=True)
    _check(m, shapes=[(4, 3), (1, 1)])


def test_no_sequence_lens_no_bias():
    m = _model([_spec("LSTM", "bidirectional", bias=False), _spec("GRU", bias=False, linear_before_reset=1),
                _spec("RNN", "reverse", bias=False)], layout=1)
    _check(m, layout=1, shapes=[(3, 2), (6, 1)])


def test_weights_as_graph_inputs():
    """W and R given at run time: the input projection is a plain reduction instead of the packed GEMM."""
    m = _model([_spec("LSTM", "bidirectional", weights_as_inputs=True, peepholes=True),
                _spec("GRU", "reverse", weights_as_inputs=True)], lens=True)
    _check(m, shapes=[(4, 3), (1, 2)])


def test_ops_feed_a_consumer():
    """The states are read by an ordinary op after the layer (Y_h into a MatMul), not only returned."""
    m = _model([_spec("LSTM", outputs=("Y", "Y_h"))])
    w = onnx.numpy_helper.from_array(np.random.default_rng(1).normal(size=(HIDDEN, 5)).astype(np.float32), "proj")
    m.graph.initializer.append(w)
    m.graph.node.append(helper.make_node("MatMul", ["lstm0_Y_h", "proj"], ["logits"]))
    m.graph.node.append(helper.make_node("Relu", ["lstm0_Y"], ["y_relu"]))
    del m.graph.output[:]
    m.graph.output.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("logits", "y_relu")])
    _check(m, shapes=[(3, 2), (1, 1)])


# --- errors ----------------------------------------------------------------------------------------------

def test_bad_activation_is_a_clear_error():
    m = _model([_spec("RNN", activations=["Swish"])])
    with pytest.raises(CuvilError, match=r"rnn0.*RNN.*unknown activation"):
        Pipeline.from_onnx(m)


def test_bad_direction_is_a_clear_error():
    m = _model([_spec("GRU", "sideways")])
    with pytest.raises(CuvilError, match=r"gru0.*GRU.*direction 'sideways'"):
        Pipeline.from_onnx(m)


# --- the GPU kernels -------------------------------------------------------------------------------------

def _ptx_tools():
    from cuvil.targets.ptx import find_libdevice, find_ptxas
    return find_ptxas(), find_libdevice()


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_ptx_assembles_for_sm90(op):
    """The same lowering on the GPU target: the schedule (fixed at one shape, as a GPU bucket is) lowers to
    PTX that ptxas assembles for sm_90, the sequential kernel one thread block per (direction, batch row)."""
    from cuvil.targets.ptx import assemble, generate_ptx
    from cuvil.targets.ptx.codegen import gpu_schedule
    ptxas, libdevice = _ptx_tools()
    if ptxas is None or libdevice is None:
        pytest.skip("ptxas or libdevice not found (no CUDA toolkit): PTX cannot be assembled here")
    extra = {"LSTM": dict(peepholes=True, init_c=True, clip=3.0), "GRU": dict(linear_before_reset=1),
             "RNN": dict(activations=["Relu", "Tanh"])}[op]
    m = _model([_spec(op, "bidirectional", init_h=True, **extra)], lens=True)
    sched = gpu_schedule(Pipeline.from_onnx(m).specialize({"T": 6, "N": 3}).optimize().graph)
    ptx, descs = generate_ptx(sched, "sm_90")
    assert ".target sm_90" in ptx and ".extern" not in ptx
    _, info = assemble(ptx, "sm_90", ptxas)
    assert set(info) == {d.name for d in descs}
    assert all(info[d.name].registers for d in descs)
    steps = [d for d in descs if d.kind == "sequential"]
    assert len(steps) == 1 and steps[0].grid == 2 * 3 and steps[0].block % 32 == 0   # a block per (dir, row)
    body = ptx.split(f".entry {steps[0].name}")[1].split(".entry")[0]
    assert "bar.sync" in body            # the block meets after each assignment


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_double(op):
    """float64 layers (onnxruntime has no double kernels for them): against onnx.reference in float64."""
    from onnx.reference import ReferenceEvaluator
    m = _model([_spec(op, "bidirectional", init_h=True)])
    for t in list(m.graph.input) + list(m.graph.output):
        t.type.tensor_type.elem_type = TensorProto.DOUBLE
    for k, init in enumerate(m.graph.initializer):
        m.graph.initializer[k].CopyFrom(onnx.numpy_helper.from_array(
            onnx.numpy_helper.to_array(init).astype(np.float64), init.name))
    art = Pipeline.from_onnx(m).compile(opt_level=2)
    ref = ReferenceEvaluator(m)
    for k, (T, N) in enumerate([(4, 2), (1, 3)]):
        feeds = {n: v.astype(np.float64) for n, v in _feeds(m, 0, T, N, seed=k).items()}
        got = art.run(feeds)
        for o, want in zip(m.graph.output, ref.run(None, feeds)):
            assert got[o.name].dtype == np.float64
            np.testing.assert_allclose(got[o.name], want, rtol=1e-10, atol=1e-12, err_msg=f"{o.name} at T={T}, N={N}")


# --- the sequential kernel node in the bounds proof ------------------------------------------------------

def _sequential_schedule(shift: int):
    """One stage over rows r in [0, 4) running: state[r, s + shift] = x[r, s] for s in [0, 6)."""
    from cuvil.kernels.schedule import Schedule, Stage
    from cuvil.kernels.sequential import Assign, Sequential, sequential
    from cuvil.kernels.texpr import Buf, load, var
    from cuvil.ir.dtype import DType
    x = Buf("x", DType.FLOAT, (4, 6), 2, 0)
    state = Buf("state", DType.FLOAT, (4, 6), 0, 0)
    out = Buf("out", DType.FLOAT, (4,), 3, 0)
    r, s = var("r"), var("s")
    prog = Sequential([r], [], s, 6, [Assign(state, [r, s + shift], load(x, [r, s]))])
    i = var("i")
    st = Stage("steps", out, [i], sequential([i], prog, DType.FLOAT))
    return Schedule([st], [x], [out], [], 4 * 6 * 4, 0, {}, []), st


def test_sequential_stores_are_proved_and_an_off_by_one_is_refuted():
    from cuvil.kernels.bounds import BoundsProver, prove_stage
    from cuvil.kernels.schedule import _reads
    good, st = _sequential_schedule(0)
    count, failed = prove_stage(BoundsProver(), good, st)
    assert count == 3 and not failed            # the stage's store, the program's store and its load
    assert {b.name for b in _reads(st.expr)} == {"x", "state"}   # the memory plan sees both
    bad, st = _sequential_schedule(1)
    _, failed = prove_stage(BoundsProver(), bad, st)
    assert len(failed) == 1 and failed[0][0].buf.name == "state" and "out of bounds" in failed[0][1]


def test_tiny_layers(monkeypatch):
    """Hidden size 1 and input size 1: the projection is too small for the GEMM micro-kernel (a plain
    reduction), every row of the recurrent product one term."""
    monkeypatch.setattr(sys.modules[__name__], "INPUT", 1)
    m = _model([_spec("LSTM", "bidirectional", hidden=1, peepholes=True, init_c=True),
                _spec("GRU", "reverse", hidden=1, linear_before_reset=1), _spec("RNN", hidden=1, init_h=True)],
               lens=True)
    _check(m, shapes=[(3, 2), (1, 1)])
