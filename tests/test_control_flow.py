"""ONNX control flow (If, Loop, Scan), expanded on import (cuvil.frontend.subgraphs), against onnxruntime.

Hand-written graphs: an If on a run-time condition (one library over a range of batch sizes), an If whose
condition folds (its untaken branch does not even fit the shapes), a Loop with a compile-time trip count
and a data-dependent early exit (predicated), Loop scan outputs, Scan computing running sums in every
direction and axis, an If nested in a Loop body; the constructs left unsupported each raise one
UnsupportedOpError naming op, node and opset; the same expansion through the GPU target assembles.
"""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

from cuvil import Pipeline
from cuvil.errors import UnsupportedOpError
from cuvil.frontend import import_model
from cuvil.targets.ptx import assemble, find_ptxas, generate_ptx
from cuvil.targets.ptx.codegen import gpu_schedule
from cuvil.testing.oracles import ort_session

OPSET = 17
PTXAS = find_ptxas()


def vi(name, dtype, shape):
    """A tensor's value info; ``shape`` None: rank 2 of unnamed dims (onnx's checker wants a shape)."""
    return h.make_tensor_value_info(name, dtype, shape if shape is not None else ["", ""])


def model(nodes, inputs, outputs, inits=(), opset=OPSET):
    m = h.make_model(h.make_graph(nodes, "g", inputs, outputs, list(inits)),
                     opset_imports=[h.make_opsetid("", opset)])
    onnx.checker.check_model(m, full_check=True)
    return m


def scalar(name, value, dtype=T.FLOAT):
    return h.make_tensor(name, dtype, [], [value])


def check(m, feeds_list, profiles=None, rtol=1e-6, atol=1e-6):
    """Compile once, run every feed set, compare each output with onnxruntime."""
    art = Pipeline.from_onnx(m).optimize().compile(shape_profiles=profiles)
    sess = ort_session(m)
    names = [o.name for o in m.graph.output]
    for feeds in feeds_list:
        got = art.run(feeds)
        want = sess.run(None, feeds)
        for name, w in zip(names, want):
            assert got[name].shape == w.shape, (name, got[name].shape, w.shape)
            assert got[name].dtype == w.dtype, (name, got[name].dtype, w.dtype)
            np.testing.assert_allclose(got[name], w, rtol=rtol, atol=atol, err_msg=name)
    return art


def ops_of(m):
    return {n.op for n in import_model(m).nodes}


# --- If -------------------------------------------------------------------------------------------------

def runtime_if_model(n="N"):
    """y = x * 2 + b if sum(x) > 0 else -x (batch n, symbolic by default), and an int64 output from the
    branches."""
    then_g = h.make_graph([h.make_node("Mul", ["x", "two"], ["m"]), h.make_node("Add", ["m", "b"], ["y_then"]),
                           h.make_node("Constant", [], ["k_then"], value=h.make_tensor("k", T.INT64, [1], [7]))],
                          "then", [], [vi("y_then", T.FLOAT, [n, 3]), vi("k_then", T.INT64, [1])],
                          [scalar("two", 2.0)])
    else_g = h.make_graph([h.make_node("Neg", ["x"], ["y_else"]),
                           h.make_node("Constant", [], ["k_else"], value=h.make_tensor("k", T.INT64, [1], [-3]))],
                          "else", [], [vi("y_else", T.FLOAT, [n, 3]), vi("k_else", T.INT64, [1])])
    return model([h.make_node("ReduceSum", ["x"], ["s"], keepdims=1),         # s: [1, 1], one element
                  h.make_node("Greater", ["s", "zero"], ["c"]),
                  h.make_node("If", ["c"], ["y", "k"], then_branch=then_g, else_branch=else_g, name="the_if")],
                 [vi("x", T.FLOAT, [n, 3])], [vi("y", T.FLOAT, [n, 3]), vi("k", T.INT64, [1])],
                 [scalar("zero", 0.0), h.make_tensor("b", T.FLOAT, [3], [0.5, -1.0, 2.0])])


def test_if_on_a_runtime_condition_selects_per_run():
    m = runtime_if_model()
    assert {"Where"} <= ops_of(m) and not {"If"} & ops_of(m)
    rng = np.random.default_rng(0)
    feeds = []
    for n in (1, 3, 8):
        x = rng.standard_normal((n, 3)).astype(np.float32)
        feeds += [{"x": np.abs(x)}, {"x": -np.abs(x)}, {"x": np.zeros((n, 3), np.float32)}]
    check(m, feeds, profiles={"N": (1, 4, 8)})


def test_if_whose_condition_folds_inlines_its_branch():
    # cond = (Shape(x)[1] == 4): known at compile time, though x's batch is symbolic. The else branch
    # reshapes x to [-1, 5], which does not fit these shapes: it must never be imported.
    then_g = h.make_graph([h.make_node("Relu", ["x"], ["t"])], "then", [], [vi("t", T.FLOAT, None)])
    else_g = h.make_graph([h.make_node("Reshape", ["x", "five"], ["e"])], "else", [], [vi("e", T.FLOAT, None)],
                          [h.make_tensor("five", T.INT64, [2], [-1, 5])])
    m = model([h.make_node("Shape", ["x"], ["s"]),
               h.make_node("Gather", ["s", "one"], ["d"], axis=0),
               h.make_node("Equal", ["d", "four"], ["c"]),
               h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
              [vi("x", T.FLOAT, ["N", 4])], [vi("y", T.FLOAT, None)],
              [h.make_tensor("one", T.INT64, [], [1]), h.make_tensor("four", T.INT64, [], [4])])
    ops = ops_of(m)
    assert "Relu" in ops and "Where" not in ops and "Reshape" not in ops
    rng = np.random.default_rng(1)
    check(m, [{"x": rng.standard_normal((n, 4)).astype(np.float32)} for n in (1, 5)], profiles={"N": (1, 2, 8)})


def test_runtime_if_with_branches_of_different_shapes_is_one_clear_error():
    then_g = h.make_graph([h.make_node("Identity", ["x"], ["t"])], "then", [], [vi("t", T.FLOAT, [2, 3])])
    else_g = h.make_graph([h.make_node("ReduceSum", ["x"], ["e"], keepdims=0)], "else", [], [vi("e", T.FLOAT, [])])
    m = model([h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g, name="shape_if")],
              [vi("c", T.BOOL, []), vi("x", T.FLOAT, [2, 3])], [vi("y", T.FLOAT, None)])
    with pytest.raises(UnsupportedOpError, match=r"unsupported op If \(node 'shape_if', opset 17\): .*differ"):
        import_model(m)


# --- Loop -----------------------------------------------------------------------------------------------

def early_exit_loop_model(with_scan=False):
    """acc doubles plus x each iteration while max(acc) < limit, at most M = Shape(x)[0] iterations (M is
    computed from the input's static shape; the exit is data-dependent)."""
    body_nodes = [h.make_node("Mul", ["acc_in", "two"], ["a2"]), h.make_node("Add", ["a2", "x"], ["acc_out"]),
                  h.make_node("ReduceMax", ["acc_out"], ["mx"], keepdims=0),
                  h.make_node("Less", ["mx", "limit"], ["cond_out"]),
                  h.make_node("Cast", ["i"], ["i_f"], to=T.FLOAT),
                  h.make_node("Add", ["i_f", "one_f"], ["i1"])]
    outs = [vi("cond_out", T.BOOL, []), vi("acc_out", T.FLOAT, [6])]
    if with_scan:
        outs.append(vi("i1", T.FLOAT, []))
    body = h.make_graph(body_nodes, "body", [vi("i", T.INT64, []), vi("cond_in", T.BOOL, []),
                                              vi("acc_in", T.FLOAT, [6])], outs,
                        [scalar("two", 2.0), scalar("one_f", 1.0)])
    loop_outs = ["acc", "iters"] if with_scan else ["acc"]
    g_outs = [vi("acc", T.FLOAT, [6])] + ([vi("iters", T.FLOAT, [""])] if with_scan else [])
    return model([h.make_node("Shape", ["x"], ["s"]), h.make_node("Gather", ["s", "zero"], ["M"], axis=0),
                  h.make_node("Loop", ["M", "go", "acc0"], loop_outs, body=body, name="the_loop")],
                 [vi("x", T.FLOAT, [6]), vi("acc0", T.FLOAT, [6]), vi("go", T.BOOL, []), vi("limit", T.FLOAT, [])],
                 g_outs, [h.make_tensor("zero", T.INT64, [], [0])])


def test_loop_with_a_data_dependent_early_exit():
    m = early_exit_loop_model()
    assert {"Where", "And"} <= ops_of(m) and "Loop" not in ops_of(m)   # predicated after the first iteration
    rng = np.random.default_rng(2)
    feeds = []
    for limit in (-1.0, 0.5, 3.0, 20.0, 1e9):   # exits after 1, a few, or all 6 iterations
        for go in (True, False):
            feeds.append({"x": rng.uniform(0, 1, 6).astype(np.float32), "acc0": rng.uniform(0, 1, 6).astype(np.float32),
                          "go": np.array(go), "limit": np.array(limit, np.float32)})
    check(m, feeds)


@pytest.mark.parametrize("trip", [6, 1, 0, -2])
def test_loop_scan_outputs_with_a_static_exit(trip):
    # The body's condition passes its input through: known at compile time, so the scan output's
    # length is the trip count, stacked along a new axis 0 (empty for no iteration, as for M < 0).
    body = h.make_graph([h.make_node("Add", ["acc_in", "x"], ["acc_out"]), h.make_node("Identity", ["c_in"], ["c_out"]),
                         h.make_node("Mul", ["acc_out", "acc_out"], ["sq"])], "body",
                        [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("acc_in", T.FLOAT, [2, 2])],
                        [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, [2, 2]), vi("sq", T.FLOAT, [2, 2])])
    m = model([h.make_node("Loop", ["M", "", "a0"], ["a", "sqs"], body=body)],
              [vi("x", T.FLOAT, [2, 2]), vi("a0", T.FLOAT, [2, 2])],
              [vi("a", T.FLOAT, [2, 2]), vi("sqs", T.FLOAT, ["", 2, 2])], [h.make_tensor("M", T.INT64, [], [trip])])
    rng = np.random.default_rng(3)
    check(m, [{"x": rng.standard_normal((2, 2)).astype(np.float32), "a0": rng.standard_normal((2, 2)).astype(np.float32)}],
          rtol=1e-5)


def test_if_nested_in_a_loop_body():
    # Each iteration: if i is even (folds per unrolled iteration) add x, else take an If on the data
    # (sum(acc) > 0: a run-time select) between acc * 0.5 and acc - 1.
    inner_then = h.make_graph([h.make_node("Mul", ["acc_in", "half"], ["p"])], "p", [], [vi("p", T.FLOAT, [3])],
                              [scalar("half", 0.5)])
    inner_else = h.make_graph([h.make_node("Sub", ["acc_in", "one"], ["q"])], "q", [], [vi("q", T.FLOAT, [3])],
                              [scalar("one", 1.0)])
    odd = h.make_graph([h.make_node("ReduceSum", ["acc_in"], ["s"], keepdims=0),
                        h.make_node("Greater", ["s", "zero"], ["pos"]),
                        h.make_node("If", ["pos"], ["r"], then_branch=inner_then, else_branch=inner_else)],
                       "odd", [], [vi("r", T.FLOAT, [3])], [scalar("zero", 0.0)])
    even = h.make_graph([h.make_node("Add", ["acc_in", "x"], ["e"])], "even", [], [vi("e", T.FLOAT, [3])])
    body = h.make_graph([h.make_node("Mod", ["i", "two"], ["r2"]), h.make_node("Equal", ["r2", "zero_i"], ["is_even"]),
                         h.make_node("If", ["is_even"], ["acc_out"], then_branch=even, else_branch=odd),
                         h.make_node("Identity", ["c_in"], ["c_out"])], "body",
                        [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("acc_in", T.FLOAT, [3])],
                        [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, [3])],
                        [h.make_tensor("two", T.INT64, [], [2]), h.make_tensor("zero_i", T.INT64, [], [0])])
    m = model([h.make_node("Loop", ["M", "", "a0"], ["a"], body=body)],
              [vi("x", T.FLOAT, [3]), vi("a0", T.FLOAT, [3])], [vi("a", T.FLOAT, [3])],
              [h.make_tensor("M", T.INT64, [], [5])])
    assert "If" not in ops_of(m)
    rng = np.random.default_rng(4)
    check(m, [{"x": rng.standard_normal(3).astype(np.float32) * s, "a0": rng.standard_normal(3).astype(np.float32)}
              for s in (0.1, 1.0, -3.0, 5.0)], rtol=1e-5)


def test_loop_trip_count_known_only_at_run_time_runs_at_run_time():
    # (formerly refused; now a run-time loop: tests/test_runtime_loops.py) the body passes its carried value
    # through (the next value is a view of its own state slot)
    body = h.make_graph([h.make_node("Identity", ["c_in"], ["c_out"]), h.make_node("Identity", ["v_in"], ["v_out"])],
                        "body", [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("v_in", T.FLOAT, [2])],
                        [vi("c_out", T.BOOL, []), vi("v_out", T.FLOAT, [2])])
    m = model([h.make_node("Loop", ["M", "", "v"], ["w"], body=body, name="dyn_loop")],
              [vi("M", T.INT64, []), vi("v", T.FLOAT, [2])], [vi("w", T.FLOAT, [2])])
    assert "LoopState" in ops_of(m)
    check(m, [{"M": np.array(n, np.int64), "v": np.array([1.5, -2.0], np.float32)} for n in (0, 3)])


def test_loop_scan_output_under_a_runtime_exit_is_one_clear_error():
    with pytest.raises(UnsupportedOpError, match=r"Loop \(node 'the_loop', opset 17\): .*data-dependent"):
        import_model(early_exit_loop_model(with_scan=True))


# --- Scan -----------------------------------------------------------------------------------------------

def running_sum_model(in_axis=0, in_dir=0, out_axis=0, out_dir=0, opset=OPSET):
    """Scan over x (sequence axis in_axis): state += x_t, scan output the running sum and x_t * state."""
    body = h.make_graph([h.make_node("Add", ["s_in", "x_t"], ["s_out"]), h.make_node("Identity", ["s_out"], ["y_t"]),
                         h.make_node("Mul", ["x_t", "s_in"], ["z_t"])], "body",
                        [vi("s_in", T.FLOAT, [4]), vi("x_t", T.FLOAT, [4])],
                        [vi("s_out", T.FLOAT, [4]), vi("y_t", T.FLOAT, [4]), vi("z_t", T.FLOAT, [4])])
    x_shape = [5, 4] if in_axis in (0, -2) else [4, 5]
    return model([h.make_node("Scan", ["s0", "x"], ["s", "y", "z"], body=body, num_scan_inputs=1,
                              scan_input_axes=[in_axis], scan_input_directions=[in_dir],
                              scan_output_axes=[out_axis, 0], scan_output_directions=[out_dir, 1 - out_dir])],
                 [vi("s0", T.FLOAT, [4]), vi("x", T.FLOAT, x_shape)],
                 [vi("s", T.FLOAT, [4]), vi("y", T.FLOAT, None), vi("z", T.FLOAT, None)], opset=opset)


@pytest.mark.parametrize("in_axis,in_dir,out_axis,out_dir", [(0, 0, 0, 0), (1, 1, 1, 0), (-1, 0, -1, 1), (-2, 1, 0, 1)])
def test_scan_running_sum(in_axis, in_dir, out_axis, out_dir):
    m = running_sum_model(in_axis, in_dir, out_axis, out_dir)
    rng = np.random.default_rng(5)
    x_shape = [d.dim_value for d in m.graph.input[1].type.tensor_type.shape.dim]
    check(m, [{"s0": rng.standard_normal(4).astype(np.float32), "x": rng.standard_normal(x_shape).astype(np.float32)}],
          rtol=1e-5, atol=1e-6)




# --- GPU: the expansion goes through the shared lowering ---------------------------------------------------

@pytest.mark.skipif(PTXAS is None, reason="ptxas not found (no CUDA toolkit): PTX cannot be assembled here")
def test_control_flow_assembles_for_the_gpu():
    g = Pipeline.from_onnx(runtime_if_model(4)).optimize().graph
    assert "Where" in {n.op for n in g.nodes}
    ptx, descs = generate_ptx(gpu_schedule(g), "sm_90")
    _, info = assemble(ptx, "sm_90", PTXAS)
    assert set(info) == {d.name for d in descs}


# --- inputs fixed at compile time ---------------------------------------------------------------------------

def test_input_values_fix_an_input_an_if_branches_on():
    # The branches differ in shape, so a run-time sr is refused; input_values={"sr": ...} keeps one branch
    # and sr leaves the compiled model's inputs.
    then_g = h.make_graph([h.make_node("Identity", ["x"], ["t"])], "then", [], [vi("t", T.FLOAT, [4])])
    else_g = h.make_graph([h.make_node("Slice", ["x", "zero", "two"], ["e"])], "else", [], [vi("e", T.FLOAT, [2])],
                          [h.make_tensor("zero", T.INT64, [1], [0]), h.make_tensor("two", T.INT64, [1], [2])])
    m = model([h.make_node("Equal", ["sr", "k16"], ["c"]),
               h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g, name="sr_if")],
              [vi("x", T.FLOAT, [4]), vi("sr", T.INT64, [])], [vi("y", T.FLOAT, [""])],
              [h.make_tensor("k16", T.INT64, [], [16000])])
    with pytest.raises(UnsupportedOpError, match=r"If \(node 'sr_if', opset 17\)"):
        import_model(m)
    x = np.arange(4, dtype=np.float32)
    sess = ort_session(m)
    for sr in (16000, 8000):
        p = Pipeline.from_onnx(m, input_values={"sr": sr}).optimize()
        assert [v.name for v in p.graph.inputs] == ["x"]
        got = p.compile().run({"x": x})["y"]
        np.testing.assert_array_equal(got, sess.run(None, {"x": x, "sr": np.array(sr, np.int64)})[0])


def test_input_values_are_checked():
    m = runtime_if_model(2)
    from cuvil.errors import ModelLoadError, ShapeError
    with pytest.raises(ModelLoadError, match=r"(?s)no input of.*next: name its inputs: 'x'"):
        import_model(m, input_values={"sr": 1})
    with pytest.raises(ShapeError, match=r"input_values\['x'\] has shape \[3\]"):
        import_model(m, input_values={"x": np.zeros(3)})


# --- a packaged model: Silero VAD (If on the sample rate) -----------------------------------------------------

def _silero(name):
    import os
    for d in (os.environ.get("CUVIL_SILERO_DIR", ""), os.path.join(os.path.dirname(__file__), "fixtures", "packaged")):
        if d and os.path.isfile(os.path.join(d, name)):
            return os.path.join(d, name)
    pytest.fail(f"{name} not found in tests/fixtures/packaged (nor CUVIL_SILERO_DIR): it is committed there")


@pytest.mark.parametrize("sr,S", [(16000, 512), (8000, 256)])
def test_silero_vad_if_on_the_sample_rate(sr, S):
    # silero_vad_op18_ifless: one If on sr around the 16 kHz and 8 kHz models (LSTM cells as Gemm). A run-time
    # sr computes both branches and selects; input_values={"sr": sr} keeps one. Both against onnxruntime.
    path = _silero("silero_vad_op18_ifless.onnx")
    sess = ort_session(onnx.load(path))
    rng = np.random.default_rng(6)
    runtime = Pipeline.from_onnx(path).optimize().compile(shape_profiles={"batch": (1, 1, 4), "sequence": (256, 512, 512)})
    fixed = Pipeline.from_onnx(path, input_values={"sr": sr}).optimize().compile(
        shape_profiles={"batch": (1, 1, 4), "sequence": (256, 512, 512)})
    for b in (1, 3):
        feeds = {"input": rng.standard_normal((b, S)).astype(np.float32) * 0.1,
                 "state": rng.standard_normal((2, b, 128)).astype(np.float32) * 0.3, "sr": np.array(sr, np.int64)}
        want = dict(zip(["output", "stateN"], sess.run(None, feeds)))
        for got in (runtime.run(feeds), fixed.run({k: v for k, v in feeds.items() if k != "sr"})):
            for k, w in want.items():
                assert got[k].shape == w.shape
                assert np.abs(got[k] - w).max() <= 1e-4 * np.abs(w).max(), k


def test_runtime_if_on_a_symbolic_dim_folds_once_the_dim_is_fixed():
    # cond = (N == 1) reads a symbolic dim: a Where over both branches in the generic library; with N fixed
    # the condition folds and the select goes, leaving one branch.
    then_g = h.make_graph([h.make_node("Relu", ["x"], ["t"])], "then", [], [vi("t", T.FLOAT, ["N", 3])])
    else_g = h.make_graph([h.make_node("Neg", ["x"], ["e"])], "else", [], [vi("e", T.FLOAT, ["N", 3])])
    m = model([h.make_node("Shape", ["x"], ["s"]), h.make_node("Gather", ["s", "zero"], ["n"], axis=0),
               h.make_node("Equal", ["n", "one"], ["c"]),
               h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
              [vi("x", T.FLOAT, ["N", 3])], [vi("y", T.FLOAT, ["N", 3])],
              [h.make_tensor("zero", T.INT64, [], [0]), h.make_tensor("one", T.INT64, [], [1])])
    p = Pipeline.from_onnx(m).optimize()
    assert "Where" in {n.op for n in p.graph.nodes}
    for n, kept, gone in ((1, "Relu", "Neg"), (3, "Neg", "Relu")):
        ops = {x.op for x in p.specialize({"N": n}).graph.nodes}
        assert kept in ops and gone not in ops and "Where" not in ops, ops
    rng = np.random.default_rng(7)
    check(m, [{"x": rng.standard_normal((n, 3)).astype(np.float32)} for n in (1, 2, 3)], profiles={"N": (1, 1, 4)})


@pytest.mark.parametrize("sr,S,B", [(16000, 512, 1), (8000, 256, 2)])
def test_silero_vad_with_lstm_inside_its_ifs(sr, S, B):
    # silero_vad.onnx: 25 Ifs (the sample rate's, and the exporter's "squeeze if the dim is 1" guards, whose
    # branches differ in rank), LSTMs inside them. With sr fixed and static shapes every condition folds.
    from cuvil.ir.registry import all_ops
    if "LSTM" not in all_ops():
        pytest.skip("LSTM is not registered in this tree")
    path = _silero("silero_vad.onnx")
    m = onnx.load(path)
    for v in m.graph.input:
        dims = v.type.tensor_type.shape.dim
        if v.name == "input":
            dims[0].dim_value, dims[1].dim_value = B, S
        elif v.name == "state":
            dims[1].dim_value = B
    art = Pipeline.from_onnx(m, input_values={"sr": sr}).optimize().compile()
    sess = ort_session(onnx.load(path))
    rng = np.random.default_rng(8)
    for scale in (0.05, 1.0):
        feeds = {"input": rng.standard_normal((B, S)).astype(np.float32) * scale,
                 "state": rng.standard_normal((2, B, 128)).astype(np.float32) * 0.3}
        want = dict(zip(["output", "stateN"], sess.run(None, dict(feeds, sr=np.array(sr, np.int64)))))
        got = art.run(feeds)
        for k, w in want.items():
            assert got[k].shape == w.shape
            assert np.abs(got[k] - w).max() <= 1e-4 * np.abs(w).max(), k


# --- run-time branch choice: the steps of the branch not taken are skipped (x86) -------------------------------

def heavy_branches_model(rng):
    """An If on sign(mean(x)) whose branches are MatMul chains ending in a Softmax (stored stages, not
    inlined into the select), of equal output types."""
    w = [h.make_tensor(f"w{k}", T.FLOAT, [16, 16], rng.standard_normal(256).astype(np.float32).tolist())
         for k in range(3)]
    then_g = h.make_graph([h.make_node("MatMul", ["x", "w0"], ["t1"]), h.make_node("Relu", ["t1"], ["t2"]),
                           h.make_node("MatMul", ["t2", "w1"], ["t3"]), h.make_node("Softmax", ["t3"], ["yt"], axis=-1)],
                          "then", [], [vi("yt", T.FLOAT, ["N", 16])])
    else_g = h.make_graph([h.make_node("MatMul", ["x", "w2"], ["e1"]), h.make_node("Tanh", ["e1"], ["e2"]),
                           h.make_node("Softmax", ["e2"], ["ye"], axis=0)], "else", [], [vi("ye", T.FLOAT, ["N", 16])])
    return model([h.make_node("ReduceMean", ["x"], ["s"], keepdims=0), h.make_node("Greater", ["s", "zero"], ["c"]),
                  h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
                 [vi("x", T.FLOAT, ["N", 16])], [vi("y", T.FLOAT, ["N", 16])], w + [scalar("zero", 0.0)])


def test_runtime_if_skips_the_steps_of_the_branch_not_taken():
    rng = np.random.default_rng(9)
    m = heavy_branches_model(rng)
    xs = [s * np.abs(rng.standard_normal((n, 16))).astype(np.float32) for n in (3, 8) for s in (1, -1)]
    art = check(m, [{"x": x} for x in xs], profiles={"N": (1, 8, 8)}, rtol=1e-5)
    steps = art.manifest["steps"]
    when = [s.get("guard", {}).get("runs_when") for s in steps]
    assert True in when and False in when, steps
    mod = art.model()
    for x in xs:
        # the profile times only the steps that ran: a skipped step accumulates nothing
        times = mod.profile(x=x, runs=2)
        taken = bool(x.mean() > 0)
        variant = "opt" if x.shape[0] == 8 else "generic"
        skipped = [t for step, w, t in zip(steps, when, times)
                   if w is not None and w != taken and step.get("variant") == variant]
        assert skipped and all(t == 0 for t in skipped), (taken, variant, skipped)


def test_nested_runtime_ifs_with_a_subexpression_shared_by_both_branches():
    # Both branches compute MatMul(x, w0) (CSE merges them: the survivor must run whichever branch is taken);
    # the then branch nests a second run-time If. Every combination of the two conditions against onnxruntime.
    rng = np.random.default_rng(10)
    w = [h.make_tensor(f"w{k}", T.FLOAT, [16, 16], rng.standard_normal(256).astype(np.float32).tolist())
         for k in range(3)]
    inner_then = h.make_graph([h.make_node("MatMul", ["p", "w1"], ["q"]), h.make_node("Softmax", ["q"], ["it"], axis=-1)],
                              "it", [], [vi("it", T.FLOAT, [8, 16])])
    inner_else = h.make_graph([h.make_node("Tanh", ["p"], ["r"]), h.make_node("MatMul", ["r", "w2"], ["ie"])],
                              "ie", [], [vi("ie", T.FLOAT, [8, 16])])
    then_g = h.make_graph([h.make_node("MatMul", ["x", "w0"], ["p"]),
                           h.make_node("If", ["c2"], ["t"], then_branch=inner_then, else_branch=inner_else)],
                          "then", [], [vi("t", T.FLOAT, [8, 16])])
    else_g = h.make_graph([h.make_node("MatMul", ["x", "w0"], ["p2"]), h.make_node("Relu", ["p2"], ["p3"]),
                           h.make_node("Softmax", ["p3"], ["e"], axis=0)], "else", [], [vi("e", T.FLOAT, [8, 16])])
    m = model([h.make_node("If", ["c1"], ["y"], then_branch=then_g, else_branch=else_g)],
              [vi("x", T.FLOAT, [8, 16]), vi("c1", T.BOOL, []), vi("c2", T.BOOL, [1])], [vi("y", T.FLOAT, [8, 16])], w)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    check(m, [{"x": x, "c1": np.array(a), "c2": np.array([b])} for a in (True, False) for b in (True, False)],
          rtol=1e-5, atol=1e-5)
