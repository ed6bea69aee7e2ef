"""Narrow element types (targets/llvm/narrow.py): bfloat16, float8, float4 and 2/4-bit integers, compiled for
x86 and run, bit for bit against onnx's reference (ml_dtypes' conversions), on adversarial values (ties,
subnormals, overflow, inf, NaN, negative zero); the same kernels assemble for the GPU."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from cuvil import Pipeline
from cuvil.ir.dtype import DType
from cuvil.kernels.schedule import schedule
from cuvil.onnx_backend import prepare
from cuvil.targets.ptx import assemble, find_libdevice, find_ptxas, generate_ptx

MINIFLOATS = [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2,
              TensorProto.FLOAT8E5M2FNUZ, TensorProto.FLOAT4E2M1]
NARROW_INTS = [TensorProto.INT4, TensorProto.UINT4, TensorProto.INT2, TensorProto.UINT2]


def _cast_model(src: int, dst: int, n: int, saturate=None) -> onnx.ModelProto:
    attrs = {"to": dst} if saturate is None else {"to": dst, "saturate": saturate}
    node = helper.make_node("Cast", ["x"], ["y"], **attrs)
    g = helper.make_graph([node], "cast", [helper.make_tensor_value_info("x", src, [n])],
                          [helper.make_tensor_value_info("y", dst, [n])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 25)])


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint16)


def _adversarial_floats() -> np.ndarray:
    rng = np.random.default_rng(0)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-7, -1e-7, 1e30, -1e30, 448, 464, 465, 480, 240, 248, 57344,
               59392, 61440, 6.0, 5.0, 7.0, 0.25, 0.75, 2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -16, 2.0 ** -17,
               1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 2.0 ** -126, 1e-40]
    # every minifloat value and the midpoints between neighbours (the ties) of the widest format
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = grid[np.isfinite(grid)]
    grid = np.sort(grid)
    mids = (grid[:-1] + grid[1:]) / 2
    wide = rng.standard_normal(300).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 18, 300)
    return np.concatenate([np.array(special, np.float32), grid, mids, -mids, wide]).astype(np.float32)


@pytest.mark.parametrize("dst", MINIFLOATS, ids=lambda d: TensorProto.DataType.Name(d))
@pytest.mark.parametrize("saturate", [1, 0])
def test_float_to_minifloat_matches_reference_bit_for_bit(dst, saturate):
    x = _adversarial_floats()
    model = _cast_model(TensorProto.FLOAT, dst, x.size, saturate)
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    (got,) = prepare(model, opt_level=1).run([x])
    assert got.dtype == want.dtype
    bad = np.nonzero(_bits(got) != _bits(want))[0]
    assert bad.size == 0, [(float(x[i]), int(_bits(got)[i]), int(_bits(want)[i])) for i in bad[:8]]


@pytest.mark.parametrize("src", MINIFLOATS, ids=lambda d: TensorProto.DataType.Name(d))
@pytest.mark.parametrize("dst", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE])
def test_every_minifloat_pattern_decodes_exactly(src, dst):
    np_src = helper.tensor_dtype_to_np_dtype(src)
    n = 16 if src == TensorProto.FLOAT4E2M1 else 256
    x = np.arange(n, dtype=np.uint8).view(np_src)
    model = _cast_model(src, dst, n)
    (got,) = prepare(model, opt_level=1).run([x])
    want = x.astype(helper.tensor_dtype_to_np_dtype(dst))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("dt", NARROW_INTS, ids=lambda d: TensorProto.DataType.Name(d))
def test_narrow_int_casts(dt):
    np_dt = helper.tensor_dtype_to_np_dtype(dt)
    x = np.array([-9, -8.5, -8, -2.5, -1.5, -1, -0.5, 0, 0.5, 1.5, 2.5, 3, 7, 7.5, 8, 15, 15.5, 16, np.nan, np.inf], np.float32)
    model = _cast_model(TensorProto.FLOAT, dt, x.size)
    (want,) = ReferenceEvaluator(model).run(None, {"x": x})
    (got,) = prepare(model, opt_level=1).run([x])
    np.testing.assert_array_equal(_bits(got), _bits(want))
    lo, hi = DType(dt).int_range
    vals = np.arange(lo, hi + 1).astype(np_dt)
    for to in (TensorProto.FLOAT, TensorProto.INT8 if lo < 0 else TensorProto.UINT8, TensorProto.INT64):
        (back,) = prepare(_cast_model(dt, to, vals.size), opt_level=1).run([vals])
        np.testing.assert_array_equal(back, np.arange(lo, hi + 1))


def test_bfloat16_rounds_to_nearest_even_and_computes_in_float32():
    x = _adversarial_floats()
    model = _cast_model(TensorProto.FLOAT, TensorProto.BFLOAT16, x.size)
    (got,) = prepare(model, opt_level=1).run([x])
    want = x.astype(ml_dtypes.bfloat16)
    same = (_bits(got) == _bits(want)) | (np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))
    assert same.all(), x[~same][:8]
    # arithmetic on bfloat16 tensors: computed in float32, rounded once when stored
    node = helper.make_node("Mul", ["a", "b"], ["y"])
    g = helper.make_graph([node], "mul", [helper.make_tensor_value_info(n, TensorProto.BFLOAT16, [64]) for n in "ab"],
                          [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [64])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(64).astype(ml_dtypes.bfloat16) for _ in range(2))
    (y,) = prepare(m, opt_level=1).run([a, b])
    np.testing.assert_array_equal(_bits(y), _bits((a.astype(np.float32) * b.astype(np.float32)).astype(ml_dtypes.bfloat16)))


@pytest.mark.skipif(find_ptxas() is None or find_libdevice() is None, reason="ptxas or libdevice not found")
def test_narrow_casts_assemble_for_sm90():
    """The same conversions (and BitCast) through the GPU's emitter assemble with ptxas."""
    chain = [TensorProto.FLOAT, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.FLOAT,
             TensorProto.INT4, TensorProto.FLOAT, TensorProto.FLOAT8E5M2FNUZ, TensorProto.FLOAT, TensorProto.FLOAT8E8M0,
             TensorProto.FLOAT16]
    nodes = [helper.make_node("Cast", [f"v{i}"], [f"v{i + 1}"], to=chain[i + 1], saturate=i % 2) for i in range(len(chain) - 1)]
    nodes = [helper.make_node("BitCast", ["x"], ["xi"], to=TensorProto.INT32),
             helper.make_node("BitCast", ["xi"], ["v0"], to=TensorProto.FLOAT)] + nodes + [helper.make_node("Identity", [f"v{len(chain) - 1}"], ["y"])]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [32])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 26)])
    sched = schedule(Pipeline.from_onnx(m).graph)
    ptx, descs = generate_ptx(sched, "sm_90")
    _, info = assemble(ptx, "sm_90")
    assert set(info) == {d.name for d in descs}


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
@pytest.mark.parametrize("saturate", [1, 0])
def test_float8e8m0_round_modes_match_reference(round_mode, saturate):
    x = np.concatenate([_adversarial_floats(), np.array([2.0 ** 127 * 1.5, 3e38, 1.5, 1.25, 1.75, 0.75], np.float32)])
    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E8M0, saturate=saturate, round_mode=round_mode)
    g = helper.make_graph([node], "cast", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [x.size])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT8E8M0, [x.size])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 25)])
    (want,) = ReferenceEvaluator(m).run(None, {"x": x})
    (got,) = prepare(m, opt_level=1).run([x])
    np.testing.assert_array_equal(_bits(got), _bits(want))
    (back,) = prepare(_cast_model(TensorProto.FLOAT8E8M0, TensorProto.FLOAT, 256), opt_level=1).run(
        [np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)])
    np.testing.assert_array_equal(back, np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
