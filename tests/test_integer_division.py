"""Integer Div and Mod on run-time data never trap: a zero divisor or INT_MIN / -1 used to reach LLVM's
sdiv/srem, which raise SIGFPE on x86 and kill the caller's process. Now a zero divisor gives 0 (as numpy does)
and INT_MIN / -1 wraps (remainder 0); every other element is what onnxruntime computes."""
import numpy as np
import pytest
from onnx import TensorProto, helper

from cuvil.testing.artifacts import close_and_remove, compile_and_load
from cuvil.testing.oracles import ort_session

DTYPES = {np.int32: TensorProto.INT32, np.int64: TensorProto.INT64, np.uint8: TensorProto.UINT8}


def _model(op: str, dtype, **attrs):
    t = DTYPES[dtype]
    node = helper.make_node(op, ["a", "b"], ["y"], **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("a", t, ["N"]),
                                        helper.make_tensor_value_info("b", t, ["N"])],
                          [helper.make_tensor_value_info("y", t, ["N"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("op, attrs", [("Div", {}), ("Mod", {}), ("Mod", {"fmod": 1})])
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
def test_division_by_run_time_zero_does_not_trap(op, attrs, dtype):
    info = np.iinfo(dtype)
    a = np.array([7, -7, 9, info.min, info.min, 5, 0, info.max], dtype=np.int64).clip(info.min, info.max).astype(dtype)
    b = np.array([2, 2, -4, -1, 1, 0, 0, 0], dtype=np.int64).clip(info.min, info.max).astype(dtype)
    model = _model(op, dtype, **attrs)
    art, m = compile_and_load(model, {"N": (1, 16)})
    try:
        (y,) = m.run(a, b)
        safe = b != 0
        if np.issubdtype(dtype, np.signedinteger):
            safe &= ~((a == info.min) & (b == -1))
        (want,) = ort_session(model).run(None, {"a": a[safe], "b": b[safe]})
        np.testing.assert_array_equal(y[safe], want)
        assert (y[b == 0] == 0).all()
        if np.issubdtype(dtype, np.signedinteger):
            overflow = (a == info.min) & (b == -1)
            assert (y[overflow] == (info.min if op == "Div" else 0)).all()
    finally:
        close_and_remove(art, m)
