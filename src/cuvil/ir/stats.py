"""Static statistics of a graph: op histogram, parameters, and FLOPs of the compute-heavy ops."""
from __future__ import annotations

from collections import Counter
from typing import Dict, Mapping, Tuple

import attrs

from ..errors import ShapeError
from .dim import Atom, Dim, SymExpr, evaluate, product
from .graph import Graph, Node
from .ops.spectral import dft_geometry, stft_geometry
from .registry import InferCtx, lookup


@attrs.define
class GraphStats:
    op_histogram: Dict[str, int]
    parameters: int          # elements of all constants the graph reads
    parameter_bytes: int
    macs: Dim                # multiply-accumulates of convolutions, products, recurrences, DFTs (symbolic if shapes are)
    flops_by_op: Dict[str, Dim]

    @property
    def flops(self) -> Dim:
        return self.macs * 2


def node_macs(n: Node) -> Dim:
    """Multiply-accumulates of one Conv/ConvTranspose/Gemm/MatMul node, an LSTM/GRU/RNN (its gates' products
    over every step), a DFT/STFT (as the direct sums the kernels compute), 0 for other ops. Ops imported as
    their ONNX function bodies (opset-23 Attention) count through the MatMuls of the body."""
    if n.op in ("Conv", "ConvTranspose", "ConvInteger", "QLinearConv"):
        w = n.inputs[3 if n.op == "QLinearConv" else 1].type.shape
        out = n.outputs[0].type.shape
        if w is None or out is None:
            return 0
        if n.op == "ConvTranspose":
            # each input pixel scatters into a kernel window of every output channel of its group
            x = n.inputs[0].type.shape
            return product(x) * product(w[1:])
        return product(out) * product(w[1:])
    if n.op in ("Gemm", "MatMul", "MatMulInteger", "QLinearMatMul"):
        a = n.inputs[0].type.shape
        out = n.outputs[0].type.shape
        if a is None or out is None or not a:
            return 0
        k = a[0] if n.op == "Gemm" and n.attrs.get("transA", 0) else a[-1]
        return product(out) * k
    if n.op in ("LSTM", "GRU", "RNN"):
        return _recurrent_macs(n)
    if n.op in ("DFT", "STFT"):
        return _spectral_macs(n)
    return 0


def _recurrent_macs(n: Node) -> Dim:
    """Every step multiplies X's row by W ([dirs, G*hidden, input]) and the state by R ([dirs, G*hidden,
    hidden]) for each batch row: seq*batch*dirs*G*hidden*(input + hidden), G = 4 (LSTM), 3 (GRU), 1 (RNN)."""
    x, w, r = (n.inputs[k].type.shape for k in range(3))
    if x is None or w is None or r is None or len(x) != 3:
        return 0
    seq, batch = (x[1], x[0]) if n.attrs.get("layout", 0) else (x[0], x[1])
    return seq * batch * (product(w) + product(r))


def _spectral_macs(n: Node) -> Dim:
    """A direct DFT: each output frequency sums N input samples times a complex twiddle, 2 real MACs per
    sample of a real signal, 4 of a complex one; an STFT does that per frame (window length samples)."""
    x, out = n.inputs[0].type.shape, n.outputs[0].type.shape
    if x is None or out is None:
        return 0
    per_sample = 2 if x[-1] == 1 else 4
    try:
        ctx = InferCtx(n, lookup(n.op))
        if n.op == "DFT":
            _, length, size, _ = dft_geometry(ctx)
            return product(out[:-1]) * min(length, size) * per_sample
        _, frame_length, _, _ = stft_geometry(ctx)
        return product(out[:-1]) * frame_length * per_sample
    except ShapeError:   # a node shape inference refused: no cost to report
        return 0


def graph_stats(g: Graph) -> GraphStats:
    hist = Counter(n.op for n in g.nodes)
    consts = g.constants()
    flops: Dict[str, Dim] = {}
    total: Dim = 0
    for n in g.nodes:
        m = node_macs(n)
        if m != 0:
            flops[n.op] = flops.get(n.op, 0) + m * 2
            total = total + m
    return GraphStats(dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))),
                      sum(int(v.const.size) for v in consts), sum(int(v.const.nbytes) for v in consts),
                      total, flops)


# --- a readable cost ---------------------------------------------------------------------------------
# The exact MAC count of a model with symbolic H and W is a polynomial over floor divisions and max() of
# the symbols (every stride-2 layer adds a (H + 1)/2): exact, and unreadable. For people, cost_terms reads
# a/b as an exact quotient, takes from max()/min() the argument that wins at the given point, and any other
# opaque part at its value there, leaving a polynomial in the symbols with a few terms that dominate.

Monomial = Tuple[str, ...]


def approximate_polynomial(d: Dim, at: Mapping[str, int]) -> Dict[Monomial, float]:
    """``d`` as a polynomial with real coefficients over plain symbols, close to ``d`` near the point ``at``
    (every symbol of ``d`` needs a value there)."""
    if isinstance(d, int):
        return {(): float(d)} if d else {}
    out: Dict[Monomial, float] = {}
    for mono, coef in d.terms:
        prod: Dict[Monomial, float] = {(): float(coef)}
        for atom in mono:
            prod = _poly_mul(prod, _approximate_atom(atom, at))
        for m, c in prod.items():
            out[m] = out.get(m, 0.0) + c
    return {m: c for m, c in out.items() if c}


def _approximate_atom(a: Atom, at) -> Dict[Monomial, float]:
    if a.kind == "sym":
        return {(a.args[0],): 1.0}
    if a.kind == "floordiv" and isinstance(a.args[1], int):
        return {m: c / a.args[1] for m, c in approximate_polynomial(a.args[0], at).items()}
    if a.kind in ("max", "min"):
        vals = [evaluate(x, at) for x in a.args]
        pick = vals.index(max(vals) if a.kind == "max" else min(vals))
        return approximate_polynomial(a.args[pick], at)
    return {(): float(evaluate(SymExpr({(a,): 1}), at))}


def _poly_mul(p: Dict[Monomial, float], q: Dict[Monomial, float]) -> Dict[Monomial, float]:
    out: Dict[Monomial, float] = {}
    for ma, ca in p.items():
        for mb, cb in q.items():
            m = tuple(sorted(ma + mb))
            out[m] = out.get(m, 0.0) + ca * cb
    return out


def cost_terms(d: Dim, at: Mapping[str, int], max_terms: int = 3, share: float = 0.01) -> str:
    """``d`` in a few terms: ``d`` itself when it is a short polynomial of plain symbols, else
    ``~ 4.2k*H*W + 310*H + ...``: the terms of :func:`approximate_polynomial` worth at least ``share`` of the
    total at ``at``, the largest first, at most ``max_terms`` of them."""
    if isinstance(d, int):
        return str(d)
    exact = all(a.kind == "sym" for mono, _ in d.terms for a in mono)
    if exact and len(d.terms) <= max_terms:
        return str(d)
    poly = approximate_polynomial(d, at)
    size = {m: abs(c) * _mono_value(m, at) for m, c in poly.items()}
    total = sum(size.values()) or 1.0
    ranked = sorted(poly, key=lambda m: (-size[m], -len(m), m))
    kept = [m for m in ranked if size[m] >= share * total][:max_terms] or ranked[:1]
    text = ""
    for k, m in enumerate(kept):
        c = poly[m]
        body = "*".join([_coef_text(abs(c))] * (not m or abs(c) != 1.0) + [_mono_text(m)] * bool(m))
        text += (("-" if c < 0 else "") if k == 0 else (" - " if c < 0 else " + ")) + body
    if len(kept) < len(poly):
        text += " + ..."
    return ("" if exact else "~ ") + text


def _mono_value(m: Monomial, at) -> float:
    out = 1.0
    for s in m:
        out *= at[s]
    return out


def _mono_text(m: Monomial) -> str:
    parts = []
    for s in dict.fromkeys(m):
        n = m.count(s)
        parts.append(s if n == 1 else f"{s}^{n}")
    return "*".join(parts)


def _coef_text(c: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if c >= div:
            return f"{c / div:.3g}{unit}"
    return f"{c:.3g}"
