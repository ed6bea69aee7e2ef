"""A profile the graph cannot serve is refused in one line naming the symbols as the model spells them, with a
few short details (node, counterexample) and a next step the solver found and checked: the divisibility a
detector needs, as --input-shape values that then compile; a maximum a Slice needs; two '?' dims to make one."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import cuvil
from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import MAX_DETAIL_CHARS, MAX_DETAIL_LINES, ShapeError
from cuvil.ir.constraints import check_constraints
from cuvil.ir.shape_advice import required_multiples
from cuvil.testing.oracles import max_rel_error, ort_session
from test_runtime_shapes import position_ids

DYN = ["p2o.DynamicDimension.0", 3, "p2o.DynamicDimension.1", "p2o.DynamicDimension.2"]   # as PP-OCR writes them


def detector_model():
    """A PP-OCR-like text detector in miniature: five 3x3 stride-2 convolutions (H/32), the coarsest map brought
    back up by a 2x nearest Resize and a stride-2 ConvTranspose, each added to the finer map: the sizes agree
    for every H, W only when they are multiples of 32."""
    rng = np.random.default_rng(0)
    inits, nodes, prev, chans = [], [], "x", 3
    for k in range(1, 6):
        inits.append(numpy_helper.from_array(0.3 * rng.standard_normal((4, chans, 3, 3)).astype(np.float32), f"w{k}"))
        nodes.append(helper.make_node("Conv", [prev, f"w{k}"], [f"c{k}"], name=f"conv{k}", pads=[1, 1, 1, 1],
                                      strides=[2, 2]))
        prev, chans = f"c{k}", 4
    inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    inits.append(numpy_helper.from_array(0.3 * rng.standard_normal((4, 4, 2, 2)).astype(np.float32), "wt"))
    nodes += [helper.make_node("Resize", ["c5", "", "scales"], ["u5"], name="up5", mode="nearest",
                               coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
              helper.make_node("Add", ["c4", "u5"], ["p4"], name="fpn_add4"),
              helper.make_node("ConvTranspose", ["p4", "wt"], ["u4"], name="up4", strides=[2, 2]),
              helper.make_node("Add", ["c3", "u4"], ["y"], name="fpn_add3")]
    graph = helper.make_graph(nodes, "det", [helper.make_tensor_value_info("x", TensorProto.FLOAT, DYN)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


PROFILE = {"x": ([1, 3, 32, 32], [1, 3, 64, 96], [1, 3, 256, 256])}
SUGGESTED = "x=1x3x32x32:1x3x64x96:1x3x256x256/1x1x32x32"


@pytest.fixture(scope="module")
def detector_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("det") / "det.onnx"
    path.write_bytes(detector_model().SerializeToString())
    return str(path)


def test_detector_profile_names_the_multiple_and_input_shapes_that_work():
    with pytest.raises(ShapeError) as e:
        Pipeline.from_onnx(detector_model()).with_input_shapes(PROFILE)
    err = e.value
    assert err.message == ("the graph's shape conditions fail inside the profile: p2o.DynamicDimension.1 (x axis 2) "
                           "and p2o.DynamicDimension.2 (x axis 3) must be multiples of 32")
    assert err.details and all(" makes Add 'fpn_add" in d for d in err.details), err.details
    lines = str(err).splitlines()
    assert len(lines) <= 1 + MAX_DETAIL_LINES + 2 and all(len(x) <= MAX_DETAIL_CHARS + 10 for x in lines), str(err)
    assert err.hint.startswith(f"give multiples: --input-shape {SUGGESTED} ")
    assert "p2o_DynamicDimension" not in str(err)


def test_the_multiple_is_the_smallest_that_works():
    g = Pipeline.from_onnx(detector_model()).specialize({"p2o.DynamicDimension.0": 1}).graph
    h, w = "p2o.DynamicDimension.1", "p2o.DynamicDimension.2"
    assert required_multiples(g, check_constraints(g)) == {h: 32, w: 32}
    assert check_constraints(g, multiples={h: 32, w: 32}) == []
    assert check_constraints(g, multiples={h: 16, w: 32}) != []


def test_cli_compile_refuses_then_the_suggested_input_shape_compiles(detector_path, tmp_path, capsys):
    lib = str(tmp_path / "libdet.so")
    assert cli_main(["compile", "--input", detector_path, "--output", lib, "--input-shape",
                     "x=1x3x32x32:1x3x64x96:1x3x256x256"]) == 2
    err = capsys.readouterr().err
    first = next(x for x in err.splitlines() if x.startswith("cuvil: error: "))
    assert first == ("cuvil: error: the graph's shape conditions fail inside the profile: p2o.DynamicDimension.1 "
                     "(x axis 2) and p2o.DynamicDimension.2 (x axis 3) must be multiples of 32")
    assert f"  next: give multiples: --input-shape {SUGGESTED} " in err
    assert len(err) < 1500, err
    # the suggestion, as printed, proves (inspect --shapes) and compiles; the library serves a page of 64x96
    assert cli_main(["inspect", detector_path, "--shapes", "--input-shape", SUGGESTED]) == 0
    assert "violated somewhere in range: 0" in capsys.readouterr().out
    assert cli_main(["compile", "--input", detector_path, "--output", lib, "--input-shape", SUGGESTED]) == 0
    x = np.random.default_rng(1).standard_normal((1, 3, 64, 96)).astype(np.float32)
    got = cuvil.load(lib).run(x)
    got = list(got.values())[0] if isinstance(got, dict) else got[0]
    assert max_rel_error(got, ort_session(detector_model()).run(None, {"x": x})[0]) < 1e-4


def test_default_ranges_get_the_multiple_too():
    with pytest.raises(ShapeError) as e:
        Pipeline.from_onnx(detector_model()).compile(cache=False)
    assert e.value.message.endswith("must be multiples of 32")
    assert "--input-shape x=1x3x32x32:1x3x32x32:4096x3x4096x4096/1x1x32x32" in e.value.hint


def test_a_slice_past_its_table_asks_for_a_maximum():
    with pytest.raises(ShapeError) as e:
        Pipeline.from_onnx(position_ids(max_pos=64)).with_profiles({"B": (1, 8), "S": (1, 512)})
    assert e.value.message == "the graph's shape conditions fail inside the profile: S (ids axis 1) must be at most 64"
    assert e.value.details[0].startswith("S = 65 makes Slice 'pids' need 64 >= S")
    assert e.value.hint.startswith("narrow the ranges: --input-shape ids=1x1:1x1:8x64 ")
    Pipeline.from_onnx(position_ids(max_pos=64)).with_input_shapes({"ids": ([1, 1], [1, 1], [8, 64])})


def test_inspect_shapes_lists_the_failures_and_the_next_step(detector_path, capsys):
    assert cli_main(["inspect", detector_path, "--shapes", "--input-shape", "x=1x3x32x32:1x3x64x96:1x3x256x256"]) == 0
    out = capsys.readouterr().out
    assert "violated somewhere in range: 4" in out and " makes Add 'fpn_add4' need " in out
    assert f"  next: give multiples: --input-shape {SUGGESTED} " in out


def test_a_fixed_size_off_the_multiple_names_the_nearest_that_works():
    p = Pipeline.from_onnx(detector_model())
    with pytest.raises(ShapeError) as e:
        p.with_input_shapes({"x": [1, 3, 100, 64]})
    assert e.value.message == "node 'fpn_add4' (Add): shapes [1,4,7,4] and [1,4,8,4] do not broadcast"
    assert e.value.hint == "p2o.DynamicDimension.1 (x axis 2) must be a multiple of 32: --input-shape x=1x3x96x64"
    assert p.with_input_shapes({"x": [1, 3, 96, 64]}).graph.symbols == {}      # the hint, followed
