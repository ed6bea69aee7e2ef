"""Semantics of MatMul and Gemm: sums of products, left to right over the reduction index."""
from __future__ import annotations

import numpy as np

from .domains import RealDomain
from .table import _in, sem
from .tensors import _empty, _map, _py_number, _scalar_attr, _sum, _unsupported

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
