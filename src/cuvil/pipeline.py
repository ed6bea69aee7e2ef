"""``Pipeline``: the one place that sequences Cuvil's stages (import -> optimize -> export/compile)."""
from __future__ import annotations

import os
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx

from .errors import ShapeError
from .frontend import export_model, import_model, load_model
from .ir.dim import SymExpr, evaluate
from .ir.graph import Graph
from .ir.printer import print_graph
from .ir.stats import GraphStats, graph_stats
from .rewrite_rules.engine import RewriteReport

ModelSource = Union[str, os.PathLike, bytes, onnx.ModelProto]
RulePath = Union[str, os.PathLike]


class Pipeline:
    """A model on its way through Cuvil. Each stage returns a new Pipeline; the source is left as it was.

    >>> from cuvil import Pipeline
    >>> p = Pipeline.from_onnx("model.onnx").optimize()      # doctest: +SKIP
    >>> outputs = p.run_reference({"x": x})                  # doctest: +SKIP
    """

    def __init__(self, graph: Graph, report: Optional[RewriteReport] = None, initializer_elements: Optional[int] = None,
                 rule_paths: Sequence[RulePath] = ()):
        self._graph = graph
        self.report = report
        self.rule_paths: Tuple[RulePath, ...] = tuple(rule_paths)
        # Elements of the source model's initializers (what model zoos call its parameter count).
        self.initializer_elements = initializer_elements

    @classmethod
    def from_onnx(cls, source: ModelSource, *, constant_initializer_inputs: bool = True) -> "Pipeline":
        """Import an ONNX model (path, bytes or ModelProto), external data included."""
        model = load_model(source)
        graph = import_model(model, constant_initializer_inputs=constant_initializer_inputs)
        return cls(graph, initializer_elements=sum(int(np.prod(t.dims)) for t in model.graph.initializer))

    @property
    def graph(self) -> Graph:
        return self._graph

    def with_rules(self, *paths: RulePath) -> "Pipeline":
        """The same model, with extra ``.rule`` files or directories for :meth:`optimize`."""
        return Pipeline(self._graph, self.report, self.initializer_elements, self.rule_paths + tuple(paths))

    def optimize(self, rules: Union[RulePath, Sequence[RulePath], None] = None, *, builtin: bool = True,
                 on_unproved: str = "error") -> "Pipeline":
        """Rewrite a copy of the graph to a fixpoint: the built-in rules (unless ``builtin=False``), the
        rules of :meth:`with_rules` and ``rules``, together with folding, CSE and DCE.

        Every rule must be proved first (shipped verdicts, the proof cache, or a proof now); an unproved
        rule raises :class:`cuvil.rewrite_rules.prove.RuleRejectedError` (``on_unproved="skip"`` leaves it out).
        """
        from .dsl.parser import load_rules
        from .rewrite_rules.engine import rewrite
        from .rewrite_rules.verdicts import builtin_rules, proved_rules
        extra = list(self.rule_paths)
        if rules is not None:
            extra += [rules] if isinstance(rules, (str, os.PathLike)) else list(rules)
        all_rules = (builtin_rules() if builtin else []) + (load_rules(extra) if extra else [])
        runnable = proved_rules(all_rules, on_unproved=on_unproved)
        g = self._graph.clone()
        report = rewrite(g, runnable)
        return Pipeline(g, report, self.initializer_elements, self.rule_paths)

    def to_onnx(self) -> onnx.ModelProto:
        return export_model(self._graph)

    def stats(self) -> GraphStats:
        return graph_stats(self._graph)

    def print_ir(self) -> str:
        return print_graph(self._graph)

    def check_inputs(self, inputs: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Validate names, dtypes and shapes (symbols bound consistently); errors are ShapeError."""
        g = self._graph
        names = [v.name for v in g.inputs]
        unknown = sorted(set(inputs) - set(names))
        if unknown:
            raise ShapeError(f"unknown input(s) {unknown}; the model's inputs are {names}")
        env: Dict[str, int] = {}
        out = {}
        for v in g.inputs:
            if v.name not in inputs:
                raise ShapeError(f"missing input {v.name!r} ({v.type})")
            arr = np.asarray(inputs[v.name])
            if arr.dtype != v.dtype.numpy:
                raise ShapeError(f"input {v.name!r}: expected {v.dtype.numpy} ({v.type}), got {arr.dtype}")
            if v.shape is not None:
                if arr.ndim != len(v.shape):
                    raise ShapeError(f"input {v.name!r}: expected rank {len(v.shape)} ({v.type}), got shape {arr.shape}")
                for k, (d, got) in enumerate(zip(v.shape, arr.shape)):
                    if isinstance(d, SymExpr) and len(d.free_symbols) == 1 and str(d) in g.symbols:
                        sym = g.symbols[str(d)]
                        if not sym.min <= got <= sym.max:
                            raise ShapeError(f"input {v.name!r} dim {k}: {sym.name} = {got} is outside [{sym.min}, {sym.max}]")
                        if env.setdefault(sym.name, got) != got:
                            raise ShapeError(f"input {v.name!r} dim {k}: {sym.name} = {got}, but another input has {sym.name} = {env[sym.name]}")
                    elif isinstance(d, int) and d != got:
                        raise ShapeError(f"input {v.name!r}: expected shape {v.type}, got {arr.shape}")
            out[v.name] = arr
        for v in g.inputs:  # derived dims (e.g. 2*N) checked once every symbol is bound
            for k, (d, got) in enumerate(zip(v.shape or (), out[v.name].shape)):
                if isinstance(d, SymExpr) and d.free_symbols <= env.keys() and evaluate(d, env) != got:
                    raise ShapeError(f"input {v.name!r} dim {k}: expected {d} = {evaluate(d, env)}, got {got}")
        return out

    def run_reference(self, inputs: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Run the graph through ``onnx.reference`` (:mod:`cuvil.reference`) on the exported model."""
        from .reference import run_reference
        feeds = self.check_inputs(inputs)
        results = run_reference(self.to_onnx(), feeds)
        return dict(zip(self._graph.output_names, results))

    def __repr__(self):
        return f"<Pipeline {self._graph!r}>"
