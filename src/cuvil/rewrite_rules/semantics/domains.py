"""Z3 domains of the semantics: IEEE-754 binary32 (:class:`FP32Domain`, ``prove exact``), other float
formats (:class:`FPDomain`) and the reals (:class:`RealDomain`, ``prove real``).
"""
from __future__ import annotations

import abc
import itertools
import math
import struct
from fractions import Fraction
from typing import List

import numpy as np
import z3

from ...errors import UnsupportedOpError

FP32 = z3.FPSort(8, 24)
_F32_MAX = float(np.finfo(np.float32).max)


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
