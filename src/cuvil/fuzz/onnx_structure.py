"""Structure-level mutations of valid seed models: nodes dropped, duplicated or reordered, values renamed
or left dangling, attributes of the wrong type or odd values, dtypes swapped, odd dims (0, -1, huge,
unknown), cycles, duplicate names, other opsets, sparse initializers, external data references, deep
chains in either order."""
from __future__ import annotations

from typing import Tuple

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from .corpus import seed_model, seed_models
from .oracle import check_model
from .report import FamilyReport
from .sandbox import run_cases

NAME = "onnx_structure"
TIMEOUT_S = 30.0

_OPS = ("Relu", "Neg", "Abs", "Add", "Mul", "Sub", "Div", "MatMul", "Transpose", "Reshape", "Concat", "Slice",
        "Gather", "Squeeze", "Unsqueeze", "Softmax", "ReduceSum", "Conv", "MaxPool", "Cast", "Where", "Expand",
        "Tile", "Range", "ConstantOfShape", "Einsum", "GatherElements", "Pad", "Split", "TopK", "Flatten", "Identity",
        "Resize", "CumSum", "OneHot", "Trilu", "NoSuchOp", "Shape", "Size", "Sqrt", "Pow", "Clip", "Gemm")
_DTYPES = (0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 16, 17, 23, 99)
_ODD_INTS = (0, -1, 1, 2, 3, -2, 7, 1 << 31, -(1 << 40), 1 << 62)


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _names(m):
    out = [i.name for i in m.graph.input] + [t.name for t in m.graph.initializer]
    return out + [o for n in m.graph.node for o in n.output]


def drop_node(m, rng):
    if m.graph.node:
        del m.graph.node[int(rng.integers(len(m.graph.node)))]


def duplicate_node(m, rng):
    if m.graph.node:
        n = _pick(rng, m.graph.node)
        m.graph.node.insert(int(rng.integers(len(m.graph.node) + 1)), n)


def reorder_nodes(m, rng):
    nodes = list(m.graph.node)
    order = rng.permutation(len(nodes)) if rng.random() < 0.5 else np.arange(len(nodes))[::-1]
    del m.graph.node[:]
    m.graph.node.extend(nodes[k] for k in order)


def rename_value(m, rng):
    names = _names(m)
    if not names:
        return
    old, new = _pick(rng, names), _pick(rng, names + ["fresh", ""])
    for n in m.graph.node:
        for seq in (n.input, n.output):
            for k, name in enumerate(seq):
                if name == old and rng.random() < 0.7:
                    seq[k] = new


def dangling_input(m, rng):
    if m.graph.node:
        n = _pick(rng, m.graph.node)
        if n.input:
            n.input[int(rng.integers(len(n.input)))] = "nowhere"
        else:
            n.input.append("nowhere")


def _random_attr(name, rng):
    kind = int(rng.integers(7))
    if kind == 0:
        return h.make_attribute(name, int(_pick(rng, _ODD_INTS)))
    if kind == 1:
        return h.make_attribute(name, float(rng.choice([0.0, -1.5, 1e30, np.nan, np.inf])))
    if kind == 2:
        return h.make_attribute(name, _pick(rng, ["", "abc", "NOTSET", "SAME_UPPER", "linear", "ij->ji", "i,i->"]))
    if kind == 3:
        return h.make_attribute(name, [int(_pick(rng, _ODD_INTS)) for _ in range(int(rng.integers(0, 6)))])
    if kind == 4:
        return h.make_attribute(name, [float(x) for x in rng.standard_normal(int(rng.integers(1, 4)))])
    if kind == 5:
        return h.make_attribute(name, nh.from_array(rng.standard_normal(int(rng.integers(0, 3))).astype(np.float32)))
    return h.make_attribute(name, ["a", "b"])


def attribute_chaos(m, rng):
    if not m.graph.node:
        return
    n = _pick(rng, m.graph.node)
    try:
        schema = onnx.defs.get_schema(n.op_type, 17, "")
        names = list(schema.attributes) or ["axis"]
    except onnx.defs.SchemaError:
        names = ["axis"]
    name = _pick(rng, names)
    for k, a in enumerate(n.attribute):
        if a.name == name:
            del n.attribute[k]
            break
    if rng.random() < 0.85:
        n.attribute.append(_random_attr(name, rng))


def swap_dtype(m, rng):
    g = m.graph
    pool = list(g.input) + list(g.output) + list(g.initializer)
    if not pool:
        return
    t = _pick(rng, pool)
    code = int(_pick(rng, _DTYPES))
    if isinstance(t, onnx.TensorProto):
        t.data_type = code
    else:
        t.type.tensor_type.elem_type = code


def odd_dims(m, rng):
    vis = list(m.graph.input) + list(m.graph.output)
    if not vis:
        return
    vi = _pick(rng, vis)
    shape = vi.type.tensor_type.shape
    if not shape.dim or rng.random() < 0.2:
        shape.dim.add()
    d = _pick(rng, shape.dim)
    choice = int(rng.integers(6))
    if choice == 0:
        d.dim_value = 0
    elif choice == 1:
        d.dim_value = -1
    elif choice == 2:
        d.dim_value = 1 << int(rng.integers(20, 62))
    elif choice == 3:
        d.dim_param = _pick(rng, ["?", "N", "batch size", "2*N", ""])
    elif choice == 4:
        d.Clear()
    else:
        vi.type.tensor_type.ClearField("shape")


def make_cycle(m, rng):
    nodes = m.graph.node
    if len(nodes) >= 2:
        a, b = sorted(int(x) for x in rng.choice(len(nodes), 2, replace=False))
        if nodes[a].input and nodes[b].output:
            nodes[a].input[0] = nodes[b].output[0]


def duplicate_names(m, rng):
    g = m.graph
    if g.initializer and rng.random() < 0.5:
        g.initializer.append(_pick(rng, g.initializer))
    elif len(g.node) >= 2:
        a, b = rng.choice(len(g.node), 2, replace=False)
        g.node[int(b)].output[0] = g.node[int(a)].output[0]


def change_opset(m, rng):
    m.opset_import[0].version = int(rng.integers(1, 26))
    if rng.random() < 0.2:
        m.opset_import.append(h.make_opsetid(_pick(rng, ["", "ai.onnx", "com.microsoft", "x"]), int(rng.integers(1, 3))))


def sparsify(m, rng):
    g = m.graph
    inits = [t for t in g.initializer if t.data_type == T.FLOAT]
    if not inits:
        return
    t = _pick(rng, inits)
    arr = nh.to_array(t)
    flat = arr.reshape(-1)
    nz = np.flatnonzero(rng.random(flat.size) < 0.5)
    vals = nh.from_array(flat[nz].astype(np.float32), t.name)
    if rng.random() < 0.5 or arr.ndim == 0:
        idx = nz.astype(np.int64)
    else:
        idx = np.stack(np.unravel_index(nz, arr.shape), axis=1).astype(np.int64)
    if rng.random() < 0.2 and idx.size:  # out of range, or misshaped
        idx = idx + int(rng.choice([flat.size, -flat.size - 1])) if rng.random() < 0.5 else idx.reshape(-1)[:-1]
    g.initializer.remove(t)
    g.sparse_initializer.append(h.make_sparse_tensor(vals, nh.from_array(idx, t.name + "_idx"), list(arr.shape)))


def external_ref(m, rng):
    g = m.graph
    if not g.initializer:
        return
    t = _pick(rng, g.initializer)
    t.ClearField("raw_data")
    t.data_location = T.EXTERNAL
    for k, v in (("location", _pick(rng, ["../../etc/passwd", "/etc/passwd", "w.bin", "", "\x00"])),
                 ("offset", str(int(_pick(rng, _ODD_INTS)))), ("length", str(int(_pick(rng, _ODD_INTS))))):
        if k == "location" or rng.random() < 0.5:
            e = t.external_data.add()
            e.key, e.value = k, v


def deep_chain(m, rng):
    g = m.graph
    if not g.output:
        return
    out = g.output[0].name
    producer = next((n for n in g.node if out in n.output), None)
    if producer is None:
        return
    n = int(rng.integers(200, 1500))
    tmp = out + "_pre"
    producer.output[list(producer.output).index(out)] = tmp
    op = _pick(rng, ["Identity", "Relu", "Neg", "Abs"])
    chain = [h.make_node(op, [tmp if k == 0 else f"{tmp}{k}"], [out if k == n - 1 else f"{tmp}{k + 1}"])
             for k in range(n)]
    g.node.extend(chain[::-1] if rng.random() < 0.5 else chain)


def new_node(m, rng):
    names = _names(m) or ["x"]
    op = _pick(rng, _OPS)
    ins = [_pick(rng, names) for _ in range(int(rng.integers(1, 4)))]
    out = m.graph.output[0].name if m.graph.output and rng.random() < 0.5 else "extra"
    n = h.make_node(op, ins, [out])
    if rng.random() < 0.5:
        attribute_chaos_node(n, rng)
    m.graph.node.insert(int(rng.integers(len(m.graph.node) + 1)), n)


def attribute_chaos_node(n, rng):
    try:
        names = list(onnx.defs.get_schema(n.op_type, 17, "").attributes)
    except onnx.defs.SchemaError:
        names = []
    if names:
        n.attribute.append(_random_attr(_pick(rng, names), rng))


def change_op(m, rng):
    if m.graph.node:
        _pick(rng, m.graph.node).op_type = _pick(rng, _OPS)


def const_tensor(m, rng):
    """An initializer of odd contents: strings, empty, huge claimed dims, wrong raw length, a scalar."""
    g = m.graph
    if not g.initializer:
        return
    k = int(rng.integers(len(g.initializer)))
    old = g.initializer[k]
    kind = int(rng.integers(4))
    if kind == 0:
        new = h.make_tensor(old.name, T.STRING, [2], [b"a", b"b"])
    elif kind == 1:
        new = T(name=old.name, data_type=old.data_type or T.FLOAT, dims=[1 << int(rng.integers(16, 40)), 4])
        new.raw_data = b"\0" * int(rng.integers(0, 64))
    elif kind == 2:
        new = nh.from_array(np.zeros((0,) + tuple(old.dims[1:]), np.float32), old.name)
    else:
        new = T(name=old.name, data_type=old.data_type, dims=old.dims)
        new.raw_data = old.raw_data[: max(0, len(old.raw_data) - int(rng.integers(1, 9)))] if old.raw_data else b"\1"
    g.initializer[k].CopyFrom(new)


MUTATIONS = (drop_node, duplicate_node, reorder_nodes, rename_value, dangling_input, attribute_chaos, attribute_chaos,
             attribute_chaos, swap_dtype, odd_dims, odd_dims, make_cycle, duplicate_names, change_opset, sparsify,
             sparsify, external_ref, deep_chain, new_node, new_node, change_op, const_tensor)


def mutate(seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    m = seed_model(rng)
    for _ in range(int(rng.integers(1, 4))):
        MUTATIONS[int(rng.integers(len(MUTATIONS)))](m, rng)
    return m


def case(seed: int) -> Tuple[str, str]:
    try:
        m = mutate(seed)
        data = m.SerializeToString()
    except Exception as e:  # noqa: BLE001 - a mutation protobuf itself refuses is no case
        return "clean-error", f"mutation not serializable: {type(e).__name__}"
    return check_model(data, seed)


def run(budget: int, seed: int, *, timeout_s: float = TIMEOUT_S, progress=None) -> FamilyReport:
    seed_models()
    return run_cases(NAME, case, budget, seed, timeout_s, progress)
