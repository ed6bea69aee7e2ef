"""Low precision with certificates (issue 21, docs/precision.md): the range analysis is sound, fp16's classic
overflows are refused with counterexamples that really overflow in float16, and ``auto`` keeps them float32."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from cuvil import Pipeline
from cuvil.cli import main
from cuvil.errors import CuvilError
from cuvil.frontend import export_model
from cuvil.precision import plan_precision
from cuvil.precision.policy import REFUSED, SAFE, UNKNOWN

EVERYWHERE = {"fp16": frozenset({"LayerNormalization", "Pow", "Mul", "Add", "Tanh", "Softmax", "Conv", "Gemm",
                                 "MatMul", "Relu", "Sub", "Div", "ReduceMean", "Sqrt"}),
              "bf16": frozenset({"Conv", "Gemm", "MatMul"})}


def _model(nodes, inputs, outputs, inits=()):
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in inputs],
                     [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in outputs], list(inits))
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def _graph(model):
    return Pipeline.from_onnx(model).optimize().graph


def _node(plan, op):
    return next(n for n in plan.nodes if n.op == op)


def layer_norm_model(n=64):
    return _model([h.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=-1)], [("x", [1, 4, n])],
                  [("y", [1, 4, n])], [nh.from_array(np.ones(n, np.float32), "g"),
                                       nh.from_array(np.zeros(n, np.float32), "b")])


def test_layer_norm_of_large_inputs_is_refused_for_fp16_with_a_real_overflow():
    g = _graph(layer_norm_model())
    plan = plan_precision(g, "auto", input_ranges={"x": (-1e3, 1e3)}, target_ops={"fp16": EVERYWHERE["fp16"]})
    ln = _node(plan, "LayerNormalization")
    v = ln.verdicts["fp16"]
    assert v.status == REFUSED and "counterexample" in v.detail and v.witness is not None
    assert ln.format == "" and "fp16 refused" in ln.reason           # auto keeps it float32
    # the output itself is certified: beta ± sqrt(N)·|gamma| for the kernels' two-pass float32 computation
    # (d_i^2 <= sum_j d_j^2 of the very d_j the variance sums), widened by that computation's rounding only
    assert np.sqrt(63) < ln.range.max <= np.sqrt(64) * (1 + 1e-5)
    # the counterexample, run through numpy in float16: the variance computation overflows
    x = np.asarray(v.witness.inputs["x"]).astype(np.float16)
    assert np.all(np.abs(x.astype(np.float64)) <= 1e3)
    with np.errstate(all="ignore"):
        c = x - x.mean(axis=-1, keepdims=True, dtype=np.float16)
        var = (c * c).mean(axis=-1, dtype=np.float16)
    assert np.isinf(var).any()
    # small inputs: certified safe in fp16, and auto narrows it
    plan = plan_precision(g, "auto", input_ranges={"x": (-3, 3)}, target_ops={"fp16": EVERYWHERE["fp16"]})
    assert _node(plan, "LayerNormalization").format == "fp16"


def gelu_tanh_model():
    c = lambda name, v: nh.from_array(np.array(v, np.float32), name)
    nodes = [h.make_node("Pow", ["x", "three"], ["x3"]), h.make_node("Mul", ["x3", "k"], ["kx3"]),
             h.make_node("Add", ["x", "kx3"], ["inner"]), h.make_node("Mul", ["inner", "s"], ["si"]),
             h.make_node("Tanh", ["si"], ["t"]), h.make_node("Add", ["t", "one"], ["t1"]),
             h.make_node("Mul", ["x", "t1"], ["xt"]), h.make_node("Mul", ["xt", "half"], ["y"])]
    return _model(nodes, [("x", [2, 16])], [("y", [2, 16])],
                  [c("three", 3.0), c("k", 0.044715), c("s", np.sqrt(2 / np.pi)), c("one", 1.0), c("half", 0.5)])


def test_gelu_tanh_form_overflows_fp16_beyond_40():
    g = _graph(gelu_tanh_model())
    plan = plan_precision(g, "auto", input_ranges={"x": (-50, 50)}, target_ops=EVERYWHERE)
    refused = [n for n in plan.nodes if n.verdicts["fp16"].status == REFUSED]
    assert refused and all(n.format != "fp16" for n in refused)
    w = refused[0].verdicts["fp16"].witness
    x = np.asarray(w.inputs["x"]).astype(np.float16)
    with np.errstate(over="ignore"):
        assert np.isinf(x * x * x).any()                                # x³ in float16
    # inside |x| <= 10 every node is certified safe in fp16
    plan = plan_precision(g, "auto", input_ranges={"x": (-10, 10)}, target_ops=EVERYWHERE)
    assert all(n.verdicts["fp16"].status == SAFE for n in plan.nodes)
    assert all(n.format == "fp16" for n in plan.nodes if n.op in EVERYWHERE["fp16"])


@pytest.mark.parametrize("fill", [-1e9, -np.inf])
def test_masked_softmax_is_refused_for_fp16(fill):
    mask = np.zeros((1, 8), np.float32)
    mask[0, 5:] = fill
    nodes = [h.make_node("Add", ["x", "mask"], ["s"]), h.make_node("Softmax", ["s"], ["y"], axis=-1)]
    g = _graph(_model(nodes, [("x", [4, 8])], [("y", [4, 8])], [nh.from_array(mask, "mask")]))
    plan = plan_precision(g, "auto", input_ranges={"x": (-3, 3)}, target_ops=EVERYWHERE)
    add, sm = _node(plan, "Add"), _node(plan, "Softmax")
    assert add.verdicts["fp16"].status == REFUSED and sm.verdicts["fp16"].status == REFUSED
    assert add.format == "" and sm.format == ""
    w = add.verdicts["fp16"].witness
    with np.errstate(over="ignore"):
        assert np.isinf(np.float16(w.value)) or np.isnan(w.value)       # -1e9 is -inf in float16
    # a fully masked row in float16 is NaN (exp(-inf - -inf)); float32 with -1e9 gives a finite softmax
    with np.errstate(all="ignore"):
        row = np.full(8, np.float16(fill))
        e = np.exp(row - row.max())
        assert np.isnan(e / e.sum()).all()
    assert sm.range.min >= 0 and sm.range.max <= 1 + 1e-5


def test_pow_in_a_decomposed_variance_is_refused_and_small_ranges_are_certified():
    nodes = [h.make_node("ReduceMean", ["x"], ["m"], axes=[-1]), h.make_node("Sub", ["x", "m"], ["c"]),
             h.make_node("Pow", ["c", "two"], ["c2"]), h.make_node("ReduceMean", ["c2"], ["y"], axes=[-1])]
    model = _model(nodes, [("x", [2, 32])], [("y", [2, 1])], [nh.from_array(np.array(2, np.float32), "two")])
    g = _graph(model)
    plan = plan_precision(g, "fp16", input_ranges={"x": (-500, 500)}, target_ops=EVERYWHERE)
    # the optimiser may have turned Pow(c, 2) into Mul(c, c): the squaring node, whichever it is
    square = next(n.op for n in g.nodes if n.op in ("Pow", "Mul"))
    pw = _node(plan, square)
    assert pw.verdicts["fp16"].status == REFUSED and pw.format == ""
    x = np.asarray(pw.verdicts["fp16"].witness.inputs["x"]).astype(np.float16)
    with np.errstate(all="ignore"):
        c = x - x.mean(axis=-1, keepdims=True, dtype=np.float16)
        assert np.isinf(np.power(c, np.float16(2))).any()
    plan = plan_precision(g, "fp16", input_ranges={"x": (-50, 50)}, target_ops=EVERYWHERE)
    assert _node(plan, square).format == "fp16"


def test_x_minus_max_is_tightened_by_the_affine_rule():
    nodes = [h.make_node("ReduceMax", ["x"], ["m"], axes=[-1]), h.make_node("Sub", ["x", "m"], ["c"]),
             h.make_node("Exp", ["c"], ["y"])]
    g = _graph(_model(nodes, [("x", [2, 8])], [("y", [2, 8])]))
    plan = plan_precision(g, "fp16", input_ranges={"x": (-20, 20)}, target_ops=EVERYWHERE, search_budget=0)
    e = plan.ranges[next(n.outputs[0].name for n in g.nodes if n.op == "Exp")]
    assert e.max <= 1.001                                               # not exp(40)
    sub = next(n for n in plan.nodes if n.op == "Sub")
    assert sub.verdicts["fp16"].method == "interval + affine"


def resnet_like(seed=0):
    """Conv-BN-Relu stem, MaxPool, a residual block (two 3x3 convs + skip), GlobalAveragePool, Gemm."""
    rng = np.random.default_rng(seed)
    w = lambda name, *shape: nh.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)
    bn = lambda p, c: [nh.from_array(rng.uniform(0.5, 1.5, c).astype(np.float32), p + "s"), w(p + "b", c),
                       w(p + "m", c), nh.from_array(rng.uniform(0.5, 2, c).astype(np.float32), p + "v")]
    nodes = [h.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], strides=[2, 2]),
             h.make_node("BatchNormalization", ["c0", "n0s", "n0b", "n0m", "n0v"], ["b0"]),
             h.make_node("Relu", ["b0"], ["r0"]),
             h.make_node("MaxPool", ["r0"], ["p0"], kernel_shape=[2, 2], strides=[2, 2]),
             h.make_node("Conv", ["p0", "w1", "bias1"], ["c1"], pads=[1, 1, 1, 1]),
             h.make_node("Relu", ["c1"], ["r1"]),
             h.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]),
             h.make_node("BatchNormalization", ["c2", "n2s", "n2b", "n2m", "n2v"], ["b2"]),
             h.make_node("Add", ["b2", "p0"], ["a"]), h.make_node("Relu", ["a"], ["r2"]),
             h.make_node("GlobalAveragePool", ["r2"], ["gp"]), h.make_node("Flatten", ["gp"], ["f"]),
             h.make_node("Gemm", ["f", "fw", "fb"], ["y"], transB=1)]
    inits = [w("w0", 8, 3, 3, 3), *bn("n0", 8), w("w1", 8, 8, 3, 3), w("bias1", 8), w("w2", 8, 8, 3, 3),
             *bn("n2", 8), w("fw", 10, 8), w("fb", 10)]
    return _model(nodes, [("x", [1, 3, 16, 16])], [("y", [1, 10])], inits)


def test_resnet_like_ranges_are_certified_and_sound_on_random_inputs():
    g = _graph(resnet_like())
    plan = plan_precision(g, "auto", input_ranges={"x": (0, 1)}, target_ops=EVERYWHERE)
    assert all(n.verdicts["fp16"].status == SAFE for n in plan.nodes), [n.reason for n in plan.nodes]
    assert all(n.range.bounded and n.range.origin == "certified" for n in plan.nodes)
    rng = np.random.default_rng(1)
    x = rng.random((200, 1, 3, 16, 16)).astype(np.float32)
    x[0], x[1] = 0, 1                                                   # the box's corners too
    _assert_sound(g, plan, [{"x": xi} for xi in x])


def _assert_sound(g, plan, feeds):
    """Every intermediate value of the optimised graph (onnxruntime), for every feed, inside its interval."""
    ort = pytest.importorskip("onnxruntime")
    m = export_model(g)
    tracked = [o for n in g.nodes for o in n.outputs if o.name in plan.ranges]
    have = {o.name for o in m.graph.output}
    for v in tracked:
        if v.name not in have:
            m.graph.output.append(h.make_tensor_value_info(v.name, T.FLOAT, None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    checked = 0
    for f in feeds:
        for name, val in zip(names, sess.run(None, f)):
            if name in plan.ranges:
                assert plan.ranges[name].contains(val).all(), (name, val.min(), val.max(), plan.ranges[name].text())
                checked += 1
    assert checked >= len(feeds) * len(tracked) // 2


def test_transformer_block_ranges_are_sound_on_random_inputs():
    from cuvil.testing.zoo import zoo_model
    p = Pipeline.from_onnx(zoo_model("bert-block")).optimize()
    p = p.specialize(p.resolve_shapes(None, None, {"x": [2, 12, 64], "attention_mask": [2, 12]})[0])
    g = p.graph
    plan = plan_precision(g, "auto", input_ranges={"x": (-3, 3), "attention_mask": (0, 1)}, search_budget=0)
    assert all(n.range is not None and n.range.bounded for n in plan.nodes), [n.name for n in plan.nodes
                                                                             if not n.range.bounded]
    rng = np.random.default_rng(2)
    feeds = []
    for i in range(200):
        x = rng.uniform(-3, 3, (2, 12, 64)).astype(np.float32)
        if i % 4 == 0:
            x = np.where(rng.random(x.shape) < 0.5, -3, 3).astype(np.float32)   # corners
        mask = (rng.random((2, 12)) < 0.7).astype(np.int64)
        mask[:, 0] = 1
        feeds.append({"x": x, "attention_mask": mask})
    _assert_sound(g, plan, feeds)


def test_calibration_ranges_are_measured_not_certified(tmp_path):
    g = _graph(layer_norm_model())
    np.save(tmp_path / "x.npy", np.random.default_rng(0).uniform(-2, 2, (16, 1, 4, 64)).astype(np.float32))
    plan = plan_precision(g, "auto", calibration=str(tmp_path), target_ops={"fp16": EVERYWHERE["fp16"]})
    assert plan.inputs["x"].origin == "measured"
    ln = _node(plan, "LayerNormalization")
    assert ln.verdicts["fp16"].origin == "measured" and "measured" in ln.verdicts["fp16"].detail
    assert ln.format == "" and "measured" in ln.reason                  # auto narrows on certified ranges only
    (tmp_path / "empty").mkdir()
    with pytest.raises(CuvilError, match="no .npy file"):
        plan_precision(g, "auto", calibration=str(tmp_path / "empty"))
    with pytest.raises(CuvilError, match="not a directory"):
        plan_precision(g, "auto", calibration=str(tmp_path / "nothing"))


def test_bad_ranges_and_modes_are_refused():
    g = _graph(layer_norm_model())
    with pytest.raises(CuvilError, match="not an input"):
        plan_precision(g, "auto", input_ranges={"z": (0, 1)})
    with pytest.raises(CuvilError, match="unknown precision"):
        plan_precision(g, "fp4")
    plan = plan_precision(g, "auto", target_ops={"fp16": EVERYWHERE["fp16"]})
    ln = _node(plan, "LayerNormalization")                                # no range: output still bounded
    assert ln.verdicts["fp16"].status == UNKNOWN and "no declared range" in ln.verdicts["fp16"].detail


def test_compile_records_the_precision_per_node(tmp_path, monkeypatch):
    from cuvil.targets.x86.target import X86Target
    monkeypatch.setattr(X86Target, "precision_ops", lambda self, options: {"bf16": frozenset({"Gemm"})},
                        raising=False)
    model = _model([h.make_node("Gemm", ["x", "w"], ["g"], transB=1), h.make_node("LayerNormalization",
                    ["g", "s", "b"], ["y"], axis=-1)], [("x", [2, 8])], [("y", [2, 4])],
                   [nh.from_array(np.ones((4, 8), np.float32), "w"), nh.from_array(np.ones(4, np.float32), "s"),
                    nh.from_array(np.zeros(4, np.float32), "b")])
    art = Pipeline.from_onnx(model).optimize().compile(precision="auto", input_ranges={"x": (-1, 1)})
    pr = art.manifest["precision"]
    fmts = {v["op"]: v["format"] for v in pr["nodes"].values()}
    assert fmts["Gemm"] == "bf16" and fmts["LayerNormalization"] == "fp32"
    assert "no" in pr["nodes"][next(k for k, v in pr["nodes"].items() if v["op"] == "LayerNormalization")]["reason"]
    out = art.run({"x": np.full((2, 8), 0.5, np.float32)})
    assert np.isfinite(next(iter(out.values()))).all()
    plain = Pipeline.from_onnx(model).optimize().compile()
    assert "precision" not in plain.manifest


def test_cli_report_and_errors(tmp_path, capsys):
    path = tmp_path / "ln.onnx"
    onnx.save(layer_norm_model(), path)
    assert main(["precision", "report", str(path), "--input-range", "x=-1000:1000", "--json",
                 str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "counterexample" in out and "overflow paths per layer type" in out and "LayerNormalization" in out
    assert json.loads((tmp_path / "r.json").read_text())["inputs"]["x"]["origin"] == "certified"
    assert main(["precision", "report", str(path), "--input-range", "x=3"]) == 2
    assert "NAME=LO:HI" in capsys.readouterr().err
    assert main(["precision", "report", str(path), "--precision", "fp4"]) == 2


def test_gelu_op_tanh_form_cube_is_an_internal_overflow():
    model = _model([h.make_node("Gelu", ["x"], ["y"], approximate="tanh")], [("x", [2, 16])], [("y", [2, 16])])
    model.opset_import[0].version = 20
    g = _graph(model)
    if not any(n.op == "Gelu" for n in g.nodes):
        pytest.skip("Gelu is imported as its function body here; the decomposed form is tested above")
    plan = plan_precision(g, "auto", input_ranges={"x": (-45, 45)}, target_ops={"fp16": frozenset({"Gelu"})})
    v = _node(plan, "Gelu").verdicts["fp16"]
    assert v.status == REFUSED and "x^3" in v.detail
    with np.errstate(over="ignore"):
        x = np.asarray(v.witness.inputs["x"]).astype(np.float16)
        assert np.isinf(x * x * x).any()


def test_z3_certifies_what_intervals_over_approximate():
    # x + x·(-0.9) = 0.1·x: intervals treat the two operands as independent (±57000 for x in ±30000, past fp16's
    # margin); Z3 on the elementwise cone sees one x and proves |y| <= 3000
    nodes = [h.make_node("Mul", ["x", "k"], ["xk"]), h.make_node("Add", ["x", "xk"], ["y"])]
    model = _model(nodes, [("x", [4, 8])], [("y", [4, 8])], [nh.from_array(np.array(-0.9, np.float32), "k")])
    g = _graph(model)
    add = next(n for n in g.nodes if n.op == "Add")
    plan = plan_precision(g, "fp16", input_ranges={"x": (-3e4, 3e4)}, target_ops={"fp16": frozenset({"Add"})})
    assert plan.ranges[add.outputs[0].name].max_abs > 32752                # the interval alone cannot
    v = _node(plan, "Add").verdicts["fp16"]
    assert v.status == SAFE and v.method == "interval + Z3 (local)", v
    assert _node(plan, "Add").format == "fp16"
    plan = plan_precision(g, "fp16", input_ranges={"x": (-3e4, 3e4)}, target_ops={"fp16": frozenset({"Add"})},
                          z3_rlimit=0)
    assert _node(plan, "Add").verdicts["fp16"].status == UNKNOWN          # without Z3: unknown, kept float32
    # a real overflow is not certified: x + 1.5·x = 2.5·x; Z3 finds an input, running the model confirms it
    model.graph.initializer[0].CopyFrom(nh.from_array(np.array(1.5, np.float32), "k"))
    g = _graph(model)
    plan = plan_precision(g, "fp16", input_ranges={"x": (-3e4, 3e4)}, target_ops={"fp16": frozenset({"Add"})},
                          search_budget=0)
    v = _node(plan, "Add").verdicts["fp16"]
    assert v.status == REFUSED and v.method == "Z3 + run", v
    assert abs(v.witness.value) > 32752 and np.all(np.abs(v.witness.inputs["x"]) <= 3e4)
    # a declared range the format cannot hold is refused at its edge
    plan = plan_precision(g, "fp16", input_ranges={"x": (-1e6, 1e6)}, target_ops={"fp16": frozenset({"Add"})})
    v = _node(plan, "Add").verdicts["fp16"]
    assert v.status == REFUSED and v.method == "declared range"


def test_z3_never_certifies_a_division_by_a_range_holding_zero():
    nodes = [h.make_node("Div", ["one", "x"], ["y"])]
    model = _model(nodes, [("x", [4])], [("y", [4])], [nh.from_array(np.array(1.0, np.float32), "one")])
    plan = plan_precision(_graph(model), "fp16", input_ranges={"x": (-1, 1)}, target_ops={"fp16": frozenset({"Div"})},
                          search_budget=0)
    assert _node(plan, "Div").verdicts["fp16"].status != SAFE


def deep_matmul_chain(layers=6, scale=1e8, n=16):
    """MatMuls whose weights' row sums of |W| are ``n * scale``: the intervals pass bf16's ±1.7e38 margin after a
    few layers although real values stay far from it (each W is a scaled orthogonal-ish sign pattern)."""
    rng = np.random.default_rng(3)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (np.sign(rng.standard_normal((n, n))) * scale / n).astype(np.float32)
        inits.append(nh.from_array(w, f"w{i}"))
        nodes.append(h.make_node("MatMul", [x, f"w{i}"], [f"y{i}"]))
        x = f"y{i}"
    nodes.append(h.make_node("Identity", [x], ["out"]))
    return _model(nodes, [("x", [1, n])], [("out", [1, n])], inits)


def test_bf16_rounding_lemma_is_proved_by_z3():
    from cuvil.precision.relative import rounding_lemma
    assert "Z3 (bit-exact)" in rounding_lemma()


def test_explicit_bf16_narrows_uncertified_contractions_relative_to_float32_and_auto_does_not():
    from cuvil.precision.relative import RELATIVE
    g = _graph(deep_matmul_chain())
    box = {"x": (-1, 1)}
    auto = plan_precision(g, "auto", input_ranges=box, target_ops=EVERYWHERE, search_budget=0)
    bf16 = plan_precision(g, "bf16", input_ranges=box, target_ops=EVERYWHERE, search_budget=0)
    fp16 = plan_precision(g, "fp16", input_ranges=box, target_ops=EVERYWHERE, search_budget=0)
    mm = lambda plan: [n for n in plan.nodes if n.op == "MatMul"]
    deep = [n for n in mm(auto) if n.verdicts["bf16"].status == UNKNOWN]
    assert deep, "the chain should outgrow bf16's certified margin"
    assert all(n.format != "bf16" for n in deep)                   # auto: absolute certificates only
    by_name = {n.name: n for n in bf16.nodes}
    for n in deep:
        p = by_name[n.name]
        assert p.format == "bf16" and p.certificate == RELATIVE and "relative to float32" in p.reason
    assert all(p.certificate == "range" for p in mm(bf16) if p.name not in {n.name for n in deep})
    assert bf16.manifest()["relative_to_float32"] == len(deep)
    assert "relative_to_float32" not in auto.manifest()
    assert not any(n.certificate == RELATIVE for n in fp16.nodes)  # fp16's range is not float32's
    from cuvil.precision.report import format_report
    assert f"of which bf16 relative to float32 (explicit --precision bf16; range not certified): {len(deep)}" \
        in format_report(bf16)


def test_a_refused_contraction_is_not_narrowed_on_the_relative_certificate():
    # inputs up to 1e30 through weights of row sum 1.6e9: float32 itself overflows; the search shows it
    g = _graph(deep_matmul_chain(layers=1, scale=1.6e9))
    plan = plan_precision(g, "bf16", input_ranges={"x": (-1e30, 1e30)}, target_ops=EVERYWHERE, search_budget=8)
    n = _node(plan, "MatMul")
    assert n.verdicts["bf16"].status == REFUSED and n.format == "" and n.certificate == ""


def test_recheck_reverts_a_narrowing_whose_rounding_overflows_a_sum_downstream_unless_bf16_is_explicit():
    # y = x @ W is certified within bf16's margin (|y| <= 1.695e38); y + y is bounded in float32 (3.39e38) but
    # not once y's bf16 rounding is added: auto reverts the MatMul, an explicit bf16 keeps it on the relative
    # certificate (Add only passes magnitudes on)
    from cuvil.precision.relative import RELATIVE
    n = 16
    w = np.full((n, n), 1.695e38 / n, np.float32)
    model = _model([h.make_node("MatMul", ["x", "w"], ["y"]), h.make_node("Add", ["y", "y"], ["z"])],
                   [("x", [1, n])], [("z", [1, n])], [nh.from_array(w, "w")])
    g = _graph(model)
    auto = plan_precision(g, "auto", input_ranges={"x": (-1, 1)}, target_ops=EVERYWHERE, search_budget=0)
    bf16 = plan_precision(g, "bf16", input_ranges={"x": (-1, 1)}, target_ops=EVERYWHERE, search_budget=0)
    assert _node(auto, "MatMul").format != "bf16"
    mm = _node(bf16, "MatMul")
    assert mm.format == "bf16" and mm.certificate == RELATIVE, mm.reason


def _bench_bert_like(layers, **kw):
    """bench/attention.py's ``bert_like`` (the encoder bench/precision_speed.py times for issue 21's BERT row)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "attention.py")
    spec = importlib.util.spec_from_file_location("bench_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.bert_like(layers, **kw)


def test_a_deep_bert_like_encoder_is_certified_layer_after_layer():
    # Issue 21's BERT rows rest on this. Before session 23 the LayerNorm bound was padded for a folded
    # x·s + (beta - mean·s) (terms up to |x|·|gamma|/sqrt(eps)), so through 8 post-norm layers the intervals
    # compounded past bf16's margin and the last layers' MatMuls were only narrowed on the relative
    # certificate. With the bound of the kernels' own two-pass computation (beta ± sqrt(N)·|gamma|, whatever
    # the input) every layer starts again from the same range: each MatMul's inputs are certified, in auto as
    # in an explicit bf16, layer 8's the same as layer 1's.
    from cuvil.precision.relative import RELATIVE
    g = Pipeline.from_onnx(_bench_bert_like(8, hidden=64, heads=4, ffn=256)).optimize().specialize(
        {"B": 1, "S": 16}).graph
    box = {"x": (-4, 4), "attention_mask": (0, 1)}
    ops = {"bf16": EVERYWHERE["bf16"]}
    auto = plan_precision(g, "auto", input_ranges=box, target_ops=ops, search_budget=0)
    bf16 = plan_precision(g, "bf16", input_ranges=box, target_ops=ops, search_budget=0)
    mm = lambda plan: [n for n in plan.nodes if n.op == "MatMul"]
    assert len(mm(bf16)) == 8 * 8
    for plan in (auto, bf16):
        assert all(n.format == "bf16" and n.certificate == "range" for n in mm(plan)), \
            [(n.name, n.reason) for n in mm(plan) if n.format != "bf16" or n.certificate != "range"]
    assert not any(n.certificate == RELATIVE for n in bf16.nodes)
    lns = [n for n in g.nodes if n.op == "LayerNormalization"]
    first, last = (bf16.ranges[n.outputs[0].name].max_abs for n in (lns[0], lns[-1]))
    assert last <= 1.01 * first + 1.0      # no compounding: the gammas and betas alone set each layer's range


def test_reconcile_counts_only_the_nodes_still_narrowed_on_the_relative_certificate():
    # x86 fuses attention's MatMuls into a float32 kernel after the policy ran: those records become fp32, keep
    # the policy's format and certificate as policy_*, and relative_to_float32 counts what really runs in bf16
    from cuvil.precision.policy import apply_precision, reconcile
    from cuvil.precision.relative import RELATIVE
    g = _graph(deep_matmul_chain())
    plan = plan_precision(g, "bf16", input_ranges={"x": (-1, 1)}, target_ops=EVERYWHERE, search_budget=0)
    relative = [n.name for n in plan.nodes if n.certificate == RELATIVE]
    assert len(relative) >= 2
    built = apply_precision(g, plan)
    next(n for n in built.nodes if n.name == relative[0]).precision = ""    # as if rewritten into a float32 kernel
    entry = reconcile(plan.manifest(), built, "rewritten")
    gone = entry["nodes"][relative[0]]
    assert gone["format"] == "fp32" and gone["policy_format"] == "bf16" and gone["policy_certificate"] == RELATIVE
    assert "certificate" not in gone
    assert entry["relative_to_float32"] == len(relative) - 1 == plan.manifest()["relative_to_float32"] - 1
    assert entry["counts"]["bf16"] == plan.manifest()["counts"]["bf16"] - 1
