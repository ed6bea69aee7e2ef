"""``Pipeline``: the one place that sequences Cuvil's stages (import -> optimize -> export/compile)."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import onnx

from .errors import CuvilError, ShapeError
from .frontend import export_model, import_model, load_model
from .ir.dim import SymExpr, evaluate
from .ir.graph import Graph
from .ir.printer import print_graph
from .ir.stats import GraphStats, graph_stats
from .rewrite_rules.engine import RewriteReport

ModelSource = Union[str, os.PathLike, bytes, onnx.ModelProto]
RulePath = Union[str, os.PathLike]


def _applied_rules(report) -> dict:
    """The manifest's record of the rules a rewrite applied: name -> times applied, obligation, verdict."""
    if report is None:
        return {}
    verdicts = getattr(report, "verdicts", {})
    proofs = getattr(report, "proofs", {})
    return {name: {"applied": n, "obligation": verdicts.get(name), **proofs.get(name, {"verdict": "proved"})}
            for name, n in report.applied.items() if n}


def _proof_record(v) -> dict:
    """A verdict as the manifest records it: status, what the proof covers, the element types covered."""
    return {"verdict": v.status, "coverage": v.shapes, "dtypes": list(v.dtypes)}


class Pipeline:
    """A model on its way through Cuvil. Each stage returns a new Pipeline; the source is left as it was.

    >>> from cuvil import Pipeline
    >>> p = Pipeline.from_onnx("model.onnx").optimize()      # doctest: +SKIP
    >>> outputs = p.run_reference({"x": x})                  # doctest: +SKIP
    """

    def __init__(self, graph: Graph, report: Optional[RewriteReport] = None, initializer_elements: Optional[int] = None,
                 rule_paths: Sequence[RulePath] = (), source_sha256: Optional[str] = None):
        self._graph = graph
        self.report = report
        self.source_sha256 = source_sha256
        self.rule_paths: Tuple[RulePath, ...] = tuple(rule_paths)
        # Elements of the source model's initializers (what model zoos call its parameter count).
        self.initializer_elements = initializer_elements

    @classmethod
    def from_onnx(cls, source: ModelSource, *, constant_initializer_inputs: bool = True) -> "Pipeline":
        """Import an ONNX model (path, bytes or ModelProto), external data included."""
        model = load_model(source)
        graph = import_model(model, constant_initializer_inputs=constant_initializer_inputs)
        sha = hashlib.sha256(model.SerializeToString()).hexdigest()
        return cls(graph, initializer_elements=sum(int(np.prod(t.dims)) for t in model.graph.initializer),
                   source_sha256=sha)

    @property
    def graph(self) -> Graph:
        return self._graph

    def with_rules(self, *paths: RulePath) -> "Pipeline":
        """The same model, with extra ``.rule`` files or directories for :meth:`optimize`."""
        return self._derive(self._graph, self.report, self.rule_paths + tuple(paths))

    def _derive(self, graph, report, rule_paths=None) -> "Pipeline":
        return Pipeline(graph, report, self.initializer_elements,
                        self.rule_paths if rule_paths is None else rule_paths, self.source_sha256)

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
        from .dsl.parser import load_rules
        from .rewrite_rules.engine import rewrite
        from .rewrite_rules.verdicts import builtin_rules, proved_rules
        extra = list(self.rule_paths)
        if rules is not None:
            extra += [rules] if isinstance(rules, (str, os.PathLike)) else list(rules)
        all_rules = (builtin_rules() if builtin else []) + (load_rules(extra) if extra else [])
        proofs: dict = {}
        runnable = proved_rules(all_rules, on_unproved=on_unproved, allow_bounded=allow_bounded, proofs=proofs)
        g = self._graph.clone()
        report = rewrite(g, runnable)
        report.verdicts = {r.name: r.proof for r in runnable}
        report.proofs = {name: _proof_record(v) for name, v in proofs.items()}
        return self._derive(g, report)

    def choose_algorithms(self, target: str, cpu: Optional[str] = None) -> "Pipeline":
        """Apply the built-in rules of the target's phase (``on x86``: Winograd convolutions) where the
        target's cost model accepts the match (for ``cpu``, default the host: its vector width sets the
        micro-kernels' register tiles); the rules are proved like every other rule."""
        from .rewrite_rules.engine import rewrite
        from .rewrite_rules.verdicts import builtin_rules, proved_rules
        from .targets.x86.choose import accepter
        from .targets.x86.codegen import host_target, vector_bits
        from .targets.x86.gemm import tile_shapes
        _, _, cpu_name, features = host_target(cpu)
        proofs: dict = {}
        runnable = proved_rules([r for r in builtin_rules() if r.on == "x86"], proofs=proofs)
        g = self._graph.clone()
        report = rewrite(g, runnable, phase="x86", accept=accepter(tile_shapes(vector_bits(cpu_name, features))))
        report.verdicts = {r.name: r.proof for r in runnable}
        report.proofs = {name: _proof_record(v) for name, v in proofs.items()}
        return self._derive(g, report)

    def check_shapes(self, shape_profiles: Optional[Mapping[str, Tuple[int, ...]]] = None):
        """Prove every shape condition of the graph for every symbol value in its range (``shape_profiles``:
        ``{"N": (min, max)}`` or ``(min, opt, max)``; default: the symbols' ranges). Returns the
        violations, each with a counterexample (:class:`cuvil.ir.constraints.Violation`)."""
        from .ir.constraints import check_constraints
        ranges = {k: (v[0], v[-1]) for k, v in (shape_profiles or {}).items()}
        return check_constraints(self._graph, ranges)

    def specialize(self, fixed: Mapping[str, int]) -> "Pipeline":
        """Fix symbolic dims to values (``{"N": 1}``): shapes become static and shape computations fold."""
        from .ir.dim import evaluate as ev
        from .ir.types import TensorType
        from .rewrite_rules.engine import rewrite
        from .rewrite_rules.shape_prop import propagate_shapes
        g = self._graph.clone()
        for name, val in fixed.items():
            sym = g.symbols.get(name)
            if sym is None:
                raise ShapeError(f"the model has no symbol {name!r} (it has {sorted(g.symbols) or 'none'})")
            if not sym.min <= int(val) <= sym.max:
                raise ShapeError(f"{name} = {val} is outside its range [{sym.min}, {sym.max}]")
        env = {k: int(v) for k, v in fixed.items()}
        for v in g.inputs:
            if v.shape is not None and any(not isinstance(d, int) for d in v.shape):
                dims = [d if isinstance(d, int) or not (d.free_symbols <= env.keys()) else ev(d, env) for d in v.shape]
                v.type = TensorType(v.dtype, dims)
        for name in env:
            del g.symbols[name]
        propagate_shapes(g)
        report = rewrite(g, [])
        return self._derive(g, report)

    def with_profiles(self, shape_profiles: Mapping[str, Tuple[int, ...]]) -> "Pipeline":
        """The same graph with symbol ranges set: ``{"N": (1, 8, 64)}`` (min, opt, max) or ``(min, max)``.
        Every shape condition of the graph must hold over the new ranges (else ShapeError naming the node
        and a counterexample); derived dims' ranges follow."""
        from .ir.dim import Symbol
        g = self._graph.clone()
        for name, prof in shape_profiles.items():
            if name not in g.symbols:
                raise ShapeError(f"--shape-profile {name}: the model has no symbol {name!r} "
                                 f"(it has {sorted(g.symbols) or 'none'})")
            vals = tuple(int(x) for x in prof)
            if len(vals) not in (2, 3):
                raise ShapeError(f"shape profile of {name}: expected (min, opt, max) or (min, max), got {prof!r}")
            lo, hi = vals[0], vals[-1]
            opt = vals[1] if len(vals) == 3 else None
            if not (1 <= lo <= hi) or (opt is not None and not lo <= opt <= hi):
                raise ShapeError(f"shape profile {name}={':'.join(map(str, vals))}: need 1 <= min <= opt <= max")
            g.symbols[name] = Symbol(name, lo, hi, opt)
        out = self._derive(g, self.report)
        bad = out.check_shapes()
        if bad:
            raise ShapeError("the graph's shape conditions fail inside the profile:\n  " + "\n  ".join(map(str, bad)))
        return out

    def compile(self, target: str = "x86_64-linux-gnu", opt_level: int = 3, *, cpu: Optional[str] = None,
                prefix: str = "cuvil", fixed: Optional[Mapping[str, int]] = None, cache: bool = True,
                progress=None, arch: str = "sm_90", fma: bool = True, enable_fp16: bool = False,
                kernel_rules=None, shape_profiles: Optional[Mapping[str, Tuple[int, ...]]] = None,
                opt_kernels: bool = True, winograd: bool = True, register_pass: bool = False):
        """Compile to a native artifact: :class:`cuvil.artifact.Artifact` (``libNAME.so``) for
        ``x86_64-linux-gnu``, :class:`cuvil.artifact.Bundle` (``NAME.cuvil/``, PTX for ``arch``) for
        ``nvptx64-nvidia-cuda``; the GPU bundle is built without a GPU.

        Symbolic dims (x86): ``shape_profiles`` (``{"N": (1, 8, 64)}``, min/opt/max) sets their ranges (without
        one a symbol ranges over ``[1, 4096]``, :data:`cuvil.ir.dim.DEFAULT_MAX`); every shape condition must
        hold over them (Z3; else ShapeError with a counterexample). ``fixed`` (``{"N": 1}``) specialises
        symbols to values. The library serves every shape of the profile with one set of kernels that read
        the symbols at run time, and rejects shapes outside it. The GPU target specialises every symbol
        (to ``fixed``, else its opt or min). ``opt_kernels`` (x86, default on): a second set of kernels,
        specialised for the opt point (every symbol at its opt, else its min), is linked in and runs when a
        call's shapes are exactly that point. ``winograd`` (x86, O2 and O3, default on): stride-1 3x3
        convolutions become Winograd convolutions (proved ``on x86`` rules, rules/winograd.rule) where the
        x86 cost model expects them to be faster; they round differently from direct convolution (the
        transforms reassociate sums, see docs/rules.md), so ``winograd=False`` keeps direct convolutions.

        GPU only: ``fma`` (default on) lets the proved ``prove real`` kernel rules contract ``a * b + c`` into
        fused multiply-adds (off: every operation rounds separately); ``kernel_rules`` replaces the built-in
        ``on kernel`` rules (``[]``: none); ``enable_fp16`` computes float32 tensors in float16 (inputs and
        outputs stay float32, reductions accumulate in float32); ``register_pass`` (opt-in, needs ptxas):
        register-limited kernels that run in several waves get a register cap where one saves a wave and ptxas
        meets it without spilling (:mod:`cuvil.targets.ptx.regpressure`; measured no faster on an H200, so off
        by default).
        """
        from .artifact import PTX_TARGET, X86_TARGET, Artifact, build_cached, cache_key
        from .ir.hash import structural_hash
        from .targets.x86.compile import compile_x86
        if target not in (X86_TARGET, PTX_TARGET):
            raise CuvilError(f"unknown target {target!r}; available: {X86_TARGET}, {PTX_TARGET}")
        if opt_level not in (0, 1, 2, 3):
            raise CuvilError(f"opt_level must be 0-3, got {opt_level}")
        if enable_fp16 and target != PTX_TARGET:
            raise CuvilError(f"enable_fp16 (--enable-fp16) is supported for the {PTX_TARGET} target only; "
                             f"{target} computes float32")
        fixed = {k: int(v) for k, v in (fixed or {}).items()}
        base = self.with_profiles(shape_profiles) if shape_profiles else self
        if target == PTX_TARGET:
            for name, sym in base._graph.symbols.items():
                fixed.setdefault(name, sym.tuned)
        p = base.specialize(fixed) if fixed else base
        if target != PTX_TARGET and p._graph.symbols and not shape_profiles:   # with_profiles checked those
            bad = p.check_shapes()
            if bad:
                raise ShapeError("the graph's shape conditions fail inside the symbols' ranges (give a "
                                 "--shape-profile):\n  " + "\n  ".join(map(str, bad)))
        profiles = {s.name: [s.min, s.tuned, s.max] for s in p._graph.symbols.values()}
        rules = _applied_rules(self.report)
        derived = {}
        if p._graph.symbols:   # enclosing intervals (exact ranges: `cuvil inspect --shapes`, Z3)
            from .ir.dim import bounds
            ranges = p._graph.symbol_ranges()
            for v in p._graph.values():
                for d in v.shape or ():
                    if isinstance(d, SymExpr) and str(d) not in p._graph.symbols and str(d) not in derived:
                        try:
                            derived[str(d)] = list(bounds(d, ranges))
                        except ValueError:
                            pass
        extra = {"model_sha256": self.source_sha256, "specialized": fixed, "shape_profiles": profiles,
                 "derived_dims": derived, "rules_applied": rules}
        import cuvil
        if target == PTX_TARGET:
            return self._compile_bundle(p, arch, opt_level, prefix, extra, fixed, rules, cache, progress,
                                        fma=fma, enable_fp16=enable_fp16, kernel_rules=kernel_rules,
                                        register_pass=register_pass)
        # The x86 algorithm choices are a function of the graph, the `on x86` rules and the cost model (its
        # source is in the compiler digest): they run only when the library is built, not on a cache hit.
        choose = winograd and opt_level >= 2
        from .rewrite_rules.verdicts import builtin_rules
        key = cache_key([structural_hash(p.graph), repr(sorted(fixed.items())), repr(sorted(profiles.items())),
                         str(opt_level), str(cpu), prefix, f"opt_kernels={bool(opt_kernels)}",
                         cuvil.__version__, target, json.dumps(rules, sort_keys=True), str(self.source_sha256),
                         f"winograd={choose}"] + [r.text for r in builtin_rules() if r.on == "x86" and choose])

        def build(so):
            q = p.choose_algorithms(target, cpu) if choose else p
            opt_graph = None
            if opt_kernels and q._graph.symbols:
                opt_graph = q.specialize({k: v[1] for k, v in profiles.items()}).graph
            extra_q = dict(extra, rules_applied={**rules, **_applied_rules(q.report if choose else None)})
            return compile_x86(q.graph, so, opt_level=opt_level, cpu=cpu, prefix=prefix,
                               manifest_extra=extra_q, progress=progress, opt_graph=opt_graph)
        if not cache:
            out = os.path.join(tempfile.mkdtemp(prefix="cuvil-"), f"lib{prefix}.so")
            return Artifact(out, build(out))
        return build_cached(key, prefix, build)

    def _compile_bundle(self, p: "Pipeline", arch, opt_level, prefix, extra, fixed, rules, cache, progress, *,
                        fma=True, enable_fp16=False, kernel_rules=None, register_pass=False):
        from .artifact import PTX_TARGET, Bundle, build_cached_bundle, cache_key
        from .ir.hash import structural_hash
        from .targets.ptx.bundle import compile_bundle
        from .targets.ptx.codegen import target_machine
        import cuvil
        target_machine(arch)   # a bad arch fails before any work
        from .kernels.kernel_rules import select_kernel_rules
        krules = [] if kernel_rules is False else select_kernel_rules(kernel_rules, fma=fma)
        key = cache_key([structural_hash(p.graph), repr(sorted(fixed.items())), str(opt_level), arch, prefix,
                         cuvil.__version__, PTX_TARGET, json.dumps(rules, sort_keys=True), str(self.source_sha256),
                         f"fma={bool(fma)}", f"fp16={bool(enable_fp16)}", f"register_pass={bool(register_pass)}"]
                        + [r.text or r.name for r in krules])
        build = lambda out: compile_bundle(p.graph, out, arch=arch, opt_level=opt_level, prefix=prefix,
                                           fma=fma, kernel_rules=krules, enable_fp16=enable_fp16,
                                           register_pass=register_pass, manifest_extra=extra, progress=progress)
        if not cache:
            out = os.path.join(tempfile.mkdtemp(prefix="cuvil-"), f"{prefix}.cuvil")
            return Bundle(out, build(out))
        return build_cached_bundle(key, prefix, build)

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
