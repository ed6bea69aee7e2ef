"""Semantics of Conv and ConvTranspose (products of padding zeros included, as im2col computes them)."""
from __future__ import annotations

from typing import Dict

import numpy as np

from ...errors import UnsupportedOpError
from .domains import RealDomain
from .table import _in, sem
from .tensors import _empty, _ints, _sum, _text, _unsupported

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
