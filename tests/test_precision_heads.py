"""The precision policy keeps a model's output layers float32 (cuvil.precision.heads), and ``keep_fp32`` /
``--keep-fp32`` name what stays float32 instead."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from cuvil import Pipeline
from cuvil.cli import main
from cuvil.errors import CuvilError
from cuvil.precision import plan_precision
from cuvil.precision.heads import HEAD_MAC_SHARE, output_heads

BF16 = {"bf16": frozenset({"Conv", "Gemm", "MatMul"})}


def _model(nodes, inputs, outputs, inits=()):
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in inputs],
                     [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in outputs], list(inits))
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def classifier(seed=0, head=("Gemm",)):
    """Conv 3 -> 32 (3x3, 32x32), Relu, GlobalAveragePool, Flatten, then a 32 -> 10 Gemm (0.04% of the MACs)
    and ``head``'s ops after it (Softmax, ...)."""
    rng = np.random.default_rng(seed)
    w = lambda name, *shape: nh.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)
    nodes = [h.make_node("Conv", ["x", "w0", "b0"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Relu", ["c"], ["r"]),
             h.make_node("GlobalAveragePool", ["r"], ["g"]), h.make_node("Flatten", ["g"], ["f"]),
             h.make_node("Gemm", ["f", "fw", "fb"], ["z0"], transB=1)]
    for i, op in enumerate(head[1:]):
        nodes.append(h.make_node(op, [f"z{i}"], [f"z{i + 1}"]))
    nodes[-1].output[0] = "y"
    return _model(nodes, [("x", [1, 3, 32, 32])], [("y", [1, 10])],
                  [w("w0", 32, 3, 3, 3), w("b0", 32), w("fw", 10, 32), w("fb", 10)])


def _plan(model, **kw):
    g = Pipeline.from_onnx(model).optimize().graph
    return plan_precision(g, kw.pop("mode", "bf16"), input_ranges={"x": (-1, 1)}, target_ops=BF16, **kw)


def _formats(plan):
    return {n.op: n.format or "fp32" for n in plan.nodes if n.op in ("Conv", "Gemm", "MatMul")}


@pytest.mark.parametrize("head", [("Gemm",), ("Gemm", "Softmax"), ("Gemm", "Tanh", "Identity")])
def test_a_classifier_keeps_its_last_gemm_float32_and_narrows_the_rest(head):
    plan = _plan(classifier(head=head))
    assert _formats(plan) == {"Conv": "bf16", "Gemm": "fp32"}
    gemm = next(n for n in plan.nodes if n.op == "Gemm")
    assert "output layer" in gemm.reason and "0.04%" in gemm.reason and "--keep-fp32 none" in gemm.reason
    assert plan.manifest()["nodes"][gemm.name]["format"] == "fp32"


def test_auto_keeps_the_head_too_and_fp32_plans_nothing():
    assert _formats(_plan(classifier(), mode="auto"))["Gemm"] == "fp32"
    assert all(not n.format for n in _plan(classifier(), mode="fp32").nodes)


def test_keep_fp32_replaces_the_default():
    assert _formats(_plan(classifier(), keep_fp32=[])) == {"Conv": "bf16", "Gemm": "bf16"}
    plan = _plan(classifier(), keep_fp32=["Conv"])
    assert _formats(plan) == {"Conv": "fp32", "Gemm": "bf16"}
    assert "as asked" in next(n for n in plan.nodes if n.op == "Conv").reason
    name = next(n.name for n in plan.nodes if n.op == "Conv")
    assert _formats(_plan(classifier(), keep_fp32=[name])) == {"Conv": "fp32", "Gemm": "bf16"}


def test_unknown_names_and_a_bare_string_are_refused_with_the_next_step():
    with pytest.raises(CuvilError) as e:
        _plan(classifier(), keep_fp32=["Gemm", "no_such_node"])
    assert "no_such_node" in str(e.value) and "precision report" in (e.value.hint or "")
    with pytest.raises(CuvilError) as e:
        _plan(classifier(), keep_fp32="Gemm")
    assert "keep_fp32=['Gemm']" in (e.value.hint or "")
    with pytest.raises(CuvilError) as e:            # op types are case-sensitive: the error says which was meant
        _plan(classifier(), keep_fp32=["gemm"])
    assert "'gemm' -> 'Gemm'" in str(e.value)
    with pytest.raises(CuvilError):                 # checked under fp32 too, where nothing is narrowed
        _plan(classifier(), mode="fp32", keep_fp32=["no_such_node"])


def test_what_is_not_an_output_layer():
    rng = np.random.default_rng(0)
    w = nh.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")
    # the only contraction: all of the model's work, not a cheap head
    lone = _model([h.make_node("MatMul", ["x", "w"], ["y"])], [("x", [4, 16])], [("y", [4, 16])], [w])
    assert output_heads(Pipeline.from_onnx(lone).optimize().graph) == {}
    # its output added to another input (a residual) before the output: the sum is not the layer's alone
    big = nh.from_array(rng.standard_normal((16, 2048)).astype(np.float32), "big")
    big2 = nh.from_array(rng.standard_normal((2048, 16)).astype(np.float32), "big2")
    res = _model([h.make_node("MatMul", ["x", "big"], ["a"]), h.make_node("MatMul", ["a", "big2"], ["b"]),
                  h.make_node("MatMul", ["b", "w"], ["m"]), h.make_node("Add", ["m", "x"], ["y"])],
                 [("x", [4, 16])], [("y", [4, 16])], [w, big, big2])
    g = Pipeline.from_onnx(res).optimize().graph
    assert output_heads(g) == {}
    # the same layer's output straight to the model's output is one
    direct = _model([h.make_node("MatMul", ["x", "big"], ["a"]), h.make_node("MatMul", ["a", "big2"], ["b"]),
                     h.make_node("MatMul", ["b", "w"], ["y"])], [("x", [4, 16])], [("y", [4, 16])], [w, big, big2])
    heads = output_heads(Pipeline.from_onnx(direct).optimize().graph)
    assert len(heads) == 1 and "0.39%" in next(iter(heads.values()))
    # above the share: narrowed
    assert output_heads(Pipeline.from_onnx(direct).optimize().graph, share=0.001) == {}
    assert HEAD_MAC_SHARE == 0.01


def test_compiled_library_records_and_runs_the_float32_head(tmp_path):
    model = classifier()
    x = np.random.default_rng(1).uniform(-1, 1, (1, 3, 32, 32)).astype(np.float32)
    ref = Pipeline.from_onnx(model).optimize().compile().run({"x": x})["y"]
    for keep, gemm in ((None, "fp32"), ([], "bf16")):
        art = Pipeline.from_onnx(model).optimize().compile(precision="bf16", input_ranges={"x": (-1, 1)},
                                                           keep_fp32=keep)
        nodes = art.manifest["precision"]["nodes"]
        assert {v["op"]: v["format"] for v in nodes.values() if v["op"] in ("Conv", "Gemm")} == \
            {"Conv": "bf16", "Gemm": gemm}
        steps = [st for st in art.manifest["steps"] if st["op"] == "Gemm"]
        assert steps and all(st.get("precision", "") == ("" if gemm == "fp32" else "bf16") for st in steps), steps
        got = art.run({"x": x})["y"]
        assert np.abs(got - ref).max() <= 2e-2 * np.abs(ref).max()
    with pytest.raises(CuvilError) as e:
        Pipeline.from_onnx(model).optimize().compile(keep_fp32=["Gemm"])
    assert "precision fp32" in str(e.value) and "bf16" in (e.value.hint or "")


def test_cli_keep_fp32(tmp_path, capsys):
    path = tmp_path / "cls.onnx"
    onnx.save(classifier(), path)
    args = ["precision", "report", str(path), "--precision", "bf16", "--input-range", "x=-1:1", "--search", "0",
            "--all"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "output layer" in out
    assert main(args + ["--keep-fp32", "none"]) == 0
    assert "output layer" not in capsys.readouterr().out
    assert main(args + ["--keep-fp32", "Relu,nothing_here"]) == 2
    assert "nothing_here" in capsys.readouterr().err
    for empty in ("", " ", ","):                    # an unset shell variable is not `none`
        assert main(args + ["--keep-fp32", empty]) == 2
        assert "--keep-fp32 none" in capsys.readouterr().err
    assert main(["compile", str(path), "-o", str(tmp_path / "libcls.so"), "--keep-fp32", "Gemm"]) == 2
    assert "precision fp32" in capsys.readouterr().err
