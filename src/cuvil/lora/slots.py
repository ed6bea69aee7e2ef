"""LoRA slots: a graph whose chosen linear layers take an adapter at run time, without recompiling.

For each target layer ``y = x·W`` (a MatMul with a constant ``W`` [in, out], or a Gemm with a constant ``B``,
``transB`` either way) the pass adds three graph inputs that the runtime supplies, not the caller (the
library's *hidden* inputs, after the public ones): ``A`` [in, R] and ``B`` [R, out], the active adapter's
``Aᵀ`` and ``s·Bᵀ`` zero-padded to the library's slot rank R, and ``on``, a bool scalar. The layer becomes

    t  = MatMul(x, A)         guarded by on
    u  = MatMul(t, B)         guarded by on
    y2 = Add(y, u)            guarded by on
    y' = Where(on, y2, y)     -> every former reader of y

The guards let the runtime skip the three branch kernels when ``on`` is false (no adapter active, or the
active one leaves this layer alone), and ``Where`` then selects ``y`` itself: a session with no active
adapter computes the base model's values bit for bit. Zero padding adds exact zeros to each dot product of
``t`` and ``u``, so an adapter of rank r < R gives what rank r would.

Targets are chosen like PEFT's ``target_modules``: module-name suffixes (``query`` matches
``encoder.layer.0.attention.self.query``), or, for a pattern holding a regex character, a regular expression
the whole module name must match. A layer's module name is its weight initializer's less ``.weight``
(``encoder.layer.0.attention.self.query.weight``), else its node's path (``/model/encoder/layer.0/attention/
self/query/MatMul`` -> ``model.encoder.layer.0.attention.self.query``), as the torch exporters leave them.
"""
from __future__ import annotations

import re
from typing import List, Optional, Sequence, Tuple

import attrs

from ..errors import CuvilError
from ..ir.dtype import DType
from ..ir.graph import Graph, Node, Value
from ..ir.types import TensorType

#: The attention projections of the common architectures (BERT: query, key, value, attention.output.dense;
#: GPT-2: c_attn, attn.c_proj; LLaMA-style: q_proj, k_proj, v_proj, o_proj): the default targets.
DEFAULT_TARGETS = ("query", "key", "value", "attention.output.dense", "c_attn", "attn.c_proj",
                   "q_proj", "k_proj", "v_proj", "o_proj")

#: Graph input names of slot k (hidden: the runtime supplies them).
HIDDEN_NAMES = ("lora.{k}.A", "lora.{k}.B", "lora.{k}.on")

_REGEX_CHARS = set("*+?[](){}|^$\\")


@attrs.frozen
class LoraSlot:
    """One adaptable layer: ``module`` (its name), ``in_features``, ``out_features``, the slot ``rank``;
    ``weight``: the constant it multiplies by; ``node``: the MatMul/Gemm."""

    index: int
    module: str
    in_features: int
    out_features: int
    rank: int
    weight: str
    node: str

    def to_json(self) -> dict:
        return {"module": self.module, "in": self.in_features, "out": self.out_features, "rank": self.rank,
                "weight": self.weight, "node": self.node}


def module_name(node: Node, weight: Value) -> Optional[str]:
    """The module a linear layer belongs to: from its weight's name, else from its node's path; None when
    neither names one."""
    if weight.name.endswith(".weight"):
        return weight.name[:-len(".weight")]
    if "/" in node.name:
        parts = [p for p in node.name.split("/") if p]
        if len(parts) >= 2:
            return ".".join(parts[:-1])
    return None


def linear_layers(g: Graph) -> List[Tuple[Node, Value, str, int, int]]:
    """Every layer a slot can adapt: ``(node, weight, module, in, out)`` for each float32 MatMul with a
    constant 2-D right operand and each Gemm with a constant 2-D ``B`` (not ``transA``) that names a module."""
    out = []
    for n in g.nodes:
        if n.op not in ("MatMul", "Gemm") or len(n.inputs) < 2:
            continue
        x, w = n.inputs[0], n.inputs[1]
        if x is None or w is None or x.is_const or not w.is_const or w.shape is None or len(w.shape) != 2:
            continue
        if x.shape is None or len(x.shape) < 2 or w.dtype != DType.FLOAT:
            continue
        if n.op == "Gemm" and n.attrs.get("transA", 0):
            continue
        name = module_name(n, w)
        if name is None:
            continue
        d_in, d_out = (int(w.shape[1]), int(w.shape[0])) if n.op == "Gemm" and n.attrs.get("transB", 0) \
            else (int(w.shape[0]), int(w.shape[1]))
        out.append((n, w, name, d_in, d_out))
    return out


def matches(module: str, pattern: str) -> bool:
    """PEFT's ``target_modules`` rule for one pattern: a regex (it holds a regex character) must match the
    whole name; any other pattern is a suffix of dotted components."""
    if _REGEX_CHARS & set(pattern):
        return re.fullmatch(pattern, module) is not None
    return module == pattern or module.endswith("." + pattern)


def _check_pattern(pattern: str) -> None:
    if _REGEX_CHARS & set(pattern):
        try:
            re.compile(pattern)
        except re.error as e:
            raise CuvilError(f"--lora-targets {pattern!r} is not a valid regular expression: {e}",
                             hint="give module-name suffixes (query value) or a valid regex "
                                  r"(.*attention\.self\.(query|value))") from None


def select_targets(g: Graph, patterns: Sequence[str] = ()) -> List[Tuple[Node, Value, str, int, int]]:
    """The layers of ``g`` whose module matches one of ``patterns`` (default :data:`DEFAULT_TARGETS`); a
    pattern that matches nothing, or no layer at all, is a CuvilError listing the modules there are."""
    patterns = tuple(patterns) or DEFAULT_TARGETS
    for p in patterns:
        _check_pattern(p)
    layers = linear_layers(g)
    chosen = [t for t in layers if any(matches(t[2], p) for p in patterns)]
    modules = sorted({t[2] for t in layers})
    shown = ", ".join(modules[:8]) + (f" (+{len(modules) - 8} more)" if len(modules) > 8 else "")
    if not layers:
        raise CuvilError("the model has no linear layer a LoRA slot can adapt (a float32 MatMul or Gemm with a "
                         "constant weight whose initializer or node names its module)",
                         hint="export the model with the torch exporter's names kept (torch.onnx.export keeps "
                              "node paths such as /encoder/layer.0/attention/self/query/MatMul)")
    if patterns != DEFAULT_TARGETS:
        unused = [p for p in patterns if not any(matches(t[2], p) for t in layers)]
        if unused:
            raise CuvilError(f"--lora-targets {' '.join(unused)} matches no linear layer of the model",
                             details=[f"modules: {shown}"],
                             hint="give module-name suffixes or a regex that match these modules")
    if not chosen:
        raise CuvilError(f"no linear layer matches the LoRA targets {' '.join(patterns)}",
                         details=[f"modules: {shown}"],
                         hint="name the layers to adapt: --lora-targets SUFFIX ... (Python: lora_targets=[...])")
    return chosen


def add_lora_slots(g: Graph, rank: int, patterns: Sequence[str] = ()) -> Tuple[Graph, List[LoraSlot]]:
    """A copy of ``g`` with a LoRA slot of rank ``rank`` on each target layer (module docstring), and the
    slots in hidden-input order: slot k's inputs are ``g.inputs[-3 * n + 3 * k:]`` (A, B, on)."""
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= 4096:
        raise CuvilError(f"--lora-slots {rank!r}: the slot rank must be an integer in [1, 4096]",
                         hint="give the largest adapter rank you will load, e.g. --lora-slots 16")
    g = g.clone()
    slots: List[LoraSlot] = []
    for k, (node, w, module, d_in, d_out) in enumerate(select_targets(g, patterns)):
        if rank > min(d_in, d_out):
            raise CuvilError(f"--lora-slots {rank} is above {module}'s smaller dimension ({d_in} x {d_out})",
                             hint=f"give a rank up to {min(d_in, d_out)}")
        names = [n.format(k=k) for n in HIDDEN_NAMES]
        a = g.add_input(names[0], TensorType(DType.FLOAT, (d_in, rank)))
        b = g.add_input(names[1], TensorType(DType.FLOAT, (rank, d_out)))
        on = g.add_input(names[2], TensorType(DType.BOOL, ()))
        y = node.outputs[0]
        uses, outs = list(y.uses), [j for j, o in enumerate(g.outputs) if o is y]
        guard = (on, True)
        t = g.add_node("MatMul", [node.inputs[0], a], name=g.fresh_name(f"{node.name}/lora_A")).outputs[0]
        u = g.add_node("MatMul", [t, b], name=g.fresh_name(f"{node.name}/lora_B")).outputs[0]
        y2 = g.add_node("Add", [y, u], name=g.fresh_name(f"{node.name}/lora_add")).outputs[0]
        for v in (t, u, y2):
            v.producer.guard = guard
        y3 = g.add_node("Where", [on, y2, y], name=g.fresh_name(f"{node.name}/lora_select")).outputs[0]
        for user, i in uses:
            g.set_input(user, i, y3)
        for j in outs:
            g.outputs[j] = y3
        slots.append(LoraSlot(k, module, d_in, d_out, rank, w.name, node.name))
    modules = [s.module for s in slots]
    dup = sorted({m for m in modules if modules.count(m) > 1})
    if dup:
        raise CuvilError(f"several linear layers are named {', '.join(dup)}: an adapter's module could not say "
                         f"which one it changes", hint="narrow --lora-targets to layers with distinct names")
    return g, slots   # add_input appended: the hidden inputs follow the public ones, slot by slot
