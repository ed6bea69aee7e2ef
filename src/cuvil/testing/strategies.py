"""Hypothesis strategies for fuzzing Cuvil, its rules and your models.

* :func:`graphs` draws random valid ONNX models built from the op registry (shape inference decides
  what is valid), biased towards the patterns rewrite rules look for;
* :func:`inputs_for` draws inputs for a given model (symbolic dims inside their ranges);
* :func:`float_arrays` draws float32 arrays including the IEEE corner cases (+-0, +-inf, NaN, subnormals)
  that bit-exact rules must preserve.

Use them in your own CI::

    from hypothesis import given
    from cuvil.testing import strategies as cst

    @given(cst.graphs())
    def test_my_rules_keep_meaning(model):
        ...
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import onnx
from hypothesis import strategies as st

from ..errors import CuvilError
from ..frontend.onnx_export import export_model
from ..ir.dim import evaluate
from ..ir.dtype import DType
from ..ir.graph import Graph, Value
from ..ir.types import TensorType
from ..pipeline import Pipeline

SPECIAL_FLOATS = (0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 3.4e38, 0.5)


def shapes(min_rank: int = 0, max_rank: int = 4, min_side: int = 1, max_side: int = 4) -> st.SearchStrategy:
    return st.lists(st.integers(min_side, max_side), min_size=min_rank, max_size=max_rank).map(tuple)


SMALL_ARRAY = 64  # up to this many elements each one is drawn (and shrunk) on its own


def float_arrays(shape: Sequence[int], special: bool = True, low: float = -4.0, high: float = 4.0) -> st.SearchStrategy:
    """float32 arrays of ``shape``; with ``special``, some elements are IEEE corner cases.

    Small arrays are drawn element by element; large ones from a seeded generator with a drawn scale
    (shrinking towards all zeros) and, with ``special``, corner cases at drawn positions."""
    n = int(np.prod(shape))
    if n <= SMALL_ARRAY:
        finite = st.floats(low, high, width=32, allow_subnormal=True)
        elem = st.one_of(finite, st.sampled_from(SPECIAL_FLOATS)) if special else finite
        return st.lists(elem, min_size=n, max_size=n).map(lambda xs: np.asarray(xs, np.float32).reshape(shape))

    @st.composite
    def big(draw):
        seed = draw(st.integers(0, 2**32 - 1))
        scale = draw(st.floats(0.0, max(abs(low), abs(high)), width=32))
        arr = (np.random.default_rng(seed).uniform(-1, 1, n) * scale).astype(np.float32)
        if special:
            for pos, val in draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(SPECIAL_FLOATS)), max_size=8)):
                arr[pos] = val
        return arr.reshape(shape)
    return big()


@st.composite
def inputs_for(draw, model, max_dim: int = 4, special: bool = False) -> Dict[str, np.ndarray]:
    """Inputs for ``model`` (a Pipeline, Graph or ModelProto): symbolic dims drawn inside their ranges
    (capped at ``max_dim`` to keep examples small), values from :func:`float_arrays`."""
    g = _graph_of(model)
    env = {s.name: draw(st.integers(s.min, max(s.min, min(s.max, max_dim)))) for s in g.symbols.values()}
    out = {}
    for v in g.inputs:
        shape = tuple(evaluate(d, env) for d in v.shape)
        if v.dtype == DType.FLOAT:
            out[v.name] = draw(float_arrays(shape, special=special))
        elif v.dtype == DType.BOOL:
            out[v.name] = np.asarray(draw(st.lists(st.booleans(), min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))), bool).reshape(shape)
        elif v.dtype.is_int:
            n = int(np.prod(shape))
            out[v.name] = np.asarray(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), v.dtype.numpy).reshape(shape)
        else:
            raise CuvilError(f"input {v.name!r}: cannot draw {v.dtype.name} values")
    return out


def _graph_of(model) -> Graph:
    if isinstance(model, Pipeline):
        return model.graph
    if isinstance(model, Graph):
        return model
    return Pipeline.from_onnx(model).graph


# --- random graphs -----------------------------------------------------------------------------------

UNARY = ("Relu", "Neg", "Abs", "Sigmoid", "Tanh", "Identity", "Dropout", "Exp", "Sqrt", "Floor", "LeakyRelu",
         "HardSigmoid", "Softsign", "Elu")
BINARY = ("Add", "Sub", "Mul", "Div", "Max", "Min")


def _const(g: Graph, rng: np.random.Generator, shape, kind: str = "normal") -> Value:
    if kind == "positive":
        arr = rng.uniform(0.5, 1.5, shape)
    elif kind == "one":
        arr = np.ones(shape)
    elif kind == "zero":
        arr = np.zeros(shape)
    else:
        arr = rng.normal(0, 0.5, shape)
    return g.const(np.asarray(arr, np.float32), "c")


def _step(g: Graph, rng: np.random.Generator, vals: List[Value], choice: int) -> Optional[Value]:
    x = vals[int(rng.integers(len(vals)))]
    s = x.shape
    kind = choice % 12
    if kind in (0, 1):
        op = UNARY[int(rng.integers(len(UNARY)))]
        return g.add_node(op, [x]).outputs[0]
    if kind in (2, 3):
        op = BINARY[int(rng.integers(len(BINARY)))]
        if rng.random() < 0.5 and len(vals) > 1:
            y = vals[int(rng.integers(len(vals)))]
        else:
            sub = s[int(rng.integers(len(s) + 1)):] if s else ()
            y = _const(g, rng, sub, ["normal", "one", "zero", "positive"][int(rng.integers(4))])
        return g.add_node(op, [x, y]).outputs[0]
    if kind == 4 and len(s) == 4:  # Conv (+ BatchNormalization) on NCHW values
        c = s[1]
        m = int(rng.integers(1, 4))
        k = int(rng.choice([1, 3]))
        attrs = {"pads": [k // 2] * 4} if k == 3 else {}
        ins = [x, _const(g, rng, (m, c, k, k))] + ([_const(g, rng, (m,))] if rng.random() < 0.7 else [])
        y = g.add_node("Conv", ins, attrs).outputs[0]
        if rng.random() < 0.6:
            y = g.add_node("BatchNormalization", [y, _const(g, rng, (m,), "positive"), _const(g, rng, (m,)),
                                                  _const(g, rng, (m,)), _const(g, rng, (m,), "positive")]).outputs[0]
        return y
    if kind == 5 and len(s) >= 2:
        perm = list(rng.permutation(len(s)))
        y = g.add_node("Transpose", [x], {"perm": [int(p) for p in perm]}).outputs[0]
        if rng.random() < 0.5:
            inv = [int(i) for i in np.argsort(perm)]
            y = g.add_node("Transpose", [y], {"perm": inv}).outputs[0]
        return y
    if kind == 6 and s and all(isinstance(d, int) for d in s):
        return g.add_node("Reshape", [x], {"shape": [-1]}).outputs[0]
    if kind == 7 and len(s) >= 1:
        return g.add_node("Softmax", [x], {"axis": -1}).outputs[0]
    if kind == 8 and len(s) == 2:
        k = s[1]
        w = _const(g, rng, (k, int(rng.integers(1, 4))))
        y = g.add_node("MatMul", [x, w]).outputs[0]
        if rng.random() < 0.6:
            y = g.add_node("Add", [y, _const(g, rng, (y.shape[1],))]).outputs[0]
        return y
    if kind == 9:
        return g.add_node("Unsqueeze", [x], {"axes": [0]}).outputs[0] if len(s) < 4 else None
    if kind == 10 and len(s) >= 1:
        return g.add_node("ReduceMean", [x], {"axes": [-1], "keepdims": 1}).outputs[0]
    if kind == 11:
        return g.add_node("Relu", [g.add_node("Relu", [x]).outputs[0]]).outputs[0]
    return None


@st.composite
def graphs(draw, max_nodes: int = 8, max_inputs: int = 2) -> onnx.ModelProto:
    """A random valid model: float inputs of random shapes, then ``max_nodes`` random steps."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    g = Graph(name="fuzz")
    n_in = draw(st.integers(1, max_inputs))
    vals: List[Value] = []
    for k in range(n_in):
        shape = draw(st.sampled_from([(2, 3), (1, 2, 3, 3), (3,), (2, 2, 4), (1, 3, 4, 4)]))
        vals.append(g.add_input(f"x{k}", TensorType(DType.FLOAT, shape)))
    steps = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=max_nodes))
    for choice in steps:
        try:
            v = _step(g, rng, vals, choice)
        except CuvilError:
            v = None
        if v is not None:
            vals.append(v)
    produced = [v for v in vals if v.producer is not None]
    g.add_output(produced[-1] if produced else g.add_node("Identity", [vals[0]]).outputs[0], "y")
    return export_model(g)
