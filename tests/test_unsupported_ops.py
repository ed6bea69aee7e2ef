"""A model with ops Cuvil cannot import is refused with ONE error naming every such op (subgraphs included),
node by node, and the next step; `cuvil inspect` still shows the model as its file declares it (the user's dim
names, '?' for unknown dims) and lists them all, exit status 1."""
import json

import numpy as np
import onnx.version_converter
import pytest
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.errors import MAX_DETAIL_LINES, ModelLoadError, UnsupportedOpError


def model_with_unsupported_ops():
    then = helper.make_graph([helper.make_node("Frobnicate", ["r"], ["t"], domain="my.ops", name="frob_in_then")],
                             "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["r"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    b = numpy_helper.from_array(np.zeros(4, np.float32), "b")
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("BiasGelu", ["r", "b"], ["g1"], domain="com.microsoft", name="gelu1"),
             helper.make_node("BiasGelu", ["g1", "b"], ["g2"], domain="com.microsoft", name="gelu2"),
             helper.make_node("TfIdfVectorizer", ["ids"], ["tf"], name="tfidf", mode="TF", min_gram_length=1,
                              max_gram_length=1, max_skip_count=0, ngram_counts=[0], ngram_indexes=[0],
                              pool_int64s=[5]),
             helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then, else_branch=other)]
    g = helper.make_graph(nodes, "unsupported",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["p2o.DynamicDimension.0", 4]),
                           helper.make_tensor_value_info("ids", TensorProto.INT64, ["?", 3]),
                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("g2", TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("tf", TensorProto.FLOAT, None)], [b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
                                               helper.make_opsetid("my.ops", 1)])


MESSAGE = "3 unsupported ops in the model: com.microsoft::BiasGelu, TfIdfVectorizer, my.ops::Frobnicate"
DETAILS = ["com.microsoft::BiasGelu (opset 1): 2 nodes: 'gelu1', 'gelu2'",
           "TfIdfVectorizer (opset 17): 1 node: 'tfidf'",
           "my.ops::Frobnicate (opset 1): 1 node: 'frob_in_then' (in 'branch')"]


@pytest.fixture
def model_path(tmp_path):
    path = tmp_path / "unsupported.onnx"
    path.write_bytes(model_with_unsupported_ops().SerializeToString())
    return str(path)


def test_import_names_every_unsupported_op_at_once():
    with pytest.raises(UnsupportedOpError) as e:
        Pipeline.from_onnx(model_with_unsupported_ops())
    err = e.value
    assert err.message == MESSAGE and err.details == DETAILS
    assert [(n.op, n.domain, n.node, n.opset, n.scope) for n in err.nodes] == [
        ("BiasGelu", "com.microsoft", "gelu1", 1, ""), ("BiasGelu", "com.microsoft", "gelu2", 1, ""),
        ("TfIdfVectorizer", "", "tfidf", 17, ""), ("Frobnicate", "my.ops", "frob_in_then", 1, "branch")]
    assert (err.op, err.node, err.opset, err.domain) == ("BiasGelu", "gelu1", 1, "com.microsoft")
    assert "`cuvil ops`" in err.hint and "`cuvil inspect MODEL`" in err.hint


def test_many_nodes_of_many_ops_stay_a_few_lines():
    nodes = [helper.make_node(f"Op{k}", ["x"], [f"y{k}_{j}"], domain="my.ops", name=f"n{k}_{j}")
             for k in range(9) for j in range(7)]
    g = helper.make_graph(nodes, "many", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y0_0", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.ops", 1)])
    with pytest.raises(UnsupportedOpError) as e:
        Pipeline.from_onnx(m)
    assert e.value.message.startswith("9 unsupported ops in the model: my.ops::Op0, my.ops::Op1")
    assert e.value.details[0] == "my.ops::Op0 (opset 1): 7 nodes: 'n0_0', 'n0_1', 'n0_2', 'n0_3' and 3 more"
    assert len(str(e.value).splitlines()) == 1 + MAX_DETAIL_LINES + 1 + 1   # message, 6 details, "... 3 more", next


def test_a_domain_the_model_does_not_import_is_said_so():
    g = helper.make_graph([helper.make_node("Foo", ["x"], ["y"], domain="com.example", name="c")], "d",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.raises(UnsupportedOpError, match=r"^unsupported op com.example::Foo \(node 'c', domain 'com.example' "
                                                 r"not imported\)"):
        Pipeline.from_onnx(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))


def test_survey_reads_the_model_as_declared():
    sv = Pipeline.survey(model_with_unsupported_ops())
    assert sv.inputs == [("x", "f32[p2o.DynamicDimension.0,4]"), ("ids", "i64[?,3]"), ("c", "bool[]")]
    assert sv.outputs == [("y", "f32[*]"), ("g2", "f32[*]"), ("tf", "f32[*]")]
    assert sv.op_histogram["com.microsoft::BiasGelu"] == 2 and sv.op_histogram["Identity"] == 1   # subgraphs too
    assert sv.initializer_elements == 4 and len(sv.unsupported) == 4 and sv.opset == 17


def test_cli_inspect_shows_the_model_and_lists_every_unsupported_op(model_path, capsys):
    assert cli_main(["inspect", model_path]) == 1
    out, err = capsys.readouterr()
    assert "  input  x: f32[p2o.DynamicDimension.0,4]" in out and "  input  ids: i64[?,3]" in out
    assert "  com.microsoft::BiasGelu  2  (unsupported)" in out and "  Relu                     1\n" in out
    lines = err.splitlines()
    assert lines[0] == "cuvil: error: " + MESSAGE and [x.strip() for x in lines[1:4]] == DETAILS
    assert lines[4].startswith("  next: export the model without these ops") and "`cuvil ops`" in lines[4]
    # the next step works: `cuvil ops` runs and does not list these ops as imported
    assert cli_main(["ops", "--json"]) == 0
    listed = {r["op"] for r in json.loads(capsys.readouterr().out)["ops"]}
    assert not {"BiasGelu", "TfIdfVectorizer", "Frobnicate"} & listed


def test_cli_compile_refuses_with_every_op(model_path, tmp_path, capsys):
    assert cli_main(["compile", "--input", model_path, "--output", str(tmp_path / "libu.so")]) == 2
    err = capsys.readouterr().err
    assert "cuvil: error: " + MESSAGE in err and "`cuvil inspect MODEL` shows the rest of the model" in err


def test_an_old_opset_names_the_converter_and_the_converted_model_imports():
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "old",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 6)])
    with pytest.raises(ModelLoadError) as e:
        Pipeline.from_onnx(m)
    assert e.value.message == "opset 6 is older than the oldest supported (7)"
    assert "onnx.version_converter.convert_version(model, 13)" in e.value.hint
    p = Pipeline.from_onnx(onnx.version_converter.convert_version(m, 13))   # the hint, followed
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(p.run_reference({"x": x})["y"], np.maximum(x, 0))
