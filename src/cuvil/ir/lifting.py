"""Canonical form: constant inputs at an op's lifted positions become attributes (and back, on export)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .graph import Graph, Node
from .registry import attr_defaults, lookup

def _is_window(node: Node) -> bool:
    """Window ops (the ``window`` trait): attributes whose unset meaning is "all zeros"/"all ones"/"from the
    weights" though ONNX gives no default."""
    return lookup(node.op, node=node.name, domain=node.domain).window


def lifted_value(arr: np.ndarray) -> Any:
    """The attribute form of a lifted constant: a scalar for 0-d arrays, else a (nested) list."""
    arr = np.asarray(arr)
    return arr.item() if arr.ndim == 0 else arr.tolist()


def lift_const_inputs(graph: Graph, node: Node) -> bool:
    """Move constant inputs at lifted positions into attributes; True if the node changed."""
    changed = False
    for name, idx, _kind in lookup(node.op).lifted:
        v = node.input(idx)
        if v is not None and v.is_const and name not in node.attrs:
            node.attrs[name] = lifted_value(v.const)
            graph.set_input(node, idx, None)
            changed = True
    while node.inputs and node.inputs[-1] is None:
        node.inputs.pop()
    return changed


def drop_default_attrs(node: Node) -> None:
    """Canonical form: an attribute equal to its unset meaning is removed, so patterns need not list it.

    Covers the schema defaults, and for windowed ops all-zero ``pads``, all-one ``strides``/``dilations``
    and a Conv ``kernel_shape`` equal to the weights' spatial dims.
    """
    defaults = attr_defaults(node.op)
    for name in list(node.attrs):
        if name in defaults and _same(node.attrs[name], defaults[name]):
            del node.attrs[name]
    if not _is_window(node):
        return
    for name, unit in (("pads", 0), ("strides", 1), ("dilations", 1), ("output_padding", 0)):
        val = node.attrs.get(name)
        if isinstance(val, list) and all(x == unit for x in val):
            del node.attrs[name]
    ks = node.attrs.get("kernel_shape")
    w = node.input(1)
    if ks is not None and node.op in ("Conv", "ConvTranspose", "ConvInteger") and w is not None \
            and w.shape is not None and list(w.shape[2:]) == list(ks):
        del node.attrs["kernel_shape"]
    if node.attrs.get("auto_pad") == "NOTSET":
        del node.attrs["auto_pad"]


def implicit_attr(node: Node, name: str):
    """The value an absent attribute stands for: its schema default, or for windowed ops the all-zero
    ``pads``, unit ``strides``/``dilations`` and the weights' ``kernel_shape`` that canonical form drops."""
    defaults = attr_defaults(node.op)
    if name in defaults:
        return defaults[name]
    if not _is_window(node):
        return None
    x = node.input(0)
    if x is None or x.shape is None or len(x.shape) < 3:
        return None
    k = len(x.shape) - 2
    unit = {"pads": [0] * (2 * k), "strides": [1] * k, "dilations": [1] * k}
    if name in unit:
        return unit[name]
    w = node.input(1)
    if name == "kernel_shape" and node.op in ("Conv", "ConvTranspose", "ConvInteger") and w is not None and w.shape:
        return list(w.shape[2:])
    return None


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return False
    if isinstance(a, float) or isinstance(b, float):
        return np.float32(a) == np.float32(b)
    return a == b
