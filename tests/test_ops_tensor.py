"""Shape inference of the tensor-manipulation families (shape, indexing, cast, resize, misc) against onnx."""
import itertools

import numpy as np
import pytest
from onnx import TensorProto, helper

from cuvil.errors import ShapeError
from cuvil.ir import DType, Graph, TensorType, parse_dim
from cuvil.ir.dim import ceildiv, evaluate
from cuvil.testing.shape_inference import assert_agrees, cuvil_infer, onnx_infer

F, H, D, I32, I64, B = DType.FLOAT, DType.FLOAT16, DType.DOUBLE, DType.INT32, DType.INT64, DType.BOOL
BIG = 2**63 - 1
i64 = lambda *v: np.array(v, np.int64)
f32 = lambda *v: np.array(v, np.float32)


def shp(*dims):
    return tuple(parse_dim(d) if isinstance(d, str) else d for d in dims)


# (op, inputs, attrs, consts, num_outputs, expected shapes or None): each also checked against onnx.
CASES = [
    # Reshape
    ("Reshape", [(F, (2, 3, 4)), None], {}, {1: i64(4, -1)}, 1, [(4, 6)]),
    ("Reshape", [(F, (2, 3, 4)), None], {}, {1: i64(0, 0, 2, 2)}, 1, [(2, 3, 2, 2)]),
    ("Reshape", [(F, ("N", 3, 4)), None], {}, {1: i64(0, -1)}, 1, [("N", 12)]),
    ("Reshape", [(F, ("N", 3, 4)), None], {}, {1: i64(-1, 3)}, 1, [("4*N", 3)]),
    ("Reshape", [(F, ("N", "S", 8)), None], {}, {1: i64(0, 0, 2, 4)}, 1, [("N", "S", 2, 4)]),
    ("Reshape", [(F, (0, 3)), None], {"allowzero": 1}, {1: i64(3, 0)}, 1, [(3, 0)]),
    ("Reshape", [(F, (1, 1)), None], {}, {1: i64()}, 1, [()]),
    # Transpose
    ("Transpose", [(F, (2, 3, 4))], {}, {}, 1, [(4, 3, 2)]),
    ("Transpose", [(F, ("N", 3, "S"))], {"perm": [0, 2, 1]}, {}, 1, [("N", "S", 3)]),
    # Concat
    ("Concat", [(F, (2, 3)), (F, (2, 5))], {"axis": 1}, {}, 1, [(2, 8)]),
    ("Concat", [(F, ("N", 3)), (F, ("N", 3)), (F, ("N", 3))], {"axis": -2}, {}, 1, [("3*N", 3)]),
    ("Concat", [(F, ("N", "S")), (F, ("N", 4))], {"axis": 0}, {}, 1, [("2*N", 4)]),
    # Split
    ("Split", [(F, (6, 4)), None], {"axis": 0}, {1: i64(1, 2, 3)}, 3, [(1, 4), (2, 4), (3, 4)]),
    ("Split", [(F, (7, 4))], {"num_outputs": 3}, {}, 3, [(3, 4), (3, 4), (1, 4)]),
    ("Split", [(F, ("N", 6))], {"axis": 1, "num_outputs": 2}, {}, 2, [("N", 3), ("N", 3)]),
    ("Split", [(F, ("N", 4)), None], {"axis": 1}, {1: i64(1, 3)}, 2, [("N", 1), ("N", 3)]),
    # Slice
    ("Slice", [(F, (10, 8)), None, None], {}, {1: i64(1), 2: i64(BIG)}, 1, [(9, 8)]),
    ("Slice", [(F, (10, 8)), None, None, None, None], {}, {1: i64(-1, 0), 2: i64(-BIG - 1, 8), 3: i64(0, -1), 4: i64(-2, 3)}, 1, [(5, 3)]),
    ("Slice", [(F, (5, 2)), None, None, None, None], {}, {1: i64(-10), 2: i64(-BIG - 1), 3: i64(0), 4: i64(-1)}, 1, [(1, 2)]),
    ("Slice", [(F, (5, 2)), None, None, None], {}, {1: i64(7), 2: i64(9), 3: i64(0)}, 1, [(0, 2)]),
    ("Slice", [(F, (5, 2)), None, None, None, None], {}, {1: i64(1), 2: i64(4), 3: i64(0), 4: i64(2)}, 1, [(2, 2)]),
    ("Slice", [(F, ("N", 8)), None, None, None], {}, {1: i64(1), 2: i64(BIG), 3: i64(0)}, 1, [("N - 1", 8)]),
    ("Slice", [(F, ("N", 8)), None, None, None], {}, {1: i64(0), 2: i64(-1), 3: i64(0)}, 1, [("N - 1", 8)]),
    ("Slice", [(F, ("N", 8)), None, None, None], {}, {1: i64(0), 2: i64(3), 3: i64(0)}, 1, [("min(3, N)", 8)]),
    ("Slice", [(F, ("N", 8)), None, None, None], {}, {1: i64(-3), 2: i64(BIG), 3: i64(0)}, 1, [("min(3, N)", 8)]),
    ("Slice", [(F, ("N", 8)), None, None, None, None], {}, {1: i64(-1), 2: i64(-BIG - 1), 3: i64(0), 4: i64(-1)}, 1, [("N", 8)]),
    ("Slice", [(F, ("N", 8)), None, None, None, None], {}, {1: i64(0), 2: i64(BIG), 3: i64(0), 4: i64(2)}, 1, [(ceildiv(parse_dim("N"), 2), 8)]),
    # Squeeze / Unsqueeze / Flatten
    ("Squeeze", [(F, (1, 3, 1, 2))], {}, {}, 1, [(3, 2)]),
    ("Squeeze", [(F, ("N", 1, 3)), None], {}, {1: i64(-2)}, 1, [("N", 3)]),
    ("Squeeze", [(F, ("N", 1, 3))], {}, {}, 1, None),
    ("Unsqueeze", [(F, ("N", 3)), None], {}, {1: i64(0, -1)}, 1, [(1, "N", 3, 1)]),
    ("Unsqueeze", [(F, ()), None], {}, {1: i64(0)}, 1, [(1,)]),
    ("Flatten", [(F, (2, 3, 4, 5))], {}, {}, 1, [(2, 60)]),
    ("Flatten", [(F, ("N", 3, 4))], {"axis": -1}, {}, 1, [("3*N", 4)]),
    ("Flatten", [(F, ("N", 3))], {"axis": 0}, {}, 1, [(1, "3*N")]),
    # Expand / Tile / Pad
    ("Expand", [(F, (3, 1)), None], {}, {1: i64(2, 1, 6)}, 1, [(2, 3, 6)]),
    ("Expand", [(F, ("N", 1)), None], {}, {1: i64(1, 5)}, 1, [("N", 5)]),
    ("Tile", [(F, (2, 3)), None], {}, {1: i64(3, 2)}, 1, [(6, 6)]),
    ("Tile", [(F, ("N", 3)), None], {}, {1: i64(2, 1)}, 1, [("2*N", 3)]),
    ("Pad", [(F, (2, 3)), None], {}, {1: i64(1, 0, 2, 1)}, 1, [(5, 4)]),
    ("Pad", [(F, ("N", 3, 8)), None, None, None], {"mode": "reflect"}, {1: i64(1, -2, 1, 0), 2: f32(0), 3: i64(-1, 1)}, 1, [("N", 1, 10)]),
    ("Pad", [(F, ("N", 3)), None], {"mode": "edge"}, {1: i64(1, 0, 1, 0)}, 1, [("N + 2", 3)]),
    ("Pad", [(I64, (4,)), None], {"mode": "wrap"}, {1: i64(2, 2)}, 1, [(8,)]),
    # Shape / Size / ConstantOfShape / Range
    ("Shape", [(F, ("N", 3, 4))], {}, {}, 1, [(3,)]),
    ("Shape", [(F, ("N", 3, 4))], {"start": -2}, {}, 1, [(2,)]),
    ("Shape", [(F, (2, 3, 4))], {"start": 1, "end": 10}, {}, 1, [(2,)]),
    ("Shape", [(F, (2, 3, 4))], {"start": 2, "end": 1}, {}, 1, [(0,)]),
    ("Size", [(F, ("N", 3))], {}, {}, 1, [()]),
    ("ConstantOfShape", [None], {}, {0: i64(2, 3)}, 1, [(2, 3)]),
    ("ConstantOfShape", [None], {"value": helper.make_tensor("v", TensorProto.INT32, [1], [7])}, {0: i64(4)}, 1, [(4,)]),
    ("ConstantOfShape", [None], {}, {0: i64()}, 1, [()]),
    ("Range", [None, None, None], {}, {0: np.int64(0), 1: np.int64(10), 2: np.int64(3)}, 1, [(4,)]),
    ("Range", [None, None, None], {}, {0: np.int32(10), 1: np.int32(0), 2: np.int32(-2)}, 1, [(5,)]),
    ("Range", [None, None, None], {}, {0: np.float32(0.5), 1: np.float32(2), 2: np.float32(0.5)}, 1, [(3,)]),
    ("Range", [None, None, None], {}, {0: np.int64(5), 1: np.int64(0), 2: np.int64(1)}, 1, [(0,)]),
    ("Range", [(I64, ()), (I64, ()), (I64, ())], {}, {}, 1, None),
    # DepthToSpace / SpaceToDepth / EyeLike / Compress
    ("DepthToSpace", [(F, (1, 8, 2, 3))], {"blocksize": 2}, {}, 1, [(1, 2, 4, 6)]),
    ("DepthToSpace", [(F, ("N", 18, "H", 3))], {"blocksize": 3, "mode": "CRD"}, {}, 1, [("N", 2, "3*H", 9)]),
    ("SpaceToDepth", [(F, ("N", 3, 4, 6))], {"blocksize": 2}, {}, 1, [("N", 12, 2, 3)]),
    ("EyeLike", [(F, (3, 4))], {}, {}, 1, [(3, 4)]),
    ("EyeLike", [(F, ("N", 4))], {"dtype": int(TensorProto.INT32), "k": 1}, {}, 1, [("N", 4)]),
    ("Compress", [(F, ("N", 4)), (B, (4,))], {"axis": -1}, {}, 1, None),
    # Gather family
    ("Gather", [(F, (5, 4, 3)), (I64, (2, 6))], {"axis": 1}, {}, 1, [(5, 2, 6, 3)]),
    ("Gather", [(F, ("N", 4)), None], {}, {1: np.int64(-1)}, 1, [(4,)]),
    ("Gather", [(F, ("N", "S", 8)), (I32, ("K",))], {"axis": -2}, {}, 1, [("N", "K", 8)]),
    ("GatherElements", [(F, (3, 4)), (I64, (3, 2))], {"axis": 1}, {}, 1, [(3, 2)]),
    ("GatherElements", [(F, ("N", 4)), (I64, ("N", 2))], {"axis": -1}, {}, 1, [("N", 2)]),
    ("GatherND", [(F, (2, 3, 4)), (I64, (5, 2))], {}, {}, 1, [(5, 4)]),
    ("GatherND", [(F, ("N", 3, 4)), (I64, ("N", 2, 1))], {"batch_dims": 1}, {}, 1, [("N", 2, 4)]),
    ("GatherND", [(F, (2, 3)), (I64, (4, 2))], {}, {}, 1, [(4,)]),
    ("ScatterND", [(F, ("N", 3, 4)), (I64, (5, 2)), (F, (5, 4))], {"reduction": "add"}, {}, 1, [("N", 3, 4)]),
    ("ScatterElements", [(F, ("N", 4)), (I64, (2, 4)), (F, (2, 4))], {"axis": 0, "reduction": "max"}, {}, 1, [("N", 4)]),
    ("OneHot", [(I64, ("N", 3)), None, (F, (2,))], {}, {1: np.int64(10)}, 1, [("N", 3, 10)]),
    ("OneHot", [(I64, ("N", 3)), None, (I32, (2,))], {"axis": 0}, {1: i64(5)}, 1, [(5, "N", 3)]),
    ("OneHot", [(I64, (2, 3)), None, (F, (2,))], {"axis": -2}, {1: np.float32(4.0)}, 1, [(2, 4, 3)]),
    ("OneHot", [(I64, (2,)), (I64, ()), (F, (2,))], {}, {}, 1, None),
    ("NonZero", [(F, ("N", 3))], {}, {}, 1, None),
    ("TopK", [(F, ("N", 10)), None], {}, {1: i64(3)}, 2, [("N", 3), ("N", 3)]),
    ("TopK", [(F, (4, 10, 5)), None], {"axis": 1, "largest": 0}, {1: i64(10)}, 2, [(4, 10, 5), (4, 10, 5)]),
    ("Trilu", [(F, ("N", 4, 4)), None], {"upper": 0}, {1: np.int64(-1)}, 1, [("N", 4, 4)]),
    ("Trilu", [(F, (3, 5))], {}, {}, 1, [(3, 5)]),
    ("CumSum", [(F, ("N", 4)), None], {"exclusive": 1, "reverse": 1}, {1: np.int64(-1)}, 1, [("N", 4)]),
    ("CumSum", [(D, (2, 3)), (I32, ())], {}, {}, 1, [(2, 3)]),
    ("Unique", [(F, ("N", 3))], {}, {}, 4, None),
    ("ReverseSequence", [(F, (5, "N", 3)), (I64, ("N",))], {}, {}, 1, [(5, "N", 3)]),
    ("ReverseSequence", [(F, ("N", 5)), (I64, ("N",))], {"batch_axis": 0, "time_axis": 1}, {}, 1, [("N", 5)]),
    ("NonMaxSuppression", [(F, ("N", 100, 4)), (F, ("N", 5, 100)), None, None], {}, {2: i64(10), 3: f32(0.5)}, 1, None),
    # Cast
    ("Cast", [(F, ("N", 3))], {"to": int(TensorProto.INT64)}, {}, 1, [("N", 3)]),
    ("Cast", [(I64, (2,))], {"to": int(TensorProto.FLOAT16), "saturate": 0}, {}, 1, [(2,)]),
    ("CastLike", [(F, ("N", 3)), (H, (1,))], {}, {}, 1, [("N", 3)]),
    ("CastLike", [(I32, ()), (B, ())], {}, {}, 1, [()]),
    # Resize / GridSample
    ("Resize", [(F, (1, 3, 10, 20)), None, None], {"mode": "linear"}, {1: f32(), 2: f32(1, 1, 2, 0.5)}, 1, [(1, 3, 20, 10)]),
    ("Resize", [(F, (1, 3, 7, 7)), None, None], {}, {1: f32(), 2: f32(1, 1, 1.5, 0.33)}, 1, [(1, 3, 10, 2)]),
    ("Resize", [(F, ("N", 3, "H", "W")), None, None], {"mode": "nearest"}, {1: f32(), 2: f32(1, 1, 2, 0.5)}, 1, [("N", 3, "2*H", "W/2")]),
    ("Resize", [(F, ("N", 3, 10, 20)), None, None, None], {"mode": "cubic"}, {1: f32(), 2: f32(), 3: i64(1, 3, 32, 32)}, 1, [(1, 3, 32, 32)]),
    ("Resize", [(F, ("N", 3, 10, 20)), None, None, None], {"axes": [-2, -1]}, {1: f32(), 2: f32(), 3: i64(5, 7)}, 1, [("N", 3, 5, 7)]),
    ("Resize", [(F, (1, 3, 10, 20)), None, None, None], {"keep_aspect_ratio_policy": "not_larger", "axes": [2, 3]}, {3: i64(15, 15)}, 1, [(1, 3, 8, 15)]),
    ("Resize", [(F, (1, 3, 10, 20)), None, None, None], {"keep_aspect_ratio_policy": "not_smaller", "axes": [2, 3]}, {3: i64(15, 15)}, 1, [(1, 3, 15, 30)]),
    ("GridSample", [(F, ("N", 3, 10, 10)), (F, ("N", 5, 6, 2))], {}, {}, 1, [("N", 3, 5, 6)]),
    ("GridSample", [(F, (1, 3, 4, 4, 4)), (F, (1, 2, 2, 2, 3))], {"mode": "nearest", "padding_mode": "border"}, {}, 1, [(1, 3, 2, 2, 2)]),
    # misc
    ("Identity", [(B, ("N", "S"))], {}, {}, 1, [("N", "S")]),
    ("Dropout", [(F, ("N", 8)), None], {}, {1: np.float32(0.2)}, 1, [("N", 8)]),
    ("Dropout", [(F, ("N", 8))], {"seed": 3}, {}, 2, [("N", 8), ("N", 8)]),
    ("Constant", [], {"value": helper.make_tensor("v", TensorProto.FLOAT16, [2, 3], [0] * 6)}, {}, 1, [(2, 3)]),
    ("Constant", [], {"value_float": 1.5}, {}, 1, [()]),
    ("Constant", [], {"value_floats": [1.0, 2.0]}, {}, 1, [(2,)]),
    ("Constant", [], {"value_int": 4}, {}, 1, [()]),
    ("Constant", [], {"value_ints": [1, 2, 3]}, {}, 1, [(3,)]),
    ("Constant", [], {"value_string": "hi"}, {}, 1, [()]),
    ("Constant", [], {"value_strings": ["a", "b"]}, {}, 1, [(2,)]),
    ("Constant", [], {"sparse_value": helper.make_sparse_tensor(
        helper.make_tensor("v", TensorProto.INT64, [2], [5, 6]), helper.make_tensor("i", TensorProto.INT64, [2], [0, 3]), [4])},
     {}, 1, [(4,)]),
    ("RandomNormal", [], {"shape": [2, 3]}, {}, 1, [(2, 3)]),
    ("RandomUniform", [], {"shape": [4], "dtype": int(TensorProto.DOUBLE), "high": 2.0}, {}, 1, [(4,)]),
    ("RandomNormalLike", [(H, ("N", 3))], {}, {}, 1, [("N", 3)]),
    ("RandomUniformLike", [(F, ("N", 3))], {"dtype": int(TensorProto.DOUBLE)}, {}, 1, [("N", 3)]),
    ("Bernoulli", [(F, ("N", 3))], {}, {}, 1, [("N", 3)]),
    ("Bernoulli", [(D, (2,))], {"dtype": int(TensorProto.BOOL)}, {}, 1, [(2,)]),
    ("Multinomial", [(F, ("N", 10))], {"sample_size": 4}, {}, 1, [("N", 4)]),
    ("Multinomial", [(F, (2, 10))], {"dtype": int(TensorProto.INT64)}, {}, 1, [(2, 1)]),
    ("Det", [(F, ("N", 3, 3))], {}, {}, 1, [("N",)]),
    ("Det", [(D, (4, 4))], {}, {}, 1, [()]),
]


@pytest.mark.parametrize("op, inputs, attrs, consts, n, want", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_agrees_with_onnx(op, inputs, attrs, consts, n, want):
    got = assert_agrees(op, inputs, attrs, consts, num_outputs=n)
    if want is not None:
        assert [s for _, s in got] == [shp(*w) for w in want]


def test_slice_bounds_exhaustively():
    # Static dims: exactly onnx's clamping. Symbolic dims: exact once the dim is as long as the bounds.
    vals = [-BIG - 1, -7, -3, -1, 0, 1, 3, 7, BIG]
    for st, en, step in itertools.product(vals, vals, [-2, -1, 1, 3]):
        consts = {1: i64(st), 2: i64(en), 3: i64(0), 4: i64(step)}
        slice_len = lambda d: cuvil_infer("Slice", [(F, (d,)), None, None, None, None], {}, consts)[0][1][0]
        for d in (0, 1, 5):
            assert slice_len(d) == onnx_infer("Slice", [(F, (d,)), None, None, None, None], {}, consts)[0][1][0]
        sym, lo = slice_len("N"), sum(abs(v) for v in (st, en) if abs(v) < BIG) + 1
        assert all(evaluate(sym, {"N": d}) == slice_len(d) for d in range(lo, lo + 4)), (st, en, step, sym)


def test_dtypes():
    t = lambda *a, **k: [dt for dt, _ in cuvil_infer(*a, **k)]
    assert t("Shape", [(F, ("N",))]) == [I64]
    assert t("NonZero", [(F, (3,))]) == [I64]
    assert t("TopK", [(H, (4, 10)), None], consts={1: i64(2)}) == [H, I64]
    assert t("Unique", [(I32, (5,))], num_outputs=4) == [I32, I64, I64, I64]
    assert t("Dropout", [(F, (2,))], num_outputs=2) == [F, B]
    assert t("ConstantOfShape", [None], consts={0: i64(2)}) == [F]
    assert t("Multinomial", [(F, (2, 3))]) == [I32]
    assert t("EyeLike", [(D, (2, 2))]) == [D]


def test_more_precise_than_onnx():
    # onnx leaves these dims unknown; they follow from constants or from the spec.
    assert cuvil_infer("Split", [(F, (4, 6))], {"axis": -1}, num_outputs=2) == [(F, (4, 3))] * 2
    assert cuvil_infer("Split", [(F, (7,))], num_outputs=3) == [(F, (3,)), (F, (3,)), (F, (1,))]
    cond = {1: np.array([True, False, True])}
    assert cuvil_infer("Compress", [(F, (3, 4)), None], {"axis": 1}, cond) == [(F, (3, 2))]
    assert cuvil_infer("Compress", [(F, (3, 4)), None], {}, cond) == [(F, (2,))]
    assert cuvil_infer("Compress", [(F, ("N", 4)), None], {"axis": 0}, cond) == [(F, shp(2, 4))]
    assert cuvil_infer("NonZero", [None], consts={0: np.array([[1, 0], [2, 3]], np.float32)}) == [(I64, (2, 3))]
    x = np.array([[1, 2], [1, 2], [3, 4]], np.float32)
    assert [s for _, s in cuvil_infer("Unique", [None], {"axis": 0}, {0: x}, num_outputs=4)] == [(2, 2), (2,), (3,), (2,)]
    assert [s for _, s in cuvil_infer("Unique", [None], {}, {0: x}, num_outputs=4)] == [(4,), (4,), (6,), (4,)]
    y, idx, inv, cnt = cuvil_infer("Unique", [(F, ("N", 3))], num_outputs=4)
    assert y[1] == idx[1] == cnt[1] and str(y[1][0]).endswith("_unique") and inv[1] == shp("3*N")
    assert cuvil_infer("Unique", [(F, (2, 3))], {"axis": -1}, num_outputs=4)[2] == (I64, (3,))
    (v, vs), (i, is_) = cuvil_infer("TopK", [(F, (4, 10)), (I64, (1,))], num_outputs=2)
    assert vs[0] == is_[0] == 4 and str(vs[1]).endswith("_k") and (v, i) == (F, I64)


def test_unknown_inputs_give_unknown_rank_or_fresh_symbols():
    # Shape-defining inputs computed from data: rank unknown, or a fresh symbol for data-dependent sizes.
    g = Graph()
    x = g.add_input("x", TensorType(F, (2, 3)))
    v = g.add_input("v", TensorType(I64, (2,)))
    assert _node(g, "Reshape", [x, v])[0].type == TensorType(F, None)
    assert _node(g, "Slice", [x, v, v])[0].type == TensorType(F, None)
    assert _node(g, "Resize", [x, None, g.add_input("sc", TensorType(F, (2,)))])[0].type == TensorType(F, None)
    assert _node(g, "Shape", [g.add_input("u", TensorType(F, None))])[0].type == TensorType(I64, None)
    assert _node(g, "Squeeze", [g.add_input("w", TensorType(F, shp("N", 1)))])[0].type == TensorType(F, None)
    (dt, s), = cuvil_infer("NonZero", [(F, ("N", 3))])
    assert dt == I64 and s[0] == 2 and str(s[1]).endswith("_nnz")
    (_, s), = cuvil_infer("Range", [(I64, ()), (I64, ()), (I64, ())])
    assert str(s[0]).endswith("_len")
    (_, s), = cuvil_infer("NonMaxSuppression", [(F, (1, 10, 4)), (F, (1, 2, 10))])
    assert s[1] == 3 and str(s[0]).endswith("_selected")
    (_, s), = cuvil_infer("OneHot", [(I64, (2,)), (I64, ()), (F, (2,))])
    assert s[0] == 2 and str(s[1]).endswith("_depth")
    # Unknown input ranks keep each op's output dtypes.
    u = lambda name, dt=F: g.add_input(name, TensorType(dt, None))
    assert [o.type for o in _node(g, "TopK", [u("t"), g.const(i64(2))], num_outputs=2)] == [TensorType(F, None), TensorType(I64, None)]
    assert _node(g, "NonZero", [u("nz")])[0].type == TensorType(I64, None)
    assert _node(g, "OneHot", [u("oh", I64), g.const(np.int64(3)), g.const(f32(0, 1))])[0].type == TensorType(F, None)
    assert _node(g, "Multinomial", [u("mn")])[0].type == TensorType(I32, None)
    assert _node(g, "EyeLike", [u("ey")], {"dtype": int(TensorProto.INT64)})[0].type == TensorType(I64, None)
    assert str(_node(g, "NonMaxSuppression", [u("bx"), u("sc")])[0].type) == "i64[nonmaxsuppression_selected,3]"


def _node(g, op, inputs, attrs=None, **kw):
    return g.add_node(op, inputs, attrs, **kw).outputs


def test_symbolic_shape_chain_end_to_end():
    g = Graph()
    x = g.add_input("x", TensorType(F, shp("N", 3, 4)))
    (s,) = _node(g, "Shape", [x])
    assert s.sym_value == shp("N", 3, 4)
    (n,) = _node(g, "Gather", [s, g.const(np.int64(0))], {"axis": 0})
    assert n.type == TensorType(I64, ()) and n.sym_value == shp("N")
    (n1,) = _node(g, "Unsqueeze", [n], {"axes": [0]})
    assert n1.type.shape == (1,) and n1.sym_value == shp("N")
    (target,) = _node(g, "Concat", [n1, g.const(i64(-1))], {"axis": 0})
    assert target.type.shape == (2,) and target.sym_value == shp("N", -1)
    (y,) = _node(g, "Reshape", [x, target])
    assert y.type == TensorType(F, shp("N", 12))


def test_symbolic_values_through_shape_ops():
    g = Graph()
    x = g.add_input("x", TensorType(F, shp("N", "S", 8)))
    (s,) = _node(g, "Shape", [x])
    (tail,) = _node(g, "Slice", [s, g.const(i64(1)), g.const(i64(BIG))])
    assert tail.type.shape == (2,) and tail.sym_value == shp("S", 8)
    (rev,) = _node(g, "Slice", [s, g.const(i64(-1)), g.const(i64(-BIG)), g.const(i64(0)), g.const(i64(-1))])
    assert rev.sym_value == shp(8, "S", "N")
    (s32,) = _node(g, "Cast", [s], {"to": int(TensorProto.INT32)})
    assert s32.type == TensorType(I32, (3,)) and s32.sym_value == shp("N", "S", 8)
    (sz,) = _node(g, "Size", [x])
    assert sz.sym_value == shp("8*N*S")
    (ns,) = _node(g, "Shape", [x], {"start": 0, "end": -1})
    (sq,) = _node(g, "Squeeze", [_node(g, "Unsqueeze", [ns, g.const(i64(0))])[0], g.const(i64(0))])
    assert sq.type.shape == (2,) and sq.sym_value == shp("N", "S")
    (r,) = _node(g, "Range", [g.const(np.int64(0)), g.const(np.int64(6)), g.const(np.int64(2))])
    assert r.sym_value == (0, 2, 4)
    (c,) = _node(g, "ConstantOfShape", [g.const(i64(3))], {"value": np.array([1], np.int64)})
    assert c.type == TensorType(I64, (3,)) and c.sym_value == (1, 1, 1)
    (ident,) = _node(g, "Identity", [ns])
    (t,) = _node(g, "Tile", [ident, g.const(i64(2))])
    assert t.sym_value == shp("N", "S", "N", "S")
    (e,) = _node(g, "Expand", [_node(g, "Gather", [s, g.const(i64(2))])[0], g.const(i64(3))])
    assert e.type.shape == (3,) and e.sym_value == (8, 8, 8)
    (k,) = _node(g, "Constant", [], {"value_ints": [2, 3]})
    assert k.sym_value == (2, 3)
    # Shapes computed from symbolic values: a causal mask's slice and an expand to the input's shape.
    (seq,) = _node(g, "Gather", [s, g.const(np.int64(1))])
    (mask,) = _node(g, "Slice", [g.const(np.zeros((512, 512), np.float32)), g.const(i64(0, 0)),
                                  _node(g, "Concat", [_node(g, "Unsqueeze", [seq, g.const(i64(0))])[0]] * 2, {"axis": 0})[0]])
    assert mask.type.shape == shp("S", "S")
    (ex,) = _node(g, "Expand", [g.const(np.zeros((1, 1, 8), np.float32)), s])
    assert ex.type.shape == shp("N", "S", 8)
    (rs,) = _node(g, "Resize", [x, None, None, _node(g, "Concat", [ns, g.const(i64(16))], {"axis": 0})[0]])
    assert rs.type.shape == shp("N", "S", 16)


def test_lifted_inputs_given_as_values():
    g = Graph()
    x = g.add_input("x", TensorType(F, shp("N", 6)))
    (a, b) = _node(g, "Split", [x, g.const(i64(2, 4))], {"axis": 1}, num_outputs=2)
    assert (a.type.shape, b.type.shape) == (shp("N", 2), shp("N", 4))
    (p,) = _node(g, "Pad", [x, g.const(i64(0, 1, 0, 1)), g.const(np.float32(0))])
    assert p.type.shape == shp("N", 8)
    (v, i) = _node(g, "TopK", [x, g.const(i64(2))], num_outputs=2)
    assert v.type.shape == i.type.shape == shp("N", 2)
    (r,) = _node(g, "Resize", [x, None, g.const(f32(2, 1))])
    assert r.type.shape == shp("2*N", 6)
    (o,) = _node(g, "OneHot", [g.add_input("i", TensorType(I64, shp("N"))), g.const(np.float32(3)), g.const(f32(0, 1))])
    assert o.type.shape == shp("N", 3)


ERRORS = [
    ("Reshape", [(F, (2, 3)), None], {}, {1: i64(4, -1)}, "cannot reshape"),
    ("Reshape", [(F, (2, 3)), None], {}, {1: i64(5)}, "cannot reshape"),
    ("Reshape", [(F, (2, 3)), None], {}, {1: i64(-1, -1)}, "more than one -1"),
    ("Reshape", [(F, (2, 3)), None], {}, {1: i64(0, 0, 0)}, "copies input dim 2"),
    ("Reshape", [(F, (0, 3)), None], {"allowzero": 1}, {1: i64(0, -1)}, "both 0 and -1"),
    ("Transpose", [(F, (2, 3))], {"perm": [0, 0]}, {}, "not a permutation"),
    ("Concat", [(F, (2, 3)), (F, (4, 5))], {"axis": 0}, {}, "differ in dim 1"),
    ("Concat", [(F, (2, 3)), (F, (2, 3, 1))], {"axis": 0}, {}, "ranks differ"),
    ("Concat", [(F, (2, 3)), (F, (2, 3))], {"axis": 2}, {}, "out of range"),
    ("Concat", [(F, (2, 3)), (F, (2, 3))], {}, {}, "missing required attribute 'axis'"),
    ("Concat", [(F, (2, 3)), (I64, (2, 3))], {"axis": 0}, {}, "dtypes differ"),
    ("Split", [(F, (6, 4)), None], {}, {1: i64(1, 2)}, "sum to 3"),
    ("Split", [(F, (2, 4))], {"num_outputs": 4}, {}, "into 4 parts"),
    ("Slice", [(F, (5,)), None, None, None, None], {}, {1: i64(0), 2: i64(3), 3: i64(0), 4: i64(0)}, "steps must not be zero"),
    ("Slice", [(F, (5, 2)), None, None, None], {}, {1: i64(0, 0), 2: i64(3, 1), 3: i64(1, -1)}, "repeat an axis"),
    ("Slice", [(F, (5, 2)), None, None], {}, {1: i64(0, 0), 2: i64(3)}, "differ in length"),
    ("Squeeze", [(F, (2, 3)), None], {}, {1: i64(0)}, "cannot squeeze axis 0 of size 2"),
    ("Unsqueeze", [(F, (2, 3)), None], {}, {1: i64(0, 0)}, "repeat an axis"),
    ("Unsqueeze", [(F, (2, 3)), None], {}, {1: i64(3)}, "out of range"),
    ("Flatten", [(F, (2, 3))], {"axis": 3}, {}, "out of range"),
    ("Expand", [(F, (2, 3)), None], {}, {1: i64(4, 3)}, "do not broadcast"),
    ("Tile", [(F, (2, 3)), None], {}, {1: i64(2)}, "one entry per input dim"),
    ("Pad", [(F, (2, 3)), None], {}, {1: i64(1, 1)}, "2 entries per padded axis"),
    ("Pad", [(F, (2, 3)), None], {"mode": "mirror"}, {1: i64(1, 1, 1, 1)}, "mode must be one of"),
    ("Pad", [(F, (2, 3)), None], {}, {1: i64(0, -2, 0, -2)}, "below zero"),
    ("ConstantOfShape", [None], {}, {0: i64(2, -1)}, "must not be negative"),
    ("Range", [(I64, ()), (I32, ()), (I64, ())], {}, {}, "share a dtype"),
    ("Range", [None, None, None], {}, {0: np.int64(0), 1: np.int64(5), 2: np.int64(0)}, "delta must not be zero"),
    ("DepthToSpace", [(F, (1, 6, 2, 2))], {"blocksize": 2}, {}, "not divisible"),
    ("DepthToSpace", [(F, (6, 2, 2))], {"blocksize": 2}, {}, "must be 4-D"),
    ("SpaceToDepth", [(F, (1, 3, 5, 4))], {"blocksize": 2}, {}, "not divisible"),
    ("EyeLike", [(F, (2, 3, 4))], {}, {}, "must be 2-D"),
    ("Compress", [(F, (3, 4)), (F, (3,))], {"axis": 0}, {}, "must be bool"),
    ("Gather", [(F, (3, 4)), (F, (2,))], {}, {}, "int32 or int64"),
    ("Gather", [(F, (3, 4)), None], {"axis": 1}, {1: i64(4)}, "out of range"),
    ("Gather", [(F, (3, 4)), (I64, (2,))], {"axis": -3}, {}, "out of range"),
    ("GatherElements", [(F, (3, 4)), (I64, (3,))], {}, {}, "same rank"),
    ("GatherND", [(F, (3, 4)), (I64, (2, 3))], {}, {}, "last dim 3 must be in"),
    ("GatherND", [(F, (3, 4)), (I64, (2, 1))], {"batch_dims": 1}, {}, "batch dim 0"),
    ("ScatterND", [(F, (3, 4)), (I64, (2, 1)), (F, (2, 5))], {}, {}, "updates shape"),
    ("ScatterND", [(F, (3, 4)), (I64, (2, 1)), (F, (2, 4))], {"reduction": "sub"}, {}, "reduction must be"),
    ("ScatterElements", [(F, (3, 4)), (I64, (2, 4)), (F, (2, 3))], {}, {}, "differ in dim 1"),
    ("OneHot", [(I64, (3,)), None, (F, (2,))], {"axis": 2}, {1: np.int64(4)}, "out of range"),
    ("OneHot", [(I64, (3,)), None, (F, (3,))], {}, {1: np.int64(4)}, "off_value, on_value"),
    ("TopK", [(F, (3, 4)), None], {}, {1: i64(5)}, "out of range for axis 1 of size 4"),
    ("Trilu", [(F, (3,))], {}, {}, "rank >= 2"),
    ("CumSum", [(F, (3, 4)), None], {}, {1: np.int64(2)}, "out of range"),
    ("ReverseSequence", [(F, (3, 4)), (I64, (4,))], {"batch_axis": 0, "time_axis": 0}, {}, "0 and 1"),
    ("ReverseSequence", [(F, (3, 4)), (I64, (5,))], {}, {}, "batch size"),
    ("NonMaxSuppression", [(F, (1, 10, 5)), (F, (1, 2, 10))], {}, {}, "boxes must be"),
    ("Cast", [(F, (2,))], {"to": 99}, {}, "not supported"),
    ("Resize", [(F, (1, 3, 4, 4)), None, None, None], {}, {2: f32(1, 1, 2, 2), 3: i64(1, 3, 8, 8)}, "exactly one of scales and sizes"),
    ("Resize", [(F, (1, 3, 4, 4)), None, None], {}, {2: f32(2, 2)}, "one entry per resized axis"),
    ("Resize", [(F, ("N", 3, "H", 4)), None, None], {}, {2: f32(1, 1, 1.5, 1)}, "non-integer scale"),
    ("Resize", [(F, (1, 3, 4, 4)), None, None], {"mode": "area"}, {2: f32(1, 1, 2, 2)}, "mode must be one of"),
    ("Resize", [(F, (1, 3, "H", 4)), None, None, None], {"keep_aspect_ratio_policy": "not_larger"}, {3: i64(1, 3, 8, 8)}, "needs static"),
    ("GridSample", [(F, (1, 3, 4, 4)), (F, (1, 5, 5, 3))], {}, {}, "grid must be"),
    ("GridSample", [(F, (1, 3, 4, 4)), (F, (2, 5, 5, 2))], {}, {}, "batch of X and grid"),
    ("Dropout", [(F, (2,)), None], {}, {1: np.float32(1.5)}, "ratio must be"),
    ("Constant", [], {"value_int": 1, "value_float": 2.0}, {}, "exactly one of"),
    ("RandomNormal", [], {}, {}, "missing required attribute 'shape'"),
    ("Multinomial", [(F, (2, 3, 4))], {}, {}, "batch_size, class_size"),
    ("Det", [(F, (2, 3))], {}, {}, "square"),
]


@pytest.mark.parametrize("op, inputs, attrs, consts, msg", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors(op, inputs, attrs, consts, msg):
    with pytest.raises(ShapeError, match=msg) as e:
        cuvil_infer(op, inputs, attrs, consts)
    assert f"({op})" in str(e.value)  # the message names the node and op
