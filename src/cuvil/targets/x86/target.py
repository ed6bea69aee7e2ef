"""The x86-64 target (``x86_64-linux-gnu``): its options, its algorithm choices, and the steps of
:class:`cuvil.targets.base.Target` (``plan``, ``emit``, ``load``) over :func:`compile_x86`."""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import attrs

from ...errors import CuvilError
from ...ir.graph import Graph
from ...lora.slots import add_lora_slots
from ...precision.policy import computed_as, reconcile, residual_opted_out
from ...progress import stage
from ...rewrite_rules.engine import RewriteReport
from ...rewrite_rules.proved_rewrite import applied_rules, proved_rewrite
from ...rewrite_rules.specialize import specialize_graph
from ...rewrite_rules.verdicts import builtin_rules
from .. import X86_TARGET
from ..base import BuildPlan, TargetOptions, check, is_bool, is_opt_level, target_options
from .amx import has_amx
from .artifact import Artifact, sidecars
from .choose import BF16_WINOGRAD_UNIT, accepter, bf16_winograd_pays, conv_sum_rule, winograd_geometry
from .codegen import cpu_identity
from .compile import arena_limit, compile_x86
from .cpu import describe_cpu, validate_cpu
from .gemm import tile_shapes
from .gemm_bf16 import BF16_OPS, narrow_formats
from .gemm_fp16 import FP16_OPS, fp16_formats
from .model_info import is_c_identifier
from .tune import tune_graph
from .tuning import DEFAULT_TUNING, X86Tuning, calibrated_tuning
from .weights_file import WeightsKey, key_id


@target_options(X86_TARGET)
class X86Options(TargetOptions):
    """Options of the x86 target.

    ``opt_level`` 0-3; ``cpu``: the LLVM CPU name to generate for (None, ``"native"`` or ``"host"``: this
    machine's; its ISA features, not its name, set the kernels' vector width); ``prefix``: the C ABI's symbol
    prefix and the library's name (``libPREFIX.so``). ``opt_kernels`` (default on): for models
    with symbolic dims, a second set of kernels specialised for the opt point (every symbol at its opt,
    else its min) is linked in and runs when a call's shapes are exactly that point. ``winograd`` (O2 and
    O3, default on): stride-1 3x3 convolutions become Winograd convolutions (proved ``on x86`` rules,
    rules/winograd.rule) where the x86 cost model expects them to be faster; they round differently from
    direct convolution, so ``winograd=False`` keeps direct convolutions. ``max_arena_bytes``: the largest
    arena a library may reserve (default :data:`cuvil.targets.x86.compile.MAX_ARENA_BYTES`, or the
    ``CUVIL_MAX_ARENA_BYTES`` environment variable). ``tuning``: the cost model's weights and the register
    tiles offered (:class:`cuvil.targets.x86.tuning.X86Tuning`), the settings benchmarks vary; None (default):
    the ones fitted for the host's microarchitecture (:data:`cuvil.targets.x86.tuning.CALIBRATED`), else the
    shipped, measured :data:`~cuvil.targets.x86.tuning.DEFAULT_TUNING`. ``math``: float32 exp, erf, tanh and log as inline polynomials the loop
    vectoriser widens (``"vector"``, the default; their errors in ULPs are in docs/math.md) or as calls to
    libm (``"libm"``: glibc's results, one scalar call per element). ``fused_attention`` (O2 and O3, default
    on): attention as the exports spell it (MatMul / Softmax / MatMul) becomes one FusedAttention kernel with
    an online softmax (proved ``on x86`` rules, rules/attention.rule); it reassociates the softmax's sums, so
    ``fused_attention=False`` keeps the unfused ops. ``external_weights``: the weights go to ``libNAME.weights``
    beside the library instead of into it (mapped read-only and shared between processes when loaded;
    docs/weights.md); ``encrypt_weights``: a key file (or the key's 32 bytes) that file is encrypted with
    (AES-256-GCM; implies ``external_weights``; load with ``cuvil.load(path, weights_key=...)``).
    ``lora_slots`` (a rank R > 0): the layers ``lora_targets``
    names (PEFT ``target_modules`` style: module-name suffixes or a regex; default the attention projections,
    :data:`cuvil.lora.slots.DEFAULT_TARGETS`) take a LoRA adapter of rank up to R at run time
    (``load_adapter`` / ``set_adapter`` on the loaded model; docs/lora.md). ``batch_slices`` (default on,
    with ``opt_kernels``): where every row along the batch symbol is computed on its own (a CNN; see
    :mod:`cuvil.kernels.batch_rows`), a call whose batch is a multiple of the symbol's opt runs the opt-point
    kernels once per slice of that many rows, so each slice's activations stay in cache (SqueezeNet at N = 8:
    per image as at N = 1, not 1.3x); ``batch_slices=False`` runs the generic kernels over the whole batch.
    ``tune`` (default off): the convolution layers' schedules (register tile, Winograd F(2x2) / F(4x4) / none)
    are measured on this machine and the fastest taken (:mod:`cuvil.targets.x86.tune`; docs/tuning.md);
    ``tune_budget`` bounds the measuring in seconds, ``tune_threads`` (default 1) is the thread count timed.
    The choices are cached by CPU model, ISA features and layer shape; the manifest's ``tune`` entry lists them.
    """

    opt_level: int = attrs.field(default=3, validator=check(is_opt_level, "0, 1, 2 or 3"))
    # checked against the names LLVM knows (nearest names suggested) before any work: LLVM itself only warns
    # about an unknown name, then aborts
    cpu: Optional[str] = attrs.field(default=None, validator=lambda inst, attr, v: validate_cpu(v))
    prefix: str = attrs.field(default="cuvil", validator=check(is_c_identifier, "a C identifier (not a keyword)"))
    opt_kernels: bool = attrs.field(default=True, validator=check(is_bool, "True or False"))
    winograd: bool = attrs.field(default=True, validator=check(is_bool, "True or False"))
    fused_attention: bool = attrs.field(default=True, validator=check(is_bool, "True or False"))
    max_arena_bytes: Optional[int] = attrs.field(default=None, validator=check(
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
        "a positive number of bytes, or None for the default"))
    tuning: Optional[X86Tuning] = attrs.field(default=None, validator=check(
        lambda v: v is None or isinstance(v, X86Tuning), "an X86Tuning, or None for the CPU's"))
    math: str = attrs.field(default="vector", validator=check(lambda v: v in ("vector", "libm"),
                                                              '"vector" or "libm"'))
    external_weights: bool = attrs.field(default=False, validator=check(is_bool, "True or False"))
    # a key file or the key's bytes, read at once into a WeightsKey: the options (and the provenance that
    # records them) then show the key's id only, never the key or its path
    encrypt_weights: Optional[WeightsKey] = attrs.field(
        default=None, converter=lambda v: None if v is None else WeightsKey.of(v, "encrypt_weights"))
    lora_slots: int = attrs.field(default=0, validator=check(
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 4096,
        "a rank from 1 to 4096 (0: no LoRA slots)"))
    lora_targets: tuple = attrs.field(
        default=(), converter=lambda v: (v,) if isinstance(v, str) else tuple(v) if isinstance(v, (list, tuple)) else v,
        validator=check(lambda v: isinstance(v, tuple) and all(isinstance(p, str) and p for p in v),
                        "a list of module-name suffixes or regexes (strings)"))
    batch_slices: bool = attrs.field(default=True, validator=check(is_bool, "True or False"))
    # compile-time tuning (cuvil.targets.x86.tune): each float32 convolution layer's candidate schedules are
    # timed on this machine at tune_threads threads within tune_budget seconds (None: tune.DEFAULT_BUDGET),
    # the fastest taken; the choices are cached by CPU model and layer shape
    tune: bool = attrs.field(default=False, validator=check(is_bool, "True or False"))
    tune_budget: Optional[float] = attrs.field(default=None, validator=check(
        lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0),
        "seconds >= 0, or None for the default"))
    tune_threads: int = attrs.field(default=1, validator=check(
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a thread count >= 1"))

    def weights_key(self) -> Optional[bytes]:
        """The 32-byte key ``encrypt_weights`` holds, or None."""
        return None if self.encrypt_weights is None else self.encrypt_weights.key


def x86_rules(winograd: bool = True, fused_attention: bool = True) -> list:
    """The built-in ``on x86`` rules the options turn on: Winograd convolutions (rules/winograd.rule) and
    fused attention (rules/attention.rule, the rules whose replacement is a FusedAttention); the sums of two
    1x1 convolutions as one (rules/conv_sum.rule) always, where the cost model accepts them."""
    def wanted(rule) -> bool:
        if conv_sum_rule(rule):
            return True
        attention = getattr(rule.rhs, "op", None) == "FusedAttention"
        return fused_attention if attention else winograd
    return [r for r in builtin_rules() if r.on == "x86" and wanted(r)]


def choose_algorithms(graph: Graph, cpu: Optional[str] = None, tuning: X86Tuning = DEFAULT_TUNING,
                      winograd: bool = True, fused_attention: bool = True) -> Tuple[Graph, RewriteReport]:
    """A copy of ``graph`` with the built-in ``on x86`` rules (Winograd convolutions, fused attention; the
    flags turn each off) applied where the x86 cost model (weights ``tuning``) accepts the match for ``cpu``
    (default the host: its vector width sets the micro-kernels' register tiles), and the rewrite's report;
    the rules are proved like every other rule."""
    cpu_info = describe_cpu(cpu)
    g = graph.clone()
    # (the bf16 convolutions take the channels-last AMX form: the sums of two of them may run as one)
    amx = tuning.amx and has_amx(cpu_info.features)
    channels_last = bool(tuning.channels_last and tuning.conv_sum and amx)
    # (bf16 convolutions on vdpbf16ps kernels, where the CPU has AVX512_BF16 and no AMX tiles are used, may take
    # Winograd F(2x2): the transforms float32, the GEMMs bf16)
    bf16_winograd = "bf16" in narrow_formats(cpu_info) and not amx and tuning.bf16_winograd is not False
    report = proved_rewrite(g, x86_rules(winograd, fused_attention), phase="x86",
                            accept=accepter(tile_shapes(cpu_info.vector_bits, tuning), tuning, channels_last,
                                            bf16_winograd))
    return g, report


def transformed_notes(graph: Graph) -> Dict[str, str]:
    """{narrowed node name: how it is computed} for the bf16 convolutions the algorithm choice made Winograd
    (rewrite_rules.engine.TRANSFORMED_OPS: the rounding is of the transformed operands, not of the node's)."""
    out = {}
    for n in graph.nodes:
        if n.op == "WinogradConv" and n.precision:
            m = int(n.attrs.get("tile", 4))
            note = (f"Winograd F({m}x{m}, 3x3) in {n.precision}: the transformed input (Bt d B, float32) and "
                    f"weights (G g Gt) rounded to {n.precision}, float32 sums and output transform")
            out.update({name: note for name in n.fused_from})
    return out


def _winograd_choice(graph: Graph, cpu: Optional[str], tuning: X86Tuning) -> Graph:
    """The algorithm choice ``--tune`` builds each candidate with (one convolution: Winograd rules only)."""
    return choose_algorithms(graph, cpu, tuning, winograd=True, fused_attention=False)[0]


class X86Target:
    """``libPREFIX.so``, its header and manifest; symbolic dims stay symbolic (one library per profile)."""

    triple = X86_TARGET
    options_type = X86Options
    keeps_symbols = True
    stores_bf16 = True      # values between bf16 convolutions stored as bfloat16 (cuvil.kernels.bf16_storage)

    def precision_ops(self, options: X86Options) -> Dict[str, frozenset]:
        """The ops whose kernels compute narrowed on the CPU ``options`` builds for (read by the precision
        policy, :func:`cuvil.targets.base.precision_ops`): bf16 Conv / MatMul / Gemm contractions with AVX-512
        and AVX512_BF16 (``vdpbf16ps``, :mod:`cuvil.targets.x86.gemm_bf16`); fp16 MatMul / Gemm with constant
        weights where the CPU has F16C (float16 weight panels, float32 sums: :mod:`cuvil.targets.x86.gemm_fp16`)."""
        cpu = describe_cpu(options.cpu)
        return {**{f: BF16_OPS for f in narrow_formats(cpu)}, **{f: FP16_OPS for f in fp16_formats(cpu)}}

    def transformed_rounding(self, options: X86Options, graph: Graph) -> Dict[str, float]:
        """{Conv name: unit roundoff} for the convolutions this build computes as bf16 Winograd F(2x2) where the
        policy narrows them (read by the precision policy through
        :func:`cuvil.targets.base.transformed_rounding`): their rounding is of the transformed operands, bounded
        as if their inputs were rounded by :data:`~cuvil.targets.x86.choose.BF16_WINOGRAD_UNIT`."""
        cpu = describe_cpu(options.cpu)
        t = options.tuning or calibrated_tuning(cpu)
        if (not options.winograd or options.opt_level < 2 or "bf16" not in narrow_formats(cpu)
                or (t.amx and has_amx(cpu.features)) or t.bf16_winograd is False):
            return {}       # (the algorithm choice runs at O2 and above: plan's `choose`)
        shapes = tile_shapes(cpu.vector_bits, t)
        out = {}
        for n in graph.nodes:
            geo = winograd_geometry(n)
            if geo is not None and bf16_winograd_pays(*geo, shapes, t):
                out[n.name] = BF16_WINOGRAD_UNIT
        return out

    def plan(self, graph: Graph, options: X86Options, profiles: Dict[str, list]) -> BuildPlan:
        # The algorithm choices are a function of the graph, the `on x86` rules and the cost model (its
        # source is in the compiler digest): they run in `emit`, when the library is built, not on a cache hit.
        if options.tuning is None:     # not given: this microarchitecture's fitted settings, else the shipped ones
            options = attrs.evolve(options, tuning=calibrated_tuning(describe_cpu(options.cpu)))
        tuned = None
        if options.tune:
            with stage("tune", detail=f"convolution schedules timed at {options.tune_threads} thread(s)") as s:
                tuned = tune_graph(graph, options.tuning, cpu=options.cpu, opt_level=options.opt_level,
                                   threads=options.tune_threads, budget=options.tune_budget, math=options.math,
                                   progress=s.detail, choose=_winograd_choice)
                n = sum(1 for r in tuned.report["layers"] if "ms" in r)
                s.detail(f"{n} of {len(tuned.report['layers'])} layers measured or cached")
            options = attrs.evolve(options, tuning=tuned.tuning)
        choose = (options.winograd or options.fused_attention) and options.opt_level >= 2
        rules = x86_rules(options.winograd, options.fused_attention) if choose else []
        # The arena limit is enforced while building, so a cached library must have been built under the same one.
        # The ISA features the code may use, by name: a cache shared between hosts never hands a library that
        # needs AVX-512 to a host without it, whatever the CPU is called.
        isa = "isa=" + ",".join(sorted(describe_cpu(options.cpu).features))
        key = [str(options.opt_level), cpu_identity(options.cpu), isa, options.prefix, f"opt_kernels={options.opt_kernels}",
               f"winograd={choose and options.winograd}", f"max_arena_bytes={arena_limit(options.max_arena_bytes)}",
               f"tuning={options.tuning!r}", f"math={options.math}"] + [r.text for r in rules]
        narrowed = sorted(f"{n.name}:{n.precision}" for n in graph.nodes if n.precision)
        if narrowed:             # the precision policy's choices (default builds keep their cache keys)
            key.append("precision=" + ",".join(narrowed))
        key_bytes = options.weights_key()
        if options.external_weights or key_bytes is not None:   # default builds keep their cache keys
            key.append(f"external_weights=True key={key_id(key_bytes) if key_bytes is not None else None}")
        if options.lora_slots:
            key += [f"lora_slots={options.lora_slots}", f"lora_targets={list(options.lora_targets)}"]
        if not options.batch_slices:        # default builds keep their cache keys
            key.append("batch_slices=False")
        if tuned is not None:     # the choices are in the tuning's repr; untuned builds keep their keys
            key.append("tune=" + json.dumps(tuned.report["layers"], sort_keys=True))
        return BuildPlan(graph, options, f"lib{options.prefix}.so", key,
                         {"choose": choose, "profiles": profiles, "tune": tuned.report if tuned else None})

    def emit(self, plan: BuildPlan, path: str, manifest_extra: dict) -> dict:
        o: X86Options = plan.options
        g = plan.graph
        extra = dict(manifest_extra)
        if plan.extra.get("tune") is not None:
            extra["tune"] = plan.extra["tune"]
        if plan.extra["choose"]:
            with stage("choose algorithms", detail="Winograd convolutions and fused attention where they apply") as s:
                g, report = choose_algorithms(g, o.cpu, o.tuning, o.winograd, o.fused_attention)
                s.detail(f"{sum(report.applied.values())} rewrites")
            extra["rules_applied"] = {**extra.get("rules_applied", {}), **applied_rules(report)}
            if "precision" in extra:
                extra["precision"] = computed_as(reconcile(extra["precision"], g, "rewritten by the x86 algorithm "
                                                           "choice (FusedAttention, a Winograd form), whose kernel "
                                                           "computes it in float32"), transformed_notes(g))
        if "precision" in extra and o.tuning.bf16_storage_mode in ("", "convs"):
            extra["precision"] = residual_opted_out(extra["precision"], "X86Tuning(bf16_residual=False) or "
                                                    "bf16_storage=False")
        slots = []
        if o.lora_slots:
            with stage("lora slots", detail=f"rank {o.lora_slots}") as s:
                g, slots = add_lora_slots(g, o.lora_slots, o.lora_targets)
                s.detail(f"{len(slots)} layers: {', '.join(x.module for x in slots[:4])}"
                         + (", ..." if len(slots) > 4 else ""))
        elif o.lora_targets:
            raise CuvilError("--lora-targets without --lora-slots: no layer gets a LoRA slot",
                             hint="add --lora-slots RANK (Python: lora_slots=RANK), the largest adapter rank to load")
        opt_graph = None
        if o.opt_kernels and g.symbols:
            opt_graph, _ = specialize_graph(g, {k: v[1] for k, v in plan.extra["profiles"].items()})
        return compile_x86(g, path, opt_level=o.opt_level, cpu=o.cpu, prefix=o.prefix, manifest_extra=extra,
                           opt_graph=opt_graph, max_arena_bytes=o.max_arena_bytes,
                           tuning=o.tuning, math=o.math, external_weights=o.external_weights or
                           o.encrypt_weights is not None, weights_key=o.weights_key(), lora_slots=slots,
                           batch_slices=o.batch_slices)

    def load(self, path: str, manifest: Optional[dict] = None, cached: bool = False) -> Artifact:
        if manifest is None:
            mp = sidecars(path)["manifest"]
            try:
                with open(mp, encoding="utf-8") as f:
                    manifest = json.load(f)
            except (OSError, ValueError) as e:
                raise CuvilError(f"{mp}: unreadable manifest: {e}") from None
        return Artifact(os.fspath(path), manifest, cached=cached)


TARGET = X86Target()
