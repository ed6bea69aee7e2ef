"""`cuvil zoo`: the BERT-style block the README compiles serves its whole profile and matches onnxruntime;
an unknown name is refused with the list of names."""
import numpy as np
import onnx
import pytest

from cuvil import CuvilError, Pipeline
from cuvil.cli import main as cli_main
from cuvil.testing.bert_block import BERT_BLOCK_PROFILE, bert_block
from cuvil.testing.zoo import ZOO, zoo_model

ort = pytest.importorskip("onnxruntime")


def test_bert_block_structure():
    m = bert_block()
    onnx.checker.check_model(m, full_check=True)
    ops = {n.op_type for n in m.graph.node}
    assert {"LayerNormalization", "MatMul", "Add", "Softmax", "Erf", "Reshape", "Transpose", "Cast"} <= ops
    dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in m.graph.input]
    assert dims == [["B", "S", 64], ["B", "S"]]


def test_bert_block_serves_its_profile_like_onnxruntime():
    m = bert_block()
    art = Pipeline.from_onnx(m).optimize().compile(shape_profiles=BERT_BLOCK_PROFILE)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for b, s in [(1, 1), (1, 128), (3, 77), (8, 512)]:
        x = rng.standard_normal((b, s, 64)).astype(np.float32)
        mask = np.ones((b, s), np.int64)
        mask[1:, s // 2:] = 0          # the other rows of the batch padded from half-way
        want = sess.run(None, {"x": x, "attention_mask": mask})[0]
        got = art.run({"x": x, "attention_mask": mask})["y"]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_padding_is_masked():
    """A padded position's content changes no unpadded output (the mask really reaches the scores)."""
    m = bert_block(batch=1, seq=6)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).standard_normal((1, 6, 64)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 0, 0]], np.int64)
    y1 = sess.run(None, {"x": x, "attention_mask": mask})[0]
    x[0, 4:] += 5.0
    y2 = sess.run(None, {"x": x, "attention_mask": mask})[0]
    np.testing.assert_allclose(y1[0, :4], y2[0, :4], rtol=1e-5, atol=1e-5)


def test_zoo_cli_writes_bert_block(tmp_path, capsys):
    out = tmp_path / "bert_block.onnx"
    assert cli_main(["zoo", "bert-block", "-o", str(out)]) == 0
    assert "BERT-style encoder block" in capsys.readouterr().out
    assert onnx.load(str(out)).graph.name == "bert_block"


def test_unknown_zoo_name_lists_the_names():
    with pytest.raises(CuvilError) as e:
        zoo_model("bert")
    assert "bert-block" in e.value.hint and "squeezenet" in e.value.hint
    assert set(ZOO) >= {"bert-block", "resnet50", "squeezenet"}
