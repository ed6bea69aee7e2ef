"""Adapters onto an imported graph: read, map to the ONNX model's weights, write unmerged, merge (proved)."""
from __future__ import annotations

import os
from typing import Optional, Sequence, Tuple

import onnx

from ..errors import CuvilError
from ..ir.graph import Graph
from ..rewrite_rules.engine import RewriteReport
from .adapter import Adapter, read_adapter
from .mapping import load_lora_map, map_adapter
from .merge import add_lora_branches, merge_lora


def resolve(spec) -> Tuple[Adapter, float, Optional[dict]]:
    """``(adapter or path, weight[, lora_map or its path])`` -> (Adapter, weight, lora_map dict)."""
    src, weight = spec[0], float(spec[1])
    lmap = spec[2] if len(spec) > 2 else None
    adapter = src if isinstance(src, Adapter) else read_adapter(src)
    if isinstance(lmap, (str, os.PathLike)):
        lmap = load_lora_map(lmap)
    if weight != weight or weight in (float("inf"), float("-inf")):
        raise CuvilError(f"LoRA weight {weight} for adapter {adapter.name!r} is not finite",
                         hint="give a finite --lora-weight (default 1.0)")
    return adapter, weight, lmap


def unmerged_graph(graph: Graph, model: onnx.ModelProto, specs: Sequence) -> Tuple[Graph, list, list]:
    """A copy of ``graph`` with every adapter of ``specs`` written unmerged (``x·W + ((x·a) ∘ s)·b``), its
    branches, and the targets (target, module, weight) per adapter in order."""
    parts = []
    for spec in specs:
        adapter, weight, lmap = resolve(spec)
        for t in map_adapter(model, adapter, lmap):
            parts.append((t, adapter.modules[t.module], weight))
    g = graph.clone()
    branches = add_lora_branches(g, parts)
    return g, branches, parts


def merged_graph(graph: Graph, model: onnx.ModelProto, specs: Sequence) -> Tuple[Graph, RewriteReport, list]:
    """A copy of ``graph`` with the adapters of ``specs`` (``(path or Adapter, weight[, lora_map])``) merged:
    each adapted weight is ``W + Σ weight·scale·B·A`` in its layout, correctly rounded, through the proved
    ``lora_merge_*`` rules. Returns the graph, the rewrite report (rules and verdicts) and one record per
    merged weight."""
    g, branches, _ = unmerged_graph(graph, model, specs)
    report, records = merge_lora(g, branches)
    g.verify()
    return g, report, records
