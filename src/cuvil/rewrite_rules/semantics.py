"""Z3 semantics of ONNX ops over small concrete shapes, for proving rewrite rules.

A tensor here is a numpy array of dtype=object (0-d allowed) whose elements are Z3 expressions; its shape
is concrete. :func:`evaluate` computes an op's outputs from such inputs in one of two domains:

* :class:`FP32Domain` (``prove exact``): IEEE-754 binary32, round-nearest-even, NaN, +-0, +-inf and
  subnormals included (Z3 ``FPSort(8, 24)``). SMT-LIB has a single NaN, so NaN payloads and NaN signs are
  not distinguished: every NaN equals every NaN, while +0 and -0 differ (:meth:`Domain.equal`).
* :class:`RealDomain` (``prove real``): the reals. Operations undefined somewhere (x/0, Sqrt of a
  negative, Log of a non-positive) record definedness conditions in ``dom.side``; facts about the
  uninterpreted functions (sqrt(a) >= 0, exp(a) > 0 ...) go to ``dom.axioms``. ``dom.side`` holds each
  condition once (a condition already required by the left side is not appended again for the right);
  :meth:`Domain.mark` / :meth:`Domain.side_since` give one side's full list. Sqrt is an uninterpreted
  ``sqrt`` with sqrt(a) >= 0 and sqrt(a)^2 = a (for a >= 0); Exp, Log, Tanh, Erf ... are uninterpreted
  (exp > 0; tanh, erf in (-1, 1)); Floor/Ceil/Round are exact via ToInt (Round half-to-even); Pow with a
  literal integer exponent 0..4 is a product, otherwise uninterpreted; Softmax is exp(x) / sum(exp(x))
  and LogSoftmax is Log(Softmax(x)) (equal, over the reals, to the max-shifted function bodies).

Choices that matter for bit-exactness (FP32Domain):

* Transcendentals (Exp, Log, Tanh, Erf, Sin, Pow ...) are uninterpreted functions, one per op and domain,
  the same Z3 declaration on both sides of a rule, so only structural identities about them are provable.
  Composite ops are defined by their ONNX function bodies (opset 21) over those primitives: Sigmoid =
  1 / (1 + Exp(-x)), Softplus = Log(Exp(x) + 1), Elu, Selu, Gelu, HardSigmoid, HardSwish, Softmax =
  Exp(x - ReduceMax(x)) / ReduceSum(...), LogSoftmax = (x - max) - Log(ReduceSum(...)), LayerNormalization.
  "Exact" therefore means: bit for bit, given that each primitive is implemented once.
* Max / Min / Relu follow numpy's ``maximum`` / ``minimum`` on float32: a NaN in either argument gives NaN,
  and on ties (which includes -0 vs +0) the *second* argument is returned. Relu(x) is ONNX's function body
  Max(x, 0), i.e. ``np.maximum(x, 0)``, so Relu(-0.0) = +0.0 (as onnx.reference; onnxruntime's CPU kernel
  returns -0.0 here). Variadic Max/Min and ReduceMax/Min fold left: r = maximum(r, a_i).
* Clip follows numpy's clip with scalar bounds: NaN in x, min or max gives NaN; otherwise
  t = min if x < min else x; y = max if t > max else t (a tie keeps x, so Clip(-0.0, 0, 6) = -0.0).
  An absent bound is ONNX's default (the lowest / largest finite float32, as onnxruntime; the
  reference implementation leaves that side unbounded instead). In the real domain an absent bound is no bound.
* Sums (Sum, MatMul, Gemm, Conv, ReduceSum, pools) add left to right over the reduction index, in row-major
  order of the reduced axes (Conv: input channel, then kernel position), starting from the first term (not
  from +0, which would turn a -0 result into +0). Rules that reorder sums are therefore not provable
  exactly, which is right. Conv includes the products of padding zeros with weights (0 * inf = NaN), as
  convolving the zero-padded input (im2col) does; pools ignore padding.
* MaxPool skips NaNs (as onnx.reference and onnxruntime do when the window holds a number; an all-NaN
  window gives NaN), ties giving the later element; GlobalMaxPool and ReduceMax/Min propagate NaN like
  np.max. AveragePool propagates NaN (onnxruntime; onnx.reference skips NaNs there). The runtimes
  disagree among themselves on these corners (onnxruntime's MaxPool turns -inf into -FLT_MAX).
* Gemm is (A'B') * alpha + C * beta as onnx.reference computes it, with C skipped when beta == 0; alpha == 1
  and beta == 1 (exact identities) are not multiplied out.
* BatchNormalization (inference) is (x - mean) / Sqrt(var + eps) * scale + B in this order (the ONNX spec
  formula); InstanceNormalization is scale * (x - mean) / Sqrt(var + eps) + B with var the mean of squared
  deviations; LayerNormalization follows its function body (var = E[x^2] - E[x]^2, stash_type 1 only).
* LeakyRelu, PRelu, Elu, Selu use their bodies' Where(x < 0, ..., x): -0.0 passes through unchanged
  (onnx.reference's PRelu computes where(x > 0, x, x * slope) and differs in the sign of zeros).
* Sign(+-0) = +0, Sign(NaN) = NaN (np.sign); Round is half-to-even; Floor/Ceil round toward -inf/+inf.
* Dropout in inference is the identity (mask all True). In training mode every element gets a fresh
  symbolic Bool mask m: y = m ? x * (1 / (1 - ratio)) : 0 (ratio == 0 keeps everything), so removing a
  training-mode Dropout is refuted.

Public interface: :class:`FP32Domain`, :class:`RealDomain`, :func:`evaluate`, :data:`SEMANTICS`,
:func:`symbolic`, :func:`tensors_equal`, :func:`element_equalities`, :func:`constant_tensor`,
:data:`SEMANTICS_VERSION`.
"""
from __future__ import annotations

import abc
import itertools
import math
import struct
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import z3

from ..errors import UnsupportedOpError
from ..ir.registry import attr_defaults

# Part of the proof-cache key: bump whenever any op's semantics change.
SEMANTICS_VERSION = "2"

FP32 = z3.FPSort(8, 24)
_F32_MAX = float(np.finfo(np.float32).max)


# --- domains --------------------------------------------------------------------------------------

class Domain(abc.ABC):
    """Scalar operations on Z3 expressions, plus the side conditions and axioms they produce."""

    name: str = ""
    sort: z3.SortRef

    def __init__(self):
        self.side: List[z3.BoolRef] = []    # definedness conditions (inputs must satisfy them)
        self.axioms: List[z3.BoolRef] = []  # facts true of every interpretation (always safe to assume)
        self._seen_side: set = set()
        self._seen_axioms: set = set()
        self._log: List[z3.BoolRef] = []    # every condition required, in order, repeats included
        self._fresh = itertools.count()

    # bookkeeping
    def require(self, cond) -> None:
        """Record a definedness condition (skipped when trivially true)."""
        cond = z3.simplify(cond) if not isinstance(cond, bool) else z3.BoolVal(cond)
        if z3.is_true(cond):
            return
        self._log.append(cond)
        if cond.get_id() not in self._seen_side:
            self._seen_side.add(cond.get_id())
            self.side.append(cond)

    def mark(self) -> int:
        """A position in the log of definedness conditions, for :meth:`side_since`."""
        return len(self._log)

    def side_since(self, mark: int) -> List[z3.BoolRef]:
        """The definedness conditions required since ``mark`` (each once), including ones already in ``side``:
        evaluate a rule's left side between a mark and this call to get that side's conditions alone."""
        out, seen = [], set()
        for c in self._log[mark:]:
            if c.get_id() not in seen:
                seen.add(c.get_id())
                out.append(c)
        return out

    def assume(self, fact) -> None:
        """Record an axiom about an uninterpreted function application."""
        if fact.get_id() not in self._seen_axioms:
            self._seen_axioms.add(fact.get_id())
            self.axioms.append(fact)

    def assumptions(self) -> List[z3.BoolRef]:
        return self.side + self.axioms

    # leaves
    def var(self, name: str):
        return z3.Const(name, self.sort)

    def bool_var(self, name: str):
        return z3.Bool(name)

    def fresh(self, prefix: str = "t"):
        return self.var(f"{prefix}!{next(self._fresh)}")

    def fresh_bool(self, prefix: str = "b"):
        return self.bool_var(f"{prefix}!{next(self._fresh)}")

    @abc.abstractmethod
    def const(self, value: float):
        """A literal of this domain's sort."""

    def lift(self, v):
        """A scalar operand: Z3 expressions pass through, Python/numpy numbers become literals."""
        if isinstance(v, np.ndarray):
            v = v.item() if v.dtype != object else v.reshape(-1)[0]
        if isinstance(v, z3.ExprRef):
            return v
        if isinstance(v, (bool, np.bool_)):
            return z3.BoolVal(bool(v))
        return self.const(v)

    # logic (shared)
    def ite(self, c, a, b):
        return z3.If(c, a, b)

    def and_(self, *xs):
        return z3.And(*xs)

    def or_(self, *xs):
        return z3.Or(*xs)

    def not_(self, x):
        return z3.Not(x)

    def xor(self, a, b):
        return z3.Xor(a, b)

    def func(self, name: str, *args):
        """An uninterpreted function application, the same declaration wherever ``name`` is used."""
        f = z3.Function(name, *([self.sort] * len(args)), self.sort)
        return f(*args)

    def is_nan(self, x):
        return z3.BoolVal(False)

    def is_inf(self, x, pos=True, neg=True):
        return z3.BoolVal(False)

    # derived
    def relu(self, x):
        return self.maximum(x, self.const(0.0))

    def gt(self, a, b):
        return self.lt(b, a)

    def ge(self, a, b):
        return self.le(b, a)

    def sign(self, x):
        zero = self.const(0.0)
        return self.ite(self.gt(x, zero), self.const(1.0), self.ite(self.lt(x, zero), self.const(-1.0), zero))

    def recip(self, x):
        return self.div(self.const(1.0), x)

    def exp(self, x):
        return self.func("exp", x)

    def log(self, x):
        return self.func("log", x)

    def equal(self, a, b):
        return a == b

    @abc.abstractmethod
    def value_of(self, model, expr):
        """A Python value of ``expr`` in a Z3 model (for counterexamples)."""


class FP32Domain(Domain):
    """Bit-exact IEEE-754 binary32 with round-nearest-even."""

    name = "exact"
    sort = FP32

    def const(self, value):
        f = np.float32(value)
        if np.isnan(f):
            return z3.fpNaN(FP32)
        bits = struct.unpack("<I", struct.pack("<f", float(f)))[0]
        return z3.simplify(z3.fpBVToFP(z3.BitVecVal(bits, 32), FP32))

    def add(self, a, b):
        return z3.fpAdd(z3.RNE(), a, b)

    def sub(self, a, b):
        return z3.fpSub(z3.RNE(), a, b)

    def mul(self, a, b):
        return z3.fpMul(z3.RNE(), a, b)

    def div(self, a, b):
        return z3.fpDiv(z3.RNE(), a, b)

    def neg(self, x):
        return z3.fpNeg(x)

    def abs(self, x):
        return z3.fpAbs(x)

    def sqrt(self, x):
        return z3.fpSqrt(z3.RNE(), x)

    def floor(self, x):
        return z3.fpRoundToIntegral(z3.RTN(), x)

    def ceil(self, x):
        return z3.fpRoundToIntegral(z3.RTP(), x)

    def round(self, x):
        return z3.fpRoundToIntegral(z3.RNE(), x)

    def lt(self, a, b):
        return z3.fpLT(a, b)

    def le(self, a, b):
        return z3.fpLEQ(a, b)

    def eq(self, a, b):
        return z3.fpEQ(a, b)  # IEEE: -0 == +0, NaN != NaN

    def is_nan(self, x):
        return z3.fpIsNaN(x)

    def is_inf(self, x, pos=True, neg=True):
        if pos and neg:
            return z3.fpIsInf(x)
        if pos:
            return z3.And(z3.fpIsInf(x), z3.fpIsPositive(x))
        if neg:
            return z3.And(z3.fpIsInf(x), z3.fpIsNegative(x))
        return z3.BoolVal(False)

    def nan(self):
        return z3.fpNaN(FP32)

    def maximum(self, a, b):
        # np.maximum: NaN if either is NaN; on ties (incl. -0 vs +0) the second argument.
        return z3.If(z3.Or(z3.fpIsNaN(a), z3.fpIsNaN(b)), self.nan(), z3.If(z3.fpGT(a, b), a, b))

    def minimum(self, a, b):
        return z3.If(z3.Or(z3.fpIsNaN(a), z3.fpIsNaN(b)), self.nan(), z3.If(z3.fpLT(a, b), a, b))

    def nan_skipping_max(self, a, b):
        # MaxPool's fold: NaNs are skipped (an all-NaN window gives NaN); ties give the later element.
        return z3.If(z3.fpIsNaN(b), a, z3.If(z3.fpIsNaN(a), b, z3.If(z3.fpGT(a, b), a, b)))

    def sign(self, x):
        return z3.If(z3.fpIsNaN(x), self.nan(), super().sign(x))

    def equal(self, a, b):
        # Z3's structural '=' on FP terms: +0 and -0 differ, and (SMT-LIB having one NaN) NaN equals NaN.
        return a == b

    def value_of(self, model, expr):
        v = z3.simplify(expr) if model is None else model.eval(expr, model_completion=True)
        if z3.is_bool(v):
            return bool(z3.is_true(v))
        v = z3.simplify(v)
        if not isinstance(v, z3.FPNumRef):
            raise ValueError(f"not a concrete float: {v}")
        if v.isNaN():
            return float("nan")
        if v.isInf():
            return float("-inf") if v.isNegative() else float("inf")
        if v.isZero():
            return -0.0 if v.isNegative() else 0.0
        r = z3.simplify(z3.fpToReal(v))
        return float(np.float32(Fraction(r.numerator_as_long(), r.denominator_as_long())))


class FPDomain(FP32Domain):
    """Another IEEE-754 format (float16, bfloat16, float64) with the same operations: elementwise rules
    are proved in each format a graph may hold, since rounding (and so bit-exactness) depends on it."""

    def __init__(self, dtype: str, ebits: int, sbits: int, max_finite: float):
        super().__init__()
        self.dtype, self.sort, self.max_finite = dtype, z3.FPSort(ebits, sbits), max_finite

    def const(self, value):
        v = float(value)
        if math.isnan(v):
            return z3.fpNaN(self.sort)
        return z3.simplify(z3.fpToFP(z3.RNE(), z3.FPVal(v, z3.Float64()), self.sort))

    def nan(self):
        return z3.fpNaN(self.sort)


# The formats an exact elementwise rule is proved in besides float32 (name, exponent bits, significand
# bits, largest finite value: Clip's default bound).
FP_FORMATS = {"float16": (5, 11, 65504.0), "bfloat16": (8, 8, 3.3895313892515355e38),
              "double": (11, 53, float(np.finfo(np.float64).max))}


class RealDomain(Domain):
    """The reals; partial operations record definedness conditions, function facts record axioms."""

    name = "real"
    sort = z3.RealSort()

    def const(self, value):
        if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
            return z3.RealVal(int(value))
        value = float(value)
        if not math.isfinite(value):
            raise UnsupportedOpError("Constant", detail=f"{value} is not a real number")
        return z3.RealVal(Fraction(value))  # the exact value of the (double) literal

    def add(self, a, b):
        return a + b

    def sub(self, a, b):
        return a - b

    def mul(self, a, b):
        return a * b

    def div(self, a, b):
        self.require(b != 0)
        return a / b

    def neg(self, x):
        return -x

    def abs(self, x):
        return z3.If(x >= 0, x, -x)

    def sqrt(self, x):
        self.require(x >= 0)
        r = z3.Function("sqrt", self.sort, self.sort)(x)
        self.assume(z3.Implies(x >= 0, z3.And(r >= 0, r * r == x)))
        return r

    def floor(self, x):
        return z3.ToReal(z3.ToInt(x))

    def ceil(self, x):
        return -z3.ToReal(z3.ToInt(-x))

    def round(self, x):
        f = z3.ToInt(x)
        d = x - z3.ToReal(f)
        half = z3.RealVal(Fraction(1, 2))
        up = z3.ToReal(f + 1)
        return z3.If(d < half, z3.ToReal(f), z3.If(d > half, up, z3.If(f % 2 == 0, z3.ToReal(f), up)))

    def lt(self, a, b):
        return a < b

    def le(self, a, b):
        return a <= b

    def eq(self, a, b):
        return a == b

    def maximum(self, a, b):
        return z3.If(a > b, a, b)

    def minimum(self, a, b):
        return z3.If(a < b, a, b)

    def relu(self, x):
        return z3.If(x > 0, x, z3.RealVal(0))

    def nan_skipping_max(self, a, b):
        return self.maximum(a, b)

    def exp(self, x):
        r = self.func("exp", x)
        self.assume(r > 0)
        return r

    def log(self, x):
        self.require(x > 0)
        return self.func("log", x)

    def value_of(self, model, expr):
        v = z3.simplify(expr) if model is None else model.eval(expr, model_completion=True)
        if z3.is_bool(v):
            return bool(z3.is_true(v))
        if z3.is_rational_value(v):
            return float(Fraction(v.numerator_as_long(), v.denominator_as_long()))
        if z3.is_algebraic_value(v):
            a = v.approx(20)
            return float(Fraction(a.numerator_as_long(), a.denominator_as_long()))
        raise ValueError(f"not a concrete real: {v}")


# --- tensors --------------------------------------------------------------------------------------

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


# --- the table ------------------------------------------------------------------------------------

Sem = Callable[[Domain, List[Optional[np.ndarray]], Dict[str, Any]], List[np.ndarray]]
SEMANTICS: Dict[str, Sem] = {}


def sem(*names: str):
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


# elementwise arithmetic
sem("Add")(_binary(lambda d, a, b: d.add(a, b)))
sem("Sub")(_binary(lambda d, a, b: d.sub(a, b)))
sem("Mul")(_binary(lambda d, a, b: d.mul(a, b)))
sem("Div")(_binary(lambda d, a, b: d.div(a, b)))
sem("Pow")(_binary(lambda d, a, b: _pow(d, a, b)))
sem("Neg")(_unary(lambda d, x, _: d.neg(x)))
sem("Abs")(_unary(lambda d, x, _: d.abs(x)))
sem("Reciprocal")(_unary(lambda d, x, _: d.recip(x)))
sem("Sqrt")(_unary(lambda d, x, _: d.sqrt(x)))
sem("Exp")(_unary(lambda d, x, _: d.exp(x)))
sem("Log")(_unary(lambda d, x, _: d.log(x)))
sem("Floor")(_unary(lambda d, x, _: d.floor(x)))
sem("Ceil")(_unary(lambda d, x, _: d.ceil(x)))
sem("Round")(_unary(lambda d, x, _: d.round(x)))
sem("Sign")(_unary(lambda d, x, _: d.sign(x)))
sem("Identity")(lambda dom, inputs, attrs: [_in(dom, inputs, 0)])


def _pow(dom, a, b):
    # Real: small non-negative integer literal exponents are products; everything else is uninterpreted.
    if isinstance(dom, RealDomain):
        e = z3.simplify(b)
        if z3.is_rational_value(e) and e.denominator_as_long() == 1 and 0 <= e.numerator_as_long() <= 4:
            return _fold(dom.mul, [a] * e.numerator_as_long()) if e.numerator_as_long() else dom.const(1)
    return dom.func("pow", a, b)


_REAL_RANGE = {  # definedness of inverse functions over the reals
    "Asin": lambda x: z3.And(x >= -1, x <= 1), "Acos": lambda x: z3.And(x >= -1, x <= 1),
    "Acosh": lambda x: x >= 1, "Atanh": lambda x: z3.And(x > -1, x < 1),
}
_REAL_BOUNDED = ("Tanh", "Erf")  # values in (-1, 1)


def _transcendental(name):
    def fn(dom, x, _attrs):
        if isinstance(dom, RealDomain) and name in _REAL_RANGE:
            dom.require(_REAL_RANGE[name](x))
        r = dom.func(name.lower(), x)
        if isinstance(dom, RealDomain) and name in _REAL_BOUNDED:
            dom.assume(z3.And(r > -1, r < 1))
        return r
    return _unary(fn)


for _name in ("Tanh", "Erf", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh"):
    sem(_name)(_transcendental(_name))


def _variadic_op(name):
    def run(dom, inputs, attrs):
        xs = [_in(dom, inputs, i) for i in range(len(inputs))]
        if not xs or any(x is None for x in xs):
            _unsupported(name, "needs at least one input")
        if name in ("Sum", "Mean"):
            r = _map(lambda *v: _sum(dom, list(v)), *xs)
            if name == "Mean":
                n = dom.const(float(len(xs)))
                r = _map(lambda v: dom.div(v, n), r)
            return [r]
        f = dom.maximum if name == "Max" else dom.minimum
        return [_map(lambda *v: _fold(f, list(v)), *xs)]
    return run


for _name in ("Sum", "Mean", "Max", "Min"):
    SEMANTICS[_name] = _variadic_op(_name)


# comparisons and logic (Bool outputs)
sem("Equal")(_binary(lambda d, a, b: d.eq(a, b) if not z3.is_bool(a) else a == b))
sem("Less")(_binary(lambda d, a, b: d.lt(a, b)))
sem("LessOrEqual")(_binary(lambda d, a, b: d.le(a, b)))
sem("Greater")(_binary(lambda d, a, b: d.gt(a, b)))
sem("GreaterOrEqual")(_binary(lambda d, a, b: d.ge(a, b)))
sem("And")(_binary(lambda d, a, b: z3.And(a, b)))
sem("Or")(_binary(lambda d, a, b: z3.Or(a, b)))
sem("Xor")(_binary(lambda d, a, b: z3.Xor(a, b)))
sem("Not")(_unary(lambda d, x, _: z3.Not(x)))
sem("IsNaN")(_unary(lambda d, x, _: d.is_nan(x)))
sem("IsInf")(_unary(lambda d, x, a: d.is_inf(x, bool(a.get("detect_positive", 1)), bool(a.get("detect_negative", 1)))))


@sem("Where")
def _where(dom, inputs, attrs):
    c, a, b = (_in(dom, inputs, i) for i in range(3))
    return [_map(lambda cc, x, y: dom.ite(cc, x, y), c, a, b)]


@sem("Cast")
def _cast(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    if int(attrs.get("to", 0)) != 1 or any(not isinstance(v, z3.ExprRef) or v.sort() != dom.sort
                                          for v in x.reshape(-1)):
        _unsupported("Cast", "only float32 -> float32 has Z3 semantics")
    return [x]


# --- activations (ONNX function bodies) -----------------------------------------------------------

sem("Relu")(_unary(lambda d, x, _: d.relu(x)))


def _where_lt0(dom, x, neg, pos):
    return dom.ite(dom.lt(x, dom.const(0.0)), neg, pos)


sem("LeakyRelu")(_unary(lambda d, x, a: _where_lt0(d, x, d.mul(_scalar_attr(d, a["alpha"]), x), x)))
sem("ThresholdedRelu")(_unary(lambda d, x, a: d.ite(d.lt(_scalar_attr(d, a.get("alpha", 1.0)), x), x, d.const(0.0))))


@sem("PRelu")
def _prelu(dom, inputs, attrs):
    x, slope = _in(dom, inputs, 0), _in(dom, inputs, 1)
    return [_map(lambda v, s: _where_lt0(dom, v, dom.mul(s, v), v), x, slope)]


def _elu(d, x, alpha):
    return _where_lt0(d, x, d.mul(alpha, d.sub(d.exp(x), d.const(1.0))), x)


sem("Elu")(_unary(lambda d, x, a: _elu(d, x, _scalar_attr(d, a["alpha"]))))


def _selu(d, x, a):
    alpha, gamma = _scalar_attr(d, a["alpha"]), _scalar_attr(d, a["gamma"])
    return _where_lt0(d, x, d.mul(gamma, d.sub(d.mul(alpha, d.exp(x)), alpha)), d.mul(gamma, x))


sem("Selu")(_unary(_selu))


def _celu(d, x, a):
    alpha = _scalar_attr(d, a.get("alpha", 1.0))  # Celu body: alpha * Elu(x / alpha)
    return d.mul(alpha, _elu(d, d.div(x, alpha), d.const(1.0)))


sem("Celu")(_unary(_celu))
# Sigmoid: the spec formula 1 / (1 + exp(-x)).
sem("Sigmoid")(_unary(lambda d, x, _: d.div(d.const(1.0), d.add(d.const(1.0), d.exp(d.neg(x))))))


def _hard_sigmoid(d, x, alpha, beta):
    return d.maximum(d.minimum(d.add(d.mul(x, alpha), beta), d.const(1.0)), d.const(0.0))


sem("HardSigmoid")(_unary(lambda d, x, a: _hard_sigmoid(d, x, _scalar_attr(d, a["alpha"]), _scalar_attr(d, a["beta"]))))
sem("HardSwish")(_unary(lambda d, x, _: d.mul(x, _hard_sigmoid(d, x, d.const(1.0 / 6.0), d.const(0.5)))))
sem("Softplus")(_unary(lambda d, x, _: d.log(d.add(d.exp(x), d.const(1.0)))))
sem("Softsign")(_unary(lambda d, x, _: d.div(x, d.add(d.const(1.0), d.abs(x)))))
sem("Mish")(_unary(lambda d, x, _: d.mul(x, _tanh(d, d.log(d.add(d.exp(x), d.const(1.0)))))))


def _gelu(d, x, a):
    half, one = d.const(0.5), d.const(1.0)
    if _text(a.get("approximate", "none")) == "tanh":
        k = d.sqrt(d.const(0.63661975))  # sqrt(2 / pi), as the body computes it
        inner = d.mul(k, d.add(x, d.mul(d.const(0.044715), _pow(d, x, d.const(3.0)))))
        phi = d.add(one, _tanh(d, inner))
    else:
        phi = d.add(one, _erf(d, d.div(x, d.sqrt(d.const(2.0)))))
    return d.mul(d.mul(half, x), phi)


def _tanh(d, x):
    r = d.func("tanh", x)
    if isinstance(d, RealDomain):
        d.assume(z3.And(r > -1, r < 1))
    return r


def _erf(d, x):
    r = d.func("erf", x)
    if isinstance(d, RealDomain):
        d.assume(z3.And(r > -1, r < 1))
    return r


sem("Gelu")(_unary(_gelu))


@sem("Clip")
def _clip(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    lo = attrs.get("min", _in(dom, inputs, 1) if len(inputs) > 1 else None)
    hi = attrs.get("max", _in(dom, inputs, 2) if len(inputs) > 2 else None)
    real = isinstance(dom, RealDomain)
    lo = None if lo is None or (isinstance(lo, np.ndarray) and lo.size == 0) else _scalar_attr(dom, lo)
    hi = None if hi is None or (isinstance(hi, np.ndarray) and hi.size == 0) else _scalar_attr(dom, hi)
    if not real:  # absent bounds: ONNX's defaults, the lowest / largest float32
        top = getattr(dom, "max_finite", _F32_MAX)
        lo = dom.const(-top) if lo is None else lo
        hi = dom.const(top) if hi is None else hi

    def one(v):
        t = v if lo is None else dom.ite(dom.lt(v, lo), lo, v)
        t = t if hi is None else dom.ite(dom.gt(t, hi), hi, t)
        if not real:
            t = dom.ite(z3.Or(dom.is_nan(v), dom.is_nan(lo), dom.is_nan(hi)), dom.nan(), t)
        return t
    return [_map(one, x)]


@sem("Dropout")
def _dropout(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    ratio = attrs.get("ratio", inputs[1] if len(inputs) > 1 else None)
    tm = attrs.get("training_mode", inputs[2] if len(inputs) > 2 else None)
    tm = False if tm is None else (_py_bool(tm) if _py_bool(tm) is not None else _scalar_attr(dom, tm))
    if tm is not False:
        ratio = 0.5 if ratio is None else ratio
        if _py_number(ratio) is not None and float(_py_number(ratio)) == 0.0:
            tm = False
    if tm is False:
        y, mask = x, _map(lambda _: z3.BoolVal(True), x)
    else:
        r = _scalar_attr(dom, ratio)
        scale = dom.div(dom.const(1.0), dom.sub(dom.const(1.0), r))
        keep_all = dom.eq(r, dom.const(0.0))
        keeps = _map(lambda _: z3.Or(dom.fresh_bool("dropout_mask"), keep_all), x)
        y = _map(lambda v, k: dom.ite(k, dom.mul(v, scale), dom.const(0.0)), x, keeps)
        mask = keeps
        if tm is not True:  # symbolic training_mode
            y = _map(lambda a, b: dom.ite(tm, a, b), y, x)
            mask = _map(lambda k: z3.Or(z3.Not(tm), k), keeps)
    return [y, mask][:max(1, _nout(attrs))]


# --- shapes ---------------------------------------------------------------------------------------

@sem("Reshape")
def _reshape(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    spec = _ints(attrs.get("shape"))
    if spec is None:
        _unsupported("Reshape", "shape must be a constant attribute")
    out = []
    for i, d in enumerate(spec):
        out.append(x.shape[i] if d == 0 and not attrs.get("allowzero", 0) else d)
    if -1 in out:
        k = out.index(-1)
        known = int(np.prod([d for j, d in enumerate(out) if j != k]))
        out[k] = x.size // known if known else 0
    return [x.reshape(out)]


@sem("Flatten")
def _flatten(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    a = attrs.get("axis", 1)
    a = a + x.ndim if a < 0 else a
    return [x.reshape(int(np.prod(x.shape[:a])), int(np.prod(x.shape[a:])))]


@sem("Transpose")
def _transpose(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    perm = attrs.get("perm")
    return [np.transpose(x, None if perm is None else _ints(perm)).copy()]


@sem("Squeeze")
def _squeeze(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    axes = _ints(attrs.get("axes"))
    if axes is None or not axes:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = [_axis(a, x.ndim) for a in axes]
    if any(x.shape[a] != 1 for a in axes):
        _unsupported("Squeeze", f"cannot squeeze axes {axes} of shape {x.shape}")
    return [x.reshape([d for i, d in enumerate(x.shape) if i not in axes])]


@sem("Unsqueeze")
def _unsqueeze(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    axes = _ints(attrs.get("axes"))
    if axes is None:
        _unsupported("Unsqueeze", "axes must be a constant attribute")
    r = x.ndim + len(axes)
    norm = {_axis(a, r) for a in axes}
    rest = iter(x.shape)
    return [x.reshape([1 if i in norm else next(rest) for i in range(r)])]


@sem("Concat")
def _concat(dom, inputs, attrs):
    xs = [_in(dom, inputs, i) for i in range(len(inputs))]
    return [np.concatenate(xs, axis=_axis(attrs["axis"], xs[0].ndim))]


@sem("Split")
def _split(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    a = _axis(attrs.get("axis", 0), x.ndim)
    sizes = _ints(attrs.get("split"))
    if not sizes:
        n = attrs.get("num_outputs") or attrs.get("_num_outputs")
        if not n:
            _unsupported("Split", "needs split sizes, num_outputs or the number of outputs")
        chunk = -(-x.shape[a] // n)
        sizes = [chunk] * (n - 1) + [x.shape[a] - chunk * (n - 1)]
    bounds = np.cumsum([0] + sizes)
    return [np.take(x, range(bounds[i], bounds[i + 1]), axis=a) for i in range(len(sizes))]


def _slice_clamp(d, s, e, step):
    s, e = s + d if s < 0 else s, e + d if e < 0 else e
    if step > 0:
        return min(max(s, 0), d), min(max(e, 0), d)
    return min(max(s, 0), d - 1), min(max(e, -1), d - 1)


@sem("Slice")
def _slice(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    starts, ends = _ints(attrs.get("starts")), _ints(attrs.get("ends"))
    if starts is None or ends is None:
        _unsupported("Slice", "starts and ends must be constant attributes")
    axes = _ints(attrs.get("axes")) or list(range(len(starts)))
    steps = _ints(attrs.get("steps")) or [1] * len(starts)
    for st, en, a, step in zip(starts, ends, axes, steps):
        a = _axis(a, x.ndim)
        s, e = _slice_clamp(x.shape[a], st, en, step)
        x = np.take(x, list(range(s, e, step)), axis=a)
    return [x]


@sem("Pad")
def _pad(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    pads = _ints(attrs.get("pads"))
    if pads is None:
        _unsupported("Pad", "pads must be a constant attribute")
    axes = _ints(attrs.get("axes")) or list(range(x.ndim))
    axes = [_axis(a, x.ndim) for a in axes]
    n = len(axes)
    widths = [[0, 0] for _ in range(x.ndim)]
    for i, a in enumerate(axes):
        widths[a] = [pads[i], pads[i + n]]
    for a, (b, e) in enumerate(widths):  # negative pads crop
        if b < 0 or e < 0:
            x = np.take(x, range(max(-b, 0), x.shape[a] - max(-e, 0)), axis=a)
    widths = [(max(b, 0), max(e, 0)) for b, e in widths]
    mode = _text(attrs.get("mode", "constant"))
    if mode == "constant":
        cv = attrs.get("constant_value")
        cv = dom.const(0.0) if cv is None or (isinstance(cv, np.ndarray) and cv.size == 0) else _scalar_attr(dom, cv)
        out = _empty([d + b + e for d, (b, e) in zip(x.shape, widths)])
        out.fill(cv)
        out[tuple(slice(b, b + d) for d, (b, _e) in zip(x.shape, widths))] = x
        return [out]
    if mode in ("reflect", "edge", "wrap"):
        return [np.pad(x, widths, mode=mode)]
    _unsupported("Pad", f"mode {mode!r}")


@sem("Expand")
def _expand(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    shape = np.broadcast_shapes(x.shape, tuple(_ints(attrs.get("shape"))))
    return [np.broadcast_to(x, shape).copy()]


@sem("Tile")
def _tile(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    return [np.tile(x, _ints(attrs.get("repeats")))]


@sem("Gather")
def _gather(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    idx = attrs.get("indices", inputs[1] if len(inputs) > 1 else None)
    if idx is None:
        _unsupported("Gather", "indices are missing")
    arr = idx if isinstance(idx, np.ndarray) else np.asarray(idx, dtype=object)
    shape = arr.shape
    flat = _ints(list(arr.reshape(-1)))
    a = _axis(attrs.get("axis", 0), x.ndim)
    d = x.shape[a]
    flat = [i + d if i < 0 else i for i in flat]
    if any(not 0 <= i < d for i in flat):
        _unsupported("Gather", f"index out of range for axis of size {d}")
    return [np.take(x, np.array(flat, dtype=np.int64).reshape(shape), axis=a)]


@sem("DepthToSpace")
def _d2s(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    b = attrs["blocksize"]
    n, c, h, w = x.shape
    if _text(attrs.get("mode", "DCR")) == "DCR":
        t = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        t = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return [t.reshape(n, c // (b * b), h * b, w * b)]


@sem("SpaceToDepth")
def _s2d(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    b = attrs["blocksize"]
    n, c, h, w = x.shape
    t = x.reshape(n, c, h // b, b, w // b, b).transpose(0, 3, 5, 1, 2, 4)
    return [t.reshape(n, c * b * b, h // b, w // b)]


# --- linear algebra -------------------------------------------------------------------------------

def _dot(dom, xs, ws):
    return _sum(dom, [dom.mul(a, b) for a, b in zip(xs, ws)])


def _matmul(dom, a, b):
    va, vb = a.ndim == 1, b.ndim == 1
    if va:
        a = a.reshape(1, -1)
    if vb:
        b = b.reshape(-1, 1)
    if a.shape[-1] != b.shape[-2]:
        _unsupported("MatMul", f"inner dims differ: {a.shape} @ {b.shape}")
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = np.broadcast_to(a, batch + a.shape[-2:])
    b = np.broadcast_to(b, batch + b.shape[-2:])
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    out = _empty(batch + (m, n))
    for bi in np.ndindex(*batch):
        for i in range(m):
            for j in range(n):
                out[bi + (i, j)] = _dot(dom, [a[bi + (i, t)] for t in range(k)], [b[bi + (t, j)] for t in range(k)])
    if va:
        out = out.reshape(out.shape[:-2] + out.shape[-1:])
    if vb:
        out = out.reshape(out.shape[:-1])
    return out


@sem("MatMul")
def _matmul_sem(dom, inputs, attrs):
    return [_matmul(dom, _in(dom, inputs, 0), _in(dom, inputs, 1))]


@sem("Gemm")
def _gemm(dom, inputs, attrs):
    a, b, c = _in(dom, inputs, 0), _in(dom, inputs, 1), _in(dom, inputs, 2)
    if attrs.get("transA"):
        a = a.T
    if attrs.get("transB"):
        b = b.T
    y = _matmul(dom, a, b)
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if _py_number(alpha) is None or float(_py_number(alpha)) != 1.0:
        al = _scalar_attr(dom, alpha)
        y = _map(lambda v: dom.mul(v, al), y)
    if c is None or (_py_number(beta) is not None and float(_py_number(beta)) == 0.0):
        return [y]
    if _py_number(beta) is not None and float(_py_number(beta)) == 1.0:
        return [_map(dom.add, y, c)]
    be = _scalar_attr(dom, beta)
    if isinstance(dom, RealDomain):
        return [_map(lambda v, w: dom.add(v, dom.mul(w, be)), y, c)]
    return [_map(lambda v, w: dom.ite(dom.eq(be, dom.const(0.0)), v, dom.add(v, dom.mul(w, be))), y, c)]


def _window(spatial, kernel, attrs, ceil=False):
    """Output sizes and (begin, end) paddings of a sliding window, as in ONNX shape inference."""
    n = len(spatial)
    strides = _ints(attrs.get("strides")) or [1] * n
    dils = _ints(attrs.get("dilations")) or [1] * n
    pads = _ints(attrs.get("pads")) or [0] * (2 * n)
    auto = _text(attrs.get("auto_pad", "NOTSET"))
    outs, begins, ends = [], [], []
    for i, (h, k, s, d) in enumerate(zip(spatial, kernel, strides, dils)):
        dk = d * (k - 1) + 1
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            o = -(-h // s)
            total = max(0, (o - 1) * s + dk - h)
            b = total // 2 if auto == "SAME_UPPER" else total - total // 2
            e = total - b
        else:
            b, e = (0, 0) if auto == "VALID" else (pads[i], pads[i + n])
            span = h + b + e - dk
            o = (-(-span // s) if ceil else span // s) + 1
            if ceil and (o - 1) * s >= h + b:
                o -= 1
        if o < 1:
            raise UnsupportedOpError("window", detail=f"kernel {kernel} does not fit input {spatial}")
        outs.append(o)
        begins.append(b)
        ends.append(e)
    return outs, begins, ends, strides, dils


@sem("Conv")
def _conv(dom, inputs, attrs):
    x, w, bias = _in(dom, inputs, 0), _in(dom, inputs, 1), _in(dom, inputs, 2)
    g = int(attrs.get("group", 1))
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    kernel = w.shape[2:]
    if c != cg * g or m % g:
        _unsupported("Conv", f"channels {c} / weight {w.shape} / group {g} do not fit")
    outs, begins, _ends, strides, dils = _window(x.shape[2:], kernel, attrs)
    mg = m // g
    zero = dom.const(0.0)
    real = isinstance(dom, RealDomain)
    y = _empty((n, m, *outs))
    for bi in range(n):
        for mi in range(m):
            gi = mi // mg
            for o in np.ndindex(*outs):
                terms = []
                for ci in range(cg):
                    for k in np.ndindex(*kernel):
                        pos = tuple(oo * s - b + kk * d for oo, s, b, kk, d in zip(o, strides, begins, k, dils))
                        wv = w[(mi, ci) + k]
                        if all(0 <= p < h for p, h in zip(pos, x.shape[2:])):
                            terms.append(dom.mul(x[(bi, gi * cg + ci) + pos], wv))
                        elif not real:  # a padding zero times the weight
                            terms.append(dom.mul(zero, wv))
                acc = _sum(dom, terms)
                if bias is not None:
                    acc = dom.add(acc, bias[mi])
                y[(bi, mi) + o] = acc
    return [y]


def _exact(dom: Domain, v: Fraction):
    """An exact rational constant: exact over the reals, rounded to float32 in the IEEE domain."""
    return z3.RealVal(v) if isinstance(dom, RealDomain) else dom.const(float(v))


def _combine(dom: Domain, coeffs, terms):
    """sum_i coeffs[i] * terms[i] over the non-zero coefficients, left to right (1 and -1 not multiplied)."""
    out = []
    for c, t in zip(coeffs, terms):
        if c == 0:
            continue
        out.append(t if c == 1 else dom.neg(t) if c == -1 else dom.mul(_exact(dom, c), t))
    return _sum(dom, out)


def _sandwich(dom: Domain, left, tile, right):
    """left @ tile @ right.T for matrices of Fractions and a 2-D object array."""
    rows = [[_combine(dom, lr, [tile[a][b] for a in range(len(lr))]) for b in range(len(tile[0]))] for lr in left]
    return [[_combine(dom, rr, row) for rr in right] for row in rows]


@sem("WinogradKernel")
def _winograd_kernel(dom, inputs, attrs):
    from ..ir.ops.winograd import MATRICES
    w = _in(dom, inputs, 0)
    m = int(attrs.get("tile", 4))
    _, g, _ = MATRICES[m]
    k, c = w.shape[:2]
    u = _empty(((m + 2) ** 2, k, c))
    for ki in range(k):
        for ci in range(c):
            t = _sandwich(dom, g, w[ki, ci], g)
            for i, row in enumerate(t):
                for j, v in enumerate(row):
                    u[i * (m + 2) + j, ki, ci] = v
    return [u]


@sem("WinogradConv")
def _winograd_conv(dom, inputs, attrs):
    """The algorithm itself: zero-padded input tiles d, V = Bt d B, M = sum_c U * V, Y = At M A, cropped."""
    from ..ir.ops.winograd import MATRICES
    x, u, bias = _in(dom, inputs, 0), _in(dom, inputs, 1), _in(dom, inputs, 2)
    m = int(attrs.get("tile", 4))
    pads = _ints(attrs.get("pads")) or [0, 0, 0, 0]
    bt, _, at = MATRICES[m]
    a = m + 2
    n, c, h, w = x.shape
    k = u.shape[1]
    oh, ow = h + pads[0] + pads[2] - 2, w + pads[1] + pads[3] - 2
    zero = dom.const(0.0)

    def px(ni, ci, r, q):
        r, q = r - pads[0], q - pads[1]
        return x[ni, ci, r, q] if 0 <= r < h and 0 <= q < w else zero
    y = _empty((n, k, oh, ow))
    for ni in range(n):
        for th in range(0, oh, m):
            for tw in range(0, ow, m):
                v = [_sandwich(dom, bt, [[px(ni, ci, th + i, tw + j) for j in range(a)] for i in range(a)], bt)
                     for ci in range(c)]
                for ki in range(k):
                    mm = [[_sum(dom, [dom.mul(u[i * a + j, ki, ci], v[ci][i][j]) for ci in range(c)])
                           for j in range(a)] for i in range(a)]
                    out = _sandwich(dom, at, mm, at)
                    for r in range(min(m, oh - th)):
                        for q in range(min(m, ow - tw)):
                            val = out[r][q]
                            y[ni, ki, th + r, tw + q] = val if bias is None else dom.add(val, bias[ki])
    return [y]


@sem("ConvTranspose")
def _conv_transpose(dom, inputs, attrs):
    x, w, bias = _in(dom, inputs, 0), _in(dom, inputs, 1), _in(dom, inputs, 2)
    g = int(attrs.get("group", 1))
    n, c = x.shape[:2]
    kernel = w.shape[2:]
    mg = w.shape[1]
    m, cg = mg * g, c // g
    nsp = len(kernel)
    strides = _ints(attrs.get("strides")) or [1] * nsp
    dils = _ints(attrs.get("dilations")) or [1] * nsp
    opad = _ints(attrs.get("output_padding")) or [0] * nsp
    pads = _ints(attrs.get("pads")) or [0] * (2 * nsp)
    out_shape = _ints(attrs.get("output_shape"))
    auto = _text(attrs.get("auto_pad", "NOTSET"))
    full = [s * (h - 1) + op_ + d * (k - 1) + 1 for h, k, s, d, op_ in zip(x.shape[2:], kernel, strides, dils, opad)]
    if out_shape or auto in ("SAME_UPPER", "SAME_LOWER"):
        target = out_shape[-nsp:] if out_shape else [h * s for h, s in zip(x.shape[2:], strides)]
        # the spec's total padding, split with the extra at the end for SAME_UPPER, else at the start
        totals = [f - t for f, t in zip(full, target)]
        begins = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in totals]
        outs = list(target)
    else:
        begins = pads[:nsp] if auto != "VALID" else [0] * nsp
        ends = pads[nsp:] if auto != "VALID" else [0] * nsp
        outs = [f - b - e for f, b, e in zip(full, begins, ends)]
    contrib: Dict[tuple, list] = {}
    for bi in range(n):
        for ci in range(c):
            gi = ci // cg
            for ipos in np.ndindex(*x.shape[2:]):
                for mo in range(mg):
                    for k in np.ndindex(*kernel):
                        o = tuple(p * s + kk * d - b for p, s, kk, d, b in zip(ipos, strides, k, dils, begins))
                        if all(0 <= oo < t for oo, t in zip(o, outs)):
                            key = (bi, gi * mg + mo) + o
                            contrib.setdefault(key, []).append(dom.mul(x[(bi, ci) + ipos], w[(ci, mo) + k]))
    y = _empty((n, m, *outs))
    for idx in np.ndindex(*y.shape):
        acc = _sum(dom, contrib.get(idx, []))
        y[idx] = acc if bias is None else dom.add(acc, bias[idx[1]])
    return [y]


# --- normalisation --------------------------------------------------------------------------------

def _per_channel(p, rank):
    return p.reshape((-1,) + (1,) * (rank - 2))


@sem("BatchNormalization")
def _batchnorm(dom, inputs, attrs):
    x, s, b, mean, var = (_in(dom, inputs, i) for i in range(5))
    if attrs.get("training_mode") or _nout(attrs) > 1:
        _unsupported("BatchNormalization", "training mode has no Z3 semantics")
    eps = _scalar_attr(dom, attrs.get("epsilon", 1e-5))
    r = x.ndim
    if r < 2:
        _unsupported("BatchNormalization", "input must have rank >= 2")
    s, b, mean, var = (_per_channel(p, r) for p in (s, b, mean, var))
    # (x - mean) / sqrt(var + eps) * scale + B
    def one(v, sc, bb, mu, va):
        return dom.add(dom.mul(dom.div(dom.sub(v, mu), dom.sqrt(dom.add(va, eps))), sc), bb)
    return [_map(one, x, s, b, mean, var)]


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


@sem("InstanceNormalization")
def _instnorm(dom, inputs, attrs):
    x, s, b = (_in(dom, inputs, i) for i in range(3))
    eps = _scalar_attr(dom, attrs.get("epsilon", 1e-5))
    axes = list(range(2, x.ndim))
    cnt = dom.const(float(np.prod(x.shape[2:])))
    mean = _reduce(x, axes, True, lambda v: dom.div(_sum(dom, v), cnt))
    dev = _map(dom.sub, x, mean)
    var = _reduce(dev, axes, True, lambda v: dom.div(_sum(dom, [dom.mul(t, t) for t in v]), cnt))
    s, b = _per_channel(s, x.ndim), _per_channel(b, x.ndim)
    return [_map(lambda dv, va, sc, bb: dom.add(dom.div(dom.mul(sc, dv), dom.sqrt(dom.add(va, eps))), bb),
                 dev, var, s, b)]


@sem("LayerNormalization")
def _layernorm(dom, inputs, attrs):
    x, s, b = (_in(dom, inputs, i) for i in range(3))
    if int(attrs.get("stash_type", 1)) != 1 and not isinstance(dom, RealDomain):
        _unsupported("LayerNormalization", "stash_type other than float has no exact semantics")
    eps = _scalar_attr(dom, attrs.get("epsilon", 1e-5))
    a = _axis(attrs.get("axis", -1), x.ndim)
    axes = list(range(a, x.ndim))
    cnt = dom.const(float(np.prod(x.shape[a:])))
    mean = _reduce(x, axes, True, lambda v: dom.div(_sum(dom, v), cnt))
    meansq = _reduce(_map(lambda v: dom.mul(v, v), x), axes, True, lambda v: dom.div(_sum(dom, v), cnt))
    std = _map(lambda ms, mu: dom.sqrt(dom.add(dom.sub(ms, dom.mul(mu, mu)), eps)), meansq, mean)
    y = _map(lambda v, mu, sd, sc: dom.mul(dom.div(dom.sub(v, mu), sd), sc), x, mean, std, s)
    if b is not None:
        y = _map(dom.add, y, b)
    return [y, mean, _map(dom.recip, std)][:max(1, _nout(attrs))]


# --- pooling --------------------------------------------------------------------------------------

def _pool(dom, x, attrs, kernel, combine):
    outs, begins, ends, strides, dils = _window(x.shape[2:], kernel, attrs, ceil=bool(attrs.get("ceil_mode", 0)))
    y = _empty(x.shape[:2] + tuple(outs))
    for nc in np.ndindex(*x.shape[:2]):
        for o in np.ndindex(*outs):
            inside, padded = [], 0
            for k in np.ndindex(*kernel):
                pos = tuple(oo * s - b + kk * d for oo, s, b, kk, d in zip(o, strides, begins, k, dils))
                if all(0 <= p < h for p, h in zip(pos, x.shape[2:])):
                    inside.append(x[nc + pos])
                if all(-b <= p < h + e for p, b, h, e in zip(pos, begins, x.shape[2:], ends)):
                    padded += 1
            if not inside:
                _unsupported("pool", "a window lies entirely in the padding")
            y[nc + o] = combine(inside, padded)
    return y


@sem("MaxPool")
def _maxpool(dom, inputs, attrs):
    if _nout(attrs) > 1:
        _unsupported("MaxPool", "the Indices output has no Z3 semantics")
    x = _in(dom, inputs, 0)
    return [_pool(dom, x, attrs, _ints(attrs["kernel_shape"]), lambda v, _n: _fold(dom.nan_skipping_max, v))]


@sem("AveragePool")
def _avgpool(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    incl = bool(attrs.get("count_include_pad", 0))
    return [_pool(dom, x, attrs, _ints(attrs["kernel_shape"]),
                  lambda v, npad: dom.div(_sum(dom, v), dom.const(float(npad if incl else len(v)))))]


@sem("GlobalAveragePool")
def _gap(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    cnt = dom.const(float(np.prod(x.shape[2:])))
    return [_reduce(x, range(2, x.ndim), True, lambda v: dom.div(_sum(dom, v), cnt))]


@sem("GlobalMaxPool")
def _gmp(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    return [_reduce(x, range(2, x.ndim), True, lambda v: _fold(dom.maximum, v))]


# --- reductions -----------------------------------------------------------------------------------

_REDUCERS = {
    # name: (map applied first, fold over the reduced elements, finish(value, count))
    "ReduceSum": (None, "sum", None),
    "ReduceMean": (None, "sum", "mean"),
    "ReduceMax": (None, "max", None),
    "ReduceMin": (None, "min", None),
    "ReduceProd": (None, "prod", None),
    "ReduceSumSquare": ("square", "sum", None),
    "ReduceL1": ("abs", "sum", None),
    "ReduceL2": ("square", "sum", "sqrt"),
    "ReduceLogSum": (None, "sum", "log"),
    "ReduceLogSumExp": ("exp", "sum", "log"),
}


def _reduce_op(name):
    pre, fold, post = _REDUCERS[name]

    def run(dom, inputs, attrs):
        x = _in(dom, inputs, 0)
        if pre is not None:
            f = {"square": lambda v: dom.mul(v, v), "abs": dom.abs, "exp": dom.exp}[pre]
            x = _map(f, x)
        axes = _ints(attrs.get("axes"))
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return [x if post in (None, "mean") else _map(dom.sqrt if post == "sqrt" else dom.log, x)]
            axes = list(range(x.ndim))
        axes = [_axis(a, x.ndim) for a in axes]
        cnt = int(np.prod([x.shape[a] for a in set(axes)]))
        fn = {"sum": lambda v: _sum(dom, v), "max": lambda v: _fold(dom.maximum, v),
              "min": lambda v: _fold(dom.minimum, v), "prod": lambda v: _fold(dom.mul, v)}[fold]
        if post == "mean":
            g = lambda v: dom.div(fn(v), dom.const(float(cnt)))  # noqa: E731
        elif post == "sqrt":
            g = lambda v: dom.sqrt(fn(v))  # noqa: E731
        elif post == "log":
            g = lambda v: dom.log(fn(v))  # noqa: E731
        else:
            g = fn
        return [_reduce(x, axes, bool(attrs.get("keepdims", 1)), g)]
    return run


for _name in _REDUCERS:
    SEMANTICS[_name] = _reduce_op(_name)


def _softmax_op(log: bool):
    def run(dom, inputs, attrs):
        x = _in(dom, inputs, 0)
        a = _axis(attrs.get("axis", -1), x.ndim)
        if isinstance(dom, RealDomain):
            # Mathematically the same as the function body's max-shifted form: exp(x) / sum(exp(x)); and
            # LogSoftmax is, by definition, Log(Softmax(x)).
            e = _map(dom.exp, x)
            y = _map(dom.div, e, _reduce(e, [a], True, lambda v: _sum(dom, v)))
            return [_map(dom.log, y) if log else y]
        # the ONNX function body, in float32
        xs = _map(dom.sub, x, _reduce(x, [a], True, lambda v: _fold(dom.maximum, v)))
        e = _map(dom.exp, xs)
        s = _reduce(e, [a], True, lambda v: _sum(dom, v))
        if log:
            return [_map(dom.sub, xs, _map(dom.log, s))]
        return [_map(dom.div, e, s)]
    return run


SEMANTICS["Softmax"] = _softmax_op(False)
SEMANTICS["LogSoftmax"] = _softmax_op(True)


@sem("CumSum")
def _cumsum(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    a = _axis(_ints(attrs.get("axis"))[0], x.ndim)
    excl, rev = bool(attrs.get("exclusive", 0)), bool(attrs.get("reverse", 0))
    t = np.moveaxis(x, a, -1)
    out = _empty(t.shape)
    for idx in np.ndindex(*t.shape[:-1]):
        row = list(t[idx])
        order = list(range(len(row)))[::-1] if rev else list(range(len(row)))
        acc = None
        for j in order:
            if excl:
                out[idx + (j,)] = dom.const(0.0) if acc is None else acc
            acc = row[j] if acc is None else dom.add(acc, row[j])
            if not excl:
                out[idx + (j,)] = acc
    return [np.moveaxis(out, -1, a).copy()]


# --- counterexamples: shared by the bounded and the generic prover ---------------------------------

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
