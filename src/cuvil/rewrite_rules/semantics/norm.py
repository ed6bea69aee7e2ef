"""Semantics of BatchNormalization, InstanceNormalization and LayerNormalization (the ONNX formulas)."""
from __future__ import annotations

import numpy as np

from .domains import RealDomain
from .table import _in, sem
from .tensors import _axis, _map, _nout, _reduce, _scalar_attr, _sum, _unsupported

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
