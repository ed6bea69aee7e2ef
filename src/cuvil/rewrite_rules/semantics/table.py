"""The table of op semantics: :func:`sem` registers an op's function (in the module of its family),
:func:`evaluate` runs one op.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ...errors import UnsupportedOpError
from ...ir.registry import attr_defaults
from .domains import Domain
from .tensors import _lift, _map

# Part of the proof-cache key: bump whenever any op's semantics change.
SEMANTICS_VERSION = "2"

Sem = Callable[[Domain, List[Optional[np.ndarray]], Dict[str, Any]], List[np.ndarray]]
SEMANTICS: Dict[str, Sem] = {}


def sem(*names: str):
    """Decorator: ``fn(dom, inputs, attrs) -> outputs`` is the semantics of ops ``names``."""

    def deco(fn):
        for n in names:
            SEMANTICS[n] = fn
        return fn
    return deco


def evaluate(dom: Domain, op: str, inputs: Sequence[Optional[np.ndarray]], attrs: Optional[Dict[str, Any]] = None,
             num_outputs: Optional[int] = None) -> List[np.ndarray]:
    """Outputs of ``op`` on ``inputs`` (object arrays of Z3 expressions; None for an absent optional input).

    ``attrs`` is the node's attributes in canonical form (lifted inputs as attributes); missing ones take
    ONNX's opset-21 defaults. ``num_outputs`` (or attrs["_num_outputs"]) is how many outputs the node has;
    by default 1 (Split: as many as its split/num_outputs attributes say). Side conditions and axioms are
    appended to ``dom.side`` / ``dom.axioms``.
    """
    fn = SEMANTICS.get(op)
    if fn is None:
        raise UnsupportedOpError(op, detail="no Z3 semantics")
    full = dict(attr_defaults(op))
    full.update({k: v for k, v in (attrs or {}).items() if v is not None or k not in full})
    if num_outputs is not None:
        full["_num_outputs"] = num_outputs
    ins = list(inputs)
    while ins and ins[-1] is None:
        ins.pop()
    outs = fn(dom, ins, full)
    return list(outs)


def _in(dom, inputs, i):
    return _lift(dom, inputs[i]) if i < len(inputs) and inputs[i] is not None else None


def _unary(fn):
    def run(dom, inputs, attrs):
        return [_map(lambda x: fn(dom, x, attrs), _in(dom, inputs, 0))]
    return run


def _binary(fn):
    def run(dom, inputs, attrs):
        return [_map(lambda a, b: fn(dom, a, b), _in(dom, inputs, 0), _in(dom, inputs, 1))]
    return run
