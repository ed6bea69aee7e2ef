"""Run-time loops (a Loop whose trip count is known only at run time, a while loop, a long Loop): the body is
compiled once and the x86 runtime re-runs its steps (a backward branch in the step table), against
onnxruntime; the GPU target refuses them with one clear error. A Scan over a symbolic sequence length (one
library for S = 1..512), loops nested in loops and Ifs in loop bodies, and a Scan inside an onnx function
body (LinearAttention's).
"""
import functools
import json
import os
import warnings

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx.backend.test.case.node import collect_testcases

from cuvil import Pipeline
from cuvil.errors import UnsupportedOpError
from cuvil.frontend import import_model
from cuvil.onnx_backend import backend
from cuvil.targets.ptx.codegen import gpu_schedule
from cuvil.testing.oracles import ort_session
from test_control_flow import check, model, ops_of, running_sum_model, scalar, vi


@functools.lru_cache(maxsize=None)
def node_cases():
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return {c.name: c for c in collect_testcases(None)}


def swap_loop_model(m_from_input=True, trip=None):
    """Carried (a, b, n): a, b = b * 0.5 + i, a - x (a swap through the body), n += 1; M a graph input
    (or the constant ``trip``)."""
    body = h.make_graph([h.make_node("Cast", ["i"], ["fi"], to=T.FLOAT),
                         h.make_node("Mul", ["b_in", "half"], ["bh"]), h.make_node("Add", ["bh", "fi"], ["a_out"]),
                         h.make_node("Sub", ["a_in", "x"], ["b_out"]),
                         h.make_node("Add", ["n_in", "one"], ["n_out"]),
                         h.make_node("Identity", ["c_in"], ["c_out"])], "body",
                        [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("a_in", T.FLOAT, [2, 3]),
                         vi("b_in", T.FLOAT, [2, 3]), vi("n_in", T.INT64, [])],
                        [vi("c_out", T.BOOL, []), vi("a_out", T.FLOAT, [2, 3]), vi("b_out", T.FLOAT, [2, 3]),
                         vi("n_out", T.INT64, [])],
                        [scalar("half", 0.5), h.make_tensor("one", T.INT64, [], [1])])
    inputs = [vi("x", T.FLOAT, [2, 3]), vi("a0", T.FLOAT, [2, 3]), vi("b0", T.FLOAT, [2, 3])]
    inits = [h.make_tensor("n0", T.INT64, [], [0])]
    if m_from_input:
        inputs.insert(0, vi("M", T.INT64, [1]))
    else:
        inits.append(h.make_tensor("M", T.INT64, [1], [trip]))
    return model([h.make_node("Loop", ["M", "", "a0", "b0", "n0"], ["a", "b", "n"], body=body, name="rt_loop")],
                 inputs, [vi("a", T.FLOAT, [2, 3]), vi("b", T.FLOAT, [2, 3]), vi("n", T.INT64, [])], inits)


def feeds(rng, **extra):
    return {"x": rng.standard_normal((2, 3)).astype(np.float32), "a0": rng.standard_normal((2, 3)).astype(np.float32),
            "b0": rng.standard_normal((2, 3)).astype(np.float32), **extra}


def test_loop_trip_count_from_an_input_runs_at_run_time():
    m = swap_loop_model()
    assert {"LoopState", "LoopBack"} <= ops_of(m)
    rng = np.random.default_rng(0)
    art = check(m, [feeds(rng, M=np.array([n], np.int64)) for n in (0, 1, 7, 100, 3, -1)], rtol=1e-5, atol=1e-5)
    # the body is compiled once: its steps appear once, with the two jumps of the loop
    with open(os.path.splitext(art.path)[0] + ".manifest.json") as f:
        steps = json.load(f)["steps"]
    jumps = [(k, s["jump"]) for k, s in enumerate(steps) if "jump" in s]
    assert len(jumps) == 2, jumps
    (head, exit_), (back, again) = jumps
    assert "unless" in exit_ and exit_["to"] == back + 1 and again == {"to": head}
    assert back - head < 16 and len(steps) < 30   # the body compiled once (100 unrolled copies: hundreds)


def test_long_constant_loop_is_not_unrolled():
    m = swap_loop_model(m_from_input=False, trip=300)
    ops = [n.op for n in import_model(m).nodes]
    assert ops.count("LoopState") == 1 and len(ops) < 30
    rng = np.random.default_rng(1)
    check(m, [feeds(rng) for _ in range(2)], rtol=1e-5, atol=1e-5)


def while_model():
    """A while loop (no M): acc = acc * 2 + x while sum(acc) < limit; the iteration count (a carried value)
    and the final acc depend on the data only."""
    body = h.make_graph([h.make_node("Mul", ["acc_in", "two"], ["a2"]), h.make_node("Add", ["a2", "x"], ["acc_out"]),
                         h.make_node("ReduceSum", ["acc_out"], ["s"], keepdims=0),
                         h.make_node("Less", ["s", "limit"], ["c_out"]),
                         h.make_node("Add", ["k_in", "one"], ["k_out"])], "body",
                        [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("acc_in", T.FLOAT, [4]),
                         vi("k_in", T.INT64, [])],
                        [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, [4]), vi("k_out", T.INT64, [])],
                        [scalar("two", 2.0), h.make_tensor("one", T.INT64, [], [1])])
    return model([h.make_node("Loop", ["", "go", "acc0", "k0"], ["acc", "k"], body=body, name="while_loop")],
                 [vi("x", T.FLOAT, [4]), vi("acc0", T.FLOAT, [4]), vi("go", T.BOOL, []), vi("limit", T.FLOAT, [])],
                 [vi("acc", T.FLOAT, [4]), vi("k", T.INT64, [])], [h.make_tensor("k0", T.INT64, [], [0])])


def test_while_loop_with_a_data_dependent_condition():
    m = while_model()
    rng = np.random.default_rng(2)
    cases = []
    for limit in (-1.0, 1.0, 50.0, 1e6, 1e30):     # 1, a few, ~20, ~100 iterations
        for go in (True, False):
            cases.append({"x": rng.uniform(0.1, 1, 4).astype(np.float32),
                          "acc0": rng.uniform(0, 1, 4).astype(np.float32),
                          "go": np.array(go), "limit": np.array(limit, np.float32)})
    check(m, cases, rtol=1e-6, atol=0)


def test_if_nested_in_a_run_time_loop_body():
    """Each iteration: if sum(acc) > 0 then acc * 0.5 - x else acc + 1 (a run-time If inside a run-time
    Loop: guarded steps inside the loop's step range)."""
    then_g = h.make_graph([h.make_node("Mul", ["acc_in", "half"], ["p0"]), h.make_node("Sub", ["p0", "x"], ["p"])],
                          "t", [], [vi("p", T.FLOAT, [3])], [scalar("half", 0.5)])
    else_g = h.make_graph([h.make_node("Add", ["acc_in", "one"], ["q"])], "e", [], [vi("q", T.FLOAT, [3])],
                          [scalar("one", 1.0)])
    body = h.make_graph([h.make_node("ReduceSum", ["acc_in"], ["s"], keepdims=0),
                         h.make_node("Greater", ["s", "zero"], ["pos"]),
                         h.make_node("If", ["pos"], ["acc_out"], then_branch=then_g, else_branch=else_g),
                         h.make_node("Identity", ["c_in"], ["c_out"])], "body",
                        [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("acc_in", T.FLOAT, [3])],
                        [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, [3])], [scalar("zero", 0.0)])
    m = model([h.make_node("Loop", ["M", "", "a0"], ["a"], body=body)],
              [vi("M", T.INT64, []), vi("x", T.FLOAT, [3]), vi("a0", T.FLOAT, [3])], [vi("a", T.FLOAT, [3])])
    rng = np.random.default_rng(4)
    check(m, [{"M": np.array(n, np.int64), "x": rng.standard_normal(3).astype(np.float32) * s,
               "a0": rng.standard_normal(3).astype(np.float32)} for n in (0, 1, 6, 33) for s in (0.1, -3.0)],
          rtol=1e-5, atol=1e-5)


def test_run_time_loop_with_scan_outputs_is_one_clear_error():
    body = h.make_graph([h.make_node("Identity", ["c_in"], ["c_out"]), h.make_node("Identity", ["v_in"], ["v_out"]),
                         h.make_node("Identity", ["v_in"], ["y"])],
                        "body", [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("v_in", T.FLOAT, [2])],
                        [vi("c_out", T.BOOL, []), vi("v_out", T.FLOAT, [2]), vi("y", T.FLOAT, [2])])
    m = model([h.make_node("Loop", ["M", "", "v"], ["w", "ys"], body=body, name="dyn_loop")],
              [vi("M", T.INT64, []), vi("v", T.FLOAT, [2])], [vi("w", T.FLOAT, [2]), vi("ys", T.FLOAT, ["", 2])])
    with pytest.raises(UnsupportedOpError, match=r"Loop \(node 'dyn_loop', opset 17\): .*graph input 'M'.* scan "
                                                 r"output\(s\) would have a data-dependent length"):
        import_model(m)


def test_run_time_loop_on_the_gpu_is_one_clear_error():
    g = Pipeline.from_onnx(swap_loop_model()).optimize().graph
    with pytest.raises(UnsupportedOpError, match=r"Loop \(node 'rt_loop', opset 17\): its trip count .*run-time loop"):
        gpu_schedule(g)
    m = running_sum_model()
    m.graph.input[1].type.tensor_type.shape.dim[0].dim_param = "S"
    with pytest.raises(UnsupportedOpError, match=r"Scan \(node 's', opset 17\): its sequence length .*run-time loop"):
        Pipeline.from_onnx(m).optimize().compile(target="nvptx64-nvidia-cuda", shape_profiles={"S": (1, 16, 512)})


@pytest.mark.parametrize("in_axis,in_dir,out_axis,out_dir", [(0, 0, 0, 0), (1, 1, 1, 0), (-1, 0, -1, 1), (-2, 1, 0, 1)])
def test_scan_over_a_symbolic_sequence_length(in_axis, in_dir, out_axis, out_dir):
    """One library for sequence lengths S = 1..512: the scan input read at the iteration (or reversed), the
    scan outputs written at their row, in every direction and axis."""
    m = running_sum_model(in_axis, in_dir, out_axis, out_dir)
    dims = m.graph.input[1].type.tensor_type.shape.dim
    seq = 0 if in_axis in (0, -2) else 1
    dims[seq].dim_param = "S"
    assert "LoopState" in ops_of(m)
    rng = np.random.default_rng(6)
    cases = []
    for n in (1, 2, 7, 16, 512):   # 16: the kernels specialised for the opt point
        shape = [n, 4] if seq == 0 else [4, n]
        cases.append({"s0": rng.standard_normal(4).astype(np.float32),
                      "x": rng.standard_normal(shape).astype(np.float32)})
    check(m, cases, profiles={"S": (1, 16, 512)}, rtol=1e-5, atol=1e-5)


def test_long_static_scan_is_not_unrolled():
    m = running_sum_model()
    m.graph.input[1].type.tensor_type.shape.dim[0].dim_value = 200
    assert [n.op for n in import_model(m).nodes].count("LoopState") == 1
    rng = np.random.default_rng(7)
    check(m, [{"s0": rng.standard_normal(4).astype(np.float32), "x": rng.standard_normal((200, 4)).astype(np.float32)}],
          rtol=1e-5, atol=1e-5)


def test_nested_run_time_loops():
    """An outer Loop (M from an input) whose body runs an inner Loop with a trip count from data (the outer
    iteration number + 1): acc += sum over j <= i of (x * j)."""
    inner = h.make_graph([h.make_node("Cast", ["j"], ["fj"], to=T.FLOAT), h.make_node("Mul", ["x", "fj"], ["xj"]),
                          h.make_node("Add", ["s_in", "xj"], ["s_out"]), h.make_node("Identity", ["ci"], ["co"])],
                         "inner", [vi("j", T.INT64, []), vi("ci", T.BOOL, []), vi("s_in", T.FLOAT, [3])],
                         [vi("co", T.BOOL, []), vi("s_out", T.FLOAT, [3])])
    outer = h.make_graph([h.make_node("Add", ["i", "one"], ["n"]),
                          h.make_node("Loop", ["n", "", "acc_in"], ["acc_out"], body=inner, name="inner_loop"),
                          h.make_node("Identity", ["c_in"], ["c_out"])], "outer",
                         [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("acc_in", T.FLOAT, [3])],
                         [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, [3])],
                         [h.make_tensor("one", T.INT64, [], [1])])
    m = model([h.make_node("Loop", ["M", "", "a0"], ["a"], body=outer, name="outer_loop")],
              [vi("M", T.INT64, []), vi("x", T.FLOAT, [3]), vi("a0", T.FLOAT, [3])], [vi("a", T.FLOAT, [3])])
    assert [n.op for n in import_model(m).nodes].count("LoopState") == 2
    rng = np.random.default_rng(8)
    check(m, [{"M": np.array(n, np.int64), "x": rng.standard_normal(3).astype(np.float32),
               "a0": rng.standard_normal(3).astype(np.float32)} for n in (0, 1, 4, 20)], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["test_linear_attention_linear", "test_linear_attention_gated_delta",
                                  "test_linear_attention_decode_step"])
def test_function_body_holding_a_scan(case):
    """LinearAttention's onnx function body runs a Scan whose body reads values of the function body: the
    subgraph's outer names are renamed with the body's (frontend/functions.py), then the Scan imports."""
    c = node_cases()[case]
    rep = backend.prepare(c.model, opt_level=1)
    for inputs, expected in c.data_sets:
        for got, want in zip(rep.run(list(inputs)), expected):
            np.testing.assert_allclose(got, want, rtol=c.rtol, atol=c.atol)


def test_run_time_loop_over_a_symbolic_batch():
    """Carried values of symbolic shape [N, 3] (one library for N = 1..8): the state slots and the back edge's
    copies take the run's extents."""
    m = swap_loop_model()
    for vinfo in list(m.graph.input)[1:] + list(m.graph.output)[:2]:
        vinfo.type.tensor_type.shape.dim[0].dim_param = "N"
    for vinfo in list(m.graph.node[0].attribute[0].g.input)[2:4] + list(m.graph.node[0].attribute[0].g.output)[1:3]:
        vinfo.type.tensor_type.shape.dim[0].dim_param = "N"
    rng = np.random.default_rng(9)
    cases = []
    for n, M in ((1, 5), (3, 0), (4, 17), (8, 2)):   # 4: the opt point's kernels
        cases.append({"M": np.array([M], np.int64), **{k: rng.standard_normal((n, 3)).astype(np.float32)
                                                        for k in ("x", "a0", "b0")}})
    check(m, cases, profiles={"N": (1, 4, 8)}, rtol=1e-5, atol=1e-5)


def test_nodes_outside_the_loop_run_when_it_runs_no_iteration():
    """A loop-invariant node of the body (Relu(x), also an output of the graph itself: CSE merges the two)
    and outer nodes the sort may place among the body's must run even for M = 0, when the body's steps are
    jumped over: the schedule moves them before the loop."""
    body = h.make_graph([h.make_node("Relu", ["x"], ["r"]), h.make_node("Add", ["acc_in", "r"], ["acc_out"]),
                         h.make_node("Identity", ["c_in"], ["c_out"])], "body",
                        [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("acc_in", T.FLOAT, [5])],
                        [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, [5])])
    m = model([h.make_node("Loop", ["M", "", "a0"], ["a"], body=body), h.make_node("Relu", ["x"], ["rx"]),
               h.make_node("Neg", ["x"], ["nx"]), h.make_node("Mul", ["nx", "a0"], ["p"])],
              [vi("M", T.INT64, []), vi("x", T.FLOAT, [5]), vi("a0", T.FLOAT, [5])],
              [vi("a", T.FLOAT, [5]), vi("rx", T.FLOAT, [5]), vi("p", T.FLOAT, [5])])
    rng = np.random.default_rng(10)
    check(m, [{"M": np.array(n, np.int64), "x": rng.standard_normal(5).astype(np.float32),
               "a0": rng.standard_normal(5).astype(np.float32)} for n in (0, 3, 0)], rtol=1e-5, atol=1e-5)


def test_long_loop_with_scan_outputs():
    """A constant trip count over the unrolling limit with scan outputs: each is an accumulator [trip, ...]
    whose row the iteration replaces; no run-time exit, so the length is the trip count."""
    body = h.make_graph([h.make_node("Add", ["acc_in", "x"], ["acc_out"]), h.make_node("Identity", ["c_in"], ["c_out"]),
                         h.make_node("Mul", ["acc_out", "acc_out"], ["sq"]),
                         h.make_node("Cast", ["i"], ["fi"], to=T.FLOAT)], "body",
                        [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("acc_in", T.FLOAT, [2, 2])],
                        [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, [2, 2]), vi("sq", T.FLOAT, [2, 2]),
                         vi("fi", T.FLOAT, [])])
    m = model([h.make_node("Loop", ["M", "", "a0"], ["a", "sqs", "its"], body=body)],
              [vi("x", T.FLOAT, [2, 2]), vi("a0", T.FLOAT, [2, 2])],
              [vi("a", T.FLOAT, [2, 2]), vi("sqs", T.FLOAT, ["", 2, 2]), vi("its", T.FLOAT, [""])],
              [h.make_tensor("M", T.INT64, [], [150])])
    assert [n.op for n in import_model(m).nodes].count("LoopState") == 1
    rng = np.random.default_rng(11)
    check(m, [{"x": rng.standard_normal((2, 2)).astype(np.float32) * 0.1,
               "a0": rng.standard_normal((2, 2)).astype(np.float32)}], rtol=1e-5, atol=1e-5)


def test_for_loop_with_break_both_known_only_at_run_time():
    """M from an input and a data-dependent condition (a for loop with a break): the loop stops at whichever
    comes first."""
    body = h.make_graph([h.make_node("Mul", ["acc_in", "two"], ["a2"]), h.make_node("Add", ["a2", "x"], ["acc_out"]),
                         h.make_node("ReduceMax", ["acc_out"], ["mx"], keepdims=0),
                         h.make_node("Less", ["mx", "limit"], ["c_out"])], "body",
                        [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("acc_in", T.FLOAT, [6])],
                        [vi("c_out", T.BOOL, []), vi("acc_out", T.FLOAT, [6])], [scalar("two", 2.0)])
    m = model([h.make_node("Loop", ["M", "go", "acc0"], ["acc"], body=body)],
              [vi("M", T.INT64, [1]), vi("go", T.BOOL, []), vi("x", T.FLOAT, [6]), vi("acc0", T.FLOAT, [6]),
               vi("limit", T.FLOAT, [])], [vi("acc", T.FLOAT, [6])])
    rng = np.random.default_rng(12)
    cases = [{"M": np.array([n], np.int64), "go": np.array(go), "x": rng.uniform(0, 1, 6).astype(np.float32),
              "acc0": rng.uniform(0, 1, 6).astype(np.float32), "limit": np.array(limit, np.float32)}
             for n in (0, 2, 40) for go in (True, False) for limit in (-1.0, 30.0, 1e9)]
    check(m, cases, rtol=1e-6, atol=0)


def test_exported_run_time_loops_go_back_to_onnx_loops():
    """Pipeline.to_onnx turns each LoopState .. LoopBack run back into an ONNX Loop (nested ones inside its
    body), so run_reference (onnx.reference) and onnxruntime run the imported graph."""
    rng = np.random.default_rng(13)
    scan = running_sum_model(1, 1, 1, 0)
    scan.graph.input[1].type.tensor_type.shape.dim[1].dim_param = "S"
    models = [(swap_loop_model(), [feeds(rng, M=np.array([n], np.int64)) for n in (0, 3)]),
              (while_model(), [{"x": rng.uniform(0.1, 1, 4).astype(np.float32),
                                "acc0": rng.uniform(0, 1, 4).astype(np.float32), "go": np.array(True),
                                "limit": np.array(50.0, np.float32)}]),
              (scan, [{"s0": rng.standard_normal(4).astype(np.float32),
                       "x": rng.standard_normal((4, n)).astype(np.float32)} for n in (1, 7)])]
    for m, cases in models:
        p = Pipeline.from_onnx(m)
        assert "Loop" in {n.op_type for n in p.to_onnx().graph.node}
        sess = ort_session(m)
        for f in cases:
            got = p.run_reference(f)
            for o, want in zip(m.graph.output, sess.run(None, f)):
                np.testing.assert_allclose(got[o.name], want, rtol=1e-5, atol=1e-5, err_msg=o.name)


def test_carried_row_updates_in_place_and_not():
    """e = Where(i == row, b', e) is updated in place (nothing else reads e's slot, nothing else reads e'); a's
    and c's row updates are not (a' is read by b', c's slot by d'): every next value must read old values."""
    body = h.make_graph([h.make_node("Equal", ["i", "rows"], ["hit"]),
                         h.make_node("Where", ["hit", "x", "a_in"], ["a_out"]),
                         h.make_node("Add", ["b_in", "a_out"], ["b_out"]),
                         h.make_node("Where", ["hit", "a_out", "c_in"], ["c_out"]),
                         h.make_node("Add", ["d_in", "c_in"], ["d_out"]),
                         h.make_node("Where", ["hit", "b_out", "e_in"], ["e_out"]),
                         h.make_node("Identity", ["c0"], ["c1"])],
                        "body", [vi("i", T.INT64, []), vi("c0", T.BOOL, [])]
                        + [vi(f"{k}_in", T.FLOAT, [4]) for k in "abcde"],
                        [vi("c1", T.BOOL, [])] + [vi(f"{k}_out", T.FLOAT, [4]) for k in "abcde"],
                        [h.make_tensor("rows", T.INT64, [4], [0, 1, 2, 3])])
    inits = ("a0", "b0", "c0_", "d0", "e0")
    m = model([h.make_node("Loop", ["M", ""] + list(inits), list("abcde"), body=body)],
              [vi("M", T.INT64, []), vi("x", T.FLOAT, [4])] + [vi(n, T.FLOAT, [4]) for n in inits],
              [vi(k, T.FLOAT, [4]) for k in "abcde"])
    rng = np.random.default_rng(14)
    art = check(m, [{"M": np.array(n, np.int64), **{k: rng.standard_normal(4).astype(np.float32)
                                                     for k in ("x",) + inits}} for n in (0, 2, 6)],
                rtol=1e-5, atol=1e-5)
    with open(os.path.splitext(art.path)[0] + ".manifest.json") as f:
        stages = [s["stage"] for s in json.load(f)["steps"]]
    assert sum("_update" in s for s in stages) == 1, stages   # e only
