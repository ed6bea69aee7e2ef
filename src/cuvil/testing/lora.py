"""LoRA adapters made with numpy in PEFT's exact layout and names, for tests, docs and benches: random A [r, in]
and B [out, r] (PEFT starts B at zero; a random B makes the update visible), ``adapter_config.json`` as PEFT's
``save_pretrained`` writes it, the tensors saved with ``safetensors.numpy.save_file``."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import numpy as np
import onnx

from ..lora.mapping import linear_sites

PEFT_PREFIX = "base_model.model."


def model_modules(model, pattern: str = r".*") -> dict:
    """``{module: (in_features, out_features)}`` for the linear sites of ``model`` (a path or ModelProto) whose
    module name (initializer name less ``.weight``, or the exporter's scope) matches ``pattern`` (``re.search``),
    with the exporters' leading ``model.`` removed, as PEFT would name them on the bare model."""
    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(os.fspath(model))
    out = {}
    for s in linear_sites(model):
        for n in s.names:
            name = n[len("model."):] if n.startswith("model.") else n
            if re.search(pattern, name):
                io = s.shape if s.layout == "in_out" else (s.shape[1], s.shape[0])
                out[name] = (int(io[0]), int(io[1]))
                break
    return out


def write_peft_adapter(directory, modules: dict, r: int = 4, lora_alpha: float = 8.0, seed: int = 0,
                       dtype=np.float32, scale_b: float = 0.1, config: Optional[dict] = None,
                       ranks: Optional[dict] = None, prefix: str = PEFT_PREFIX) -> Path:
    """Write a PEFT LoRA adapter for ``modules`` (``{module: (in_features, out_features)}``) into ``directory``:
    ``adapter_model.safetensors`` with ``<prefix><module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r],
    and ``adapter_config.json`` (``config`` entries added/overriding). ``ranks``: per-module ranks (write the
    matching ``rank_pattern`` in ``config`` yourself to test it). Returns the directory."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (fin, fout) in modules.items():
        rank = (ranks or {}).get(module, r)
        tensors[f"{prefix}{module}.lora_A.weight"] = (rng.standard_normal((rank, fin)) / np.sqrt(fin)).astype(dtype)
        tensors[f"{prefix}{module}.lora_B.weight"] = (rng.standard_normal((fout, rank)) * scale_b).astype(dtype)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": None, "r": r, "lora_alpha": lora_alpha, "lora_dropout": 0.0,
           "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}), "fan_in_fan_out": False,
           "bias": "none", "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
           "modules_to_save": None, "base_model_name_or_path": None, "inference_mode": True}
    cfg.update(config or {})
    (d / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return d


def numpy_merged_model(model: onnx.ModelProto, specs) -> onnx.ModelProto:
    """An independent reference merge: a copy of ``model`` whose adapted weights are
    ``W + Σ weight·scale·B·A`` computed in numpy (float64, then cast to the weight's type), in the layout the
    consuming node reads, each adapted node given its own initializer where the weight is shared (GPT-2's
    tied lm_head). ``specs``: ``[(adapter dir or Adapter, weight), ...]``. For onnxruntime to run."""
    from onnx import numpy_helper
    from ..lora import map_adapter, read_adapter
    from ..lora.adapter import Adapter
    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {t.name: t for t in m.graph.initializer}
    acc = {}   # node name -> (initializer, layout, float64 sum of updates)
    for src, weight in specs:
        ad = src if isinstance(src, Adapter) else read_adapter(src)
        for t in map_adapter(m, ad):
            lm = ad.modules[t.module]
            d = float(weight) * lm.scale * (lm.B.astype(np.float64) @ lm.A.astype(np.float64))  # [out, in]
            d = d.T if t.layout == "in_out" else d
            prev = acc.get(t.node)
            acc[t.node] = (t, d if prev is None else prev[1] + d)
    producers = {o: n for n in m.graph.node for o in n.output}
    for node in list(m.graph.node):
        if node.name not in acc:
            continue
        t, d = acc[node.name]
        w = numpy_helper.to_array(inits[t.initializer])
        new = (w.astype(np.float64) + d).astype(w.dtype)
        name = f"{t.initializer}.merged.{node.name}"
        m.graph.initializer.append(numpy_helper.from_array(new, name))
        # re-point the node (or the Transpose / Identity it reads the weight through) at the merged copy
        chain, v = [node], node.input[1]
        while v != t.initializer:
            p = producers[v]
            chain.append(p)
            v = p.input[0]
        last = chain[-1]
        idx = 1 if last is node else 0
        if len(chain) > 1:   # a private copy of the chain for this node
            prev_out = name
            for p in reversed(chain[1:]):
                q = onnx.helper.make_node(p.op_type, [prev_out] + list(p.input[1:]), [p.output[0] + ".merged"],
                                          name=p.name + ".merged")
                q.attribute.extend(p.attribute)
                m.graph.node.insert(list(m.graph.node).index(node), q)
                prev_out = q.output[0]
            node.input[1] = prev_out
        else:
            node.input[idx] = name
    used = {i for n in m.graph.node for i in n.input} | {o.name for o in m.graph.output}
    keep = [t for t in m.graph.initializer if t.name in used]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    return m
