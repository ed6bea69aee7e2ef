"""Cuvil's shape inference for one node beside onnx.shape_inference on the same node (the per-op tests in
tests/test_ops_*.py sweep every op through :func:`assert_agrees`)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..ir import DType, Graph, TensorType, parse_dim
from ..ir.registry import lookup


def _dim_proto(d):
    return d if isinstance(d, int) else str(d)


def onnx_infer(op, inputs, attrs=None, consts=None, num_outputs=1, opset=21):
    """Output (dtype, shape) from onnx's strict shape inference; ``inputs`` = [(DType, shape) or None]."""
    consts = consts or {}
    names, vis, inits = [], [], []
    for i, t in enumerate(inputs):
        if t is None and i not in consts:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if i in consts:
            inits.append(numpy_helper.from_array(np.asarray(consts[i]), name))
        else:
            dt, shape = t
            vis.append(helper.make_tensor_value_info(name, int(dt), [_dim_proto(d) for d in shape]))
    outs = [f"out{j}" for j in range(num_outputs)]
    node = helper.make_node(op, names, outs, **(attrs or {}))
    g = helper.make_graph([node], "g", vis, [helper.make_tensor_value_info(o, 0, None) for o in outs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    res = []
    for o in m.graph.output:
        tt = o.type.tensor_type
        shape = None if not tt.HasField("shape") else tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        res.append((DType(tt.elem_type), shape))
    return res


def cuvil_infer(op, inputs, attrs=None, consts=None, num_outputs=1):
    """Output types from Cuvil's registry, with constant inputs lifted into attributes as import does."""
    consts = consts or {}
    attrs = dict(attrs or {})
    g = Graph()
    opdef = lookup(op)
    lifted = opdef.lifted_names
    vals = []
    for i, t in enumerate(inputs):
        if i in consts:
            arr = np.asarray(consts[i])
            lift = [name for name, idx in lifted.items() if idx == i]
            if lift:
                attrs[lift[0]] = arr.item() if arr.ndim == 0 else arr.tolist()
                vals.append(None)
            else:
                vals.append(g.const(arr, f"c{i}"))
        elif t is None:
            vals.append(None)
        else:
            dt, shape = t
            vals.append(g.add_input(f"in{i}", TensorType(dt, [parse_dim(d) if isinstance(d, str) else d for d in shape])))
    while vals and vals[-1] is None:
        vals.pop()
    node = g.add_node(op, vals, attrs, num_outputs=num_outputs,
                      output_names=[f"out{j}" for j in range(num_outputs)])
    return [(o.type.dtype, o.type.shape) for o in node.outputs]


def assert_agrees(op, inputs, attrs=None, consts=None, num_outputs=1, opset=21):
    """Cuvil agrees with onnx wherever onnx knows a dim; where onnx has a symbol, so must Cuvil."""
    want = onnx_infer(op, inputs, attrs, consts, num_outputs, opset)
    got = cuvil_infer(op, inputs, attrs, consts, num_outputs)
    assert len(got) >= len(want), (got, want)
    for (wdt, wshape), (gdt, gshape) in zip(want, got):
        assert wdt == gdt, f"{op}: dtype {gdt.name} != onnx {wdt.name}"
        if wshape is None:
            continue
        assert gshape is not None and len(gshape) == len(wshape), f"{op}: shape {gshape} != onnx {wshape}"
        for w, gd in zip(wshape, gshape):
            if isinstance(w, int):
                assert gd == w, f"{op}: shape {gshape} != onnx {wshape}"
            elif isinstance(w, str):
                assert str(gd) == w or not isinstance(gd, int), f"{op}: shape {gshape} != onnx {wshape}"
    return got
