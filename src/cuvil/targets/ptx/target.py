"""The GPU target (``nvptx64-nvidia-cuda``): its options and the steps of :class:`cuvil.targets.base.Target`
(``plan``, ``emit``, ``load``) over :func:`compile_bundle`. The bundle is built without a GPU."""
from __future__ import annotations

from typing import Dict, FrozenSet, Optional, Sequence, Union

import attrs

from ...dsl.ast import Rule
from ...errors import CuvilError
from ...ir.graph import Graph
from ...kernels.kernel_rules import select_kernel_rules
from .. import PTX_TARGET
from ..base import BuildPlan, TargetOptions, check, is_bool, is_name, is_opt_level, target_options
from .archs import arch_number
from .artifact import Bundle
from .bundle import compile_bundle, read_bundle
from .profile_bundle import compile_profile_bundle
from .codegen import target_machine
from .conv_mma import NARROWED_OPS as CONV_NARROW_OPS
from .matmul_mma import NARROWED_OPS
from .tuning import DEFAULT_TUNING, MAX_CONCURRENCY, PtxTuning, concurrent_tuning


def _is_buckets(v) -> bool:
    ints = lambda xs: isinstance(xs, (list, tuple)) and bool(xs) and all(  # noqa: E731
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
    return v is None or ints(v) or (isinstance(v, dict) and all(isinstance(k, str) and ints(x) for k, x in v.items()))


def _is_kernel_rules(v) -> bool:
    return v is None or v is False or (isinstance(v, (list, tuple)) and all(isinstance(r, Rule) for r in v))


@target_options(PTX_TARGET)
class PtxOptions(TargetOptions):
    """Options of the GPU target.

    ``opt_level`` 0-3; ``arch``: the GPU architecture the PTX (and the cubin, where ptxas is installed) is
    for; ``prefix``: the bundle's name (``PREFIX.cuvil``) and its kernels' prefix. ``fma`` (default on) lets
    the proved ``prove real`` kernel rules contract ``a * b + c`` into fused multiply-adds (off: every
    operation rounds separately); ``kernel_rules`` replaces the built-in ``on kernel`` rules (``[]`` or
    False: none); ``enable_fp16`` computes float32 tensors in float16 (inputs and outputs stay float32,
    reductions accumulate in float32); ``register_pass`` (opt-in, needs ptxas): register-limited kernels that
    run in several waves get a register cap where one saves a wave and ptxas meets it without spilling
    (:mod:`cuvil.targets.ptx.regpressure`; measured no faster on an H200, so off by default). ``unpadded``
    (default on): a padded convolution reads its input unpadded, testing bounds, instead of a padded copy
    (:func:`~cuvil.targets.ptx.codegen.gpu_schedule`); ``fused_splitk`` (default off, measured slower): the
    last slice of a split-K convolution tile adds the partials instead of a separate sum kernel.
    ``allow_tf32`` (default off: strict float32): float32 matrix products (MatMul, Gemm) and convolutions run
    on the tensor cores in TF32: inputs rounded to a 10-bit mantissa, products summed in float32 (about 1e-3
    relative error; :mod:`cuvil.targets.ptx.matmul_mma`, :mod:`cuvil.targets.ptx.conv_mma`, docs/targets.md).
    ``graph_buckets`` (with a shape profile): the values of the profiled symbol that get their own
    specialisation in the one bundle (``[1, 2, 4, 8]``, or by symbol ``{"N": [1, 8], "S": [128, 512]}``;
    default: the powers of two of each range plus its min and max; :mod:`cuvil.targets.ptx.buckets`).
    ``jobs`` (with a shape profile): bucket points compiled at once, each in its own process (0: one per CPU;
    default 1); the bundle is the same whatever it is. ``gemv`` (default on; False: the lane-split kernels): one-row
    products (a decode step's weight GEMVs, the LM head) take the kernel of :mod:`cuvil.targets.ptx.gemv`
    (threads along the output columns, 16-byte weight loads) instead of the lane-split one. ``fused_attention``
    (default None: on, as measured on the H200 since the keys are split over blocks): attention as the exports
    spell it becomes one FusedAttention kernel (the proved rules of
    rules/attention.rule; :mod:`cuvil.targets.ptx.attention`), reassociating the softmax's sums.
    ``concurrency`` (default 1): how many inferences the bundle is meant to run at once (sessions in flight on
    their own streams, :class:`~cuvil.targets.ptx.runtime.GpuModel`). With 1 every kernel's grid is sized to
    fill the GPU alone (split-K and key splits up to ``PtxTuning.target_blocks`` blocks, 2 per SM); with C the
    block targets are divided by C, so C calls in flight share the SMs instead of each splitting its reductions
    for the whole GPU (one call alone may then be slower). Outputs can differ from a concurrency-1 bundle's in the
    last bits where a reduction is split into fewer slices (another summation order); each bundle gives the same
    bits call after call. Measured on an H100 (bench/gpu/RESULTS.md, session 27; docs/targets.md).
    """

    opt_level: int = attrs.field(default=3, validator=check(is_opt_level, "0, 1, 2 or 3"))
    arch: str = attrs.field(default="sm_90", validator=check(is_name, "a GPU architecture such as sm_80 or sm_90"))
    prefix: str = attrs.field(default="cuvil", validator=check(is_name, "a non-empty name"))
    fma: bool = attrs.field(default=True, validator=check(is_bool, "True or False"))
    enable_fp16: bool = attrs.field(default=False, validator=check(is_bool, "True or False"))
    kernel_rules: Union[None, bool, Sequence[Rule]] = attrs.field(default=None, validator=check(
        _is_kernel_rules, "None (the built-in kernel rules), False (none) or a list of rules"))
    register_pass: bool = attrs.field(default=False, validator=check(is_bool, "True or False"))
    unpadded: bool = attrs.field(default=True, validator=check(is_bool, "True or False"))
    fused_splitk: bool = attrs.field(default=False, validator=check(is_bool, "True or False"))
    allow_tf32: bool = attrs.field(default=False, validator=check(is_bool, "True or False"))
    graph_buckets: Union[None, Sequence[int], Dict[str, Sequence[int]]] = attrs.field(
        default=None, validator=check(_is_buckets, "None, a list of non-negative ints, or {symbol: [ints]}"))
    jobs: int = attrs.field(default=1, validator=check(
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative int (0: one per CPU)"))
    gemv: bool = attrs.field(default=True, validator=check(is_bool, "True or False"))
    fused_attention: Optional[bool] = attrs.field(default=DEFAULT_TUNING.fused_attention, validator=check(
        lambda v: v is None or is_bool(v), "None (on), True or False"))
    concurrency: int = attrs.field(default=1, validator=check(
        lambda v: isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_CONCURRENCY,
        f"an int from 1 to {MAX_CONCURRENCY} (inferences in flight at once)"))

    @property
    def tuning(self) -> PtxTuning:
        """The kernel-shape settings these options select (``gemv``: PtxTuning.gemv, ``fused_attention``:
        PtxTuning.fused_attention, ``concurrency``: the grid targets divided, :func:`concurrent_tuning`)."""
        base = (DEFAULT_TUNING if (self.gemv, self.fused_attention) == (DEFAULT_TUNING.gemv, DEFAULT_TUNING.fused_attention)
                else attrs.evolve(DEFAULT_TUNING, gemv=self.gemv, fused_attention=self.fused_attention))
        return concurrent_tuning(base, self.concurrency)


class PtxTarget:
    """``PREFIX.cuvil/``: PTX, cubin where ptxas is installed, weights, launch plan, manifest. A symbol without
    a shape profile is specialised (to ``fixed``, else its opt, else its min); the symbols given a profile stay
    and the bundle holds one specialisation per bucket of them (:mod:`cuvil.targets.ptx.profile_bundle`)."""

    triple = PTX_TARGET
    options_type = PtxOptions
    keeps_symbols = False
    #: the symbols given a shape profile stay symbolic (one bundle, a specialisation per bucket)
    keeps_profiled_symbols = True

    def plan(self, graph: Graph, options: PtxOptions, profiles: Dict[str, list]) -> BuildPlan:
        target_machine(options.arch)   # a bad arch fails before any work
        narrowed = sorted({n.precision for n in graph.nodes if n.precision})
        if options.enable_fp16 and narrowed:
            raise CuvilError(f"enable_fp16 with --precision {'/'.join(narrowed)}: enable_fp16 computes every float32 "
                             "tensor in float16 without a certificate, so the precision plan's formats would not be "
                             "what runs",
                             hint="use one of them: --precision fp16 (or bf16, auto) narrows the products and "
                                  "convolutions it certifies; --enable-fp16 alone computes everything in float16")
        krules = [] if options.kernel_rules is False else select_kernel_rules(options.kernel_rules, fma=options.fma)
        key = [str(options.opt_level), options.arch, options.prefix, f"fma={options.fma}",
               f"fp16={options.enable_fp16}", f"register_pass={options.register_pass}",
               f"unpadded={options.unpadded}", f"fused_splitk={options.fused_splitk}",
               f"allow_tf32={options.allow_tf32}",
               f"graph_buckets={options.graph_buckets!r}"] + [f"gemv={options.gemv}"] + (
            [f"concurrency={options.concurrency}"] if options.concurrency != 1 else []) + [
            r.text or r.name for r in krules]
        if options.fused_attention != DEFAULT_TUNING.fused_attention:    # default builds keep their cache keys
            key.append(f"fused_attention={options.fused_attention}")
        return BuildPlan(graph, options, f"{options.prefix}.cuvil", key, {"kernel_rules": krules})

    def emit(self, plan: BuildPlan, path: str, manifest_extra: dict) -> dict:
        o: PtxOptions = plan.options
        manifest_extra = {**manifest_extra, "concurrency": o.concurrency}
        if plan.graph.symbols:
            return compile_profile_bundle(plan.graph, path, graph_buckets=o.graph_buckets, arch=o.arch,
                                          opt_level=o.opt_level, prefix=o.prefix, fma=o.fma,
                                          kernel_rules=plan.extra["kernel_rules"], enable_fp16=o.enable_fp16,
                                          register_pass=o.register_pass, unpadded=o.unpadded,
                                          fused_splitk=o.fused_splitk, allow_tf32=o.allow_tf32,
                                          manifest_extra=manifest_extra, jobs=o.jobs, tuning=o.tuning)
        if o.graph_buckets is not None:
            raise CuvilError("graph_buckets (--graph-buckets) needs a shape profile: the bundle has no symbol left",
                             hint="give the range too: --input-shape x=1x3x224x224:8x3x224x224:64x3x224x224 or "
                                  "--shape-profile N=1:8:64")
        return compile_bundle(plan.graph, path, arch=o.arch, opt_level=o.opt_level, prefix=o.prefix, fma=o.fma,
                              kernel_rules=plan.extra["kernel_rules"], enable_fp16=o.enable_fp16,
                              register_pass=o.register_pass, unpadded=o.unpadded, fused_splitk=o.fused_splitk,
                              allow_tf32=o.allow_tf32, manifest_extra=manifest_extra, tuning=o.tuning)

    def precision_ops(self, options: PtxOptions) -> Dict[str, FrozenSet[str]]:
        """The ops the precision policy may narrow for this target: MatMul, Gemm and Conv run on the tensor cores
        in fp16 or bf16 (:mod:`cuvil.targets.ptx.matmul_mma`, :mod:`cuvil.targets.ptx.conv_mma`) on sm_80 and
        later with ``fma`` on (an mma rounds its sum once), MatMul and Gemm also in fp8 (E4M3, power-of-two
        scales) on sm_89 and later; else none. A narrowed node whose kernel is not a tensor-core one (a grouped
        convolution, a one-row product) computes in float32 and the manifest records it so."""
        sm = arch_number(options.arch)
        if not options.fma or sm < 80:
            return {}
        ops = frozenset(NARROWED_OPS)
        half = ops | frozenset(CONV_NARROW_OPS)
        return {"fp16": half, "bf16": half, **({"fp8": ops} if sm >= 89 else {})}

    def load(self, path: str, manifest: Optional[dict] = None, cached: bool = False) -> Bundle:
        return Bundle(path, read_bundle(path)[1] if manifest is None else manifest, cached=cached)


TARGET = PtxTarget()
