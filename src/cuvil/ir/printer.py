"""A readable text form of a graph: one line per node with types, used by golden tests and ``--ir``.

    graph main(%x: f32[N,3,8,8]) -> (%y: f32[N,4,8,8]) {
      %w: f32[4,3,3,3] = const <432 bytes, sha 1a2b3c4d>
      %y: f32[N,4,8,8] = Conv(%x, %w) {kernel_shape=[3,3], pads=[1,1,1,1]}
      return %y
    }
"""
from __future__ import annotations

import numpy as np

from .digest import array_digest
from .graph import Graph, Value

INLINE_ELEMENTS = 8


def format_const(arr: np.ndarray) -> str:
    if arr.size <= INLINE_ELEMENTS:
        vals = ", ".join(_num(x) for x in arr.reshape(-1).tolist())
        return f"const [{vals}]" if arr.ndim else f"const {vals}"
    digest = array_digest(arr)[:8]
    return f"const <{arr.nbytes} bytes, sha {digest}>"


def _num(x) -> str:
    if isinstance(x, float):
        return repr(float(np.float32(x))) if np.isfinite(x) else str(x)
    return str(x)


def format_attr(v) -> str:
    if isinstance(v, np.ndarray):
        return format_const(v).replace("const ", "tensor ")
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(format_attr(x) for x in v) + "]"
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, float):
        return _num(v)
    return str(v)


def _ref(v: Value | None) -> str:
    return "_" if v is None else f"%{v.name}"


def print_graph(g: Graph) -> str:
    ins = ", ".join(f"%{v.name}: {v.type}" for v in g.inputs)
    outs = ", ".join(f"%{name}: {v.type}" for v, name in zip(g.outputs, g.output_names))
    lines = [f"graph {g.name}({ins}) -> ({outs}) {{"]
    for s in sorted(g.symbols.values(), key=lambda s: s.name):
        if any(s.name in v.type.free_symbols for v in g.inputs):
            lines.append(f"  symbol {s.name} in [{s.min}, {s.max}]")
    seen = set()
    for n in g.nodes:
        for v in n.inputs:
            if v is not None and v.is_const and id(v) not in seen:
                seen.add(id(v))
                lines.append(f"  %{v.name}: {v.type} = {format_const(v.const)}")
        outs_ = ", ".join(f"%{o.name}: {o.type}" for o in n.outputs)
        args = ", ".join(_ref(v) for v in n.inputs)
        attrs = ", ".join(f"{k}={format_attr(a)}" for k, a in sorted(n.attrs.items()) if not k.startswith("_"))
        lines.append(f"  {outs_} = {n.op}({args})" + (f" {{{attrs}}}" if attrs else ""))
    for v in g.outputs:
        if v.is_const and id(v) not in seen:
            seen.add(id(v))
            lines.append(f"  %{v.name}: {v.type} = {format_const(v.const)}")
    lines.append("  return " + ", ".join(
        f"%{v.name}" + (f" as {name}" if name != v.name else "") for v, name in zip(g.outputs, g.output_names)))
    lines.append("}")
    return "\n".join(lines) + "\n"
