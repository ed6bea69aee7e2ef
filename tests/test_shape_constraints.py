"""Shape conditions on symbolic dims are recorded by inference and decided by Z3 over symbol ranges."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper

from cuvil import Pipeline
from cuvil.cli import main as cli_main
from cuvil.ir import DType, Graph, TensorType
from cuvil.ir.constraints import check_constraints, dim_ranges
from cuvil.ir.dim import Symbol


def reshape_graph(lo, hi):
    g = Graph()
    g.symbols["N"] = Symbol("N", lo, hi)
    x = g.add_input("x", TensorType(DType.FLOAT, ["N", 12]))
    g.add_output(g.add_node("Reshape", [x], {"shape": [-1, 8]}, name="r1").outputs[0], "y")
    return g


def test_reshape_needs_divisibility_counterexample():
    (v,) = check_constraints(reshape_graph(1, 64))
    assert v.node == "r1" and v.op == "Reshape"
    assert (12 * v.values["N"]) % 8 != 0 and 1 <= v.values["N"] <= 64
    assert str(v).startswith(f"N = {v.values['N']} makes Reshape 'r1' need (12*N) % (8) == 0")
    assert check_constraints(reshape_graph(2, 2)) == []           # N = 2: 24 elements, fine
    assert check_constraints(reshape_graph(1, 64), {"N": (4, 4)}) == []


def test_broadcast_and_matmul_conditions():
    g = Graph()
    for s in ("A", "B", "K"):
        g.symbols[s] = Symbol(s, 1, 16)
    a = g.add_input("a", TensorType(DType.FLOAT, ["A", 4]))
    b = g.add_input("b", TensorType(DType.FLOAT, ["B", 4]))
    g.add_node("Add", [a, b], name="add")
    m = g.add_input("m", TensorType(DType.FLOAT, [2, "K"]))
    w = g.const(np.zeros((3, 5), np.float32), "w")
    g.add_node("MatMul", [m, w], name="mm")
    bad = {v.node: v for v in check_constraints(g)}
    assert set(bad) == {"add", "mm"}
    assert bad["mm"].values["K"] != 3
    va = bad["add"].values
    assert va["A"] != va["B"] and 1 not in (va["A"], va["B"])
    assert check_constraints(g, {"K": (3, 3), "A": (1, 1)}) == []


def test_conv_output_size_and_derived_ranges(capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "H", "H"])
    w = numpy_helper.from_array(np.zeros((4, 3, 3, 3), np.float32), "w")
    g = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], strides=[2, 2], name="c1")], "g", [x],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    p = Pipeline.from_onnx(m)
    bad = p.check_shapes()
    assert bad and all(v.values["H"] < 3 for v in bad)
    assert p.check_shapes({"H": (3, 64, 224)}) == []
    assert dim_ranges(p.graph, {"H": (3, 224)})["(H + 1)/2 - 1"] == (1, 111)
    path = str(__import__("pathlib").Path(__import__("tempfile").mkdtemp()) / "c.onnx")
    __import__("onnx").save(m, path)
    assert cli_main(["inspect", path, "--shapes", "--shape-profile", "H=3:64:224"]) == 0
    out = capsys.readouterr().out
    assert "violated somewhere in range: 0" in out and "dim (H + 1)/2 - 1 in [1, 111]" in out
