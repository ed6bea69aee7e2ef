import numpy as np
import pytest

from cuvil.errors import ShapeError, UnsupportedOpError
from cuvil.ir import DType, Graph, GraphError, SymExpr, TensorType
from cuvil.ir.hash import structural_hash
from cuvil.ir.printer import print_graph

N = SymExpr.symbol("N")


def small_graph(names=("x", "y", "a", "b", "out")):
    g = Graph()
    x = g.add_input(names[0], TensorType(DType.FLOAT, [N, 4]))
    y = g.add_input(names[1], TensorType(DType.FLOAT, [1, 4]))
    a = g.add_node("Add", [x, y], name=names[2]).outputs[0]
    b = g.add_node("Relu", [a], name=names[3]).outputs[0]
    c = g.add_node("Mul", [b, g.const(np.full((4,), 2, np.float32), "two")], name=names[4]).outputs[0]
    g.add_output(c)
    return g


def test_inference_on_build_and_use_lists():
    g = small_graph()
    add, relu, mul = g.nodes
    assert add.outputs[0].type == TensorType(DType.FLOAT, [N, 4])
    assert add.outputs[0].uses == [(relu, 0)]
    assert g.inputs[0].uses == [(add, 0)]
    g.verify()


def test_replace_and_remove_keep_use_lists_right():
    g = small_graph()
    add, relu, mul = g.nodes
    g.replace_all_uses(relu.outputs[0], add.outputs[0])
    g.remove_node(relu)
    assert mul.inputs[0] is add.outputs[0]
    assert (mul, 0) in add.outputs[0].uses
    g.verify()
    with pytest.raises(GraphError):
        g.remove_node(add)  # still used


def test_toposort_and_cycle_detection():
    g = small_graph()
    g.nodes.reverse()
    g.toposort()
    assert [n.op for n in g.nodes] == ["Add", "Relu", "Mul"]
    add, relu, _ = g.nodes
    g.set_input(add, 1, relu.outputs[0])
    with pytest.raises(GraphError, match="cycle"):
        g.toposort()


def test_structural_hash_ignores_names_and_order():
    g1, g2 = small_graph(), small_graph(("p", "q", "r", "s", "t"))
    assert structural_hash(g1) == structural_hash(g2)
    g2.nodes.reverse()
    assert structural_hash(g1) == structural_hash(g2)
    g3 = small_graph()
    g3.nodes[1].op = "Sigmoid"
    assert structural_hash(g1) != structural_hash(g3)
    g4 = small_graph()
    g4.nodes[2].inputs[1].const = np.full((4,), 3, np.float32)
    assert structural_hash(g1) != structural_hash(g4)


def test_clone_is_independent():
    g = small_graph()
    c = g.clone()
    c.replace_all_uses(c.nodes[1].outputs[0], c.nodes[0].outputs[0])
    c.remove_node(c.nodes[1])
    assert len(g.nodes) == 3 and len(c.nodes) == 2
    g.verify(), c.verify()
    assert structural_hash(g) != structural_hash(c)


def test_printer_shows_types_and_constants():
    text = print_graph(small_graph())
    assert text.splitlines()[0] == "graph main(%x: f32[N,4], %y: f32[1,4]) -> (%out: f32[N,4]) {"
    assert "  %a: f32[N,4] = Add(%x, %y)" in text
    assert "  %two: f32[4] = const [2.0, 2.0, 2.0, 2.0]" in text
    assert text.rstrip().endswith("return %out\n}".rstrip())


def test_inference_errors_name_the_node():
    g = Graph()
    x = g.add_input("x", TensorType(DType.FLOAT, [2, 3]))
    y = g.add_input("y", TensorType(DType.FLOAT, [4, 3]))
    with pytest.raises(ShapeError, match=r"node 'bad' \(Add\).*do not broadcast"):
        g.add_node("Add", [x, y], name="bad")
    i = g.add_input("i", TensorType(DType.INT64, [2, 3]))
    with pytest.raises(ShapeError, match="dtypes differ"):
        g.add_node("Add", [x, i], name="mixed")
    with pytest.raises(UnsupportedOpError, match="unsupported op FancyOp"):
        g.add_node("FancyOp", [x], name="f")


def test_symbolic_broadcast_takes_max():
    g = Graph()
    a = g.add_input("a", TensorType(DType.FLOAT, ["N", 1]))
    b = g.add_input("b", TensorType(DType.FLOAT, ["M", 5]))
    out = g.add_node("Add", [a, b]).outputs[0]
    assert str(out.type) == "f32[max(M, N),5]"


def test_toposort_with_a_consumer_of_several_outputs_of_one_node():
    # A Concat of a Split's pieces and of another node's output: it was decremented by both pieces once per
    # piece, went below zero and never became ready (reported as a cycle).
    g = Graph()
    x = g.add_input("x", TensorType(DType.FLOAT, [4]))
    split = g.add_node("Split", [x], {"num_outputs": 2}, num_outputs=2)
    relu = g.add_node("Relu", [x])
    cat = g.add_node("Concat", [split.outputs[1], split.outputs[0], relu.outputs[0]], {"axis": 0})
    g.add_output(cat.outputs[0], "y")
    g.nodes = [cat, split, relu]
    g.toposort()
    assert [n.op for n in g.nodes] == ["Split", "Relu", "Concat"]
