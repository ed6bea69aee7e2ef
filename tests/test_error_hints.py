"""Every error a user can hit says what to do next (issue 27): a one-line message and a hint; where the hint
gives a value, following it works."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import cuvil
from cuvil import Pipeline
from cuvil.errors import CuvilError, ModelLoadError, ShapeError
from cuvil.targets.x86.target import X86Options


def relu_model(dims=("N", 4)):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "r",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def one_line_with_hint(excinfo) -> CuvilError:
    e = excinfo.value
    assert "\n" not in e.message and e.hint, str(e)
    return e


@pytest.mark.parametrize("call, cls, words", [
    (lambda tmp: Pipeline.from_onnx(tmp / "nope.onnx"), ModelLoadError, "cuvil zoo"),
    (lambda tmp: Pipeline.from_onnx(b"\x08\x07garbage\xff\xff"), ModelLoadError, ".onnx file"),
    (lambda tmp: Pipeline.from_onnx(42), ModelLoadError, "give a path, bytes or an onnx.ModelProto"),
    (lambda tmp: cuvil.load(tmp / "libnope.so"), CuvilError, "cuvil compile MODEL -o libNAME.so"),
    (lambda tmp: Pipeline.from_onnx(relu_model()).compile(options=X86Options(), opt_level=2), CuvilError,
     "give them one way"),
    (lambda tmp: Pipeline.from_onnx(relu_model()).check_inputs({"x": np.zeros((2, 4), np.float64)}), ShapeError,
     "x.astype(np.float32)"),
    (lambda tmp: Pipeline.from_onnx(relu_model()).check_inputs({}), ShapeError, "give 'x'"),
    (lambda tmp: Pipeline.from_onnx(relu_model()).specialize({"M": 2}), ShapeError, "cuvil inspect MODEL lists them"),
])
def test_user_mistakes_get_a_next_step(tmp_path, call, cls, words):
    with pytest.raises(cls) as e:
        call(tmp_path)
    assert words in one_line_with_hint(e).hint


def test_a_profile_off_its_multiple_suggests_one_that_is_on_it():
    p = Pipeline.from_onnx(relu_model())
    with pytest.raises(ShapeError) as e:
        p.with_profiles({"N": (6, 20, 100, {"multiple": 8})})
    err = one_line_with_hint(e)
    assert err.message == "shape profile N=6:20:100/8: 6 is not a multiple of 8"
    assert err.hint == "give min, opt and max as multiples of 8: --shape-profile N=8:16:96/8"
    assert p.with_profiles({"N": (8, 16, 96, {"multiple": 8})}).graph.symbols["N"].multiple == 8   # followed
