"""Errors and listings name dims as the model spells them: a dim_param ``p2o.DynamicDimension.0`` stays that (never
``p2o_DynamicDimension_0``), a ``?`` dim is named after its place (``x.1``) and said to be the model's ``?``;
an output the C ABI cannot carry is refused by its name, not as an internal ``IODesc``."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import ShapeError, UnsupportedTypeError

DIMS = ["p2o.DynamicDimension.0", "?", 8]


def dyn_model(add_width=None):
    """x[p2o.DynamicDimension.0, ?, 8] -> Relu -> MatMul [8, 4]; with ``add_width``, + b[add_width] on the '?' axis
    moved last (so the '?' must broadcast against it)."""
    w = numpy_helper.from_array(np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4), "w")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("MatMul", ["r", "w"], ["y"], name="mm")]
    inits = [w]
    if add_width is not None:
        inits.append(numpy_helper.from_array(np.ones(add_width, np.float32), "b"))
        nodes += [helper.make_node("Transpose", ["y"], ["t"], name="tr", perm=[0, 2, 1]),
                  helper.make_node("Add", ["t", "b"], ["z"], name="add_b")]
    out = "z" if add_width is not None else "y"
    g = helper.make_graph(nodes, "dyn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, DIMS)],
                          [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def dyn_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("dyn") / "dyn.onnx"
    path.write_bytes(dyn_model().SerializeToString())
    return str(path)


def test_inspect_lists_the_models_spelling(dyn_path, capsys):
    assert cli_main(["inspect", dyn_path]) == 0
    out = capsys.readouterr().out
    assert "  input  x: f32[p2o.DynamicDimension.0,x.1,8]" in out
    assert "  symbol p2o.DynamicDimension.0 in [1, 4096], opt 1: x axis 0" in out and "symbol x.1 " in out
    assert "p2o_DynamicDimension" not in out


def test_a_shape_error_names_the_question_mark_dim_by_its_place():
    with pytest.raises(ShapeError) as e:
        Pipeline.from_onnx(dyn_model(add_width=4)).compile(shape_profiles={"x.1": (1, 4, 16)}, cache=False)
    assert e.value.message == ("the graph's shape conditions fail inside the profile: no range of x.1 (x axis 1, '?' "
                               "in the model) found where they hold; they hold at x.1 = 4")
    assert e.value.details[0].startswith("x.1 = ") and " makes Add 'add_b' need x.1 and 4 broadcast" in e.value.details[0]
    assert e.value.hint.startswith("fix them there: --input-shape x=1x4x8:1x4x8:4096x4x8 ")
    Pipeline.from_onnx(dyn_model(add_width=4)).with_input_shapes({"x": ([1, 4, 8], [1, 4, 8], [4096, 4, 8])})
    assert "p2o_DynamicDimension" not in str(e.value) and " _ " not in str(e.value)


def test_library_header_manifest_and_run_time_errors_keep_the_spelling(dyn_path, tmp_path, capsys):
    lib = str(tmp_path / "libdyn.so")
    assert cli_main(["compile", "--input", dyn_path, "--output", lib, "--opt-level", "O1",
                     "--shape-profile", "p2o.DynamicDimension.0=1:2:4"]) == 0
    capsys.readouterr()
    header = (tmp_path / "libdyn.h").read_text()
    assert "float [p2o.DynamicDimension.0, x.1, 8]" in header and "p2o_DynamicDimension" not in header
    model = cuvil.load(lib)
    with pytest.raises(ShapeError, match=r"(?s)dim 0 is p2o.DynamicDimension.0 = 8, outside the profile "
                                         r"p2o.DynamicDimension.0 in \[1, 4\].*--shape-profile p2o.DynamicDimension.0="):
        model.run(np.zeros((8, 3, 8), np.float32))
    assert cli_main(["run", lib, "--input-shape", "x=8x3x8"]) == 2
    err = capsys.readouterr().err
    assert "p2o.DynamicDimension.0 = 8" in err and "p2o_DynamicDimension" not in err


def test_a_string_output_is_refused_by_name():
    g = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.STRING)], "s",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.STRING, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(UnsupportedTypeError) as e:
        Pipeline.from_onnx(m).compile(cache=False)
    assert e.value.message == "output 'y' is str[2]: the x86 library's C ABI has no string tensors"
    assert "IODesc" not in str(e.value) and e.value.hint.startswith("export the model without the string output")
