"""Anonymous dims (each '?', empty dim_param or negative dim_value its own symbol, named after input and axis)
and binding shapes by input (``input_shapes=`` / ``--input-shape``, as trtexec's ``--shapes``): import,
binding checks and their errors, the CLI, and x86 libraries run against onnxruntime at several shapes."""
import json
import os

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import ShapeError
from cuvil.ir.dim import SymExpr, Symbol, parse_dim
from cuvil.ir.graph import Graph
from cuvil.ir.shape_binding import bind_input_shapes
from cuvil.ir.stats import cost_terms
from cuvil.ir.types import TensorType
from cuvil.testing.oracles import max_rel_error, ort_session

RTOL = 1e-4


def anonymous_cnn():
    """x[-1, 3, ?, ?] (batch -1, H and W both '?', so distinct) and s[?, 4, 1, 1] (another anonymous batch):
    Conv 3x3 stride 2 -> Relu -> MaxPool 2x2 -> * s -> y. H != W and odd sizes reach every layer."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [-1, 3, "?", "?"])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, ["?", 4, 1, 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [-1, 4, "?", None])
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Mul", ["p", "s"], ["y"])]
    g = helper.make_graph(nodes, "anon_cnn", [x, s], [y], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def anonymous_attention():
    """q[?, ?, 8] with every dim but the last anonymous (several '?' in one input): softmax(q W q^T) q."""
    rng = np.random.default_rng(1)
    q = helper.make_tensor_value_info("q", TensorProto.FLOAT, ["?", "", 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32) / 3, "w")
    nodes = [helper.make_node("MatMul", ["q", "w"], ["k"]),
             helper.make_node("Transpose", ["q"], ["qt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["k", "qt"], ["a"]),
             helper.make_node("Softmax", ["a"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "q"], ["y"])]
    g = helper.make_graph(nodes, "anon_attention", [q], [y], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def relu_model(dims, name="x", out_dims=None):
    x = helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, out_dims)
    g = helper.make_graph([helper.make_node("Relu", [name], ["y"])], "relu", [x], [y])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


# -- import: each anonymous dim its own symbol -----------------------------------------------------------

def test_each_anonymous_dim_is_its_own_symbol():
    g = Pipeline.from_onnx(anonymous_cnn()).graph
    assert str(g.inputs[0].type) == "f32[x.0,3,x.2,x.3]"
    assert str(g.inputs[1].type) == "f32[s.0,4,1,1]"
    assert set(g.symbols) == {"x.0", "x.2", "x.3", "s.0"}
    # the declared output [-1, 4, ?, (none)] is read as unknowns, not as a size of -1
    assert g.outputs[0].shape[1] == 4


def test_empty_missing_and_question_mark_dims():
    m = relu_model(["?", "", None, -1, -7])
    g = Pipeline.from_onnx(m).graph
    assert str(g.inputs[0].type) == "f32[x.0,x.1,x.2,x.3,x.4]"


def test_zero_dim_value_is_a_real_empty_dim():
    # onnxruntime refuses any other size for a dim_value of 0, so it is a size, not an unknown
    g = Pipeline.from_onnx(relu_model([0, 3])).graph
    assert g.inputs[0].shape == (0, 3) and not g.symbols


def test_models_own_spellings_are_kept():
    m = relu_model(["p2o.DynamicDimension.0", "batch size", 4], name="input.1")
    g = Pipeline.from_onnx(m).graph
    assert str(g.inputs[0].type) == "f32[p2o.DynamicDimension.0,batch_size,4]"
    # bound by the listed name or by the model's raw spelling
    p = Pipeline.from_onnx(m).specialize({"p2o.DynamicDimension.0": 2, "batch size": 3})
    assert p.graph.inputs[0].shape == (2, 3, 4)


def test_fresh_names_never_capture_a_named_dim():
    # the model names a dim 'x.0' itself; the anonymous axis 0 must not become that symbol
    g = Pipeline.from_onnx(relu_model(["?", "x.0"])).graph
    assert str(g.inputs[0].type) == "f32[x.0_1,x.0]"


def test_anonymous_names_follow_the_input_name():
    g = Pipeline.from_onnx(relu_model(["?", 3], name="input.1")).graph
    assert set(g.symbols) == {"input.1.0"}


def test_dotted_names_print_and_parse_back():
    for text in ["x.2", "2*x.2 + x.3", "(x.2 + 1)/2", "max(x.2, p2o.DynamicDimension.0) - 1", "x.2*x.3*input.1.0"]:
        d = parse_dim(text)
        assert parse_dim(str(d)) == d
    assert str(parse_dim("(x.2 - 1)/2 + 1")) == "(x.2 + 1)/2"
    with pytest.raises(ValueError):
        Symbol("x.")


def test_unknown_symbol_error_names_symbols_and_the_input_shape_flag():
    p = Pipeline.from_onnx(anonymous_cnn())
    with pytest.raises(ShapeError) as e:
        p.specialize({"?": 1})
    assert e.value.message == "--fix ?: the model has no symbol '?'"
    assert e.value.details[0].startswith("its symbols: s.0, x.0, x.2, x.3; inputs: x: f32[x.0,3,x.2,x.3]")
    assert "bind whole inputs: --input-shape x=1x3x1x1" in e.value.hint


# -- binding by input ------------------------------------------------------------------------------------

def test_one_shape_fixes_the_symbols():
    g = Pipeline.from_onnx(anonymous_cnn()).graph
    b = bind_input_shapes(g, {"x": [1, 3, 64, 48], "s": np.array([1, 4, 1, 1])})
    assert b.fixed == {"x.0": 1, "x.2": 64, "x.3": 48, "s.0": 1} and b.profiles == {}


def test_three_shapes_set_ranges():
    g = Pipeline.from_onnx(anonymous_cnn()).graph
    b = bind_input_shapes(g, {"x": ([1, 3, 8, 8], [2, 3, 32, 24], [4, 3, 64, 64])})
    assert b.profiles == {"x.0": (1, 2, 4), "x.2": (8, 32, 64), "x.3": (8, 24, 64)} and b.fixed == {}
    b = bind_input_shapes(g, {"x": ([1, 3, 8, 8], [1, 3, 32, 24], [1, 3, 64, 64])})
    assert b.fixed == {"x.0": 1} and set(b.profiles) == {"x.2", "x.3"}   # min = opt = max fixes


@pytest.mark.parametrize("shapes, message", [
    ({"z": [1]}, r"--input-shape z: the model has no input 'z'\n  its inputs: x: f32\[x.0,3,x.2,x.3\], s: .*\n  "
                 r"next: name an input: --input-shape x=1x3x1x1"),
    ({"x": [1, 3, 8]}, r"--input-shape x=1x3x8: input 'x' has rank 4 \(f32\[x.0,3,x.2,x.3\]\), the shape gives 3"),
    ({"x": [1, 4, 8, 8]}, r"--input-shape x=1x4x8x8: input 'x' axis 1 is fixed to 3 in the model \(f32\[x.0,3,"
                          r"x.2,x.3\]\)\n  next: give 3 there: --input-shape x=1x3x1x1"),
    ({"x": ([1, 3, 8, 8], [1, 3, 4, 8], [1, 3, 9, 9])}, r"input 'x' axis 2 has min 8, opt 4, max 9\n  next: .* MIN <= "),
    ({"x": "1x3x8x8"}, r"give one shape \(\[1, 3, 640, 640\]\) or three \(min, opt, max\); on the command line"),
    ({"x": ([1, 3, 8, 8], [1, 3, 9, 9])}, r"give one shape .* or three"),
    ({"x": [1, 3, -8, 8]}, r"a dim is negative"),
])
def test_binding_errors_say_what_to_give(shapes, message):
    with pytest.raises(ShapeError, match=message):
        bind_input_shapes(Pipeline.from_onnx(anonymous_cnn()).graph, shapes)


def test_inputs_sharing_a_symbol_must_agree():
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 4])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    m = helper.make_model(helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "add", [a, b], [y]),
                          opset_imports=[helper.make_opsetid("", 17)])
    g = Pipeline.from_onnx(m).graph
    assert bind_input_shapes(g, {"a": [3, 4], "b": [3, 4]}).fixed == {"N": 3}
    with pytest.raises(ShapeError, match=r"--input-shape b=5x4: input 'b' axis 0 is symbol N, which input 'a' axis 0 "
                                         r"also is; they are given 5 and 3\n  next: give both the same: 3"):
        bind_input_shapes(g, {"a": [3, 4], "b": [5, 4]})


def test_derived_input_dims_are_checked_against_their_symbols():
    g = Graph("derived")
    n = SymExpr.symbol("N")
    g.symbols["N"] = Symbol("N")
    g.add_input("a", TensorType(1, [n, 3]))
    g.add_input("b", TensorType(1, [n * 2]))
    assert bind_input_shapes(g, {"a": [4, 3], "b": [8]}).fixed == {"N": 4}
    with pytest.raises(ShapeError, match=r"input 'b' axis 0 is 2\*N = 4 from the other dims, the shape gives 9"):
        bind_input_shapes(g, {"a": [2, 3], "b": [9]})
    with pytest.raises(ShapeError, match=r"input 'b' axis 0 is 2\*N, computed from N\n  next: bind N through an input"):
        bind_input_shapes(g, {"b": [8]})


def test_a_symbol_bound_by_name_and_by_input_must_agree():
    p = Pipeline.from_onnx(anonymous_cnn())
    shapes = {"x": [1, 3, 16, 16]}
    assert p.resolve_shapes({"x.0": 1}, None, shapes)[0] == {"x.0": 1, "x.2": 16, "x.3": 16}
    with pytest.raises(ShapeError, match=r"--input-shape sets symbol x.0 to 1, --fix x.0=2 says otherwise\n  next: give one: drop "
                                         r"--fix x.0=2"):
        p.resolve_shapes({"x.0": 2}, None, shapes)
    with pytest.raises(ShapeError, match=r"--input-shape gives symbol x.2 the range 8:16:32, --shape-profile 1:4:8"):
        p.resolve_shapes(None, {"x.2": (1, 4, 8)}, {"x": ([1, 3, 8, 8], [1, 3, 16, 16], [1, 3, 32, 32])})


# -- x86: one library per profile, against onnxruntime ---------------------------------------------------

def _check_against_ort(model, art, feeds_list):
    sess = ort_session(model)
    names = [o.name for o in model.graph.output]
    for feeds in feeds_list:
        want = sess.run(None, feeds)
        got = art.run(feeds)
        for name, w in zip(names, want):
            assert got[name].shape == w.shape, (name, {k: v.shape for k, v in feeds.items()})
            assert max_rel_error(got[name], w) < RTOL, (name, {k: v.shape for k, v in feeds.items()})


def test_x86_cnn_with_anonymous_dims_one_library_many_shapes():
    model = anonymous_cnn()
    p = Pipeline.from_onnx(model).optimize()
    # s's batch broadcasts against x's: with both ranging freely the Mul could not broadcast (s.0 = 2,
    # x.0 = 3), so s is bound by one shape, its batch fixed to 1
    art = p.compile(input_shapes={"x": ([1, 3, 4, 4], [2, 3, 32, 24], [3, 3, 64, 64]), "s": [1, 4, 1, 1]})
    assert art.manifest["symbols"] == {"x.0": {"min": 1, "opt": 2, "max": 3}, "x.2": {"min": 4, "opt": 32, "max": 64},
                                       "x.3": {"min": 4, "opt": 24, "max": 64}}
    assert art.manifest["specialized"] == {"s.0": 1}
    rng = np.random.default_rng(2)
    feeds = []
    # H != W, odd sizes, the opt point, the profile's corners
    for n, h, w in [(1, 5, 9), (2, 32, 24), (3, 17, 4), (2, 64, 63), (1, 4, 64), (3, 64, 64)]:
        feeds.append({"x": rng.standard_normal((n, 3, h, w)).astype(np.float32),
                      "s": rng.standard_normal((1, 4, 1, 1)).astype(np.float32)})
    _check_against_ort(model, art, feeds)
    with pytest.raises(ShapeError, match=r"dim 2 is x.2 = 65, outside the profile x.2 in \[4, 64\]"):
        art.run({"x": np.zeros((1, 3, 65, 8), np.float32), "s": np.zeros((1, 4, 1, 1), np.float32)})


def test_anonymous_dims_that_must_be_equal_fail_with_the_next_step():
    with pytest.raises(ShapeError) as e:
        Pipeline.from_onnx(anonymous_cnn()).compile(input_shapes={"x": ([1, 3, 4, 4], [2, 3, 8, 8], [3, 3, 8, 8]),
                                                                  "s": ([1, 4, 1, 1], [2, 4, 1, 1], [3, 4, 1, 1])})
    # one line naming the two '?' dims by where they are; the failing node with a counterexample; the next step
    assert e.value.message == ("the graph's shape conditions fail inside the profile: s.0 (s axis 0, '?' in the "
                               "model) and x.0 (x axis 0, '?' in the model) must be equal")
    assert re.fullmatch(r"s.0 = \d+, x.0 = \d+ makes Mul 'y' need x.0 and s.0 broadcast: .*", e.value.details[0])
    assert e.value.hint.startswith("make them one symbol: --fix s.0=x.0 ")


def test_x86_anonymous_dims_made_one_symbol():
    # s's batch must equal x's for this library: --fix s.0=x.0 makes them one symbol, checked at every run
    model = anonymous_cnn()
    p = Pipeline.from_onnx(model).optimize()
    art = p.compile(fixed={"s.0": "x.0"}, input_shapes={"x": ([1, 3, 4, 4], [2, 3, 32, 24], [3, 3, 64, 64]),
                                                        "s": ([1, 4, 1, 1], [2, 4, 1, 1], [3, 4, 1, 1])})
    assert set(art.manifest["symbols"]) == {"x.0", "x.2", "x.3"}
    assert art.manifest["specialized"] == {"s.0": "x.0"}
    rng = np.random.default_rng(5)
    _check_against_ort(model, art, [{"x": rng.standard_normal((n, 3, h, w)).astype(np.float32),
                                     "s": rng.standard_normal((n, 4, 1, 1)).astype(np.float32)}
                                    for n, h, w in [(1, 5, 9), (2, 32, 24), (3, 64, 17)]])
    with pytest.raises(ShapeError, match=r"input 1 's': dim 0 is x.0 = 1, but input 0 'x' dim 0 bound x.0 = 2"):
        art.run({"x": np.zeros((2, 3, 8, 8), np.float32), "s": np.zeros((1, 4, 1, 1), np.float32)})
    with pytest.raises(ShapeError, match=r"input 's' axis 0 is symbol x.0, which input 'x' axis 0 also is; they "
                                         r"are given 1:2:4 and 1:2:3"):
        p.compile(fixed={"s.0": "x.0"}, input_shapes={"x": ([1, 3, 4, 4], [2, 3, 32, 24], [3, 3, 64, 64]),
                                                      "s": ([1, 4, 1, 1], [2, 4, 1, 1], [4, 4, 1, 1])})
    with pytest.raises(ShapeError, match=r"--fix s.0=H: the model has no symbol 'H'"):
        p.compile(fixed={"s.0": "H"})


def test_x86_several_question_marks_in_one_input():
    model = anonymous_attention()
    art = Pipeline.from_onnx(model).optimize().compile(input_shapes={"q": ([1, 1, 8], [2, 16, 8], [4, 64, 8])})
    rng = np.random.default_rng(3)
    _check_against_ort(model, art, [{"q": rng.standard_normal(s).astype(np.float32)}
                                    for s in [(1, 1, 8), (2, 16, 8), (4, 3, 8), (1, 64, 8), (3, 37, 8)]])


def test_x86_one_shape_gives_a_static_library():
    model = anonymous_cnn()
    art = Pipeline.from_onnx(model).compile(input_shapes={"x": [2, 3, 20, 11], "s": [1, 4, 1, 1]})
    assert art.manifest["specialized"] == {"x.0": 2, "x.2": 20, "x.3": 11, "s.0": 1}
    assert not art.manifest.get("symbols")
    rng = np.random.default_rng(4)
    _check_against_ort(model, art, [{"x": rng.standard_normal((2, 3, 20, 11)).astype(np.float32),
                                     "s": rng.standard_normal((1, 4, 1, 1)).astype(np.float32)}])


# -- the command line ------------------------------------------------------------------------------------

@pytest.fixture
def cnn_path(tmp_path):
    path = str(tmp_path / "anon.onnx")
    onnx.save(anonymous_cnn(), path)
    return path


def test_cli_compile_with_input_shape_profile_and_run(cnn_path, tmp_path, capsys):
    lib = str(tmp_path / "libanon.so")
    assert cli_main(["compile", "--input", cnn_path, "--output", lib,
                     "--input-shape", "x=1x3x8x8:2x3x32x24:4x3x64x64", "--input-shape", "s=1x4x1x1"]) == 0
    out = capsys.readouterr().out
    assert "symbol x.2 in [8, 64] (opt 32): one library serves the range" in out
    manifest = json.load(open(str(tmp_path / "libanon.manifest.json")))
    assert manifest["inputs"][0]["shape"] == ["x.0", 3, "x.2", "x.3"]
    header = open(str(tmp_path / "libanon.h")).read()
    assert "x.2 in [8, 64], opt 32" in header
    assert cli_main(["run", lib, "--input-shape", "x=3x3x9x40", "--input-shape", "s=1x4x1x1"]) == 0
    assert capsys.readouterr().out.startswith("y: float32[3, 4, 2, 10]")
    assert cli_main(["run", lib, "--input-shape", "x=3x3x9x40"]) == 2
    err = capsys.readouterr().err
    assert "input 's' is not given" in err and "next: --input s=FILE.npy, or --input-shape s=1x4x1x1" in err
    assert cli_main(["run", lib, "--input-shape", "x=1x3x7x9", "--input-shape", "s=1x4x1x1"]) == 2
    assert "x.2 = 7, outside the profile x.2 in [8, 64]" in capsys.readouterr().err


def test_cli_compile_errors_name_the_next_step(cnn_path, tmp_path, capsys):
    lib = str(tmp_path / "libanon.so")
    assert cli_main(["compile", "--input", cnn_path, "--output", lib, "--input-shape", "x=1x3x640"]) == 2
    assert "input 'x' has rank 4 (f32[x.0,3,x.2,x.3]), the shape gives 3 dims" in capsys.readouterr().err
    assert cli_main(["compile", "--input", cnn_path, "--output", lib, "--input-shape", "x=1x3x64x64:1x3x64x64"]) == 2
    assert "--input-shape takes INPUT=D0xD1x... (one shape) or INPUT=MIN:OPT:MAX (three shapes" in \
        capsys.readouterr().err
    assert cli_main(["compile", "--input", cnn_path, "--output", lib, "--fix", "H=4"]) == 2
    assert "--fix H: the model has no symbol 'H'" in capsys.readouterr().err
    assert cli_main(["compile", "--input", cnn_path, "--output", lib, "--input-shape", "x=1x3x8x8:2x3x16x16:4x3x32x32",
                     "--input-shape", "s=1x4x1x1:2x4x1x1:4x4x1x1"]) == 2
    err = capsys.readouterr().err
    assert "makes Mul 'y' need x.0 and s.0 broadcast" in err and "next: make them one symbol: --fix s.0=x.0" in err
    assert cli_main(["compile", "--input", cnn_path, "--output", lib, "--fix", "s.0=x.0", "--input-shape",
                     "x=1x3x8x8:2x3x16x16:4x3x32x32", "--input-shape", "s=1x4x1x1:2x4x1x1:4x4x1x1"]) == 0


def test_cli_inspect_shows_symbols_and_a_readable_cost(cnn_path, capsys):
    assert cli_main(["inspect", cnn_path]) == 0
    out = capsys.readouterr().out
    assert "symbol x.2 in [1, 4096], opt 1: x axis 2" in out
    assert "symbol s.0 in [1, 4096], opt 1: s axis 0" in out
    assert "-" not in out.split("compute:")[1].split("\n")[0]   # no negative MACs
    assert cli_main(["inspect", cnn_path, "--input-shape", "x=1x3x32x32:1x3x640x480:1x3x1280x1280",
                     "--input-shape", "s=1x4x1x1"]) == 0
    out = capsys.readouterr().out
    assert "input  x: f32[1,3,x.2,x.3]" in out and "fixed  x.0 = 1, s.0 = 1" in out
    # Conv 3x3x3 -> 4 at stride 2: 108 MACs per output pixel, (H + 1)/2 * (W + 1)/2 of them
    line = out.split("compute: ")[1].split("\n")[0]
    assert line == "~ 27*x.2*x.3 + ... MACs", line
    assert "at the opt point (x.2=640, x.3=480): 8.29M MACs" in out   # 108 * 320 * 240


def test_cost_terms_read_floor_divisions_as_quotients():
    d = parse_dim("108*((H + 1)/2)*((W + 1)/2) + 3*max(H, W) + 5")
    assert cost_terms(d, {"H": 640, "W": 480}) == "~ 27*H*W + ..."
    assert cost_terms(d, {"H": 640, "W": 480}, share=1e-9) == "~ 27*H*W + 30*H + 27*W + ..."  # 3*max(H, W) is 3*H there
    assert cost_terms(parse_dim("128*B*S*S + 16384*B*S"), {"B": 1, "S": 8}) == "128*B*S*S + 16384*B*S"


def test_cli_bench_takes_input_shapes(cnn_path, capsys):
    assert cli_main(["bench", cnn_path, "--input-shape", "x=1x3x16x12", "--input-shape", "s=1x4x1x1",
                     "--runs", "2", "--warmup", "0", "--cold-runs", "0"]) == 0
    assert "x: float32[1, 3, 16, 12]" in capsys.readouterr().out
