"""Semantics of the elementwise math, logic and comparison ops (the ``elementwise`` family of ``ir/ops``)."""
from __future__ import annotations

import z3

from .domains import RealDomain
from .table import SEMANTICS, _binary, _in, _unary, sem
from .tensors import _fold, _map, _sum, _unsupported

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
