"""Shape inference of the NN op families (conv, pool, norm, matmul, reduce, softmax, quant) against onnx."""
import numpy as np
import pytest

from cuvil.errors import ShapeError
from cuvil.ir import DType, Graph, SymExpr, TensorType
from cuvil.ir.dim import evaluate
from cuvil.testing.shape_inference import assert_agrees, cuvil_infer

F, H16, I8, U8, I32, I64 = DType.FLOAT, DType.FLOAT16, DType.INT8, DType.UINT8, DType.INT32, DType.INT64


def i64(*v):
    return np.array(v, dtype=np.int64)


def check_symbolic(op, sym_inputs, attrs=None, *, out=0, expect=None, envs=({"N": 2, "H": 9, "W": 12},
                   {"N": 1, "H": 16, "W": 7}, {"N": 3, "H": 31, "W": 32}), **kw):
    """Symbolic inference agrees with onnx, prints as ``expect``, and evaluates to the static result."""
    got = assert_agrees(op, sym_inputs, attrs, **kw)[out][1]
    if expect is not None:
        assert [str(d) for d in got] == expect
    for env in envs:
        static_inputs = [None if t is None else (t[0], tuple(env.get(d, d) for d in t[1])) for t in sym_inputs]
        want = assert_agrees(op, static_inputs, attrs, **kw)[out][1]
        assert tuple(evaluate(d, env) for d in got) == want, (env, got, want)
    return got


def fails(op, inputs, attrs=None, match="", **kw):
    with pytest.raises(ShapeError, match=match):
        cuvil_infer(op, inputs, attrs, **kw)


# --- conv --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attrs", [
    {}, {"pads": [1, 1, 1, 1]}, {"strides": [2, 2]}, {"strides": [2, 3], "pads": [1, 0, 2, 1]},
    {"dilations": [2, 2], "pads": [2, 2, 2, 2]}, {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
    {"auto_pad": "SAME_LOWER", "strides": [3, 1], "dilations": [1, 2]}, {"auto_pad": "VALID", "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [1, 2]},
])
def test_conv_static(attrs):
    assert_agrees("Conv", [(F, (2, 4, 17, 20)), (F, (8, 4, 3, 3)), (F, (8,))], attrs)


def test_conv_group_1d_3d_and_integer():
    assert_agrees("Conv", [(F, (1, 8, 10, 10)), (F, (16, 2, 3, 3))], {"group": 4, "pads": [1, 1, 1, 1]})
    assert_agrees("Conv", [(F, (1, 8, 10, 10)), (F, (8, 1, 3, 3))], {"group": 8})  # depthwise
    assert_agrees("Conv", [(H16, (3, 4, 50)), (H16, (6, 4, 5))], {"strides": [4], "pads": [2, 2]})
    assert_agrees("Conv", [(F, (1, 2, 8, 9, 10)), (F, (4, 2, 3, 3, 3))], {"strides": [2, 2, 2]})
    assert_agrees("ConvInteger", [(U8, (1, 3, 12, 12)), (U8, (5, 3, 3, 3))], {"pads": [1, 1, 1, 1]})


def test_conv_symbolic():
    x, w = (F, ("N", 3, "H", "W")), (F, (8, 3, 3, 3))
    got = check_symbolic("Conv", [x, w], {"strides": [2, 2], "pads": [1, 1, 1, 1]})
    assert [str(d) for d in got] == ["N", "8", "(H + 1)/2", "(W + 1)/2"]
    got = assert_agrees("Conv", [x, w], {"pads": [1, 1, 1, 1]})[0][1]
    assert [str(d) for d in got] == ["N", "8", "H", "W"]  # 'same' convolution keeps the symbols
    check_symbolic("Conv", [x, w], {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
                   expect=["N", "8", "(H + 1)/2", "(W + 1)/2"])
    check_symbolic("Conv", [x, w], {"auto_pad": "VALID", "dilations": [2, 1]},
                   expect=["N", "8", "H - 4", "W - 2"])


def test_conv_errors():
    fails("Conv", [(F, (1, 3, 8, 8)), (F, (8, 4, 3, 3))], match="input has 3 channels but the weight expects 4")
    fails("Conv", [(F, (1, 4, 8, 8)), (F, (6, 1, 3, 3))], {"group": 4}, match="do not divide into 4 groups")
    fails("Conv", [(F, (1, 3, 2, 8)), (F, (8, 3, 3, 3))], match="larger than the padded input")
    fails("Conv", [(F, (1, 3, 8, 8)), (F, (8, 3, 3))], match="weight rank 3 differs from input rank 4")
    fails("Conv", [(F, (1, 3, 8, 8)), (F, (8, 3, 3, 3))], {"strides": [1, 1, 1]}, match="strides has 3 values")
    fails("Conv", [(F, (1, 3, 8, 8)), (F, (8, 3, 3, 3)), (F, (4,))], match="bias shape")


@pytest.mark.parametrize("attrs", [
    {}, {"strides": [2, 2]}, {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]},
    {"strides": [3, 2], "dilations": [2, 1]}, {"group": 2, "strides": [2, 2]},
    {"output_shape": [20, 21], "strides": [2, 2]}, {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
    {"auto_pad": "SAME_LOWER", "strides": [3, 3]}, {"auto_pad": "VALID", "strides": [2, 2]},
])
def test_conv_transpose_static(attrs):
    assert_agrees("ConvTranspose", [(F, (2, 4, 9, 10)), (F, (4, 3, 3, 3)), (F, (3 * attrs.get("group", 1),))], attrs)


def test_conv_transpose_same_with_output_padding():
    # onnxruntime's SAME padding: total = max(0, extent + output_padding - stride), so out = stride * in when
    # that is not negative (onnx's inference adds output_padding once more)
    for k, s, op_ in [(3, 2, 1), (1, 3, 0), (1, 3, 1), (2, 4, 3)]:
        for mode in ("SAME_UPPER", "SAME_LOWER"):
            attrs = {"auto_pad": mode, "strides": [s, s], "output_padding": [op_, op_]}
            shapes = [(1, 2, 5, 6), (2, 3, k, k)]
            assert cuvil_infer("ConvTranspose", [(F, x) for x in shapes], attrs)[0][1] == ort_shape(
                "ConvTranspose", shapes, attrs)


def test_conv_transpose_symbolic_and_errors():
    got = check_symbolic("ConvTranspose", [(F, ("N", 4, "H", "W")), (F, (4, 2, 4, 4))],
                         {"strides": [2, 2], "pads": [1, 1, 1, 1]})
    assert [str(d) for d in got] == ["N", "2", "2*H", "2*W"]  # the usual 2x upsampling
    fails("ConvTranspose", [(F, (1, 3, 8, 8)), (F, (4, 2, 3, 3))], match="input has 3 channels but the weight has 4")
    fails("ConvTranspose", [(F, (1, 4, 8, 8)), (F, (4, 2, 3, 3))], {"strides": [2, 2], "output_padding": [2, 0]},
          match="output_padding 2 must be smaller")
    fails("ConvTranspose", [(F, (1, 4, 8, 8)), (F, (4, 2, 3, 3))], {"output_shape": [1, 2, 16, 16]},
          match="output_shape .* must have 2 values")


def test_deform_conv():
    x, w = (F, (2, 4, 10, 10)), (F, (6, 2, 3, 3))
    off, mask = (F, (2, 2 * 2 * 9, 8, 8)), (F, (2, 2 * 9, 8, 8))
    assert_agrees("DeformConv", [x, w, off, (F, (6,)), mask], {"group": 2, "offset_group": 2})
    off1 = (F, (2, 18, 5, 5))
    assert_agrees("DeformConv", [x, w[:1] + ((6, 4, 3, 3),), off1], {"strides": [2, 2], "pads": [1, 1, 1, 1]})
    fails("DeformConv", [x, (F, (6, 4, 3, 3)), (F, (2, 18, 7, 7))], match="offset shape")


# --- pool --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
@pytest.mark.parametrize("attrs", [
    {"kernel_shape": [2, 2]}, {"kernel_shape": [3, 3], "strides": [2, 2]},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"kernel_shape": [3, 2], "strides": [2, 3], "ceil_mode": 1},
    {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "ceil_mode": 1},
    {"kernel_shape": [3, 3], "dilations": [2, 2]}, {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER"},
    {"kernel_shape": [3, 3], "auto_pad": "SAME_LOWER", "strides": [2, 2]},
    {"kernel_shape": [3, 3], "auto_pad": "VALID", "strides": [2, 2], "ceil_mode": 1},
])
def test_pool_static(op, attrs):
    for h in (5, 6, 9):
        assert_agrees(op, [(F, (2, 3, h, h + 2))], attrs)


def test_max_pool_indices_and_1d():
    got = assert_agrees("MaxPool", [(F, (1, 3, 11, 11))], {"kernel_shape": [3, 3], "strides": [2, 2]}, num_outputs=2)
    assert got[1] == (I64, (1, 3, 5, 5))
    assert_agrees("MaxPool", [(U8, (1, 3, 11))], {"kernel_shape": [3], "storage_order": 0})
    assert len(cuvil_infer("MaxPool", [(F, (1, 3, 11, 11))], {"kernel_shape": [3, 3]})) == 1


def test_pool_symbolic():
    x = (F, ("N", 64, "H", "W"))
    check_symbolic("MaxPool", [x], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                   expect=["N", "64", "(H + 1)/2", "(W + 1)/2"])
    check_symbolic("AveragePool", [x], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
                   expect=["N", "64", "H/2", "W/2"])
    # ceil mode where the last window may start in the end padding: a min() keeps it exact (checked
    # against onnxruntime below)
    got = cuvil_infer("MaxPool", [x], {"kernel_shape": [2, 2], "strides": [3, 3], "pads": [0, 0, 1, 1],
                                       "ceil_mode": 1})[0][1]
    assert str(got[2]) == "min((H + 1)/3 + 1, (H + 2)/3)"


def ort_shape(op, shapes, attrs):
    """The output shape onnxruntime actually produces for a one-node model on float inputs."""
    import onnxruntime as ort
    from onnx import helper
    names = [f"x{i}" for i in range(len(shapes))]
    g = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], "g",
                          [helper.make_tensor_value_info(n, 1, s) for n, s in zip(names, shapes)],
                          [helper.make_tensor_value_info("y", 1, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=9)
    so = ort.SessionOptions()
    so.log_severity_level = 3  # where onnx's own inference disagrees, onnxruntime warns: silence it
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {n: np.ones(s, np.float32) for n, s in zip(names, shapes)})[0].shape


@pytest.mark.parametrize("op", ["MaxPool", "AveragePool", "LpPool"])
def test_pool_ceil_mode_drops_windows_in_end_padding(op):
    # onnx 1.23's shape inference omits PyTorch's rule (a window starting in the end padding is dropped);
    # onnxruntime and onnx's reference implementation apply it, and so does Cuvil, symbolically too.
    for k, s, pads in [(3, 2, [1, 2]), (2, 3, [0, 1]), (2, 3, [0, 0]), (3, 2, [0, 0]), (2, 2, [1, 1])]:
        attrs = {"kernel_shape": [k], "strides": [s], "pads": pads, "ceil_mode": 1}
        sym = cuvil_infer(op, [(F, (1, 2, "H"))], attrs)[0][1][2]
        for h in range(3, 10):
            want = ort_shape(op, [(1, 2, h)], attrs)
            assert cuvil_infer(op, [(F, (1, 2, h))], attrs)[0][1] == want
            assert evaluate(sym, {"H": h}) == want[2], (attrs, h, sym)


def test_pool_errors():
    fails("MaxPool", [(F, (1, 3, 8, 8))], match="missing required attribute 'kernel_shape'")
    fails("MaxPool", [(F, (1, 3, 8, 8))], {"kernel_shape": [3]}, match="must have 2 values")
    fails("AveragePool", [(F, (1, 3, 2, 8))], {"kernel_shape": [3, 3]}, match="larger than the padded input")
    fails("MaxPool", [(F, (3, 8))], {"kernel_shape": [3]}, match="rank >= 3")


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"])
def test_global_pool(op):
    assert_agrees(op, [(F, (2, 3, 7, 9))])
    assert_agrees(op, [(F, ("N", 3, "D", "H", "W"))])


def test_max_unpool():
    x = (F, (1, 3, 4, 5))
    assert_agrees("MaxUnpool", [x, (I64, (1, 3, 4, 5))], {"kernel_shape": [2, 2], "strides": [2, 2]})
    assert_agrees("MaxUnpool", [x, (I64, (1, 3, 4, 5))], {"kernel_shape": [3, 3], "strides": [2, 2],
                                                         "pads": [1, 1, 0, 0]})
    got = cuvil_infer("MaxUnpool", [x, (I64, (1, 3, 4, 5)), None], {"kernel_shape": [2, 2]},
                      consts={2: i64(1, 3, 9, 11)})
    assert got == [(F, (1, 3, 9, 11))]
    fails("MaxUnpool", [x, (I64, (1, 3, 4, 5)), (I64, (4,))], {"kernel_shape": [2, 2]}, match="must be a constant")


def test_roi_pools():
    x = (F, ("N", 256, 32, 32))
    assert_agrees("MaxRoiPool", [x, (F, ("R", 5))], {"pooled_shape": [7, 7], "spatial_scale": 0.5})
    assert_agrees("RoiAlign", [x, (F, (10, 4)), (I64, (10,))], {"output_height": 7, "output_width": 5})
    assert_agrees("RoiAlign", [x, (F, ("R", 4)), (I64, ("R",))])
    fails("RoiAlign", [x, (F, (10, 5)), (I64, (10,))], match="rois must have shape")


# --- norm --------------------------------------------------------------------------------------------

def test_batch_norm():
    c = (F, (16,))
    assert_agrees("BatchNormalization", [(F, ("N", 16, "H", "W")), c, c, c, c], {"epsilon": 1e-3})
    assert_agrees("BatchNormalization", [(F, (4, 16)), c, c, c, c])
    got = assert_agrees("BatchNormalization", [(F, (2, 16, 5, 5)), c, c, c, c], {"training_mode": 1}, num_outputs=3)
    assert got[1:] == [(F, (16,)), (F, (16,))]
    fails("BatchNormalization", [(F, (2, 16, 5)), c, (F, (8,)), c, c], match=r"B shape \[8\] must be \[16\]")


def test_layer_norm():
    x = (F, ("N", "T", 64))
    got = assert_agrees("LayerNormalization", [x, (F, (64,)), (F, (64,))], num_outputs=3)
    assert got[1] == (F, (SymExpr.symbol("N"), SymExpr.symbol("T"), 1))
    assert_agrees("LayerNormalization", [(H16, (2, 3, 4, 5)), (H16, (4, 5))], {"axis": 2}, num_outputs=3)
    got = assert_agrees("LayerNormalization", [(H16, (2, 3, 4, 5)), (H16, (3, 4, 5))], {"axis": -3, "stash_type": 1},
                        num_outputs=2)
    assert got[1] == (F, (2, 1, 1, 1))
    assert len(cuvil_infer("LayerNormalization", [x, (F, (64,))])) == 1
    fails("LayerNormalization", [x, (F, (32,))], match="does not broadcast")
    fails("LayerNormalization", [x, (F, (64,))], {"axis": 3}, match="axis 3 out of range")


def test_other_norms():
    x = (F, ("N", 32, "H", "W"))
    assert_agrees("InstanceNormalization", [x, (F, (32,)), (F, (32,))])
    assert_agrees("LRN", [x], {"size": 5, "alpha": 1e-4})
    assert_agrees("LpNormalization", [x], {"axis": 1, "p": 2})
    # onnx infers no type for these two (function ops; MVN's default axes even break onnx's inference)
    assert cuvil_infer("MeanVarianceNormalization", [x]) == cuvil_infer("GroupNormalization", [
        x, (F, (32,)), (F, (32,))], {"num_groups": 8}) == [(F, tuple(SymExpr.symbol(d) if isinstance(d, str) else d
                                                                 for d in x[1]))]
    assert_agrees("MeanVarianceNormalization", [x], {"axes": [1, -1]})
    assert_agrees("RMSNormalization", [(F, ("N", "T", 64)), (F, (64,))], {"axis": -1}, opset=23)
    assert_agrees("RMSNormalization", [(H16, (2, 3, 8)), (H16, (3, 8))], {"axis": 1}, opset=23)
    fails("GroupNormalization", [(F, (1, 30, 4, 4)), (F, (30,)), (F, (30,))], {"num_groups": 8},
          match="30 channels do not divide into 8 groups")
    fails("InstanceNormalization", [(F, (1, 30, 4, 4)), (F, (3,)), (F, (30,))], match="scale shape")
    fails("LRN", [x], match="size must be")


# --- matmul ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("a,b", [
    ((3, 4), (4, 5)), ((4,), (4,)), ((4,), (4, 5)), ((3, 4), (4,)), ((2, 3, 4), (4, 5)), ((4,), (7, 4, 5)),
    ((2, 1, 3, 4), (5, 4, 6)), (("N", "T", 64), (64, 128)), (("B", "H", "T", 16), ("B", "H", 16, "S")),
    ((1, 3, 4), ("N", 4, 2)), ((7, 2, 3, 4), (4,)),
])
def test_matmul(a, b):
    assert_agrees("MatMul", [(F, a), (F, b)])
    assert_agrees("MatMulInteger", [(U8, a), (I8, b)])


def test_matmul_errors():
    fails("MatMul", [(F, (3, 4)), (F, (5, 6))], match=r"inner dimensions differ: \[3,4\] @ \[5,6\] \(4 vs 5\)")
    fails("MatMul", [(F, (2, 3, 4)), (F, (3, 4, 5))], match="do not broadcast")
    fails("MatMul", [(F, (3, 4)), (H16, (4, 5))], match="dtypes differ")


@pytest.mark.parametrize("ta,tb,c", [(0, 0, None), (1, 0, (5,)), (0, 1, (3, 1)), (1, 1, (3, 5)), (0, 0, ()),
                                     (0, 0, (1, 5))])
def test_gemm(ta, tb, c):
    a, b = ((4, 3) if ta else (3, 4)), ((5, 4) if tb else (4, 5))
    assert_agrees("Gemm", [(F, a), (F, b)] + ([(F, c)] if c is not None else []), {"transA": ta, "transB": tb})
    assert_agrees("Gemm", [(F, ("N", 4)), (F, (5, 4)), (F, (5,))], {"transB": 1, "alpha": 0.5})


def test_gemm_errors():
    fails("Gemm", [(F, (3, 4)), (F, (5, 4))], match="inner dimensions differ")
    fails("Gemm", [(F, (3, 4)), (F, (4, 5)), (F, (2, 5))], match=r"C \[2,5\] does not broadcast to \[3,5\]")
    fails("Gemm", [(F, (3, 4, 1)), (F, (4, 5))], match="must be 2-D")


@pytest.mark.parametrize("eq,shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]), ("...ij,...jk->...ik", [(2, 3, 4), (2, 4, 5)]), ("ij,jk", [(3, 4), (4, 5)]),
    ("ii->i", [(4, 4)]), ("ii", [(4, 4)]), ("...ij,...jk", [("N", 3, 4), ("N", 4, 5)]),
    ("ij->ji", [(3, 4)]), ("ij", [(3, 4)]), ("ji", [(3, 4)]), ("i,j->ij", [(3,), (5,)]), ("i,i", [(3,), (3,)]),
    ("bij,bkj->bik", [(2, 3, 4), (2, 5, 4)]), ("...ii->...i", [(2, 3, 3)]), ("i...->...", [(3, 4, 5)]),
    ("Ab,bC", [(2, 3), (3, 4)]), ("bhqd,bhkd->bhqk", [("B", 8, "T", 64), ("B", 8, "S", 64)]),
    ("b i j , b j k -> b i k", [("N", 3, 4), ("N", 4, 5)]), ("ij,ij->", [(3, 4), (3, 4)]),
    ("ij,kj->ik", [(3, 1), (5, 4)]),
])
def test_einsum(eq, shapes):
    assert_agrees("Einsum", [(F, s) for s in shapes], {"equation": eq})


@pytest.mark.parametrize("eq,shapes", [
    ("...ij,...jk->...ik", [(2, 3, 4), (7, 1, 4, 5)]), ("...ij,...jk", [(6, 3, 4), (4, 5)]),
    ("...i,...i->...", [(5, 1, 3), (4, 3)]), ("i...,j...", [(2, 3, 1), (4, 5)]),
])
def test_einsum_ellipsis_broadcast(eq, shapes):
    # ellipses of different ranks broadcast as in numpy (onnx's inference only accepts equal ranks)
    want = np.einsum(eq, *(np.zeros(s) for s in shapes)).shape
    assert cuvil_infer("Einsum", [(F, s) for s in shapes], {"equation": eq}) == [(F, want)]


def test_einsum_errors():
    fails("Einsum", [(F, (3, 4)), (F, (5, 6))], {"equation": "ij,jk->ik"}, match="label 'j' has sizes 4 and 5")
    fails("Einsum", [(F, (3, 4))], {"equation": "ijk->i"}, match="does not match an input of rank 2")
    fails("Einsum", [(F, (3, 4))], {"equation": "ij->iz"}, match="'z' of 'ij->iz' is not an input label")
    fails("Einsum", [(F, (3, 4))], {"equation": "ij,jk->ik"}, match="has 2 operands but the node has 1")


# --- reduce ------------------------------------------------------------------------------------------

REDUCE = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
          "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op", REDUCE)
def test_reduce(op):
    x = (F, ("N", 3, "H", 5))
    assert_agrees(op, [x, None], consts={1: i64(1, -1)})
    assert_agrees(op, [x, None], {"keepdims": 0}, consts={1: i64(-3, 3)})
    assert_agrees(op, [x])  # all axes, kept as 1s
    assert_agrees(op, [x], {"keepdims": 0})
    assert_agrees(op, [x, None], {"noop_with_empty_axes": 1}, consts={1: i64()})
    assert_agrees(op, [x], {"noop_with_empty_axes": 1, "keepdims": 0})
    got = assert_agrees(op, [(F, (2, 3, 4)), None], {"keepdims": 0}, consts={1: i64(0)})
    assert got == [(F, (3, 4))]


def test_reduce_canonical_form_and_errors():
    from cuvil.ir.registry import lookup
    assert lookup("ReduceMean").lifted == (("axes", 1, "i64"),)
    assert cuvil_infer("ReduceMean", [(F, (2, 3, 4))], {"axes": [0, 2], "keepdims": 0}) == [(F, (3,))]
    fails("ReduceSum", [(F, (2, 3)), (I64, (1,))], match="axes must be constant")
    fails("ReduceSum", [(F, (2, 3))], {"axes": [2]}, match="axes entry 2 out of range for rank 2")
    fails("ReduceSum", [(F, (2, 3))], {"axes": [1, -1]}, match="repeat an axis")


def test_reduce_symbolic_values():
    g = Graph()
    v = g.add_input("s", TensorType(I64, (3,)))
    v.sym_value = (SymExpr.symbol("N"), 3, 4)
    prod = g.add_node("ReduceProd", [v], {"keepdims": 0}).outputs[0]
    assert prod.type == TensorType(I64, ()) and prod.sym_value == (SymExpr.symbol("N") * 12,)
    sum_ = g.add_node("ReduceSum", [v], {"axes": [0]}).outputs[0]
    assert sum_.type == TensorType(I64, (1,)) and str(sum_.sym_value[0]) == "N + 7"
    assert g.add_node("ReduceMean", [v]).outputs[0].sym_value is None


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg_reduce(op):
    x = (F, ("N", 3, 5))
    assert_agrees(op, [x])
    assert_agrees(op, [x], {"axis": -1, "keepdims": 0})
    assert_agrees(op, [x], {"axis": 1, "select_last_index": 1})
    fails(op, [x], {"axis": 3}, match="axis 3 out of range")


# --- softmax -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
def test_softmax(op):
    for attrs in ({}, {"axis": 1}, {"axis": -3}):
        assert_agrees(op, [(F, ("N", 4, "T"))], attrs)
    assert_agrees(op, [(H16, (7,))])
    fails(op, [(F, (2, 3))], {"axis": 2}, match="axis 2 out of range")


# --- quant -------------------------------------------------------------------------------------------

def test_quantize_linear():
    x = (F, ("N", 8, 6))
    assert_agrees("QuantizeLinear", [x, (F, ())])  # no zero point: uint8
    assert_agrees("QuantizeLinear", [x, (F, ()), (I8, ())])
    assert_agrees("QuantizeLinear", [x, (F, (8,)), (I8, (8,))], {"axis": 1})
    assert_agrees("QuantizeLinear", [x, (F, (6,))], {"axis": -1, "output_dtype": int(I8)})
    assert_agrees("QuantizeLinear", [x, (F, ("N", 8, 2)), (U8, ("N", 8, 2))], {"axis": 2, "block_size": 4})
    assert_agrees("QuantizeLinear", [(H16, (4, 6)), (H16, (1,)), (DType.UINT16, (1,))])
    fails("QuantizeLinear", [x, (F, (6,))], match=r"must be \[8\] for per-axis")
    fails("QuantizeLinear", [x, (F, (3, 8, 2))], {"axis": 2, "block_size": 2}, match=r"must be \[N,8,3\]")


def test_dequantize_linear():
    x = (I8, ("N", 8, 6))
    assert_agrees("DequantizeLinear", [x, (F, ())])
    assert_agrees("DequantizeLinear", [x, (H16, (8,)), (I8, (8,))], {"axis": 1})
    assert_agrees("DequantizeLinear", [(U8, (4, 6)), (F, (2, 6)), (U8, (2, 6))], {"axis": 0, "block_size": 2})
    assert_agrees("DequantizeLinear", [(I32, (16,)), (F, ())])


def test_dynamic_quantize_and_qlinear():
    assert_agrees("DynamicQuantizeLinear", [(F, ("N", 3, 7))], num_outputs=3)
    s, z = (F, ()), (U8, ())
    assert_agrees("QLinearConv", [(U8, ("N", 3, 32, 32)), s, z, (I8, (8, 3, 3, 3)), (F, (8,)), (I8, (8,)), s, z,
                                  (I32, (8,))], {"strides": [2, 2], "pads": [1, 1, 1, 1]})
    assert_agrees("QLinearConv", [(I8, (1, 4, 9, 9)), s, (I8, ()), (I8, (4, 1, 3, 3)), s, (I8, ()), s, (I8, ())],
                  {"group": 4, "auto_pad": "SAME_UPPER"})
    assert_agrees("QLinearMatMul", [(U8, ("N", 5, 4)), s, z, (U8, (4, 6)), s, z, s, z])
    assert_agrees("QLinearMatMul", [(I8, (4,)), s, (I8, ()), (I8, (4, 6)), s, (I8, ()), s, (I8, ())])
    fails("QLinearConv", [(U8, (1, 3, 8, 8)), s, z, (U8, (8, 4, 3, 3)), s, z, s, z], match="3 channels")
