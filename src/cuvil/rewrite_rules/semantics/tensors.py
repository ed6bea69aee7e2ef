"""Symbolic tensors (numpy object arrays of Z3 terms) and the helpers every family's semantics share:
elementwise mapping with broadcasting, attribute values, left-to-right sums and folds, reductions.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np
import z3

from ...errors import UnsupportedOpError
from .domains import Domain

def _empty(shape) -> np.ndarray:
    return np.empty(tuple(shape), dtype=object)


def symbolic(dom: Domain, name: str, shape: Sequence[int], kind: str = "float") -> np.ndarray:
    """A tensor of fresh variables ``name[i,j,...]`` (kind "float" or "bool")."""
    out = _empty(shape)
    mk = dom.var if kind == "float" else dom.bool_var
    for idx in np.ndindex(*out.shape):
        out[idx] = mk(name + ("[" + ",".join(map(str, idx)) + "]" if idx else ""))
    return out


def constant_tensor(dom: Domain, values) -> np.ndarray:
    """A tensor of literals from concrete values (floats, or bools)."""
    return _lift(dom, np.asarray(values))


def tensors_equal(dom: Domain, a: np.ndarray, b: np.ndarray) -> z3.BoolRef:
    """Both tensors have the same shape and every element is equal in ``dom``'s sense."""
    a, b = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
    if a.shape != b.shape:
        return z3.BoolVal(False)
    return z3.And([dom.equal(a[i], b[i]) for i in np.ndindex(*a.shape)] or [z3.BoolVal(True)])


def element_equalities(dom: Domain, a: np.ndarray, b: np.ndarray) -> List[z3.BoolRef]:
    """One equality per element (shapes must match). Checking each on its own is much faster than the
    conjunction for nonlinear real obligations (e.g. Conv+BatchNormalization folding)."""
    a, b = np.asarray(a, dtype=object), np.asarray(b, dtype=object)
    if a.shape != b.shape:
        return [z3.BoolVal(False)]
    return [dom.equal(a[i], b[i]) for i in np.ndindex(*a.shape)]


def _lift(dom: Domain, a) -> Optional[np.ndarray]:
    """An operand tensor as an object array of Z3 expressions (numbers become literals)."""
    if a is None:
        return None
    if isinstance(a, z3.ExprRef):
        out = _empty(())
        out[()] = a
        return out
    a = np.asarray(a) if not isinstance(a, np.ndarray) else a
    if a.dtype == object and all(isinstance(v, z3.ExprRef) for v in a.reshape(-1)):
        return a
    out = _empty(a.shape)
    for idx in np.ndindex(*a.shape):
        out[idx] = dom.lift(a[idx])
    return out


def _map(fn: Callable, *arrays) -> np.ndarray:
    """Elementwise ``fn`` with numpy broadcasting over object arrays."""
    arrs = [np.asarray(a, dtype=object) if not isinstance(a, np.ndarray) else a for a in arrays]
    try:
        shape = np.broadcast_shapes(*(a.shape for a in arrs))
    except ValueError as e:
        raise UnsupportedOpError("elementwise", detail=f"shapes do not broadcast: {e}") from None
    bs = [np.broadcast_to(a, shape) for a in arrs]
    out = _empty(shape)
    for idx in np.ndindex(*shape):
        out[idx] = fn(*(b[idx] for b in bs))
    return out


def _scalar_attr(dom: Domain, v):
    """A float attribute (Python number, Z3 expression or 1-element array) as a Z3 expression."""
    if isinstance(v, (list, tuple)):
        if len(v) != 1:
            raise UnsupportedOpError("attribute", detail=f"expected a scalar, got {v!r}")
        v = v[0]
    if isinstance(v, np.ndarray):
        if v.size != 1:
            raise UnsupportedOpError("attribute", detail=f"expected a scalar, got shape {v.shape}")
        v = v.reshape(-1)[0]
    return dom.lift(v)


def _py_number(v):
    """``v`` as a Python number when it is concrete, else None (symbolic)."""
    if isinstance(v, np.ndarray):
        v = v.reshape(-1)[0] if v.size == 1 else None
    if isinstance(v, (list, tuple)) and len(v) == 1:
        v = v[0]
    if isinstance(v, (bool, int, float, np.number, np.bool_)):
        return v
    return None


def _py_bool(v) -> Optional[bool]:
    """A concrete truth value (Python, numpy or a Z3 literal), or None when symbolic."""
    if isinstance(v, np.ndarray):
        v = v.reshape(-1)[0]
    if isinstance(v, z3.ExprRef):
        s = z3.simplify(v)
        if z3.is_true(s):
            return True
        if z3.is_false(s):
            return False
        if z3.is_fp_value(s):
            return not s.isZero()
        if z3.is_rational_value(s):
            return s.numerator_as_long() != 0
        return None
    return bool(v)


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _ints(v) -> Optional[List[int]]:
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        v = v.reshape(-1).tolist()
    elif not isinstance(v, (list, tuple)):
        v = [v]
    out = []
    for x in v:
        if isinstance(x, z3.ExprRef):
            x = z3.simplify(x)
            if z3.is_int_value(x):
                x = x.as_long()
            elif z3.is_bv_value(x):
                x = x.as_signed_long()
            elif z3.is_rational_value(x) and x.denominator_as_long() == 1:
                x = x.numerator_as_long()
            elif z3.is_fp_value(x) and not x.isNaN() and not x.isInf():
                r = z3.simplify(z3.fpToReal(x))
                if r.denominator_as_long() != 1:
                    raise UnsupportedOpError("attribute", detail=f"index {x} is not an integer")
                x = r.numerator_as_long()
            else:
                raise UnsupportedOpError("attribute", detail=f"integer value {x} must be concrete")
        out.append(int(x))
    return out


def _axis(a: int, rank: int) -> int:
    if not -rank <= a < max(rank, 1):
        raise UnsupportedOpError("axis", detail=f"axis {a} out of range for rank {rank}")
    return a + rank if a < 0 else a


def _unsupported(op: str, detail: str):
    raise UnsupportedOpError(op, detail=detail)


def _sum(dom: Domain, terms: Sequence):
    """Left-to-right sum, starting from the first term."""
    if not terms:
        return dom.const(0.0)
    acc = terms[0]
    for t in terms[1:]:
        acc = dom.add(acc, t)
    return acc


def _fold(fn, terms: Sequence):
    acc = terms[0]
    for t in terms[1:]:
        acc = fn(acc, t)
    return acc


def _nout(attrs, default: int = 1) -> int:
    n = attrs.get("_num_outputs")
    return default if n is None else int(n)


def _reduce(x, axes, keepdims, fold):
    """Fold over ``axes`` (row-major order of the reduced elements)."""
    axes = sorted(set(axes))
    kept = [i for i in range(x.ndim) if i not in axes]
    t = np.transpose(x, kept + axes).reshape([x.shape[i] for i in kept] + [-1])
    out = _empty(t.shape[:-1])
    for idx in np.ndindex(*out.shape):
        if t.shape[-1] == 0:
            raise UnsupportedOpError("Reduce", detail="empty reduction")
        out[idx] = fold(list(t[idx]))
    if keepdims:
        out = out.reshape([1 if i in axes else d for i, d in enumerate(x.shape)])
    return out
