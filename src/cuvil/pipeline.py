"""``Pipeline``: the one place that sequences Cuvil's stages (import -> optimize -> compile for a target)."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx

from . import audit
from .artifact import artifact_cache_dir, artifact_files, cache_entry, cache_key, cached_path, supply_chain_paths
from .dsl.parser import load_rules
from .errors import CuvilError, ShapeError
from .frontend import export_model, import_model, load_model
from .frontend.survey import ModelSurvey, survey_model
from .frontend.torch_import import (TORCH_SUFFIXES, dim_ranges, export_exported_program, export_module,
                                    export_torchscript)
from .ir.constraints import check_constraints
from .ir.dim import SymExpr, Symbol, bounds, evaluate, free_symbols
from .ir.graph import Graph
from .ir.hash import structural_hash
from .ir.printer import print_graph
from .ir.shape_advice import (ShapeAdvice, advise, narrowed_maxima, required_multiples, satisfying_point,
                              symbol_text)
from .ir.shape_binding import bind_input_shapes, lookup_symbol, profile_symbol, split_options
from .ir.stats import GraphStats, graph_stats
from .lora.apply import merged_graph
from .lora.merge import lora_rules
from .precision.policy import apply_precision, check_mode, plan_precision
from .progress import enabled as progress_enabled
from .progress import stage
from .reference import run_reference
from .signing import artifact_digest
from .rewrite_rules.engine import RewriteReport
from .rewrite_rules.qdq import fuse_qdq, record_qdq
from .rewrite_rules.proved_rewrite import applied_rules, proved_rewrite
from .rewrite_rules.shape_prop import propagate_shapes
from .rewrite_rules.specialize import specialize_graph, unify_required_equal
from .rewrite_rules.verdicts import builtin_rules
from .supply_chain import record_build, sha256_file
from .supply_chain.build_info import jsonable
from .targets import X86_TARGET, TargetOptions, get_target, make_options
from .targets.base import precision_ops, stores_bf16, transformed_rounding
from .targets.x86.target import choose_algorithms
from .targets.x86.cpu import describe_cpu
from .targets.x86.tuning import X86Tuning, calibrated_tuning
from .version import __version__

ModelSource = Union[str, os.PathLike, bytes, onnx.ModelProto]
RulePath = Union[str, os.PathLike]


def _derived_dims(g: Graph) -> Dict[str, list]:
    """The manifest's enclosing interval of each derived dim (``2*N``) over the symbols' ranges (exact
    ranges: ``cuvil inspect --shapes``, Z3)."""
    derived: Dict[str, list] = {}
    if not g.symbols:
        return derived
    ranges = g.symbol_ranges()
    for v in g.values():
        for d in v.shape or ():
            if isinstance(d, SymExpr) and str(d) not in g.symbols and str(d) not in derived:
                try:
                    derived[str(d)] = list(bounds(d, ranges))
                except (KeyError, ValueError):   # KeyError: a data-dependent size, refused when scheduled
                    pass
    return derived


def _rule_list(value) -> list:
    """A target option's rule objects (a GPU bundle's ``kernel_rules``: None, False or a list of rules)."""
    return list(value) if isinstance(value, (list, tuple)) else []


def _and(items) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = list(items)
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


class Pipeline:
    """A model on its way through Cuvil. Each stage returns a new Pipeline; the source is left as it was.

    >>> from cuvil import Pipeline
    >>> p = Pipeline.from_onnx("model.onnx").optimize()      # doctest: +SKIP
    >>> outputs = p.run_reference({"x": x})                  # doctest: +SKIP
    """

    def __init__(self, graph: Graph, report: Optional[RewriteReport] = None, initializer_elements: Optional[int] = None,
                 rule_paths: Sequence[RulePath] = (), source_sha256: Optional[str] = None,
                 source: Optional[Tuple[str, str]] = None, rule_sources: Optional[Mapping[str, str]] = None):
        self._graph = graph
        self.report = report
        self.source_sha256 = source_sha256
        #: The input as given, for the SBOM and provenance: (name, sha256 of its bytes): an ONNX file's name
        #: and the digest `sha256sum` prints; ("model", source_sha256) for a ModelProto.
        self.source: Tuple[str, str] = source or ("model", source_sha256 or "")
        #: rule name -> the .rule file of each rule that rewrote the graph (the provenance's digests of them).
        self.rule_sources: Dict[str, str] = dict(rule_sources or {})
        self.rule_paths: Tuple[RulePath, ...] = tuple(rule_paths)
        # Elements of the source model's initializers (what model zoos call its parameter count).
        self.initializer_elements = initializer_elements
        # LoRA (with_lora): the ONNX source (its names map adapters), the graph before any adapter, the adapters
        # merged so far, and the merge's rule report and per-weight records (kept through later stages).
        self._onnx_source: Optional[ModelSource] = None
        self._lora_base: Optional[Graph] = None
        self._loras: Tuple = ()
        self.lora_report: Optional[RewriteReport] = None
        self.lora_records: list = []

    @classmethod
    def from_onnx(cls, source: ModelSource, *, constant_initializer_inputs: bool = True,
                  input_values: Optional[Mapping[str, Any]] = None) -> "Pipeline":
        """Import an ONNX model (path, bytes or ModelProto), external data included. ``input_values`` fixes
        graph inputs to values at compile time (``{"sr": 16000}``): they become constants (an ``If`` on them
        keeps only its branch) and are no longer inputs of the compiled model."""
        named = os.path.basename(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else "model"
        with stage("import", detail=named) as s:
            model = load_model(source)
            graph = import_model(model, constant_initializer_inputs=constant_initializer_inputs,
                                 input_values=input_values)
            unify_required_equal(graph)   # input.0 and state.1 that an LSTM needs equal: one symbol (docs/shapes.md)
            s.detail(f"{named}, {len(graph.nodes)} nodes")
        sha = hashlib.sha256(model.SerializeToString()).hexdigest()
        if isinstance(source, (str, os.PathLike)):
            given = (named, sha256_file(os.fspath(source)))
        else:
            given = ("model", hashlib.sha256(bytes(source)).hexdigest() if isinstance(source, (bytes, bytearray)) else sha)
        p = cls(graph, initializer_elements=sum(int(np.prod(t.dims)) for t in model.graph.initializer),
                source_sha256=sha, source=given)
        p._onnx_source = source if isinstance(source, (str, os.PathLike)) else model
        p._lora_base = graph
        return p

    @staticmethod
    def survey(source: ModelSource) -> ModelSurvey:
        """What an ONNX model declares (inputs, outputs, op histogram, parameters) and every op in it Cuvil
        cannot import, read without importing it: works on a model :meth:`from_onnx` refuses
        (:class:`cuvil.frontend.survey.ModelSurvey`; ``cuvil inspect`` shows it)."""
        return survey_model(load_model(source))

    @classmethod
    def from_torch(cls, module, example_inputs, dynamic_shapes=None, *, input_names=None,
                   output_names=None) -> "Pipeline":
        """Import a PyTorch ``nn.Module`` through ``torch.onnx.export(..., dynamo=True)`` (opset 18).

        ``example_inputs`` is a tuple of tensors and ``dynamic_shapes`` ``torch.export``'s structure
        (``{"x": {0: torch.export.Dim("batch", min=1, max=8)}}``): each named Dim becomes a Cuvil symbol of the
        same name with the Dim's range as its profile. Needs the ``torch`` extra."""
        model = export_module(module, example_inputs, dynamic_shapes, input_names=input_names,
                              output_names=output_names)
        return cls.from_onnx(model)._with_symbol_ranges(dim_ranges(dynamic_shapes))

    @classmethod
    def from_torch_file(cls, path: Union[str, os.PathLike], input_shapes=None, input_dtypes=None) -> "Pipeline":
        """Import a ``.pt2`` ExportedProgram (``torch.export.save``; its symbols and their ranges are kept) or a
        ``.pt`` TorchScript file (``torch.jit.save``; ``input_shapes`` names each input of ``forward`` with one
        shape or ``(min, opt, max)``, and a dim that varies becomes the symbol ``NAME.AXIS``). Needs the
        ``torch`` extra."""
        if os.fspath(path).endswith(".pt2"):
            model, ranges = export_exported_program(path)
        else:
            model, ranges = export_torchscript(path, input_shapes or {}, input_dtypes)
        return cls.from_onnx(model)._with_symbol_ranges(ranges)

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike], input_shapes=None) -> "Pipeline":
        """An ``.onnx`` file, or a PyTorch file by its suffix (``.pt``, ``.pth``, ``.pt2``: :meth:`from_torch_file`)."""
        if os.fspath(path).endswith(TORCH_SUFFIXES):
            return cls.from_torch_file(path, input_shapes)
        return cls.from_onnx(path)

    def _with_symbol_ranges(self, ranges: Mapping[str, Tuple[int, int]]) -> "Pipeline":
        """The exporter's symbol ranges as profiles, for the symbols the graph kept (torch may specialise some)."""
        kept = {name: r for name, r in ranges.items() if name in self._graph.symbols}
        return self.with_profiles(kept) if kept else self

    @property
    def graph(self) -> Graph:
        return self._graph

    def with_rules(self, *paths: RulePath) -> "Pipeline":
        """The same model, with extra ``.rule`` files or directories for :meth:`optimize`."""
        return self._derive(self._graph, self.report, self.rule_paths + tuple(paths))

    def _derive(self, graph, report, rule_paths=None, rule_sources=None) -> "Pipeline":
        p = Pipeline(graph, report, self.initializer_elements,
                     self.rule_paths if rule_paths is None else rule_paths, self.source_sha256, self.source,
                     {**self.rule_sources, **(rule_sources or {})})
        p._onnx_source, p.lora_report, p.lora_records = self._onnx_source, self.lora_report, self.lora_records
        if graph is self._graph:   # adapters may still be added (with_rules); not after a stage changed the graph
            p._lora_base, p._loras = self._lora_base, self._loras
        return p

    def with_lora(self, path: Union[str, os.PathLike], weight: float = 1.0, *,
                  lora_map: Union[str, os.PathLike, Mapping[str, str], None] = None) -> "Pipeline":
        """The model with the LoRA adapter at ``path`` (a PEFT directory, an ``.onnx_adapter`` file, or a read
        :class:`cuvil.lora.Adapter`) merged
        into its weights, scaled by ``weight``: each adapted weight becomes ``W + Σ weight·scale·B·A`` (in the
        layout its MatMul/Gemm reads; ``scale`` = lora_alpha/r, or /sqrt(r) with use_rslora), correctly rounded
        to the weight's type once over all the adapters of the chain (``.with_lora(a).with_lora(b, 0.5)``).

        The merge is the proved rewrite ``lora_merge_*`` of ``rules/lora.rule`` applied to the model with its
        adapters written unmerged; it is recorded among the rules applied (``cuvil.lora.merge``). Modules map to
        weights by the names the torch exporters leave (docs/lora.md); ``lora_map`` (a JSON/YAML file or a
        dict: module -> initializer or node name) names them where those were lost. Call it on the imported
        model, before :meth:`optimize`."""
        if self._onnx_source is None or self._lora_base is None:
            raise CuvilError("with_lora needs the imported ONNX model, before optimize() or another stage",
                             hint="Pipeline.from_onnx(path).with_lora(adapter).optimize()")
        base = self._lora_base
        model = load_model(self._onnx_source)
        loras = self._loras + ((path, weight, lora_map),)
        g, report, records = merged_graph(base, model, loras)
        p = self._derive(g, self.report, rule_sources={r.name: r.loc.path for r in lora_rules()
                                                       if report.applied.get(r.name)})
        p._lora_base, p._loras, p.lora_report, p.lora_records = base, loras, report, records
        return p

    def optimize(self, rules: Union[RulePath, Sequence[RulePath], None] = None, *, builtin: bool = True,
                 on_unproved: str = "error", allow_bounded: bool = False) -> "Pipeline":
        """Rewrite a copy of the graph to a fixpoint: the built-in rules (unless ``builtin=False``), the
        rules of :meth:`with_rules` and ``rules``, together with folding, CSE and DCE.

        Every rule must be proved first (shipped verdicts, the proof cache, or a proof now); an unproved
        rule raises :class:`cuvil.rewrite_rules.prove.RuleRejectedError` (``on_unproved="skip"`` leaves it out).
        Rules checked only on bounded instances run too, except ``prove exact`` ones whose ops sum (their
        bits depend on the summation order): ``allow_bounded=True`` lets those run as well. Each rule fires
        only on the element types its proof covers.
        """
        extra = list(self.rule_paths)
        if rules is not None:
            extra += [rules] if isinstance(rules, (str, os.PathLike)) else list(rules)
        all_rules = (builtin_rules() if builtin else []) + (load_rules(extra) if extra else [])
        g = self._graph.clone()
        with stage("optimize", detail=f"{len(g.nodes)} nodes, {len(all_rules)} rules") as s:
            g, fused = fuse_qdq(g)   # quantized (QDQ) models: int8 contractions, before folding eats the DQs
            report = proved_rewrite(g, all_rules, on_unproved=on_unproved, allow_bounded=allow_bounded)
            record_qdq(report, fused)
            s.detail(f"{len(self._graph.nodes)} -> {len(g.nodes)} nodes, "
                     f"{sum(report.applied.values())} rewrites")
        return self._derive(g, report, rule_sources={r.name: r.loc.path for r in all_rules
                                                     if report.applied.get(r.name) and r.loc is not None})

    def choose_algorithms(self, target: str = X86_TARGET, cpu: Optional[str] = None,
                          tuning: Optional[X86Tuning] = None) -> "Pipeline":
        """Apply the built-in rules of the target's phase (``on x86``: Winograd convolutions) where the
        target's cost model accepts the match (for ``cpu``, default the host: its vector width sets the
        micro-kernels' register tiles) with the cost model's weights ``tuning`` (default
        :func:`cuvil.targets.x86.tuning.calibrated_tuning` of the CPU, as ``compile`` uses); the rules are proved like every
        other rule. Only the x86 target has algorithm choices (:func:`cuvil.targets.x86.target.choose_algorithms`)."""
        if target != X86_TARGET:
            get_target(target)   # an unknown target is named as such
            raise CuvilError(f"{target} has no algorithm choices", hint=f"choose_algorithms({X86_TARGET!r}) has "
                             f"(Winograd convolutions); compile for {target} without this step")
        g, report = choose_algorithms(self._graph, cpu, tuning or calibrated_tuning(describe_cpu(cpu)))
        return self._derive(g, report)

    def check_shapes(self, shape_profiles: Optional[Mapping[str, Tuple[int, ...]]] = None):
        """Prove every shape condition of the graph for every symbol value in its range (``shape_profiles``:
        ``{"N": (min, max)}`` or ``(min, opt, max)``, optionally ending in ``{"multiple": M}``; default: the
        symbols' ranges). Returns the violations, each with a counterexample
        (:class:`cuvil.ir.constraints.Violation`)."""
        if any(split_options(k, v, "--shape-profile")[1] != 1 for k, v in (shape_profiles or {}).items()):
            return self.with_profiles(shape_profiles, check=False).check_shapes()   # the multiples apply too
        ranges = {k: (v[0], v[-1]) for k, v in (shape_profiles or {}).items()}
        return check_constraints(self._graph, ranges)

    def specialize(self, fixed: Mapping[str, Union[int, str]]) -> "Pipeline":
        """Fix symbolic dims to values (``{"N": 1}``, ``{"x.2": 640}``): shapes become static and shape
        computations fold. A symbol is named as :meth:`Graph.symbols` lists it, or by the model's spelling.
        A value that is another symbol's name makes the two one symbol (``{"s.0": "x.0"}``: two anonymous
        batch dims that must be equal)."""
        fixed = {k: lookup_symbol(self._graph, v, f"--fix {k}={v}").name if isinstance(v, str) else v
                 for k, v in self._by_symbol(fixed, "--fix").items()}
        fixed = {k: v for k, v in fixed.items() if k != v}   # state.1 = input.0 where they are one already
        if not fixed:
            return self
        try:
            g, report = specialize_graph(self._graph, fixed)
        except ShapeError as e:
            raise self._fixed_values_hint(e, fixed) from None
        return self._derive(g, report)

    def _fixed_values_hint(self, err: ShapeError, fixed: Mapping[str, object]) -> ShapeError:
        """``err`` (values that break a shape condition), with the nearest values of the multiples the graph
        needs as its next step, checked by specialising to them, where a multiple is what they miss."""
        if err.hint is not None:
            return err
        g = self._graph
        bad = check_constraints(g)
        mult = required_multiples(g, bad) if bad else None
        off = {n: m for n, m in (mult or {}).items() if isinstance(fixed.get(n), int) and fixed[n] % m}
        if not off:
            return err
        point = {n: v for n, v in fixed.items() if isinstance(v, int)}
        point.update({n: max(m, round(point[n] / m) * m) for n, m in off.items()})
        advice = advise(g, point=point)
        try:
            ok = advice is not None and not self.specialize(point).check_shapes()
        except CuvilError:
            ok = False
        if ok:
            err.hint = ("; ".join(f"{symbol_text(g, n)} must be a multiple of {m}" for n, m in off.items())
                        + ": " + " ".join(advice.flags))
        return err

    def _by_symbol(self, values: Mapping[str, object], flag: str) -> Dict[str, object]:
        """``values`` keyed by the symbols' own names (a user may spell ``batch size`` for ``batch_size``)."""
        out: Dict[str, object] = {}
        for name, val in values.items():
            sym = lookup_symbol(self._graph, name, f"{flag} {name}")
            if sym.name in out and out[sym.name] != val:
                raise ShapeError(f"{flag}: symbol {sym.name} is given twice, {out[sym.name]} and {val}",
                                 hint=f"give {flag} {sym.name} once")
            out[sym.name] = val
        return out

    def with_input_shapes(self, input_shapes: Mapping[str, object]) -> "Pipeline":
        """Bind symbols by input, as trtexec's ``--shapes``: ``{"x": [1, 3, 640, 640]}`` fixes the symbols
        among ``x``'s dims (:meth:`specialize`), ``{"x": (min, opt, max)}`` (three shapes) sets their ranges
        (:meth:`with_profiles`); see :func:`cuvil.ir.shape_binding.bind_input_shapes` for the checks."""
        b = bind_input_shapes(self._graph, input_shapes)
        p = self.specialize(b.fixed) if b.fixed else self
        return p.with_profiles(b.profiles) if b.profiles else p

    def with_profiles(self, shape_profiles: Mapping[str, Tuple[int, ...]], *, check: bool = True) -> "Pipeline":
        """The same graph with symbol ranges set: ``{"N": (1, 8, 64)}`` (min, opt, max) or ``(min, max)``;
        a last element ``{"multiple": 32}`` admits only the multiples of 32 in the range (``--shape-profile
        H=32:640:1280/32``; min, opt and max are multiples too), and every shape condition is then proved for
        those values only.
        Every shape condition of the graph must hold over the new ranges (else ShapeError naming the node
        and a counterexample; ``check=False`` leaves that to :meth:`check_shapes`); derived dims' ranges
        follow."""
        g = self._graph.clone()
        for name, prof in self._by_symbol(shape_profiles, "--shape-profile").items():
            g.symbols[name] = profile_symbol(name, prof)
        propagate_shapes(g)   # dims simplified over the new ranges (min(S, 512) is S for S <= 512)
        out = self._derive(g, self.report)
        with stage("shape conditions", detail=f"symbols {', '.join(g.symbols)}") if check else contextlib.nullcontext():
            bad = out.check_shapes() if check else ()
        if bad:
            raise out.shape_conditions_error(bad)
        return out

    def shape_conditions_error(self, bad) -> ShapeError:
        """The error for shape conditions that fail inside the symbols' ranges: which symbols, the failing
        nodes with counterexamples, and a next step the solver found and checked (the multiples the graph
        needs, two symbols to make one, or values where every condition holds)."""
        g = self._graph
        names = sorted({n for v in bad for c in (v.constraint,) for n in free_symbols(c.a) | free_symbols(c.b)})
        who = _and(symbol_text(g, n) for n in names)
        need, hint = "", None
        alias = self._alias_advice(bad)
        if alias is not None:
            need = f"{symbol_text(g, alias[0])} and {symbol_text(g, alias[1])} must be equal"
            hint = f"make them one symbol: --fix {alias[0]}={alias[1]} (Pipeline: fixed={{{alias[0]!r}: {alias[1]!r}}})"
        mult = required_multiples(g, bad) if hint is None else None
        if mult:
            advice = advise(g, mult)
            if advice is not None and self._advice_holds(advice):
                groups: Dict[int, list] = {}
                for n in names:
                    groups.setdefault(mult.get(n, 1), []).append(n)
                need = "; ".join(_and(symbol_text(g, n) for n in ns) + " must be "
                                 + ("multiples" if len(ns) > 1 else "a multiple") + f" of {m}"
                                 for m, ns in sorted(groups.items()) if m > 1)
                hint = ("give multiples: " + " ".join(advice.flags) + " (Pipeline: input_shapes= / shape_profiles= "
                        "ending in {'multiple': M})")
        maxima = narrowed_maxima(g, bad) if hint is None else None
        if maxima and all(m > g.symbols[n].min for n, m in maxima.items()):   # a range, not one value
            advice = advise(g, maxima=maxima)
            if advice is not None and self._advice_holds(advice):
                need = "; ".join(f"{symbol_text(g, n)} must be at most {m}" for n, m in sorted(maxima.items()))
                hint = "narrow the ranges: " + " ".join(advice.flags) + " (Pipeline: input_shapes= / shape_profiles=)"
        if hint is None:
            point = satisfying_point(g)
            # the failing symbols fixed where every condition holds, the others keep their ranges; else all fixed
            tries = [] if point is None else [{n: point[n] for n in names}, point]
            advice = next((a for a in (advise(g, point=t) for t in tries) if a is not None and self._advice_holds(a)),
                          None)
            if advice is not None:
                fixed_at = ", ".join(f"{n} = {point[n]}" for n in names)
                need = f"no range of {who} found where they hold; they hold at {fixed_at}"
                hint = "fix them there: " + " ".join(advice.flags) + " (Pipeline: input_shapes= / fixed=)"
        if hint is None:
            hint = ("narrow the ranges of the symbols named there (--input-shape INPUT=MIN:OPT:MAX or --shape-profile "
                    "NAME=MIN:OPT:MAX), fix one of them (--fix NAME=VALUE), or give dims that must be equal one "
                    "dim_param in the model")
        message = ("the graph's shape conditions fail inside the profile: " + need if need
                   else f"the graph's shape conditions fail inside the profile of {who}")
        return ShapeError(message, hint=hint, details=[str(v) for v in bad])

    def _advice_holds(self, advice: ShapeAdvice) -> bool:
        """Whether binding ``advice`` makes every shape condition hold: the solver run again on it."""
        try:
            b = bind_input_shapes(self._graph, advice.input_shapes)
            fixed = {**b.fixed, **{k: v[0] for k, v in advice.shape_profiles.items() if v[0] == v[2]}}
            profiles = {**b.profiles, **{k: v for k, v in advice.shape_profiles.items() if v[0] != v[2]}}
            p = self.specialize(fixed) if fixed else self
            return not (p.with_profiles(profiles, check=False) if profiles else p).check_shapes()
        except CuvilError:
            return False

    def _alias_advice(self, bad) -> Optional[Tuple[str, str]]:
        """``(s.0, x.0)`` when a failing condition asks two symbols to be equal (or to broadcast) and making
        them one symbol makes every condition hold."""
        for v in bad:
            a, b = v.constraint.a, v.constraint.b
            if v.constraint.kind in ("eq", "bcast") and all(str(d) in self._graph.symbols for d in (a, b)):
                order = [str(d) for x in self._graph.inputs for d in x.shape or () if str(d) in (str(a), str(b))]
                keep, drop = sorted((str(a), str(b)), key=lambda n: (order.index(n) if n in order else len(order), n))
                try:
                    if not self.specialize({drop: keep}).check_shapes():
                        return drop, keep
                except CuvilError:
                    pass
        return None

    def compile(self, target: Optional[str] = None, opt_level: Optional[int] = None, *,
                options: Optional[TargetOptions] = None, fixed: Optional[Mapping[str, Union[int, str]]] = None,
                shape_profiles: Optional[Mapping[str, Tuple[int, ...]]] = None,
                input_shapes: Optional[Mapping[str, object]] = None, cache: bool = True,
                progress: Optional[bool] = None, precision: Optional[str] = None,
                input_ranges: Optional[Mapping[str, Tuple[float, float]]] = None, calibration=None,
                keep_fp32: Optional[Sequence[str]] = None, **target_options):
        """Compile for ``target`` (a triple of :data:`cuvil.targets.TARGETS`, default ``x86_64-linux-gnu``):
        :class:`cuvil.artifact.Artifact` (``libNAME.so``) for ``x86_64-linux-gnu``,
        :class:`cuvil.artifact.Bundle` (``NAME.cuvil/``) for ``nvptx64-nvidia-cuda``; the GPU bundle is built
        without a GPU.

        The target's options are an option object, :class:`cuvil.targets.x86.target.X86Options` or
        :class:`cuvil.targets.ptx.target.PtxOptions` (``options=PtxOptions(arch="sm_80")``; the target then
        defaults to the options' own), or, as a shorthand, their fields as keywords: ``compile(cpu="znver3",
        winograd=False)``, ``compile("nvptx64-nvidia-cuda", arch="sm_80", fma=False)``; ``opt_level`` (0-3,
        default 3) may also come second, positionally. A keyword that is not an option of ``target`` is a
        CuvilError naming the target it belongs to. ``progress``: True shows each stage on stderr (the LLVM
        stage kernel by kernel, :mod:`cuvil.progress`), False hides it, None (default) leaves it as the
        caller's ``cuvil.progress.enabled()`` block says (off outside one).

        Symbolic dims: ``shape_profiles`` (``{"N": (1, 8, 64)}``, min/opt/max) sets their ranges (without
        one a symbol ranges over ``[1, 4096]``, :data:`cuvil.ir.dim.DEFAULT_MAX`); every shape condition must
        hold over them (Z3; else ShapeError with a counterexample). ``fixed`` (``{"N": 1}``) specialises
        symbols to values, or to another symbol (``{"s.0": "x.0"}``). ``input_shapes`` binds them by input,
        whatever they are called, as trtexec's ``--shapes``: ``{"x": [1, 3, 640, 640]}`` fixes them,
        ``{"x": ([1, 3, 32, 32], [1, 3, 640, 640], [1, 3, 1280, 1280])}`` (min, opt, max) sets their ranges; a
        symbol bound twice (by name and by input) must be bound alike (docs/shapes.md). The x86 library
        serves every shape of the profile with one set of kernels that read the symbols at run time, and
        rejects shapes outside it. The GPU target specialises every symbol without a profile (to ``fixed``,
        else its opt or min) and compiles the profiled ones per bucket into one bundle (``graph_buckets``,
        :mod:`cuvil.targets.ptx.buckets`). ``cache`` (default on): artifacts are cached by content (:mod:`cuvil.artifact`).

        Low precision (docs/precision.md): ``precision`` ``"fp32"`` (default), ``"bf16"``, ``"fp16"``, ``"fp8"`` (GPU,
        sm_89 and later: E4M3 tensor cores, never chosen by ``auto``), ``"int8"`` or ``"auto"`` narrows the nodes the target runs in that format and whose ranges are proved safe in it
        (:mod:`cuvil.precision`); ``input_ranges`` (``{"x": (-3, 3)}``) declares the inputs' ranges the proof
        starts from, ``calibration`` (a directory of NAME.npy, an .npz, or ``{name: array}``) measures them
        instead. ``keep_fp32``: node names or op types kept float32 whatever their ranges (default None: the
        model's output layers, a classifier's last Gemm, :mod:`cuvil.precision.heads`; ``[]``: none). The
        manifest's ``precision`` entry gives each node's format and the reason.
        """
        with progress_enabled(progress) if progress is not None else contextlib.nullcontext():
            try:
                art = self._compile(target, opt_level, options, fixed, shape_profiles, input_shapes, cache,
                                    target_options, (precision, input_ranges, calibration, keep_fp32))
            except CuvilError as e:
                audit.record("compile", artifact=None, outcome="error", model=self._graph.name, reason=e.message)
                raise
        audit.record("compile", artifact=art.path, digest=lambda: artifact_digest(art.path), cached=art.cached,
                     model_sha256=self.source_sha256)
        return art

    def _compile(self, target, opt_level, options, fixed, shape_profiles, input_shapes, cache, target_options,
                 low_precision=(None, None, None, None)):
        mode = check_mode(low_precision[0])
        if mode == "fp32" and low_precision[3] is not None:
            raise CuvilError(f"keep_fp32={list(low_precision[3])!r} with precision fp32: nothing is narrowed, so "
                             f"nothing needs keeping", hint="give precision='bf16' (or fp16, auto) with it "
                             "(--precision bf16 --keep-fp32 ...), or leave keep_fp32 out")
        triple = target or (options.triple if options is not None else X86_TARGET)
        tgt = get_target(triple)
        if options is None:
            if opt_level is not None:
                target_options["opt_level"] = opt_level
            options = make_options(triple, **target_options)
        elif target_options or opt_level is not None:
            raise CuvilError(f"the options of {triple} are given both as options= and as keywords "
                             f"({', '.join(sorted(target_options) or ['opt_level'])})",
                             hint="give them one way: the keywords as fields of options=, or keywords alone")
        elif not isinstance(options, tgt.options_type):
            raise CuvilError(f"options={type(options).__name__}(...) are not options of {triple}",
                             hint=f"give options={tgt.options_type.__name__}(...), or target= the options' own")
        fixed, shape_profiles = self.resolve_shapes(fixed, shape_profiles, input_shapes)
        # Fixed symbols first: a profile's shape conditions are then checked with them at their values.
        p = self.specialize(fixed) if fixed else self
        p = p.with_profiles(shape_profiles) if shape_profiles else p
        if not tgt.keeps_symbols and p._graph.symbols:
            kept = set(shape_profiles or ()) if getattr(tgt, "keeps_profiled_symbols", False) else set()
            rest = {name: sym.tuned for name, sym in p._graph.symbols.items() if name not in kept}
            fixed.update(rest)
            p = p.specialize(rest) if rest else p
        if p._graph.symbols and not shape_profiles:   # with_profiles checked those
            with stage("shape conditions", detail=f"symbols {', '.join(p._graph.symbols)}"):
                bad = p.check_shapes()
            if bad:
                raise p.shape_conditions_error(bad)
        profiles = {s.name: [s.min, s.tuned, s.max] + ([{"multiple": s.multiple}] if s.multiple > 1 else [])
                    for s in p._graph.symbols.values()}
        rules = {**applied_rules(self.lora_report), **applied_rules(self.report)}
        extra = {"model_sha256": self.source_sha256, "specialized": fixed, "shape_profiles": profiles,
                 "derived_dims": _derived_dims(p._graph), "rules_applied": rules}
        if self.lora_records:
            extra["lora"] = self.lora_records
        graph = p.graph
        if mode != "fp32" or low_precision[1] or low_precision[2] is not None:
            with stage("precision", detail=mode):
                pplan = plan_precision(graph, mode, input_ranges=low_precision[1], calibration=low_precision[2],
                                       target_ops=precision_ops(tgt, options), target=triple, search_budget=0,
                                       stores_bf16=stores_bf16(tgt), keep_fp32=low_precision[3],
                                       transformed=transformed_rounding(tgt, options, graph))
            graph = apply_precision(graph, pplan)
            extra["precision"] = pplan.manifest()
        plan = tgt.plan(graph, options, profiles)
        params = {"target": triple, "options": options, "fixed": fixed, "shape_profiles": profiles}
        if not cache:
            out = os.path.join(tempfile.mkdtemp(prefix="cuvil-"), plan.artifact_name)
            return self._emit(tgt, plan, out, extra, params)
        rule_files = sorted({(name, sha256_file(path)) for name, path in self.rule_sources.items()
                             if os.path.isfile(path)})
        key = cache_key([structural_hash(p.graph), repr(sorted(fixed.items())), repr(sorted(profiles.items())),
                         __version__, triple, json.dumps(rules, sort_keys=True), str(self.source_sha256),
                         repr(self.source), repr(rule_files)] + plan.key_parts
                        + ([json.dumps(extra["precision"], sort_keys=True)] if "precision" in extra else []))
        hit = cached_path(key, plan.artifact_name)
        if hit is not None:
            return tgt.load(hit, cached=True)
        with cache_entry(key, plan.artifact_name) as out:
            art = self._emit(tgt, plan, out, extra, params)
        art.path = os.path.join(artifact_cache_dir(), key, plan.artifact_name)
        return art

    def _emit(self, tgt, plan, out: str, extra: dict, params: dict):
        """Build ``plan`` at ``out``, then its SBOM and provenance beside it (:mod:`cuvil.supply_chain`); the
        artifact object, with the build's times as its ``timings`` (they are not written into the artifact:
        builds are reproducible byte for byte)."""
        manifest = tgt.emit(plan, out, extra)
        timings = manifest.pop("timings", None)
        sbom, prov = supply_chain_paths(out)
        record_build(artifact_files(out, provenance=False), sbom, prov, manifest,
                     artifact=plan.artifact_name, model_name=self.source[0], model_sha256=self.source[1],
                     parameters=jsonable(params), rule_sources=self.rule_sources,
                     extra_rules=_rule_list(getattr(plan.options, "kernel_rules", None)))
        art = tgt.load(out, manifest)
        art.timings = timings
        return art

    def resolve_shapes(self, fixed: Optional[Mapping[str, Union[int, str]]] = None,
                       shape_profiles: Optional[Mapping[str, Tuple[int, ...]]] = None,
                       input_shapes: Optional[Mapping[str, object]] = None
                       ) -> Tuple[Dict[str, object], Dict[str, tuple]]:
        """The symbols' values and ranges that ``fixed`` (by symbol), ``shape_profiles`` (by symbol) and
        ``input_shapes`` (by input, :meth:`with_input_shapes`) give together, keyed by the symbols' names, as
        ``(fixed, shape_profiles)``; a symbol bound twice must be bound alike (else ShapeError)."""
        fixed = {k: lookup_symbol(self._graph, v, f"--fix {k}={v}").name if isinstance(v, str) else int(v)
                 for k, v in self._by_symbol(fixed or {}, "--fix").items()}
        fixed = {k: v for k, v in fixed.items() if k != v}   # state.1 = input.0 where they are one already
        profiles = self._by_symbol(shape_profiles or {}, "--shape-profile")
        if not input_shapes:
            return fixed, profiles
        aliases = {k: v for k, v in fixed.items() if isinstance(v, str)}   # s.0 = x.0: bound through x.0
        b = bind_input_shapes(specialize_graph(self._graph, aliases)[0] if aliases else self._graph, input_shapes)
        for name, val in b.fixed.items():
            other = fixed.get(name, val)
            prof = profiles.pop(name, None)
            if other != val or (prof is not None and set(prof) != {val}):
                given = (f"--fix {name}={other}" if other != val
                         else f"--shape-profile {name}=" + ":".join(map(str, prof)))
                raise ShapeError(f"--input-shape sets symbol {name} to {val}, {given} says otherwise",
                                 hint=f"give one: drop {given}, or bind {name} by it alone")
            fixed[name] = val
        for name, prof in b.profiles.items():
            if name in fixed:
                raise ShapeError(f"--input-shape gives symbol {name} the range {':'.join(map(str, prof))}, "
                                 f"--fix {name}={fixed[name]} fixes it", hint=f"give one: drop --fix {name} or the "
                                 f"range of the --input-shape")
            if name in profiles and tuple(profiles[name]) != tuple(prof):
                raise ShapeError(f"--input-shape gives symbol {name} the range {':'.join(map(str, prof))}, "
                                 f"--shape-profile {':'.join(map(str, profiles[name]))}",
                                 hint=f"give one: drop --shape-profile {name} or bind it by --input-shape alone")
            profiles[name] = prof
        return fixed, profiles

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
            raise ShapeError(f"unknown input(s) {unknown}; the model's inputs are {names}",
                             hint=f"name the inputs as the model does: {names}")
        env: Dict[str, int] = {}
        out = {}
        for v in g.inputs:
            if v.name not in inputs:
                raise ShapeError(f"missing input {v.name!r} ({v.type})", hint=f"give {v.name!r}: an array {v.type}")
            arr = np.asarray(inputs[v.name])
            if arr.dtype != v.dtype.numpy:
                raise ShapeError(f"input {v.name!r}: expected {v.dtype.numpy} ({v.type}), got {arr.dtype}",
                                 hint=f"convert it: x.astype(np.{v.dtype.numpy})")
            if v.shape is not None:
                if arr.ndim != len(v.shape):
                    raise ShapeError(f"input {v.name!r}: expected rank {len(v.shape)} ({v.type}), got shape {arr.shape}",
                                     hint=f"give an array of {len(v.shape)} dims, {v.type}")
                for k, (d, got) in enumerate(zip(v.shape, arr.shape)):
                    if isinstance(d, SymExpr) and len(d.free_symbols) == 1 and str(d) in g.symbols:
                        sym = g.symbols[str(d)]
                        if not sym.admits(got):
                            raise ShapeError(f"input {v.name!r} dim {k}: {sym.name} = {got} is outside the profile "
                                             f"{sym.profile_text()}", hint=f"give a size in the profile, or widen it: "
                                             f"--shape-profile {sym.name}=MIN:OPT:MAX covering {got}")
                        if env.setdefault(sym.name, got) != got:
                            raise ShapeError(f"input {v.name!r} dim {k}: {sym.name} = {got}, but another input has "
                                             f"{sym.name} = {env[sym.name]}", hint=f"give every dim {sym.name} one size")
                    elif isinstance(d, int) and d != got:
                        raise ShapeError(f"input {v.name!r}: expected shape {v.type}, got {arr.shape}",
                                         hint=f"give dim {k} the size {d}")
            out[v.name] = arr
        for v in g.inputs:  # derived dims (e.g. 2*N) checked once every symbol is bound
            for k, (d, got) in enumerate(zip(v.shape or (), out[v.name].shape)):
                if isinstance(d, SymExpr) and d.free_symbols <= env.keys() and evaluate(d, env) != got:
                    raise ShapeError(f"input {v.name!r} dim {k}: expected {d} = {evaluate(d, env)}, got {got}",
                                     hint=f"give dim {k} the size {evaluate(d, env)}")
        return out

    def run_reference(self, inputs: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Run the graph through ``onnx.reference`` (:mod:`cuvil.reference`) on the exported model."""
        feeds = self.check_inputs(inputs)
        results = run_reference(self.to_onnx(), feeds)
        return dict(zip(self._graph.output_names, results))

    def __repr__(self):
        return f"<Pipeline {self._graph!r}>"
