"""Shape computations over symbolic dims (Shape -> Gather -> Slice/Range/Expand/ConstantOfShape/Where/Concat/
Reshape chains, as Hugging Face exports carry them): one x86 library per profile serves every (B, S) of
B = 1..8, S = 1..512, matching onnxruntime; Slice bounds computed from shapes are shape conditions checked over
the profile; dims simplify over the profile's ranges; the GPU target still generates (it specialises symbols);
and every torch.onnx text export among the fixtures compiles once per profile and matches at several shapes."""
import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.artifact import load
from cuvil.errors import ShapeError, UnsupportedOpError
from cuvil.ir.dim import parse_dim
from cuvil.rewrite_rules.shape_prop import simplify_dim
from cuvil.targets.ptx import find_ptxas
from cuvil.testing.artifacts import close_and_remove, compile_and_load
from cuvil.testing.hf_patterns import HF_PATTERNS, HF_PROFILE, hf_feeds, position_ids, torchscript_expand
from cuvil.testing.oracles import max_rel_error, ort_session

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (B, S): the profile's corners, its opt point, odd sizes in between
SHAPES = [(1, 1), (2, 16), (3, 7), (5, 33), (1, 512), (8, 512)]


def _profile(model):
    used = {d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim}
    return {k: v for k, v in HF_PROFILE.items() if k in used}


@pytest.mark.parametrize("name", sorted(HF_PATTERNS))
def test_pattern_one_library_serves_the_profile(name):
    model = HF_PATTERNS[name]()
    art, lib = compile_and_load(model, _profile(model))
    try:
        sess = ort_session(model)
        for k, (b, s) in enumerate(SHAPES):
            feeds = hf_feeds(model, b, s, seed=k, past=1 + (7 * b * s) % 300)
            (y,) = lib.run(**feeds)
            (r,) = sess.run(None, feeds)
            assert y.shape == r.shape, (name, b, s, y.shape, r.shape)
            assert max_rel_error(y, r) <= 1e-5, (name, b, s, max_rel_error(y, r))
    finally:
        close_and_remove(art, lib)


def test_slice_end_from_a_shape_stays_symbolic():
    g = Pipeline.from_onnx(position_ids()).with_profiles({"B": (1, 8), "S": (1, 512)}).graph
    pids = next(n for n in g.nodes if n.name == "pids")
    assert [str(d) for d in pids.outputs[0].shape] == ["1", "S"]
    assert [str(d) for d in g.outputs[0].shape] == ["B", "S", "16"]


def test_slice_end_past_its_table_is_refused_with_a_counterexample():
    """position_ids[:, :S] of a 64-entry table: ONNX would clamp to 64 rows for S > 64, which the model's Add
    then rejects; the profile must keep S <= 64, and Z3 names the first S that breaks it."""
    p = Pipeline.from_onnx(position_ids(max_pos=64))
    with pytest.raises(ShapeError, match=r"S = 65 makes Slice 'pids' need 64 >= S"):
        p.with_profiles({"B": (1, 8), "S": (1, 512)})
    assert p.with_profiles({"B": (1, 8), "S": (1, 64)}).graph.outputs[0].shape[1] == parse_dim("S")


def test_dims_simplify_over_the_profile_and_widen_back():
    """Max(S, 1) is S for S >= 1; re-profiling re-infers from the inputs, so nothing stale stays."""
    p = Pipeline.from_onnx(torchscript_expand())
    narrow = p.with_profiles({"B": (1, 8), "S": (1, 512)})
    assert [str(d) for d in narrow.graph.outputs[0].shape] == ["B", "S", "S"]
    assert [str(d) for d in narrow.with_profiles({"S": (1, 4096)}).graph.outputs[0].shape] == ["B", "S", "S"]


@pytest.mark.parametrize("text, want", [
    ("max(1, S)", "S"), ("min(S, 512)", "S"), ("min(S, 100)", "min(100, S)"), ("max(B, S)", "max(B, S)"),
    ("B*max(1, S) + 2", "B*S + 2"), ("(min(S, 512) + 3)/2", "(S + 1)/2 + 1"), ("max(S - 1, 0)", "S - 1"),
    ("min(S, 511)", "min(511, S)")])
def test_simplify_dim_over_ranges(text, want):
    assert str(simplify_dim(parse_dim(text), {"S": (1, 512), "B": (1, 8)})) == want


@pytest.mark.skipif(find_ptxas() is None, reason="ptxas not found (no CUDA toolkit)")
@pytest.mark.parametrize("name", ["position_ids", "past_slice", "causal_range"])
def test_gpu_target_generates(name):
    """The GPU target specialises the symbols (one bucket: B = 1, S = 128 here) and ptxas accepts every kernel for
    sm_90. (A profile's default buckets, the powers of two of every symbol, are too many for three symbols.)"""
    model = HF_PATTERNS[name]()
    prof = {k: (lo, 128 if k == "S" else 1 if k == "B" else opt, hi) for k, (lo, opt, hi) in _profile(model).items()}
    b = Pipeline.from_onnx(model).compile("nvptx64-nvidia-cuda", shape_profiles=prof, cache=False, arch="sm_90",
                                          graph_buckets={k: [v[1]] for k, v in prof.items()})
    man = b.manifest
    assert man["ptxas"] and man["ptxas"]["kernels"]
    assert all(0 < v["registers"] <= 255 for v in man["ptxas"]["kernels"].values())


# -- the torch.onnx exports (tests/fixtures/exports, committed by the exports part of issue 19) ---------------

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "exports")
_EXPORTS = json.load(open(os.path.join(FIXTURES, "exports.json"))) if os.path.exists(
    os.path.join(FIXTURES, "exports.json")) else []
# Text models served for batch 1..8 and sequence 1..512 (a decode step: past 1..512, total = past + 1)
TEXT_PROFILE = {"batch": (1, 2, 8), "sequence": (1, 16, 512), "past_sequence": (1, 16, 512),
                "total_sequence": (2, 17, 513)}
TEXT = [e for e in _EXPORTS if e.get("status") == "ok" and any("sequence" in d for v in e["inputs"].values()
                                                                 for d in v if isinstance(d, str))]


def _export_feeds(entry, model, b, s, rng):
    env = {"batch": b, "sequence": s, "past_sequence": s, "total_sequence": s + 1}
    feeds = {}
    for vi in model.graph.input:
        shape = [env[d] if isinstance(d, str) else d for d in entry["inputs"][vi.name]]
        if "mask" in vi.name:   # row r padded on its last r/(b+1) positions, the first position always kept
            a = np.ones(shape, np.int64)
            for r in range(1, b):
                a[r, max(1, shape[1] - (r * shape[1]) // (b + 1)):] = 0
        elif vi.type.tensor_type.elem_type == onnx.TensorProto.INT64:
            a = rng.integers(0, 2 if "type" in vi.name else 500, shape).astype(np.int64)
        else:
            a = rng.standard_normal(shape).astype(np.float32)
        feeds[vi.name] = a
    return feeds


@pytest.mark.skipif(not TEXT, reason=f"no torch.onnx text exports under {FIXTURES}")
@pytest.mark.slow(reason="120 s of CPU for the twelve exports; test_real_exports.py::test_one_library_serves_the_profile "
                         "compiles each of them over the same profile (B 1-8, S 1-512) and checks five shapes")
@pytest.mark.parametrize("entry", TEXT, ids=[e["file"] for e in TEXT])
def test_text_export_one_library_for_batch_1_8_sequence_1_512(entry):
    model = onnx.load(os.path.join(FIXTURES, entry["file"]))
    syms = {d for v in entry["inputs"].values() for d in v if isinstance(d, str)}
    art = Pipeline.from_onnx(model).compile(shape_profiles={k: TEXT_PROFILE[k] for k in syms}, cache=False)
    lib = load(art.path)
    try:
        sess, rng = ort_session(model), np.random.default_rng(0)
        for b, s in [(1, 1), (3, 7), (2, 16), (8, 512)]:
            feeds = _export_feeds(entry, model, b, s, rng)
            got, want = lib.run(**feeds), sess.run(None, feeds)
            assert len(got) == len(want) == len(model.graph.output)
            for name, y, r in zip([o.name for o in model.graph.output], got, want):
                assert y.shape == r.shape, (entry["file"], b, s, name, y.shape, r.shape)
                assert max_rel_error(y, r) <= 1e-4, (entry["file"], b, s, name, max_rel_error(y, r))
    finally:
        close_and_remove(art, lib)


def test_data_dependent_size_is_one_clean_line():
    """NonZero's count depends on the values: the GPU target refuses it naming the op, node and opset (never a
    KeyError from the symbol's missing range); x86 sizes it at run time (tests/test_run_time_sizes.py)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    g = helper.make_graph([helper.make_node("NonZero", ["x"], ["nz"], name="nz"),
                           helper.make_node("Transpose", ["nz"], ["y"])], "g", [x],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, None)])
    p = Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    for target in ("nvptx64-nvidia-cuda",):
        with pytest.raises(UnsupportedOpError, match=r"NonZero \(node 'nz', opset 17\): output 'nz' has shape "
                                                     r"i64\[2,nz_nnz\], whose size nz_nnz depends on tensor values"):
            p.compile(target, shape_profiles={"N": (1, 4, 8)}, cache=False)


def _shape_value(op, a, b):
    """sym_value of ``op(a, b)`` where a and b are built from Shape(x) of x[B, S] and constants."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S"])
    consts = {"c": np.array(b, np.int64)}
    nodes = [helper.make_node("Shape", ["x"], ["sh"]), helper.make_node(op, [a, "c"], ["r"])]
    g = helper.make_graph(nodes, "g", [x], [helper.make_value_info("r", onnx.TypeProto())],
                          [numpy_helper.from_array(v, k) for k, v in consts.items()])
    graph = Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).graph
    (r,) = [n for n in graph.nodes if n.op == op][0].outputs
    return None if r.sym_value is None else [str(v) for v in r.sym_value]


@pytest.mark.parametrize("op, b, want", [
    ("Equal", [-1, -1], ["0", "0"]),          # a dim is never -1: the exporters' Where(Equal(s, -1), 1, s)
    ("Equal", [1, 1], None),                  # S == 1 depends on S: undecided, no value
    ("Less", [0, 0], ["0", "0"]),
    ("GreaterOrEqual", [1, 0], None),         # B >= 1 holds for profiles but not for every symbol value >= 0
    ("Greater", [-3, -1], ["1", "1"]),
    ("Max", [1, 1], ["max(1, B)", "max(1, S)"]),
    ("Min", [4, 4], ["min(4, B)", "min(4, S)"]),
    ("Sub", [0, 1], ["B", "S - 1"]),
])
def test_shape_values_compare_and_combine(op, b, want):
    assert _shape_value(op, "sh", b) == want


def test_where_and_neg_of_shape_values():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S"])
    nodes = [helper.make_node("Shape", ["x"], ["sh"]), helper.make_node("Equal", ["sh", "m1"], ["eq"]),
             helper.make_node("Where", ["eq", "ones", "sh"], ["w"]), helper.make_node("Neg", ["w"], ["r"])]
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "m1"),
             numpy_helper.from_array(np.array([1, 1], np.int64), "ones")]
    g = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("r", TensorProto.INT64, None)], inits)
    graph = Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])).graph
    vals = {n.outputs[0].name: n.outputs[0].sym_value for n in graph.nodes}
    assert [str(v) for v in vals["w"]] == ["B", "S"] and [str(v) for v in vals["r"]] == ["-B", "-S"]
