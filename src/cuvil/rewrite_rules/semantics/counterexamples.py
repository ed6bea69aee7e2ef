"""Counterexample text, shared by the bounded and the generic prover."""
from __future__ import annotations

import math

import numpy as np
import z3

from .domains import Domain

def format_value(v) -> str:
    """A model value as a counterexample shows it: signed zeros, nan, float32 where it fits."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if v == 0:
            return "-0.0" if math.copysign(1, v) < 0 else "+0.0"
        return repr(float(np.float32(v))) if abs(v) < 1e38 or math.isinf(v) else repr(v)
    return str(v)


def first_difference(model, dom: "Domain", lhs: np.ndarray, rhs: np.ndarray) -> str:
    """``lhs[i] = a, rhs[i] = b`` at the first element where the model makes the two sides differ, else ''."""
    for idx in np.ndindex(*np.shape(lhs)):
        if not z3.is_true(model.eval(dom.equal(lhs[idx], rhs[idx]), model_completion=True)):
            at = f"[{','.join(map(str, idx))}]" if idx else ""
            return (f"lhs{at} = {format_value(dom.value_of(model, lhs[idx]))}, "
                    f"rhs{at} = {format_value(dom.value_of(model, rhs[idx]))}")
    return ""
