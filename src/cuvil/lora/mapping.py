"""Map each module of a LoRA adapter to the weight it modifies in an ONNX graph.

A *linear site* is a MatMul(x, W) or Gemm(x, W) whose W is a 2-D initializer, reached directly or through
Identity nodes and at most one constant Transpose(perm=[1, 0]) (the dynamo exporter's MatMul(x, Transpose(W))).
Its layout is how the node consumes W: ``in_out`` (MatMul, Gemm transB=0) or ``out_in`` (Gemm transB=1, or W
behind a Transpose). A site is known by the names the torch exporters leave:

1. the initializer's name less ``.weight`` (``model.transformer.h.0.attn.c_attn.weight``);
2. the consuming node's module scope: the TorchScript exporter's node name
   (``/model/encoder/layer.0/attention/self/query/MatMul`` -> ``model.encoder.layer.0.attention.self.query``), the
   dynamo exporter's ``pkg.torch.onnx.name_scopes`` metadata (its last module scope).

A module ``M`` (``encoder.layer.0.attention.self.query``) matches a name ``N`` when, compared by dotted
components from the end, one is a suffix of the other, or they differ in their first component only (a wrapper's
attribute: ``bert.`` against ``model.``). Among the sites that match, the one with the longest common suffix wins;
a tie between different sites is an ambiguity. ``lora_map`` (module -> initializer or node name) overrides the
names for the modules it lists."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Optional

import onnx
from onnx import numpy_helper

from ..errors import CuvilError
from ..frontend.torch_scopes import node_scope
from .adapter import Adapter

#: The ONNX element types a merge can round to.
FLOAT_TYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16",
               onnx.TensorProto.BFLOAT16: "bfloat16", onnx.TensorProto.DOUBLE: "float64"}


@dataclass
class LoraTarget:
    """Where one adapter module lands: the ``initializer`` holding W, its ``layout`` as the consuming ``node``
    reads it (``in_out``: [in, out], ``out_in``: [out, in]), whether a constant Transpose sits between them,
    and ``shared_with``: the other nodes that read the same initializer (a merge must then give ``node`` its
    own copy). ``names``: the names by which the site was matched (for messages)."""

    module: str
    initializer: str
    layout: str
    node: str
    through_transpose: bool = False
    shape: tuple = ()
    dtype: str = "float32"
    shared_with: tuple = ()
    names: tuple = field(default=(), repr=False)

    @property
    def in_features(self) -> int:
        return int(self.shape[0] if self.layout == "in_out" else self.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.shape[1] if self.layout == "in_out" else self.shape[0])


@dataclass
class _Site:
    node: onnx.NodeProto
    initializer: str
    layout: str
    through_transpose: bool
    shape: tuple
    dtype: str
    names: list
    chain: list = field(default_factory=list)  # the Identity/Transpose nodes between W and the node


def linear_sites(model: onnx.ModelProto) -> list:
    """Every MatMul/Gemm of the main graph whose second operand is a 2-D float initializer (see module doc)."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    sites = []
    for node in g.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and attrs.get("transA", 0):
            continue
        name, transposed, names, chain = node.input[1], False, [], []
        ok = True
        while name not in inits:
            p = producer.get(name)
            if p is None:
                ok = False
                break
            chain.append(p)
            if p.op_type == "Identity":
                name = p.input[0]
            elif p.op_type == "Transpose" and not transposed:
                perm = [a for a in p.attribute if a.name == "perm"]
                if perm and list(perm[0].ints) != [1, 0]:
                    ok = False
                    break
                transposed, name = True, p.input[0]
            else:
                ok = False
                break
        if not ok:
            continue
        t = inits[name]
        if len(t.dims) != 2 or t.data_type not in FLOAT_TYPES:
            continue
        trans_b = bool(attrs.get("transB", 0)) if node.op_type == "Gemm" else False
        layout = "out_in" if (trans_b != transposed) else "in_out"
        if name.endswith(".weight"):
            names.append(name[:-len(".weight")])
        scope = node_scope(node)
        if scope:
            names.append(scope)
        names = list(dict.fromkeys(names))
        sites.append(_Site(node, name, layout, transposed, tuple(int(d) for d in t.dims),
                           FLOAT_TYPES[t.data_type], names, chain))
    return sites


def suffix_score(module: str, name: str) -> int:
    """How many trailing dotted components ``module`` and ``name`` share, if they match (see module doc), else 0."""
    m, n = module.split("."), name.split(".")
    k = 0
    while k < len(m) and k < len(n) and m[-1 - k] == n[-1 - k]:
        k += 1
    if k == 0:
        return 0
    if k == len(m) or k == len(n) or (k == len(m) - 1 and k == len(n) - 1):
        return k
    return 0


def load_lora_map(path) -> dict:
    """A --lora-map file: JSON or YAML, ``{module: initializer or node name}``."""
    import yaml
    try:
        with open(path) as f:
            data = yaml.safe_load(f)  # YAML is a superset of JSON
    except OSError as e:
        raise CuvilError(f"cannot read --lora-map {str(path)!r}: {e.strerror}", hint="give a JSON or YAML file")
    except yaml.YAMLError as e:
        raise CuvilError(f"--lora-map {str(path)!r} is not JSON or YAML: {e}",
                         hint='write it as {"encoder.layer.0.attention.self.query": "onnx::MatMul_335", ...}')
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise CuvilError(f"--lora-map {str(path)!r} must map module names to initializer (or node) names",
                         hint='write it as {"encoder.layer.0.attention.self.query": "onnx::MatMul_335", ...}')
    return data


def map_adapter(model: onnx.ModelProto, adapter: Adapter, lora_map: Optional[dict] = None) -> list:
    """One :class:`LoraTarget` per module of ``adapter``, in the adapter's module order; raises a
    :class:`CuvilError` naming the first module that maps to nothing, ambiguously, or to a weight of another
    shape. ``lora_map``: module -> initializer name (or consuming node name), for graphs whose names were lost."""
    sites = linear_sites(model)
    if not sites:
        raise CuvilError(f"the model has no MatMul/Gemm with a constant 2-D weight for adapter {adapter.name!r}",
                         hint="LoRA adapts Linear layers; export the model with its weights as initializers")
    by_init: dict = {}
    for s in sites:
        by_init.setdefault(s.initializer, []).append(s)
    lora_map = dict(lora_map or {})
    unknown = sorted(set(lora_map) - set(adapter.modules))
    if unknown:
        raise CuvilError(f"--lora-map names {len(unknown)} module(s) that adapter {adapter.name!r} lacks",
                         details=unknown + [f"close: {', '.join(difflib.get_close_matches(unknown[0], adapter.modules, 3))}"],
                         hint="use the module names of the adapter's keys (less base_model.model. and .lora_A.weight)")
    targets, taken = [], {}
    for module, lm in adapter.modules.items():
        if module in lora_map:
            site = _site_from_map(module, lora_map[module], sites, by_init, model)
        else:
            site = _site_by_name(module, sites, adapter)
        key = (site.node.name, site.initializer)
        if key in taken:
            raise CuvilError(f"adapter {adapter.name!r}: modules {taken[key]!r} and {module!r} both map to "
                             f"initializer {site.initializer!r} (node {site.node.name!r})",
                             hint="give --lora-map FILE to say which weight each module modifies")
        taken[key] = module
        want = (lm.in_features, lm.out_features) if site.layout == "in_out" else (lm.out_features, lm.in_features)
        if tuple(site.shape) != want:
            raise CuvilError(
                f"adapter {adapter.name!r}: module {module!r} (lora_A {list(lm.A.shape)}, lora_B {list(lm.B.shape)}) "
                f"expects a weight of shape {list(want)} ({site.layout}) but initializer {site.initializer!r} has "
                f"{list(site.shape)}", hint="the adapter was trained for another model size, or the module maps to "
                                            "the wrong weight: give --lora-map FILE")
        shared = _other_readers(model, site)
        targets.append(LoraTarget(module=module, initializer=site.initializer, layout=site.layout,
                                  node=site.node.name, through_transpose=site.through_transpose, shape=site.shape,
                                  dtype=site.dtype, shared_with=shared, names=tuple(site.names)))
    return targets


def _other_readers(model: onnx.ModelProto, site: _Site) -> tuple:
    """The nodes other than ``site``'s own that read its initializer (directly or through its chain)."""
    values = {site.initializer} | {o for p in site.chain for o in p.output}
    own = {id(site.node)} | {id(p) for p in site.chain}
    out = [n.name or n.op_type for n in model.graph.node if id(n) not in own and values & set(n.input)]
    out += [o.name for o in model.graph.output if o.name in values]
    return tuple(out)


def _site_by_name(module: str, sites: list, adapter: Adapter) -> _Site:
    scored = []
    for s in sites:
        best = max((suffix_score(module, n) for n in s.names), default=0)
        if best:
            scored.append((best, s))
    if not scored:
        all_names = sorted({n for s in sites for n in s.names})
        close = difflib.get_close_matches(module, all_names, 4, 0.5)
        details = [f"close names in the graph: {', '.join(close)}"] if close else []
        unnamed = [s.initializer for s in sites if not s.names]
        if unnamed:
            details.append(f"{len(unnamed)} of the {len(sites)} MatMul/Gemm weights carry no module names "
                           f"(initializers {', '.join(unnamed[:4])}{', ...' if len(unnamed) > 4 else ''})")
        raise CuvilError(f"adapter {adapter.name!r}: module {module!r} maps to no weight of the model",
                         details=details,
                         hint="give --lora-map FILE (JSON or YAML: module -> initializer name) for this module")
    top = max(k for k, _ in scored)
    best = [s for k, s in scored if k == top]
    if len(best) > 1:
        raise CuvilError(f"adapter {adapter.name!r}: module {module!r} matches {len(best)} weights equally",
                         details=[f"{s.initializer} (node {s.node.name}, named {', '.join(s.names)})" for s in best],
                         hint="give --lora-map FILE (JSON or YAML: module -> initializer or node name) to choose one")
    return best[0]


def _site_from_map(module: str, target: str, sites: list, by_init: dict, model: onnx.ModelProto) -> _Site:
    if target in by_init:
        cands = by_init[target]
        if len(cands) > 1:
            raise CuvilError(f"--lora-map: initializer {target!r} (for {module!r}) is read by {len(cands)} "
                             "MatMul/Gemm nodes", details=[s.node.name for s in cands],
                             hint="map the module to the name of the consuming node instead")
        return cands[0]
    by_node = [s for s in sites if s.node.name == target]
    if by_node:
        return by_node[0]
    inits = {t.name for t in model.graph.initializer}
    why = ("is not read by a MatMul/Gemm as its weight" if target in inits else "is no initializer or node of the model")
    close = difflib.get_close_matches(target, sorted(by_init), 4, 0.5)
    raise CuvilError(f"--lora-map: {target!r} (for module {module!r}) {why}",
                     details=[f"close: {', '.join(close)}"] if close else [],
                     hint="map the module to the initializer a MatMul/Gemm reads as its weight "
                          "(`cuvil lora check` lists them)")


def initializer_array(model: onnx.ModelProto, name: str):
    """The named initializer as a numpy array (external data already loaded)."""
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    raise KeyError(name)
