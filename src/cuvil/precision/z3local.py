"""Z3 where intervals are too loose: a flagged value's elementwise cone encoded over the reals.

Interval arithmetic forgets that two operands are the same tensor (``x·x``, ``x + 0.044715·x³``,
``x / (1 + |x|)``) and so can exceed a format's range where no input does. :func:`local_check` encodes the value's
*elementwise cone*: its producer and, recursively (up to ``depth``), the producers of its operands as long as they
are elementwise ops, with one real variable per tensor (an elementwise cone computes each element from the same
position of its inputs, so one scalar per tensor is exact, broadcasting included). The cone's leaves are the
graph inputs (bounded by the declared box), scalar constants (their value), and every other tensor (bounded by its
certified interval, per element hulled). Then it asks Z3 whether ``|y| > limit`` is possible:

* ``unsat``: no assignment of the leaves within their bounds reaches it: the value is certified within ±limit
  (method "Z3, local"); sound because every leaf's bound is;
* ``sat``: a candidate. Where every leaf of the cone is a graph input or a constant, the model is turned into a
  full input (each input filled with its value) for the caller to confirm by running the model; otherwise the
  leaves' intervals may be the over-approximation and the candidate stays unconfirmed;
* ``unknown`` (or the rlimit hit): nothing is concluded.

LayerNormalization's centred square gets its own exact encoding: ``x_i - mean = (N-1)/N·(x_i - m)`` with ``m``
the mean of the other N-1 elements, which ranges over the same box as ``x_i``.
"""
from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple

import attrs
import numpy as np

from ..ir.graph import Graph, Node, Value
from .interval import Interval
from .ranges import is_float

ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "Max", "Min", "Pow", "Sqrt", "Clip",
                         "Reciprocal", "Tanh", "Erf", "Sigmoid", "Exp", "Identity", "Cast", "LeakyRelu"})
#: Ops encoded as a fresh variable within the rule's interval and the sign of their input (monotone, odd).
_BOUNDED_ODD = frozenset({"Tanh", "Erf"})


@attrs.frozen
class LocalResult:
    status: str                      # "unsat" (certified within ±limit), "sat", "unknown", "not encodable"
    detail: str
    inputs: Optional[Dict[str, float]] = None   # graph input name -> value, for a sat over graph inputs only
    value: Optional[float] = None


def _bounded(z3, s, var, iv: Interval):
    if np.isfinite(iv.min):
        s.add(var >= z3.RealVal(repr(float(iv.min))))
    if np.isfinite(iv.max):
        s.add(var <= z3.RealVal(repr(float(iv.max))))


def local_check(graph: Graph, value: Value, ranges: Mapping[int, Interval], box: Mapping[str, Interval],
                limit: float, depth: int = 6, rlimit: int = 2_000_000, internal: str = "",
                node: Optional[Node] = None) -> LocalResult:
    import z3
    s = z3.Solver()
    s.set("rlimit", rlimit)
    memo: Dict[int, object] = {}
    leaves: Dict[str, object] = {}
    only_inputs = [True]
    input_names = {v.name for v in graph.inputs}

    def leaf(v: Value):
        x = z3.Real(f"leaf_{len(memo)}")
        iv = box.get(v.name) if v.name in input_names else ranges.get(id(v))
        if iv is None:
            return None
        if v.name in input_names:
            leaves[v.name] = x
        else:
            only_inputs[0] = False
        _bounded(z3, s, x, iv.hull())
        return x

    def enc(v: Value, d: int):
        if id(v) in memo:
            return memo[id(v)]
        if v.is_const:
            c = np.asarray(v.const, np.float64)
            if c.size and np.all(c == c.flat[0]) and np.isfinite(c.flat[0]):
                out = z3.RealVal(repr(float(c.flat[0])))
            else:
                out = z3.Real(f"const_{len(memo)}")
                only_inputs[0] = False
                _bounded(z3, s, out, Interval.exact(c).hull())
            memo[id(v)] = out
            return out
        n = v.producer
        if n is None or d <= 0 or n.op not in ELEMENTWISE:
            out = leaf(v)
        else:
            out = op(n, d)
        memo[id(v)] = out
        return out

    def op(n: Node, d: int):
        args = [enc(i, d - 1) if i is not None else None for i in n.inputs]
        if any(a is None for a, i in zip(args, n.inputs) if i is not None):
            return None
        a = args[0]
        b = args[1] if len(args) > 1 else None
        k = n.op
        if k in ("Identity", "Cast"):
            return a if is_float(n.outputs[0]) and is_float(n.inputs[0]) else None
        if k == "Add":
            return a + b
        if k == "Sub":
            return a - b
        if k == "Mul":
            return a * b
        if k in ("Div", "Reciprocal"):
            num, den = (a, b) if k == "Div" else (z3.RealVal(1), a)
            q = z3.Real(f"q_{len(memo)}_{id(n) % 997}")
            s.add(z3.Or(den == 0, q * den == num))   # a zero divisor (inf/nan in float) leaves q free: never certified
            return q
        if k == "Neg":
            return -a
        if k == "Abs":
            return z3.If(a >= 0, a, -a)
        if k == "Relu":
            return z3.If(a >= 0, a, 0)
        if k == "LeakyRelu":
            return z3.If(a >= 0, a, z3.RealVal(repr(float(n.attrs.get("alpha", 0.01)))) * a)
        if k == "Max":
            return z3.If(a >= b, a, b)
        if k == "Min":
            return z3.If(a <= b, a, b)
        if k == "Pow":
            e = n.inputs[1]
            if e is not None and e.is_const and np.asarray(e.const).size == 1:
                ev = float(np.asarray(e.const).ravel()[0])
                if ev == int(ev) and 0 <= ev <= 8:
                    out = z3.RealVal(1)
                    for _ in range(int(ev)):
                        out = out * a
                    return out
            return None
        if k == "Sqrt":
            r = z3.Real(f"sqrt_{len(memo)}_{id(n) % 997}")
            s.add(z3.Or(a < 0, z3.And(r >= 0, r * r == a)))   # sqrt of a negative (nan) leaves r free
            return r
        if k == "Clip":
            lo = args[1] if len(args) > 1 and args[1] is not None else None
            hi = args[2] if len(args) > 2 and args[2] is not None else None
            out = a
            if lo is not None:
                out = z3.If(out < lo, lo, out)
            if hi is not None:
                out = z3.If(out > hi, hi, out)
            return out
        if k in _BOUNDED_ODD or k in ("Sigmoid", "Exp"):
            y = z3.Real(f"{k.lower()}_{len(memo)}_{id(n) % 997}")
            iv = ranges.get(id(n.outputs[0]))
            if iv is None:
                return None
            _bounded(z3, s, y, iv.hull())
            if k in _BOUNDED_ODD:   # odd, monotone, |f(x)| <= 1 and |f(x)| <= |x|·f'(0)
                s.add(z3.If(a >= 0, y >= 0, y <= 0), y <= 1, y >= -1)
            else:
                s.add(y > 0)
            return y
        return None

    if internal:
        if node is None or node.op != "LayerNormalization" or not internal.startswith("(x - mean)^2"):
            return LocalResult("not encodable", f"no Z3 encoding of {internal}")
        xv = node.inputs[0]
        iv = (box.get(xv.name) if xv.name in input_names else ranges.get(id(xv)))
        shape = xv.type.shape
        if iv is None or shape is None:
            return LocalResult("not encodable", "no range for the normalised input")
        axis = int(node.attrs.get("axis", -1)) % len(shape)
        count = 1
        for dim in shape[axis:]:
            if not isinstance(dim, (int, np.integer)):
                return LocalResult("not encodable", "symbolic normalised size")
            count *= int(dim)
        xi, m = z3.Real("x_i"), z3.Real("mean_rest")
        _bounded(z3, s, xi, iv.hull())
        _bounded(z3, s, m, iv.hull())
        f = z3.RealVal(f"{count - 1}/{count}")
        y = (f * (xi - m)) * (f * (xi - m))
        if xv.name in input_names:
            leaves.update({})   # a witness needs a vector, not one element: the search builds it
        only_inputs[0] = False
    else:
        y = enc(value, depth)
        if y is None:
            return LocalResult("not encodable", f"an op of the cone of {value.name} has no Z3 encoding")
    lim = z3.RealVal(repr(float(limit)))
    s.add(z3.Or(y > lim, y < -lim))
    r = s.check()
    if r == z3.unsat:
        return LocalResult("unsat", f"Z3 (local, {'LayerNorm centred square' if internal else 'elementwise cone'}): "
                                    f"no value of the leaves within their bounds gives |value| > {limit:.6g}")
    if r == z3.sat:
        mdl = s.model()
        val = _num(mdl.eval(y, model_completion=True))
        if only_inputs[0] and leaves:
            ins = {name: _num(mdl.eval(x, model_completion=True)) for name, x in leaves.items()}
            return LocalResult("sat", f"Z3 (local): candidate {ins} gives {val:.6g}", ins, val)
        return LocalResult("sat", f"Z3 (local): |value| {val:.6g} reachable from the leaves' intervals (not "
                                  "confirmed: those intervals may be loose)", None, val)
    return LocalResult("unknown", f"Z3 (local): {s.reason_unknown()}")


def _num(e) -> float:
    try:
        if hasattr(e, "as_fraction"):
            fr = e.as_fraction()
            return float(fr.numerator) / float(fr.denominator)
        return float(e.as_decimal(20).rstrip("?"))
    except Exception:
        return float("nan")
