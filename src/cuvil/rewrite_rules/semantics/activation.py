"""Semantics of the activations: their ONNX function bodies (opset 21)."""
from __future__ import annotations

import numpy as np
import z3

from .domains import _F32_MAX, RealDomain
from .elementwise import _pow
from .table import _in, _unary, sem
from .tensors import _map, _scalar_attr, _text

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
