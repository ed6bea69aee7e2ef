"""The random-testing refuter: both sides of a rule run numerically on concrete instances, before Z3.

The oracle is independent of Cuvil's Z3 semantics: each instance (shapes and attributes, drawn by the
prover) is built as a graph holding the pattern and its replacement, exported to ONNX and run by
``onnx.reference`` (:func:`cuvil.reference.run_reference`). ``prove exact`` rules run in float32 and
are compared bit for bit (every NaN equal to every NaN, +0 and -0 different), on inputs full of IEEE
corner cases (+-0, +-inf, NaN, subnormals, huge and tiny magnitudes); ``prove real`` rules run in float64
on generic random reals and are compared with a tight relative tolerance, wherever the pattern's value
is finite. A difference is a counterexample naming the shapes, attributes, inputs and the differing
element; no difference proves nothing (the prover goes on to Z3).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import attrs
import numpy as np

from ..frontend.onnx_export import export_model
from ..ir.dtype import DType
from ..ir.graph import Graph, Value
from ..ir.registry import CUSTOM_DOMAIN
from ..reference import run_reference

# Relative tolerance of ``prove real`` comparisons (float64 evaluation of both sides): rounding in
# float64 stays many orders below it, a wrong rule many orders above.
REAL_RTOL = 1e-7
# Cuvil's own ops (Winograd) have float32 reference implementations, and a few real rules only type-check
# in float32: those are compared at float32's precision instead (a wrong rule still differs by orders more).
REAL_RTOL_F32 = 1e-4
DRAWS = 3  # input draws per instance

_SPECIAL32 = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, -3e-39, 3.4028235e38,
                       -3.4028235e38, 1e30, -1e30, 1e-30, 1.0, -1.0, 0.5, 3.0, 16777217.0], np.float32)


@attrs.frozen
class Sample:
    """A built instance: the graph, its pattern root and replacement, and how to describe it."""
    graph: Graph
    lhs: Value
    rhs: Value
    describe: str


def draw_values(rng: np.random.Generator, shape, dtype, exact: bool, draw: int, kind: str = "float") -> np.ndarray:
    """Input values: IEEE corner cases mixed into values of mixed magnitude (exact), or random reals."""
    if kind == "bool":
        return np.asarray(rng.random(shape) < 0.5)
    if not exact:
        return np.asarray(rng.standard_normal(shape) * rng.choice([1.0, 3.0]), dtype=dtype)
    mode = draw % 3
    if mode == 0:   # mixed magnitudes: sums round differently in another order
        v = rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)
    elif mode == 1:  # small integers, ties and signed zeros
        v = np.asarray(rng.integers(-3, 4, shape), dtype=np.float64)
        v[np.asarray(rng.random(shape) < 0.2)] = -0.0
    else:
        v = rng.standard_normal(shape)
    v = np.asarray(v, dtype=dtype)
    special = np.asarray(rng.random(shape) < (0.25 if mode == 2 else 0.08))
    if special.any():
        v[special] = rng.choice(_SPECIAL32, int(special.sum())).astype(dtype)
    return v


def _differs(a: np.ndarray, b: np.ndarray, exact: bool, rtol: float = REAL_RTOL) -> Optional[Tuple[int, ...]]:
    """The first index where ``a`` (pattern) and ``b`` (replacement) differ, or None."""
    if a.shape != b.shape:
        return ()
    if a.dtype.kind != "f" or b.dtype.kind != "f":
        bad = a != b
    elif exact:
        same = (a.view(f"u{a.itemsize}") == b.view(f"u{b.itemsize}")) if a.dtype == b.dtype else (a == b)
        bad = ~(same | (np.isnan(a) & np.isnan(b)))
    else:
        scale = max(1.0, float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0)))
        fin = np.isfinite(a)
        with np.errstate(invalid="ignore"):
            bad = fin & ~(np.abs(a - b) <= rtol * scale)
    idx = np.argwhere(bad)
    return tuple(int(i) for i in idx[0]) if len(idx) else None


def _show(arr: np.ndarray, limit: int = 6) -> str:
    flat = [_num(x) for x in np.asarray(arr).reshape(-1)[:limit]]
    if np.ndim(arr) == 0:
        return flat[0]
    return "[" + ", ".join(flat) + (", ..." if np.size(arr) > limit else "") + "]"


def _num(x) -> str:
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x)).lower()
    x = float(x)
    if x == 0:
        return "-0.0" if np.signbit(x) else "+0.0"
    return repr(x) if not np.isnan(x) else "nan"


def refute(samples: List[Sample], rng: np.random.Generator, exact: bool,
           kinds: Dict[str, str], elementwise: bool = False) -> Tuple[Optional[str], int]:
    """A counterexample over ``samples`` (None if none differs), and how many samples ran. For an
    elementwise rule (inputs of one vector shape) it shows the scalars of the differing element alone."""
    ran = 0
    for s in samples:
        try:
            model = export_model(s.graph)
        except Exception:  # an instance the exporter cannot express: the Z3 stage still checks the rule
            continue
        inputs = [v for v in s.graph.inputs]
        single = s.lhs.dtype != DType.DOUBLE or any(n.domain == CUSTOM_DOMAIN for n in s.graph.nodes)
        rtol = REAL_RTOL_F32 if single else REAL_RTOL
        for draw in range(DRAWS):
            feeds = {v.name: draw_values(rng, v.type.shape, v.dtype.numpy, exact, draw, kinds.get(v.name, "float"))
                     for v in inputs}
            try:
                lhs, rhs = run_reference(model, feeds)
            except Exception:  # an op onnx.reference lacks or rejects: inconclusive, never a counterexample
                break
            ran += 1
            lhs, rhs = np.asarray(lhs), np.asarray(rhs)
            at = _differs(lhs, rhs, exact, rtol)
            if at is not None and elementwise and lhs.shape == rhs.shape and at:
                vals = ", ".join(f"{k} = {_num(v[at])}" for k, v in feeds.items())
                consts = ", ".join(f"{c.name} = {_num(np.asarray(c.const).reshape(-1)[at[0]])}"
                                   for c in s.graph.constants() if c.name != "lit" and np.size(c.const) > at[0])
                return f"{vals}{', ' + consts if consts else ''}: lhs = {_num(lhs[at])}, rhs = {_num(rhs[at])}", ran
            if at is not None:
                where = (f"shapes differ: lhs {list(lhs.shape)}, rhs {list(rhs.shape)}" if lhs.shape != rhs.shape
                         else f"lhs[{','.join(map(str, at))}] = {_num(lhs[at])}, rhs[{','.join(map(str, at))}] = {_num(rhs[at])}")
                vals = ", ".join(f"{k} = {_show(v)}" for k, v in feeds.items())
                consts = ", ".join(f"{c.name} = {_show(c.const)}" for c in s.graph.constants() if c.name != "lit")
                return f"{s.describe}{' ' if s.describe else ''}{vals}{', ' + consts if consts else ''}: {where}", ran
    return None, ran

