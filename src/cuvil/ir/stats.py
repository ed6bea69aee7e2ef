"""Static statistics of a graph: op histogram, parameters, and FLOPs of the compute-heavy ops."""
from __future__ import annotations

from collections import Counter
from typing import Dict

import attrs

from .dim import Dim, product
from .graph import Graph, Node


@attrs.define
class GraphStats:
    op_histogram: Dict[str, int]
    parameters: int          # elements of all constants the graph reads
    parameter_bytes: int
    macs: Dim                # multiply-accumulates of Conv/ConvTranspose/Gemm/MatMul (symbolic if shapes are)
    flops_by_op: Dict[str, Dim]

    @property
    def flops(self) -> Dim:
        return self.macs * 2


def node_macs(n: Node) -> Dim:
    """Multiply-accumulates of one Conv/ConvTranspose/Gemm/MatMul node, 0 for other ops."""
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
