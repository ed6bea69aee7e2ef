"""The LoRA merge at compile time, as a proved rewrite.

1. :func:`add_lora_branches` writes each adapted weight's update into the graph unmerged, as ONNX nodes:
   ``y = op(x, W) + ((x·a) ∘ s)·b`` with ``a = Aᵀ`` [in, R], ``b = Bᵀ`` [R, out] and ``s`` [R] the scale of each
   rank component (``weight · lora_alpha / r``), several adapters of one weight side by side along R. This is
   the model with its adapters, computed as PEFT computes it unmerged.
2. :func:`merge_lora` then rewrites that graph with the ``lora_merge_*`` rules of ``rules/lora.rule`` (proved
   over the reals; their verdicts are recorded as every rule's are) into ``op(x, W + (a ∘ s)·b)``, and folds
   each new weight to the correctly rounded value of that exact sum (:mod:`cuvil.lora.rounding`), in place of
   the float32 evaluation a generic constant fold would do.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import CuvilError
from ..ir.graph import Graph, Node, Value
from ..rewrite_rules.dce import eliminate_dead_code
from ..rewrite_rules.engine import RewriteReport, apply_rules
from ..rewrite_rules.proved_rewrite import proof_record
from ..rewrite_rules.verdicts import builtin_rules, proved_rules
from .adapter import Adapter, LoraModule
from .mapping import LoraTarget
from .rounding import FORMATS, round_exact_sum

RULE_PREFIX = "lora_merge"


class Branch:
    """One adapted weight in the graph: the consuming ``node``, the weight constant ``w`` as the node reads it
    (through ``transpose`` or not), and the branch's constants ``a``, ``s``, ``b``."""

    def __init__(self, target: LoraTarget, node: Node, w: Value, transpose: Optional[Node], a: Value, s: Value,
                 b: Value, modules: List[str]):
        self.target, self.node, self.w, self.transpose = target, node, w, transpose
        self.a, self.s, self.b, self.modules = a, s, b, modules


def lora_rules():
    """The merge rules of the built-in library (``rules/lora.rule``)."""
    rules = [r for r in builtin_rules() if r.name.startswith(RULE_PREFIX)]
    if not rules:  # pragma: no cover - the package ships them
        raise CuvilError("the LoRA merge rules (rules/lora.rule) are missing from the rule library",
                         hint="reinstall cuvil")
    return rules


def _weight_in_graph(g: Graph, t: LoraTarget) -> Tuple[Node, Value, Optional[Node]]:
    """The node ``t`` names, its weight constant and the Transpose between them (None without one); the
    weight input is made to read the constant (or the Transpose) directly: Identity nodes between are skipped
    (data movement: the same values)."""
    nodes = [n for n in g.nodes if n.name == t.node]
    if len(nodes) != 1:
        raise CuvilError(f"LoRA target node {t.node!r} (module {t.module!r}) is not in the graph",
                         hint="apply adapters (with_lora / --lora) to the imported model, before optimize()")
    node = nodes[0]
    v, transpose = node.inputs[1], None
    while not v.is_const:
        p = v.producer
        if p is None or p.op not in ("Identity", "Transpose"):
            raise CuvilError(f"the weight of node {t.node!r} (module {t.module!r}) is no longer a constant "
                             f"{t.initializer!r}", hint="apply adapters before optimize()")
        if p.op == "Transpose":
            transpose = p
        v = p.inputs[0]
    if v.name != t.initializer or tuple(v.shape) != tuple(t.shape):
        raise CuvilError(f"node {t.node!r} reads {v.name!r} {list(v.shape)}, not {t.initializer!r} "
                         f"{list(t.shape)} (module {t.module!r})", hint="apply adapters before optimize()")
    if transpose is None:
        if node.inputs[1] is not v:
            g.set_input(node, 1, v)
    else:
        if transpose.inputs[0] is not v:
            g.set_input(transpose, 0, v)
        if node.inputs[1] is not transpose.outputs[0]:
            g.set_input(node, 1, transpose.outputs[0])
    return node, v, transpose


def add_lora_branches(g: Graph, parts: Sequence[Tuple[LoraTarget, LoraModule, float]]) -> List[Branch]:
    """Write each ``(target, module, weight)``'s update into ``g`` (in place) unmerged, as ONNX nodes; the
    parts of one target (several adapters) share one branch of rank ΣR. Returns the branches."""
    by_node: "OrderedDict[str, list]" = OrderedDict()
    for t, lm, weight in parts:
        by_node.setdefault(t.node, []).append((t, lm, weight))
    branches = []
    for node_name, items in by_node.items():
        t = items[0][0]
        node, w, transpose = _weight_in_graph(g, t)
        dt = w.const.dtype
        if str(dt) not in FORMATS:
            raise CuvilError(f"weight {t.initializer!r} (module {t.module!r}) is {dt}: LoRA merges into "
                             "float32, float16 or bfloat16 weights", hint="export the model in float32")
        a = np.concatenate([lm.A.astype(np.float64).T for _, lm, _ in items], axis=1).astype(dt)
        b = np.concatenate([lm.B.astype(np.float64).T for _, lm, _ in items], axis=0).astype(dt)
        s = np.concatenate([np.full(lm.rank, float(weight) * lm.scale) for _, lm, weight in items]).astype(dt)
        x, y = node.inputs[0], node.outputs[0]
        uses, is_out = list(y.uses), [i for i, o in enumerate(g.outputs) if o is y]
        base = f"{node_name}.lora"
        ca, cs, cb = g.const(a, base + ".a"), g.const(s, base + ".s"), g.const(b, base + ".b")
        xa = g.add_node("MatMul", [x, ca], name=g.fresh_name(base + ".xa"))
        xas = g.add_node("Mul", [xa.outputs[0], cs], name=g.fresh_name(base + ".scale"))
        up = g.add_node("MatMul", [xas.outputs[0], cb], name=g.fresh_name(base + ".up"))
        add = g.add_node("Add", [y, up.outputs[0]], name=g.fresh_name(base + ".add"))
        for n, i in uses:
            g.set_input(n, i, add.outputs[0])
        for i in is_out:
            g.outputs[i] = add.outputs[0]
        branches.append(Branch(t, node, w, transpose, ca, cs, cb, [tt.module for tt, _, _ in items]))
    g.toposort()
    return branches


def merge_lora(g: Graph, branches: Sequence[Branch], report: Optional[RewriteReport] = None) -> Tuple[RewriteReport, list]:
    """Rewrite the branches of :func:`add_lora_branches` with the proved ``lora_merge_*`` rules and fold each
    merged weight to the correctly rounded exact value. Returns the report (rules applied, their verdicts) and
    one record per merged weight (module(s), initializer, elements, how many decided in exact arithmetic)."""
    report = report or RewriteReport()
    proofs: dict = {}
    runnable = proved_rules(lora_rules(), proofs=proofs)
    before = dict(report.applied)
    apply_rules(g, runnable, report)
    fired = sum(report.applied.values()) - sum(before.values())
    records = []
    for br in branches:
        # the replacement's weight: w + MatMul(Mul(a, s), b), optionally Transpose()d, feeding the node
        ups = [n for n, _ in br.b.uses if n.op == "MatMul" and n.inputs[1] is br.b and n.inputs[0].producer is not None
               and n.inputs[0].producer.op == "Mul" and n.inputs[0].producer.inputs[0] is br.a]
        adds = [n for u in ups for n in _through_transpose(u.outputs[0])
                if n.op == "Add" and n.inputs[0] is br.w]
        if len(adds) != 1:
            raise CuvilError(f"the LoRA merge rule did not apply to node {br.target.node!r} "
                             f"(module {br.target.module!r})",
                             hint="report this with the model: the unmerged LoRA form was not matched")
        add = adds[0]
        transposed = add.inputs[1].producer.op == "Transpose"
        a, s, b = br.a.const, br.s.const, br.b.const
        w = br.w.const
        fmt = str(w.dtype)
        if transposed:   # w is [out, in]: w + ((a ∘ s)·b)ᵀ = w + (bᵀ ∘ s)·aᵀ
            merged, exact = round_exact_sum(w, b.T, s, a.T, fmt)
        else:
            merged, exact = round_exact_sum(w, a, s, b, fmt)
        new = g.const(merged.astype(w.dtype), name=f"{br.w.name}.merged")
        g.replace_all_uses(add.outputs[0], new)
        # the rewritten MatMul/Gemm keeps the original node's name (mapping, hot-swap slots and tools find it)
        for n in _through_transpose(new):
            if n.op in ("MatMul", "Gemm"):
                n.name = br.target.node
        records.append({"modules": list(br.modules), "node": br.target.node, "initializer": br.target.initializer,
                        "layout": br.target.layout, "elements": int(merged.size), "exact_decisions": exact,
                        "rounding": f"correctly rounded to {fmt}"})
    eliminate_dead_code(g)
    g.toposort()
    if fired < len(branches):  # pragma: no cover - caught above per branch
        raise CuvilError("the LoRA merge rules applied fewer times than there are adapted weights")
    report.verdicts.update({r.name: r.proof for r in runnable})
    report.proofs.update({name: proof_record(v) for name, v in proofs.items()})
    return report, records


def _through_transpose(v: Value) -> List[Node]:
    out = []
    for n, _ in v.uses:
        if n.op == "Transpose":
            out += [m for m, _ in n.outputs[0].uses]
        else:
            out.append(n)
    return out
