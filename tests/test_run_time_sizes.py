"""Sizes that depend on tensor values (NonZero's count, TopK's k read from data, Compress by a run-time
condition, Unique, NonMaxSuppression): one x86 library per profile, outputs of the actual size, checked against onnxruntime at sizes 0,
1 and the bound; the C ABI gives the bound before the run and the actual dims after it; the GPU target and
the sizes without a run-time size kernel (Range's length read from data) refuse with one clean error naming the op."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil.errors import ShapeError, UnsupportedOpError
from cuvil.pipeline import Pipeline
from cuvil.targets.x86.loader import CTensor

ort = pytest.importorskip("onnxruntime")


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _check(model, profile, feeds_list):
    art = Pipeline.from_onnx(model).compile(shape_profiles=profile, cache=False)
    sess = ort.InferenceSession(model.SerializeToString())
    for feeds in feeds_list:
        got = art.run(feeds)
        for o, want in zip(model.graph.output, sess.run(None, feeds)):
            assert got[o.name].shape == want.shape, ({k: v.shape for k, v in feeds.items()}, o.name)
            np.testing.assert_array_equal(got[o.name], want)
    return art


def detection_pattern():
    """Scores above a threshold -> NonZero -> Transpose -> GatherND: the kept scores, then a consumer."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    i = helper.make_tensor_value_info("idx", TensorProto.INT64, None)
    nodes = [helper.make_node("Greater", ["x", "t"], ["m"]),
             helper.make_node("NonZero", ["m"], ["nz"], name="nz"),
             helper.make_node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
             helper.make_node("GatherND", ["x", "idx"], ["g"]),
             helper.make_node("Mul", ["g", "two"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "t"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    return _model(nodes, [x], [y, i], inits)


def _scores(rng, n, p):
    return {"x": np.where(rng.random((n, 4)) < p, 1.0 + rng.random((n, 4)), 0.25).astype(np.float32)}


def test_nonzero_transpose_gathernd_matches_onnxruntime_at_zero_one_and_the_bound():
    rng = np.random.default_rng(0)
    one = {"x": np.full((1, 4), 0.25, np.float32)}
    one["x"][0, 2] = 3.0
    feeds = [_scores(rng, 1, 0.0), one, _scores(rng, 16, 1.0), _scores(rng, 16, 0.0), _scores(rng, 7, 0.5),
             _scores(rng, 3, 1.0)]
    art = _check(detection_pattern(), {"N": (1, 4, 16)}, feeds)
    assert art.manifest["run_time_sizes"] == ["nz_nnz"]
    assert art.manifest["symbols"]["nz_nnz"]["max"] == 64     # the bound: the mask's element count at N = 16


def test_topk_with_k_from_data_matches_onnxruntime_and_refuses_a_k_beyond_the_axis():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, "N"])
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
    outs = [helper.make_tensor_value_info(n, t, None) for n, t in (("v", TensorProto.FLOAT), ("i", TensorProto.INT64))]
    model = _model([helper.make_node("TopK", ["x", "k"], ["v", "i"], name="tk")], [x, k], outs)
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((3, n)).astype(np.float32), "k": np.array([kk])}
             for n, kk in ((1, 0), (1, 1), (10, 10), (7, 3), (10, 0), (4, 4))]
    art = _check(model, {"N": (1, 8, 10)}, feeds)
    for n, kk in ((10, 11), (7, 8), (5, -1)):   # 8 <= the bound 10, but beyond this run's axis of 7
        with pytest.raises(ShapeError, match="tk_k computed from the input values is invalid"):
            art.run({"x": np.zeros((3, n), np.float32), "k": np.array([kk])})


@pytest.mark.parametrize("axis", [0, None])
def test_compress_by_a_run_time_condition_matches_onnxruntime(axis):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])
    c = helper.make_tensor_value_info("c", TensorProto.BOOL, ["M"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    kw = {} if axis is None else {"axis": axis}
    model = _model([helper.make_node("Compress", ["x", "c"], ["y"], name="cp", **kw)], [x, c], [y])
    rng = np.random.default_rng(2)
    # kept 0, 1, the bound; a condition shorter than the axis; one longer than it (axis=None: the flat input)
    cases = [(1, 1, 0.0), (1, 1, 1.0), (8, 8, 1.0), (6, 6, 0.5), (6, 3, 1.0), (4, 2, 0.5), (2, 8, 1.0)]
    feeds = [{"x": rng.standard_normal((n, 3)).astype(np.float32), "c": rng.random(m) < p} for n, m, p in cases]
    if axis == 0:
        feeds.pop()   # onnxruntime refuses a condition longer than the axis
    _check(model, {"N": (1, 4, 8), "M": (1, 4, 8)}, feeds)


def test_c_abi_gives_the_bound_before_the_run_and_the_actual_dims_after():
    art = Pipeline.from_onnx(detection_pattern()).compile(shape_profiles={"N": (1, 4, 16)}, cache=False)
    with open(os.path.splitext(art.path)[0] + ".h", encoding="utf-8") as f:
        assert "nz_nnz in [0, 64], computed from the input values during the run" in f.read()
    lib = ctypes.CDLL(art.path)
    lib.cuvil_session_create.restype = ctypes.c_void_p
    lib.cuvil_session_create.argtypes = [ctypes.c_int]
    lib.cuvil_output_shape.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.cuvil_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuvil_session_destroy.argtypes = [ctypes.c_void_p]
    s = lib.cuvil_session_create(1)
    x = np.full((5, 4), 0.25, np.float32)
    x[1, 3] = x[4, 0] = 2.0
    xs = (ctypes.c_int64 * 2)(5, 4)
    t_in = CTensor(x.ctypes.data, 1, 2, ctypes.cast(xs, ctypes.POINTER(ctypes.c_int64)))
    y_shape, i_shape = (ctypes.c_int64 * 1)(), (ctypes.c_int64 * 2)()
    assert lib.cuvil_output_shape(s, ctypes.byref(t_in), 0, y_shape) == 0
    assert lib.cuvil_output_shape(s, ctypes.byref(t_in), 1, i_shape) == 0
    assert list(y_shape) == [64] and list(i_shape) == [64, 2]     # the bound over the profile (16 x 4)
    y, idx = np.full(64, -1.0, np.float32), np.full((64, 2), -1, np.int64)
    outs = (CTensor * 2)(CTensor(y.ctypes.data, 1, 1, ctypes.cast(y_shape, ctypes.POINTER(ctypes.c_int64))),
                         CTensor(idx.ctypes.data, 7, 2, ctypes.cast(i_shape, ctypes.POINTER(ctypes.c_int64))))
    assert lib.cuvil_run(s, ctypes.byref(t_in), outs) == 0
    assert list(y_shape) == [2] and list(i_shape) == [2, 2]       # the actual sizes, written by the run
    np.testing.assert_array_equal(y[:2], [4.0, 4.0])
    np.testing.assert_array_equal(idx.reshape(-1)[:4].reshape(2, 2), [[1, 3], [4, 0]])
    lib.cuvil_session_destroy(s)


def test_gpu_target_refuses_a_run_time_size_naming_the_op():
    with pytest.raises(UnsupportedOpError, match=r"NonZero \(node 'nz', opset 17\).*the x86 target sizes"):
        Pipeline.from_onnx(detection_pattern()).compile("nvptx64-nvidia-cuda", shape_profiles={"N": (1, 4, 16)},
                                                        cache=False, arch="sm_90")


@pytest.mark.parametrize("axis,sort", [(None, 1), (None, 0), (0, 1), (1, 1), (0, 0)])
def test_unique_matches_onnxruntime(axis, sort):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT if n == "y" else TensorProto.INT64, None)
            for n in ("y", "i", "inv", "c")]
    kw = {"sorted": sort} if axis is None else {"sorted": sort, "axis": axis}
    model = _model([helper.make_node("Unique", ["x"], ["y", "i", "inv", "c"], name="u", **kw)], [x], outs)
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.integers(-1, 2 if axis != 0 else 1, (n, 3)).astype(np.float32)} for n in (1, 3, 8, 5)]
    feeds.append({"x": np.full((8, 3), 2.5, np.float32)})   # one distinct element / slice
    feeds.append({"x": np.arange(24, dtype=np.float32)[::-1].reshape(8, 3).copy()})   # all distinct: the bound
    _check(model, {"N": (1, 4, 8)}, feeds)


@pytest.mark.parametrize("center", [0, 1])
def test_non_max_suppression_matches_onnxruntime(center):
    """Boxes, scores and the three limits all graph inputs: zero kept, one kept, every box kept (the bound),
    overlapping clusters, ties in score, two batches and two classes."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    ins = [helper.make_tensor_value_info("b", f, [2, "N", 4]), helper.make_tensor_value_info("s", f, [2, 2, "N"]),
           helper.make_tensor_value_info("m", i64, [1]), helper.make_tensor_value_info("iou", f, [1]),
           helper.make_tensor_value_info("st", f, [1])]
    y = helper.make_tensor_value_info("y", i64, None)
    model = _model([helper.make_node("NonMaxSuppression", ["b", "s", "m", "iou", "st"], ["y"], name="nms",
                                     center_point_box=center)], ins, [y])
    rng = np.random.default_rng(4)

    def case(n, m, iou, st, spread=4.0):
        xy = rng.random((2, n, 2)).astype(np.float32) * spread
        wh = 0.5 + rng.random((2, n, 2)).astype(np.float32)
        b = np.concatenate([xy, xy + wh] if center == 0 else [xy, wh], axis=2)
        s = np.round(rng.random((2, 2, n)), 1).astype(np.float32)   # rounded: ties in score
        return {"b": b, "s": s, "m": np.array([m]), "iou": np.array([iou], np.float32),
                "st": np.array([st], np.float32)}
    feeds = [case(1, 5, 0.5, 2.0), case(1, 1, 0.5, -1.0), case(6, 10, 1.0, -1.0, spread=100.0),
             case(6, 3, 0.3, 0.2), case(5, 2, 0.0, 0.0, spread=1.0), case(6, 0, 0.5, 0.0)]
    art = _check(model, {"N": (1, 4, 6)}, feeds)
    assert art.manifest["symbols"]["nms_selected"]["max"] == 24    # 2 batches x 2 classes x 6 boxes


def test_sizes_without_a_run_time_kernel_are_refused_naming_the_op():
    n = helper.make_tensor_value_info("n", TensorProto.INT64, [])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, None)
    model = _model([helper.make_node("Range", ["zero", "n", "one"], ["y"], name="rg")], [n], [y],
                   [numpy_helper.from_array(np.array(0, np.int64), "zero"),
                    numpy_helper.from_array(np.array(1, np.int64), "one")])
    with pytest.raises(UnsupportedOpError, match=r"Range \(node 'rg', opset 17\).*only for NonZero"):
        Pipeline.from_onnx(model).compile(cache=False)


_DRIVER_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include "libdet.h"
int main(void) {
  float x[5 * 4];
  for (int i = 0; i < 20; ++i) x[i] = (i % 3 == 0) ? 2.0f : 0.25f;
  int64_t xs[2] = {5, 4}, ys[1], is[2];
  cuvil_tensor in = {x, 1, 2, xs};
  cuvil_session *s = cuvil_session_create(2);
  if (!s || cuvil_output_shape(s, &in, 0, ys) || cuvil_output_shape(s, &in, 1, is)) return 2;
  float *y = malloc(ys[0] * sizeof(float));
  int64_t *idx = malloc(is[0] * is[1] * sizeof(int64_t));
  cuvil_tensor out[2] = {{y, 1, 1, ys}, {idx, 7, 2, is}};
  int rc = cuvil_run(s, &in, out);
  printf("rc %d y [%lld] idx [%lld, %lld] first %lld %lld\n", rc, (long long)ys[0], (long long)is[0],
         (long long)is[1], (long long)idx[0], (long long)idx[1]);
  free(y);
  free(idx);
  cuvil_session_destroy(s);
  return rc != 0;
}
"""


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("cc") is None, reason="needs valgrind and cc")
def test_run_time_sizes_are_clean_under_valgrind(tmp_path):
    """The C flow (bound from cuvil_output_shape, run, actual dims) reads and writes only what it may."""
    art = Pipeline.from_onnx(detection_pattern()).compile(shape_profiles={"N": (1, 4, 16)}, cache=False,
                                                          cpu="haswell")   # valgrind decodes AVX2, not AVX-512
    art.save(tmp_path / "libdet.so")
    (tmp_path / "main.c").write_text(_DRIVER_C)
    exe = tmp_path / "main"
    subprocess.run(["cc", "-O1", "-g", str(tmp_path / "main.c"), f"-I{tmp_path}", f"-L{tmp_path}", "-ldet",
                    f"-Wl,-rpath,{tmp_path}", "-o", str(exe)], check=True)
    res = subprocess.run(["valgrind", "--error-exitcode=1", "--leak-check=full", "--errors-for-leak-kinds=definite",
                          str(exe)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    # x[i] = 2 where i % 3 == 0: 7 of the 20 elements, the first at (0, 0), then (0, 3)
    assert res.stdout.strip() == "rc 0 y [7] idx [7, 2] first 0 0", res.stdout


def test_sizes_computed_from_earlier_run_time_sizes():
    """A run-time size over a tensor sized by another (NonZero of a GatherND of NonZero's indices, Compress by
    that mask, TopK and Unique of the result): each bound from the previous one, every kernel proved in
    bounds with the limits (a count never exceeds the length its kernel scans)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
    outs = [helper.make_tensor_value_info(n, t, None)
            for n, t in (("nz2", TensorProto.INT64), ("v", TensorProto.FLOAT), ("u", TensorProto.FLOAT))]
    nodes = [helper.make_node("Greater", ["x", "t"], ["m"]), helper.make_node("NonZero", ["m"], ["nz"], name="nz"),
             helper.make_node("Transpose", ["nz"], ["idx"], perm=[1, 0]),
             helper.make_node("GatherND", ["x", "idx"], ["g"]), helper.make_node("Greater", ["g", "t2"], ["m2"]),
             helper.make_node("NonZero", ["m2"], ["nz2"], name="nz2"),
             helper.make_node("Compress", ["g", "m2"], ["c"], name="cp", axis=0),
             helper.make_node("TopK", ["c", "k"], ["v", "vi"], name="tk"),
             helper.make_node("Unique", ["c"], ["u"], name="uq")]
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "t"),
             numpy_helper.from_array(np.array(1.5, np.float32), "t2")]
    model = _model(nodes, [x, k], outs, inits)
    rng = np.random.default_rng(5)
    feeds = [{"x": np.round(rng.random((n, 4)) * 2, 1).astype(np.float32), "k": np.array([kk])}
             for n, kk in ((1, 0), (8, 2), (5, 1), (8, 0))]
    feeds.append({"x": np.full((8, 4), 1.75, np.float32), "k": np.array([32])})   # every size at its bound
    art = _check(model, {"N": (1, 4, 8)}, feeds)
    assert art.manifest["run_time_sizes"] == ["nz_nnz", "nz2_nnz", "cp_count", "tk_k", "uq_unique"]
    safety = art.manifest["memory_safety"]
    assert safety["kernels_proved"] == safety["kernels"] and safety["guarded"] == [], safety["summary"]
