"""Which contractions the precision policy keeps float32 whatever their ranges: by default the model's output
layers (a classifier's last Gemm, a pooler's dense layer), or the nodes the caller names (``keep_fp32``).

An output layer's rounding reaches the model's outputs unattenuated: every earlier layer's rounding error is
averaged over the many products of the layers after it, the last layer's is not. ResNet-50 bf16 (seeded
weights, 32 standard-normal inputs, relative error of the logits against onnxruntime float32): every Conv and
the Gemm narrowed, median 4.49e-3, max 5.20e-3; the Gemm (0.05% of the MACs) kept float32, median 3.81e-3, max
4.43e-3, at 1.02-1.03x the latency on an Intel Xeon (family 6, model 207) with AMX
(bench/results/xeon-session31/resnet50-bf16-head.txt). So a narrowing
policy keeps a contraction float32 where

* its output reaches a graph output through the ops of ``_PASS`` (reshapes and transposes, one-input elementwise
  ops such as ``Tanh`` and ``Softmax``) and of ``_PASS_WITH_CONSTANTS`` with constant other operands (a bias
  ``Add``, a scale ``Mul``) only, and
* its multiply-accumulates are at most :data:`HEAD_MAC_SHARE` of the model's (at the symbols' opt point): a
  GPT-2 decode step's LM head, 30% of its work, is narrowed; ResNet-50's classifier is kept.

``keep_fp32`` replaces the default: a list of node names or op types kept float32 (``[]`` keeps none), matched
against the optimised graph (the names ``cuvil precision report`` lists: a BatchNormalization folded into its
Conv is no node of it any more). A model whose MACs cannot be counted at the symbols' opt point keeps no layer
float32 by this default.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from ..errors import CuvilError
from ..ir.dim import evaluate
from ..ir.graph import Graph, Node
from ..ir.stats import node_macs

#: an output layer is kept float32 when its MACs are at most this share of the model's
HEAD_MAC_SHARE = 0.01
#: the formats whose policy keeps output layers float32 by default (int8 models come quantized: their own
#: QuantizeLinear nodes say what is narrowed)
HEAD_MODES = frozenset({"bf16", "fp16", "fp8", "auto"})
#: ops an output layer's value may pass through on its way to a graph output: moves and one-input elementwise
#: ops (their result's rounding is the layer's, unaveraged) ...
_PASS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity", "Relu", "LeakyRelu",
                   "Tanh", "Sigmoid", "Softmax", "LogSoftmax", "Gelu", "Erf", "Neg", "Abs", "Clip"})
#: ... and elementwise ops whose other operands are constants (a bias, a scale)
_PASS_WITH_CONSTANTS = frozenset({"Add", "Sub", "Mul", "Div"})
_CONTRACTIONS = frozenset({"Conv", "MatMul", "Gemm"})


def _reaches_output(graph: Graph, node: Node) -> bool:
    """Whether every use of ``node``'s output leads only through pass-through ops, and at least one path ends
    at a graph output."""
    outputs = {id(v) for v in graph.outputs}

    def walk(n: Node, depth: int) -> Optional[bool]:
        if depth > 16:
            return False
        found = False
        for v in n.outputs:
            if v is None:
                continue
            if id(v) in outputs:
                found = True
            for c in graph.consumers(v):
                data = [x for x in c.inputs if x is not None and not x.is_const]
                if (c.op not in _PASS and c.op not in _PASS_WITH_CONSTANTS) or len(data) != 1:
                    return False
                below = walk(c, depth + 1)
                if below is False:
                    return False
                found = found or bool(below)
        return found
    return walk(node, 0) is True


def _macs(n: Node, env) -> Optional[int]:
    try:
        return int(evaluate(node_macs(n), env))
    except (KeyError, ValueError, TypeError):   # a dim the symbols do not bind: its share is unknown
        return None


def output_heads(graph: Graph, share: float = HEAD_MAC_SHARE) -> Dict[str, str]:
    """The output layers the policy keeps float32 by default: node name -> the reason (module doc)."""
    env = {name: sym.tuned for name, sym in graph.symbols.items()}
    macs = {n.name: _macs(n, env) for n in graph.nodes if n.op in _CONTRACTIONS}
    if any(m is None for m in macs.values()):
        return {}
    total = sum(macs.values())
    out = {}
    for n in graph.nodes:
        if n.op not in _CONTRACTIONS or not total or macs[n.name] > share * total:
            continue
        if _reaches_output(graph, n):
            out[n.name] = (f"the model's output layer ({macs[n.name]:,} MACs, {macs[n.name] / total:.2%} of the "
                           f"model's): kept float32, its rounding reaches the output unaveraged (keep_fp32=[] / "
                           f"--keep-fp32 none narrows it)")
    return out


def kept_fp32(graph: Graph, mode: str, keep: Optional[Sequence[str]] = None) -> Dict[str, str]:
    """Node name -> why it stays float32: the output layers (``keep`` None, a narrowing ``mode`` of
    :data:`HEAD_MODES`), or every node named in ``keep`` or of an op type in it."""
    if keep is None:
        return output_heads(graph) if mode in HEAD_MODES else {}
    if isinstance(keep, str):
        raise CuvilError(f"keep_fp32={keep!r} is a string, not a list of node names or op types",
                         hint=f"keep_fp32=[{keep!r}]")
    keep = [str(k) for k in keep]
    names = {n.name for n in graph.nodes}
    ops = {n.op for n in graph.nodes}
    unknown = [k for k in keep if k not in names and k not in ops]
    if unknown:
        folded = {o.lower(): o for o in ops}
        near = [f"{k!r} -> {folded[k.lower()]!r}" for k in unknown if k.lower() in folded]
        raise CuvilError(f"keep_fp32: no node or op type {', '.join(map(repr, unknown))} in the optimised model",
                         details=[f"op types here: {', '.join(sorted(ops))}"]
                         + ([f"op types are case-sensitive: {', '.join(near)}"] if near else []),
                         hint="name nodes as `cuvil precision report MODEL` lists them (after optimisation: a "
                              "folded BatchNormalization is part of its Conv), or give op types (--keep-fp32 Gemm)")
    wanted = set(keep)
    return {n.name: f"kept float32 as asked (keep_fp32: {n.name if n.name in wanted else n.op})"
            for n in graph.nodes if n.name in wanted or n.op in wanted}
