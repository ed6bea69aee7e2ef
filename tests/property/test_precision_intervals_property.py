"""The range analysis is sound (docs/precision.md, issue 21): random small graphs of the ops it bounds, random
constant weights and a random input box; onnxruntime evaluates the box's corners and random points with every
intermediate value exposed, and each must lie inside its certified interval. A value may be NaN only where its
interval says nothing ([-inf, inf]: unknown)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from cuvil import Pipeline
from cuvil.frontend import export_model
from cuvil.precision.ranges import analyze
from cuvil.precision.inputs import declared_ranges

ort = pytest.importorskip("onnxruntime")

#: Unary ops on any shape (name, attrs, the input made safe first: None, "abs", "pos").
UNARY = [("Relu", {}, None), ("Sigmoid", {}, None), ("Tanh", {}, None), ("Abs", {}, None), ("Neg", {}, None),
         ("Exp", {}, None), ("Sqrt", {}, "abs"), ("Log", {}, "pos"), ("Erf", {}, None), ("Softsign", {}, None),
         ("LeakyRelu", {"alpha": 0.1}, None), ("LeakyRelu", {"alpha": -0.5}, None), ("Elu", {}, None),
         ("HardSigmoid", {}, None), ("HardSwish", {}, None), ("Mish", {}, None), ("Softplus", {}, None),
         ("Gelu", {}, None), ("Gelu", {"approximate": "tanh"}, None), ("Atan", {}, None), ("Floor", {}, None),
         ("Reciprocal", {}, "pos"), ("Softmax", {"axis": 1}, None), ("Softmax", {"axis": -1}, None)]


class Builder:
    def __init__(self, draw, shape):
        self.draw, self.shape, self.cur = draw, list(shape), "x"
        self.x_shape = list(shape)
        self.nodes, self.inits, self.k = [], [], 0

    def name(self, p="t"):
        self.k += 1
        return f"{p}{self.k}"

    def const(self, arr):
        n = self.name("c")
        self.inits.append(nh.from_array(np.asarray(arr, np.float32), n))
        return n

    def weights(self, shape):
        seed = self.draw(st.integers(0, 2 ** 16))
        scale = self.draw(st.sampled_from([0.1, 1.0, 3.0]))
        w = np.random.default_rng(seed).standard_normal(shape) * scale
        if self.draw(st.booleans()):          # cancelling weights: the sum of a row near 0
            w -= w.mean(axis=tuple(range(1, w.ndim)), keepdims=True)
        return w.astype(np.float32)

    def node(self, op, ins, **attrs):
        out = self.name()
        self.nodes.append(h.make_node(op, ins, [out], **attrs))
        self.cur = out
        return out

    def step(self):
        d = self.draw
        kind = d(st.sampled_from(["unary", "unary", "binary", "conv", "pool", "norm", "reduce", "move", "matmul",
                                  "clip", "pow"]))
        C = self.shape[1]
        if kind == "unary":
            op, attrs, prep = d(st.sampled_from(UNARY))
            if prep == "abs":
                self.node("Abs", [self.cur])
            elif prep == "pos":
                self.node("Add", [self.node("Abs", [self.cur]), self.const(0.5)])
            self.node(op, [self.cur], **attrs)
        elif kind == "binary":
            op = d(st.sampled_from(["Add", "Sub", "Mul", "Div", "Max", "Min"]))
            if d(st.booleans()):   # a per-channel constant
                c = self.weights([1, C] + [1] * (len(self.shape) - 2))
                if op == "Div":
                    c = np.where(np.abs(c) < 0.1, 0.5, c).astype(np.float32)
                other = self.const(c)
            else:                  # the tensor with itself through another path (correlated operands)
                src = self.cur
                other = self.node("Add", [self.node("Tanh", [src]), self.const(2.0)]) if op == "Div" else \
                    self.node("Sigmoid", [src])
                self.cur = src
            self.node(op, [self.cur, other])
        elif kind == "conv" and len(self.shape) == 4:
            group = d(st.sampled_from([1, 1, C])) if C > 1 else 1
            m = group * d(st.integers(1, 3)) if group > 1 else d(st.integers(1, 4))
            k = d(st.integers(1, 3))
            dil = d(st.integers(1, 2))
            pad = d(st.integers(0, k - 1))
            if (k - 1) * dil + 1 > min(self.shape[2], self.shape[3]) + 2 * pad:
                k, dil = 1, 1
            w = self.weights([m, C // group, k, k])
            ins = [self.cur, self.const(w)] + ([self.const(self.weights([m]))] if d(st.booleans()) else [])
            self.node("Conv", ins, group=group, pads=[pad] * 4, dilations=[dil] * 2, strides=[1, 1])
            self.shape = [self.shape[0], m, self.shape[2] + 2 * pad - (k - 1) * dil, self.shape[3] + 2 * pad - (k - 1) * dil]
        elif kind == "pool" and len(self.shape) == 4:
            op = d(st.sampled_from(["AveragePool", "MaxPool", "GlobalAveragePool", "GlobalMaxPool"]))
            if op.startswith("Global"):
                self.node(op, [self.cur])
                self.shape = self.shape[:2] + [1, 1]
            else:
                k = min(2, self.shape[2], self.shape[3])
                pad = d(st.integers(0, k - 1))
                extra = {"count_include_pad": d(st.integers(0, 1))} if op == "AveragePool" else {}
                self.node(op, [self.cur], kernel_shape=[k, k], pads=[pad] * 4, **extra)
                self.shape = self.shape[:2] + [self.shape[2] + 2 * pad - k + 1, self.shape[3] + 2 * pad - k + 1]
        elif kind == "norm":
            op = d(st.sampled_from(["BatchNormalization", "LayerNormalization", "InstanceNormalization"]))
            if op == "BatchNormalization":
                rng = np.random.default_rng(d(st.integers(0, 99)))
                ins = [self.const(rng.standard_normal(C) * 2), self.const(rng.standard_normal(C)),
                       self.const(rng.standard_normal(C)), self.const(rng.random(C) + 0.1)]
                self.node(op, [self.cur] + ins)
            elif op == "LayerNormalization":
                n = self.shape[-1]
                self.node(op, [self.cur, self.const(self.weights([n])), self.const(self.weights([n]))], axis=-1)
            elif len(self.shape) >= 3:
                self.node(op, [self.cur, self.const(self.weights([C])), self.const(self.weights([C]))])
        elif kind == "reduce":
            op = d(st.sampled_from(["ReduceMean", "ReduceSum", "ReduceMax", "ReduceSumSquare", "ReduceL2",
                                    "ReduceL1", "ReduceLogSumExp"]))
            axis = d(st.integers(1, len(self.shape) - 1))
            self.node(op, [self.cur, self.const(np.array([axis], np.int64))], keepdims=1)
            self.inits[-1] = nh.from_array(np.array([axis], np.int64), self.inits[-1].name)
            self.shape[axis] = 1
        elif kind == "move" and len(self.shape) == 4:
            perm = list(d(st.permutations([1, 2, 3])))
            t = self.node("Transpose", [self.cur], perm=[0] + perm)
            c = self.weights([1, 1, 1, self.shape[1 + perm[2] - 1]])  # a per-last-axis constant after the move
            self.node("Mul", [t, self.const(c)])
            self.node("Transpose", [self.cur], perm=[0] + [perm.index(i) + 1 for i in (1, 2, 3)])
        elif kind == "matmul":
            n = d(st.integers(1, 6))
            w = self.weights([n, self.shape[-1]]).T.copy()
            self.node("MatMul", [self.cur, self.const(w)])
            self.shape[-1] = n
        elif kind == "clip":
            lo = d(st.sampled_from([None, -1.0, 0.0]))
            hi = d(st.sampled_from([None, 1.0, 6.0]))
            self.node("Clip", [self.cur, self.const(lo) if lo is not None else "",
                               self.const(hi) if hi is not None else ""])
        elif kind == "pow":
            e = d(st.sampled_from([2.0, 3.0, -2.0, 0.5, 1.5]))
            src = self.cur
            if e in (0.5, 1.5):
                src = self.node("Abs", [src])
            self.node("Pow", [src, self.const(e)])


@st.composite
def cases(draw):
    shape = draw(st.sampled_from([[1, 3, 5, 5], [1, 2, 4, 4], [2, 3, 6]]))
    b = Builder(draw, shape)
    for _ in range(draw(st.integers(1, 4))):
        b.step()
    box = draw(st.sampled_from([(-3.0, 3.0), (0.0, 1.0), (-0.1, 0.1), (2.0, 2.0), (-50.0, 50.0), (1000.0, 1000.5),
                                (-1e-3, 0.0)]))
    return b, box, draw(st.integers(0, 2 ** 16))


def _points(shape, lo, hi, seed, n=24):
    lo32, hi32 = np.float32(lo), np.float32(hi)   # the bounds as a float32 input holds them (0.1: a little above)
    rng = np.random.default_rng(seed)
    pts = [np.full(shape, lo32), np.full(shape, hi32)]
    for _ in range(6):   # random corners
        pts.append(np.where(rng.random(shape) < 0.5, lo32, hi32))
    while len(pts) < n:
        pts.append((lo32 + (hi32 - lo32) * rng.random(shape)).astype(np.float32))
    return [np.clip(p, lo32, hi32).astype(np.float32) for p in pts]


def check_sound(model, box, seed, shape):
    g = Pipeline.from_onnx(model).optimize().graph
    r = analyze(g, declared_ranges({"x": box}, ["x"]))
    names = {id(v): v.name for v in g.values()}
    ranges = {names[k]: iv for k, iv in r.items() if k in names}
    m = export_model(g)
    have = {o.name for o in m.graph.output}
    for n in m.graph.node:
        for o in n.output:
            if o in ranges and o not in have:
                m.graph.output.append(h.make_tensor_value_info(o, T.FLOAT, None))
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = [o.name for o in sess.get_outputs()]
    for x in _points(shape, *box, seed):
        with np.errstate(all="ignore"):
            vals = sess.run(None, {"x": x})
        for name, val in zip(outs, vals):
            if name not in ranges:
                continue
            iv = ranges[name]
            val = np.asarray(val, np.float64)
            graph = "; ".join(f"{n.op_type}({', '.join(n.input)}) -> {n.output[0]}" for n in model.graph.node)
            try:
                lo, hi = np.broadcast_to(iv.lo, val.shape), np.broadcast_to(iv.hi, val.shape)
            except ValueError:
                raise AssertionError(f"{name}: interval of shape {iv.lo.shape} for a tensor {val.shape}; graph: "
                                     f"{graph}") from None
            unknown = np.isneginf(lo) & np.isposinf(hi)
            ok = ((val >= lo) & (val <= hi)) | unknown
            if not ok.all():
                bad = np.argwhere(~ok)[0]
                raise AssertionError(f"{name}: value {val[tuple(bad)]!r} at {tuple(bad)} outside "
                                     f"[{lo[tuple(bad)]!r}, {hi[tuple(bad)]!r}] for x in {box}; graph: {graph}")


def build(b: Builder):
    nodes = b.nodes + [h.make_node("Identity", [b.cur], ["y"])]
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info("x", T.FLOAT, None)],
                     [h.make_tensor_value_info("y", T.FLOAT, None)], b.inits)
    g.input[0].CopyFrom(h.make_tensor_value_info("x", T.FLOAT, b.x_shape))
    return h.make_model(g, opset_imports=[h.make_opsetid("", 20)])


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_every_intermediate_lies_in_its_certified_interval(case):
    b, box, seed = case
    check_sound(build(b), box, seed, b.x_shape)
