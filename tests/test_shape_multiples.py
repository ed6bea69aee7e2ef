"""A profile that admits only multiples (``Symbol.multiple``): a feature pyramid, as detectors build them (stride-2
convolutions down, a 2x nearest upsample back and an Add with the finer map), works only when H and W divide by
the total stride; one library serves every multiple in the range, rejects other sizes at run time (Python and
the C ABI, CUVIL_ERR_PROFILE), and the shape conditions are proved over the multiples only."""
import ctypes

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.cli.shape_flags import parse_input_shapes as _parse_input_shapes, parse_profiles as _parse_profiles
from cuvil.errors import ShapeError
from cuvil.ir.dim import SymExpr, Symbol, dmax, floordiv, mod, with_multiples
from cuvil.testing.oracles import max_rel_error, ort_session
from test_dynamic_shapes import CUVIL_ERR_PROFILE, c_tensors, raw_lib

H, W = SymExpr.symbol("H"), SymExpr.symbol("W")


def pyramid_model():
    """x[1, 2, ?, ?] -> two stride-2 convolutions, the coarse map upsampled 2x (nearest) and added to the finer
    one: only H, W multiples of 4 make the two maps the same size."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 2, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w2")
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Conv", ["c1", "w2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Resize", ["c2", "", "scales"], ["up"], mode="nearest",
                              coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
             helper.make_node("Add", ["c1", "up"], ["y"], name="fpn_add")]
    graph = helper.make_graph(nodes, "pyramid", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, "?", "?"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w1, w2, scales])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


PROFILE = {"x": ([1, 2, 8, 8], [1, 2, 16, 24], [1, 2, 64, 64], {"multiple": [1, 1, 4, 4]})}


@pytest.fixture(scope="module")
def pyramid():
    model = pyramid_model()
    return model, Pipeline.from_onnx(model).compile(input_shapes=PROFILE)


def test_sizes_of_a_multiple_have_one_canonical_form():
    m = {"H": 32}
    assert with_multiples(floordiv(floordiv(H + 1, 2) + 1, 2), m) == floordiv(H, 4)
    assert with_multiples(2 * floordiv(floordiv(floordiv(H + 1, 2) + 1, 2) + 1, 2), m) == floordiv(H, 4)
    assert with_multiples(floordiv(H - 1, 2) + 1, m) == floordiv(H, 2)          # a 3x3 stride-2 conv, pad 1
    assert with_multiples(mod(H, 32), m) == 0 and with_multiples(mod(H, 64), m) == mod(H, 64)
    assert with_multiples(3 * H * W + 7, m) == 3 * H * W + 7                      # whole multiples stay as they are
    assert with_multiples(dmax(floordiv(H, 4), 2 * floordiv(H, 8)), m) == floordiv(H, 4)
    assert with_multiples(floordiv(H + 1, 2), {}) == floordiv(H + 1, 2)          # no multiple: unchanged
    for h in range(32, 320, 32):                                                   # the forms agree in value
        for d in (floordiv(floordiv(H + 1, 2) + 1, 2), floordiv(H - 1, 2) + 1, 48 * floordiv(H + 3, 8)):
            assert with_multiples(d, m).evaluate({"H": h}) == d.evaluate({"H": h})


def test_symbol_multiple_is_checked():
    assert Symbol("H", 32, 1280, 640, 32).admits(64) and not Symbol("H", 32, 1280, 640, 32).admits(48)
    with pytest.raises(ValueError, match="40 is not a multiple of 32"):
        Symbol("H", 32, 1280, 40, 32)


def test_without_the_multiple_the_profile_fails_with_a_counterexample():
    p = Pipeline.from_onnx(pyramid_model())
    with pytest.raises(ShapeError, match=r"makes Add 'fpn_add' need .* broadcast"):
        p.with_input_shapes({"x": PROFILE["x"][:3]})


def test_one_library_serves_every_multiple(pyramid):
    model, art = pyramid
    assert art.manifest["symbols"] == {"x.2": {"min": 8, "opt": 16, "max": 64, "multiple": 4},
                                       "x.3": {"min": 8, "opt": 24, "max": 64, "multiple": 4}}
    sess = ort_session(model)
    for h, w in ((8, 8), (16, 24), (12, 64), (64, 20), (40, 36)):
        x = np.random.default_rng(h * w).standard_normal((1, 2, h, w)).astype(np.float32)
        got = art.run({"x": x})["y"]
        want = sess.run(None, {"x": x})[0]
        assert got.shape == want.shape == (1, 4, h // 2, w // 2)
        assert max_rel_error(got, want) <= 1e-5


def test_a_size_that_is_not_a_multiple_is_refused(pyramid):
    _, art = pyramid
    with pytest.raises(ShapeError, match=r"dim 2 is x.2 = 18, not a multiple of 4 \(the profile x.2 in \[8, 64\], "
                                         r"multiples of 4\) \(code -19\)\n"
                                         r"  next: pad the input to a multiple of 4 \(e.g. 20\)"):
        art.run({"x": np.zeros((1, 2, 18, 16), np.float32)})
    lib = raw_lib(art.path)     # the library itself refuses it too (a C caller has no Python check)
    shape = (ctypes.c_int64 * 4)()
    s = lib.cuvil_session_create(1)
    try:
        assert lib.cuvil_output_shape(s, c_tensors(np.zeros((1, 2, 16, 22), np.float32)), 0, shape) == CUVIL_ERR_PROFILE
        assert "dim 3 is x.3 = 22, not a multiple of 4" in lib.cuvil_last_error().decode()
        assert lib.cuvil_output_shape(s, c_tensors(np.zeros((1, 2, 16, 20), np.float32)), 0, shape) == 0
        assert list(shape) == [1, 4, 8, 10]
    finally:
        lib.cuvil_session_destroy(s)
    assert "multiples of 4" in open(art.path[:-3] + ".h").read()


def test_profiles_by_name_and_their_errors():
    p = Pipeline.from_onnx(pyramid_model())
    q = p.with_profiles({"x.2": (8, 16, 64, {"multiple": 4}), "x.3": (8, 16, 64, {"multiple": 4})})
    assert q.graph.symbols["x.2"] == Symbol("x.2", 8, 64, 16, 4)
    assert str(q.graph.outputs[0].type) == "f32[1,4,x.2/2,x.3/2]"
    with pytest.raises(ShapeError, match=r"x.2=6:16:64/4: 6 is not a multiple of 4"):
        p.with_profiles({"x.2": (6, 16, 64, {"multiple": 4})})
    with pytest.raises(ShapeError, match=r"unknown profile option\(s\) \['stride'\]"):
        p.with_profiles({"x.2": (8, 16, 64, {"stride": 4})})
    with pytest.raises(ShapeError, match=r"input 'x' axis 2 has min 8, opt 18, max 64, multiple 4"):
        p.with_input_shapes({"x": ([1, 2, 8, 8], [1, 2, 18, 24], [1, 2, 64, 64], {"multiple": [1, 1, 4, 4]})})
    with pytest.raises(ShapeError, match=r"(?s)axis 1 is 2 in the model .*only a dim that is a symbol of its own"):
        p.with_input_shapes({"x": ([1, 2, 8, 8], [1, 2, 16, 24], [1, 2, 64, 64], {"multiple": [1, 2, 4, 4]})})
    with pytest.raises(ShapeError, match=r"shape gives 3 dims"):
        p.with_input_shapes({"x": ([1, 2, 8, 8], [1, 2, 16, 24], [1, 2, 64, 64], {"multiple": [1, 4, 4]})})
    with pytest.raises(ShapeError, match=r"x.2 = 18 is outside its range \[8, 64\], multiples of 4"):
        q.specialize({"x.2": 18})


def test_command_line_spelling():
    assert _parse_profiles(["H=32:640:1280/32"]) == {"H": (32, 640, 1280, {"multiple": 32})}
    assert _parse_input_shapes(["x=1x3x32x32:1x3x640x640:1x3x1280x1280/1x1x32x32"]) == {
        "x": ((1, 3, 32, 32), (1, 3, 640, 640), (1, 3, 1280, 1280), {"multiple": (1, 1, 32, 32)})}
    for bad in (["x=1x3x32x32/1x1x32x32"], ["x=1x3x32x32:1x3x64x64:1x3x96x96/"]):
        with pytest.raises(Exception, match="MULTIPLES"):
            _parse_input_shapes(bad)


def test_shape_conditions_are_proved_over_the_multiples():
    # Reshape [1, H] -> [-1, 8] needs 8 | H: false for H in [8, 64], true for its multiples of 8
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "H"])
    s = numpy_helper.from_array(np.array([-1, 8], np.int64), "s")
    g = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["y"], name="r")], "r", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [s])
    p = Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(ShapeError, match="makes Reshape 'r' need"):
        p.with_profiles({"H": (8, 16, 64)})
    art = p.compile(shape_profiles={"H": (8, 16, 64, {"multiple": 8})})
    for h in (8, 24, 64):
        x = np.arange(h, dtype=np.float32)[None]
        np.testing.assert_array_equal(art.run({"x": x})["y"], x.reshape(-1, 8))


def test_cli_inspect_and_compile_take_multiples(tmp_path, capsys):
    from cuvil.cli import main as cli_main
    import onnx
    path = str(tmp_path / "pyramid.onnx")
    onnx.save(pyramid_model(), path)
    assert cli_main(["inspect", path, "--shapes", "--input-shape", "x=1x2x8x8:1x2x16x24:1x2x64x64/1x1x4x4"]) == 0
    out = capsys.readouterr().out
    assert "symbol x.2 in [8, 64], multiples of 4, opt 16: x axis 2" in out, out
    assert "violated somewhere in range: 0" in out, out
    lib = str(tmp_path / "libpyr.so")
    assert cli_main(["compile", "--input", path, "--output", lib, "--shape-profile", "x.2=8:16:64/4",
                     "--shape-profile", "x.3=8:16:64/4"]) == 0
    assert "multiples of 4" in open(str(tmp_path / "libpyr.h")).read()


def test_check_shapes_takes_multiples():
    p = Pipeline.from_onnx(pyramid_model())
    assert p.check_shapes({"x.2": (8, 16, 64, {"multiple": 4}), "x.3": (8, 16, 64, {"multiple": 4})}) == []
    bad = p.check_shapes({"x.2": (8, 16, 64, {"multiple": 2}), "x.3": (8, 16, 64, {"multiple": 4})})
    assert bad and all(v.values["x.2"] % 4 == 2 for v in bad if "x.2" in v.values)
