"""LLVM IR for scheduled stages (llvmlite), optimised and emitted as an object file for the host CPU.

Each stage becomes ``void <sym>(ptr bufs, i64 begin, i64 end)``: it computes the output elements whose
leading (parallel) indices, flattened, lie in [begin, end); the runtime splits that range over threads.
Inner loops run over the remaining dimensions, innermost contiguous, so LLVM's vectoriser sees unit
strides. Reductions accumulate with reassociation allowed (the order of a sum is not specified by ONNX).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

import llvmlite.binding as llvm
import llvmlite.ir as ir

from ...errors import CuvilError
from ...ir.dim import bounds, evaluate, product
from ...kernels.schedule import Schedule, Stage
from ...kernels.texpr import nodes, top_level
from ...progress import stage
from ..llvm.module import LLVMKernelModule, initialize_native
from ..llvm.types import I64, PTR
from .copy import emit_copy_stage
from .cpu import CpuDescription, describe_cpu, host_cpu, is_host_name
from .attention import emit_attention_stage, emit_key_panels_stage
from .depthwise import emit_depthwise_stage
from .emitter import ROW_BLOCK, ROW_MAX, X86Emitter, row_reduction
from .gemm import emit_gemm_stage
from .gemm_int8 import emit_planes_stage, emit_qgemm_stage
from .gemm_nhwc import emit_channels_last_mean, emit_channels_last_stage, emit_rows_stage
from .gemm_planes import emit_pair_planes_stage, emit_plane_gemm_stage
from .matmul import emit_matmul_stage
from .pad import emit_pad_stage
from .winograd import emit_winograd_input, emit_winograd_output

PARALLEL_MIN = 64   # leading dims are flattened into the parallel range until it has this many points
# ... but a last dim this long stays an inner loop (see KernelModule.parallel_dims) where the dims before
# it have OUTER_MIN points or the stage has at most SMALL_STAGE elements (too little work to share out)
INNER_MIN = 16
OUTER_MIN = 8
SMALL_STAGE = 32768
# expression nodes whose one output element is a loop of its own (a reduction, a scan, a program, a product or
# window): their stages keep the parallel range of their elements (KernelModule.parallel_dims)
_PER_ELEMENT_LOOPS = frozenset(("reduce", "argscan", "sequential", "contract", "window", "attention", "qgemm",
                                "qplanes", "pplanes", "nhwc_rows", "wino_in", "wino_out", "padwin"))


def _elementwise(e) -> bool:
    """Whether no node of ``e`` runs a loop per output element (see _PER_ELEMENT_LOOPS)."""
    return not any(x.op in _PER_ELEMENT_LOOPS for x in nodes(e))


# A step is cut into at most this many chunks per thread (fewer where a chunk repeats set-up work: see
# KernelModule.split), claimed by whichever thread is free: a worker woken late, or on a core still slow
# after idling, takes fewer.
CHUNKS_PER_THREAD = 4
# exp's last step as AVX-512F's vscalefps where the target has it (the same bits; vecmath.VectorMath ``scalef``)
EXP_SCALEF = True


# AVX-512 gathers and scatters are microcoded on AMD (Zen 4/5) and slow on most Intel cores: LLVM would
# vectorise a micro-kernel epilogue's per-position copy (output rows narrower than the tile) into
# vscatterqps, which cost a 1x1 64->256 convolution over 56x56 more than its FMAs (2-core Zen 5).
_TUNING = "+prefer-no-gather,+prefer-no-scatter"


def _tuned(features: str) -> str:
    return f"{features},{_TUNING}" if features else _TUNING


def cpu_identity(cpu: Optional[str] = None) -> str:
    """What a library is built for, as a cache key part: ``cpu`` as given, or for the host (None, "native",
    "host") its LLVM name and feature string, so a cache shared between machines never hands one host's library
    to a CPU without its instructions."""
    if is_host_name(cpu):
        host = host_cpu()
        return f"{host.llvm_name}:{host.llvm_features}"
    return cpu


def host_target(cpu: Optional[str] = None, opt: int = 3) -> Tuple[object, str, CpuDescription]:
    """The LLVM target machine for ``cpu`` (a ``--cpu`` value, checked; None: this machine), the triple, and the
    CPU's description (its features set the kernels' vector width)."""
    initialize_native()
    desc = describe_cpu(cpu)
    triple = llvm.get_process_triple()
    target = llvm.Target.from_triple(triple)
    tm = target.create_target_machine(cpu=desc.llvm_name, features=_tuned(desc.llvm_features), opt=opt,
                                      reloc="pic", codemodel="default")
    return tm, triple, desc


class KernelModule(LLVMKernelModule):
    """The host kernels of one schedule: each stage a function ``void sym(ptr bufs, i64 begin, i64 end)``
    over its share of the parallel range (:meth:`add_stage`), the micro-kernels where one applies."""

    def __init__(self, name: str, tm, triple: str):
        super().__init__(name, tm, triple)
        self.vector_bits = 128   # widest vector registers of the target CPU (set by generate_object)
        self.math = "vector"     # float32 exp/erf/tanh/log: "vector" (inline polynomials) or "libm" (calls)
        self.next_panel_prefetch = True   # AMX tiles' epilogues prefetch the next panel's lines (X86Tuning)
        self.channel_sweep = True   # large AMX 1x1 convolutions sweep positions per channel block (X86Tuning)
        self.scratch_index: Optional[int] = None   # bufs slot of the thread's scratch (None: no scratch)
        self.gemm_symbols = set()   # stages emitted as GEMM micro-kernels
        self.gemm_tiles = {}        # symbol -> a convolution micro-kernel's register tile ("12x32", "32x7c")
        self.cpu_features = frozenset()   # the target CPU's ISA features (set by generate_object)
        self.narrow_paths = {}      # symbol -> the path of a narrowed contraction ("avx512_bf16", gemm_bf16.py)
        self.split = {}             # symbol -> chunks per thread, where not CHUNKS_PER_THREAD
        # stages emitted as row kernels: symbol -> "conv" (depthwise), "max" (pool), "winograd_in"/"_out"
        self.window_kinds = {}
        self.ranges: Dict[str, Tuple[int, int]] = {}   # symbol -> (min, max)
        self.opt: Dict[str, int] = {}           # symbol -> the value sizes are tuned for

    def at_opt(self, d) -> int:
        """A dimension's value at the symbols' opt point (for tuning decisions only)."""
        return evaluate(d, self.opt)

    def at_max(self, d) -> int:
        return bounds(d, self.ranges)[1]

    @property
    def scalef(self) -> bool:
        """exp scales by ``llvm.ldexp`` (AVX-512F's ``vscalefps``; :class:`~cuvil.targets.llvm.vecmath.VectorMath`)."""
        return EXP_SCALEF and self.vector_bits >= 512

    @property
    def cheap_masks(self) -> bool:
        """Masked vector loads and stores cost about as much as plain ones (AVX-512; AVX2's masked stores
        are microcoded on AMD): short rows and partial tiles then end in one masked vector."""
        return self.vector_bits >= 512

    def kernel(self, sym: str):
        """A new kernel ``void sym(ptr bufs, i64 begin, i64 end)``: its emitter (positioned in the entry
        block) and the range arguments."""
        fn = self.function(sym, [PTR, I64, I64])
        fn.linkage = "external"
        fn.visibility = "hidden"
        bufs, begin, end = fn.args
        return X86Emitter(self, fn, ir.IRBuilder(fn.append_basic_block("entry")), bufs), begin, end

    def parallel_dims(self, st: Stage) -> int:
        """How many leading dims a generic loop nest flattens into its parallel range: until it has
        PARALLEL_MIN points (a row reduction keeps its last dim for the row loop). In a plain elementwise stage
        (no reduction, no sequential program per element) a static last dim of at least INNER_MIN elements
        also stays an inner loop, which LLVM vectorises, where the dims before it still give the threads
        OUTER_MIN units at the opt point or the whole stage is at most SMALL_STAGE elements at the profile's
        maximum: flattened, every element would unflatten its index by division (LayerNormalization's
        normalising pass over BERT's [1, 32, 768], fixed shapes, ran scalar: 58 us, against 5.5 us with its 768
        columns an inner loop). A stage whose elements each run a reduction or a program (an RNN's batch rows,
        NonMaxSuppression's classes) keeps its elements spread over the threads."""
        shape = self.loop_shape(st)
        limit = len(shape) - 1 if row_reduction(st, self.at_max) is not None else len(shape)
        if (limit == len(shape) and len(shape) >= 2 and isinstance(shape[-1], int) and shape[-1] >= INNER_MIN
                and _elementwise(st.expr)
                and (self.at_opt(product(shape[:-1])) >= OUTER_MIN or self.at_max(product(shape)) <= SMALL_STAGE)):
            limit -= 1
        k, extent = 0, 1
        while k < limit and self.at_opt(extent) < PARALLEL_MIN:
            extent = extent * shape[k]
            k += 1
        return k

    def add_group(self, sym: str, parts: Sequence[Tuple[str, int]]):
        """Kernel ``sym`` running the kernels ``parts`` ((symbol, extent) each, int extents) as one parallel
        range, their ranges laid end to end: [begin, end) is cut at the part boundaries and each part runs
        on its share."""
        em, begin, end = self.kernel(sym)
        b = em.b
        off = 0
        for psym, extent in parts:
            lo = b.sub(begin, I64(off))
            lo = b.select(b.icmp_signed("<", lo, I64(0)), I64(0), lo)
            hi = b.sub(end, I64(off))
            hi = b.select(b.icmp_signed(">", hi, I64(extent)), I64(extent), hi)
            with b.if_then(b.icmp_signed("<", lo, hi)):
                b.call(self.module.get_global(psym), [em.bufs, lo, hi])
            off += extent
        b.ret_void()

    def add_stage(self, st: Stage, sym: str, lead: Optional[int] = None) -> Tuple[int, int]:
        """Emit ``st`` as function ``sym``; returns (parallel extent, grain). ``lead``: a generic loop nest
        flattens that many leading dims into its parallel range (default :meth:`parallel_dims`)."""
        done = (emit_qgemm_stage(self, st, sym) or emit_planes_stage(self, st, sym)      # int8 (AMX, VNNI) kernels
                or emit_plane_gemm_stage(self, st, sym) or emit_pair_planes_stage(self, st, sym)   # bf16 planes
                or emit_channels_last_stage(self, st, sym) or emit_rows_stage(self, st, sym))    # bf16 channels-last
        if done is not None:
            return done
        done = emit_matmul_stage(self, st, sym)
        if done is not None:
            self.gemm_symbols.add(sym)
            return done
        done = emit_gemm_stage(self, st, sym)
        if done is not None:
            self.gemm_symbols.add(sym)
            return done
        done = emit_depthwise_stage(self, st, sym)
        if done is not None:
            self.window_kinds[sym] = done[2]
            return done[:2]
        done = emit_channels_last_mean(self, st, sym)
        if done is not None:
            self.window_kinds[sym] = "nhwc_mean"
            return done
        for kind, emit in (("winograd_in", emit_winograd_input), ("winograd_out", emit_winograd_output),
                           ("pad", emit_pad_stage), ("attention", emit_attention_stage),
                           ("attention_keys", emit_key_panels_stage)):
            done = emit(self, st, sym)
            if done is not None:
                self.window_kinds[sym] = kind
                return done
        done = emit_copy_stage(self, st, sym)    # a plain block copy (a concatenation's piece): memmove runs
        if done is not None:
            return done
        em, begin, end = self.kernel(sym)
        shape = self.loop_shape(st)
        red = row_reduction(st, self.at_max)
        k = self.parallel_dims(st) if lead is None else lead
        extent = product(shape[:k])
        # work of one parallel unit: its output elements times the longest top-level reduction each sums
        # (a global average pool's 1000 outputs of 169 terms each are worth two threads)
        terms = [self.at_opt(product(r.attr[2])) for r in top_level(st.expr, "reduce")[0]]
        terms += [s.attr.work(self.opt) for s in top_level(st.expr, "sequential")[0]]   # a row's whole program
        inner_work = self.at_opt(product(shape[k:])) * max(terms, default=1)

        def at(ix):
            if st.region is None:
                return ix
            ix = list(ix)
            ix[st.region[0]] = em.b.add(ix[st.region[0]], I64(st.region[1]))
            return ix

        def body(p):
            rest = p
            idx: List[ir.Value] = [None] * len(shape)
            for d in reversed(range(k)):
                if d == 0:
                    idx[d] = rest
                else:
                    idx[d] = em.b.srem(rest, em.index(shape[d]))
                    rest = em.b.sdiv(rest, em.index(shape[d]))
            return idx[:k]

        blocked = red is not None and ROW_BLOCK * self.at_max(shape[-1]) <= ROW_MAX
        if red is None:
            em.loop_range(begin, end, lambda p: em.loops(shape[k:], tail_fold=self.cheap_masks, body=lambda inner: em.store_element(
                st, at(body(p) + inner))))
        elif not blocked:
            em.loop_range(begin, end, lambda p: em.loops(shape[k:-1], lambda mid: em.store_row(
                st, red, [at(body(p) + mid)], shape[-1])))
        elif k < len(shape) - 1:    # rows blocked along the last outer dim
            def rows(p):
                outer = body(p)
                em.loops(shape[k:-2], lambda mid: em.blocked_range(
                    I64(0), em.index(shape[-2]), ROW_BLOCK,
                    lambda j0: em.store_row(st, red, [at(outer + mid + [em.b.add(j0, I64(j))])
                                                      for j in range(ROW_BLOCK)], shape[-1]),
                    lambda j: em.store_row(st, red, [at(outer + mid + [j])], shape[-1])))
            em.loop_range(begin, end, rows)
        else:                       # every parallel unit is one row: block the parallel range
            em.blocked_range(begin, end, ROW_BLOCK,
                             lambda p0: em.store_row(st, red, [at(body(em.b.add(p0, I64(j))))
                                                               for j in range(ROW_BLOCK)], shape[-1]),
                             lambda p: em.store_row(st, red, [at(body(p))], shape[-1]))
        em.b.ret_void()
        return (extent if shape else 1), max(1, int(4096 // max(inner_work, 1)))

    def compile_parts(self, opt: int, parts: Sequence[Tuple[str, Set[str]]], done=lambda name: None) -> List[bytes]:
        """One object file per part (``(name, kernel symbols)``: a step's kernel, or a group kernel with the
        pieces it calls), each parsed, optimised and emitted on its own so that progress can name each kernel
        (``done(name)`` after each). No kernel calls outside its part, so LLVM sees what it would in one
        module: every function is optimised alone (the group's pieces inlined into it as before). A defined
        function that is no part's kernel is a helper: internal, copied into every part."""
        kernels = [sym for _, syms in parts for sym in syms]
        helpers = {f.name: f for f in self.module.functions if not f.is_declaration and f.name not in kernels}
        shared = sorted(name for name, f in helpers.items() if f.linkage not in ("internal", "private"))
        if len(set(kernels)) != len(kernels) or shared:
            raise CuvilError(f"internal: kernel parts overlap or leave out external functions ({', '.join(shared)}); "
                             f"report it")
        objects = []
        for name, syms in parts:
            try:
                mod = llvm.parse_assembly(self.part_text(set(syms) | set(helpers)))
                mod.verify()
            except RuntimeError as e:
                raise CuvilError(f"generated LLVM IR of {name} does not verify: {e}") from None
            if opt > 0:
                pto = llvm.create_pipeline_tuning_options(speed_level=min(opt, 3))
                pto.loop_vectorization = opt >= 2
                pto.slp_vectorization = opt >= 2
                # Full unrolling of short constant loops runs before the loop vectoriser and would leave it
                # nothing to vectorise; the vectoriser interleaves instead.
                pto.loop_unrolling = False
                pb = llvm.create_pass_builder(self.tm, pto)
                pb.getModulePassManager().run(mod, pb)
            objects.append(self.tm.emit_object(mod))
            done(name)
        return objects


def generate_object(sched: Schedule, prefix: str, cpu: Optional[str], opt: int,
                    variant: str = "", math: str = "vector",
                    next_panel_prefetch: bool = True,
                    channel_sweep: bool = True) -> Tuple[List[bytes], List[Tuple[str, int, int]], dict]:
    """The kernels of ``sched`` as object files (one per step), and the (symbol, extent, grain) of each
    stage. Progress (:mod:`cuvil.progress`), kernel by kernel: the LLVM IR, then LLVM's optimisation and
    code generation (``variant`` names the kernels' variant in those lines). ``math``: float32 exp, erf, tanh
    and log as inline polynomials ("vector") or libm calls ("libm"). ``next_panel_prefetch``, ``channel_sweep``:
    :attr:`cuvil.targets.x86.tuning.X86Tuning.next_panel_prefetch`, ``.channel_sweep``."""
    suffix = f" ({variant})" if variant else ""
    tm, triple, desc = host_target(cpu, opt)
    km = KernelModule(prefix, tm, triple)
    km.math = math
    km.next_panel_prefetch = next_panel_prefetch
    km.channel_sweep = channel_sweep
    km.vector_bits = desc.vector_bits
    km.cpu_features = desc.features   # ISA features (LLVM spellings): the bf16 and int8 kernels' dispatch
    km.scratch_index = 2 + len(sched.inputs) + len(sched.outputs)
    km.dims_index = km.scratch_index + 1
    km.symbol_slots = {s.name: k for k, s in enumerate(sched.symbols)}
    km.ranges, km.opt = sched.ranges, sched.opt_point
    steps, step_stages = [], []
    functions: List[Tuple[str, Set[str]]] = []   # each step: its kernel and those it calls, one object each
    k = 0
    with stage("llvm IR" + suffix, total=len(sched.stages), unit="kernels") as progress:
        while k < len(sched.stages):
            run = _slice_run(sched.stages, k)
            # a generic piece's unit is then the same block in every piece: the dims up to the region's axis
            # are its parallel range (channel planes of a channel concatenation), the rest its loop nest. With
            # rows as units instead (a piece's own choice below 64 channels), DenseNet-121's pieces ran 43% slower.
            static = all(isinstance(d, int) for i in run for d in km.loop_shape(sched.stages[i]))
            lead = sched.stages[k].region[0] + 1 if len(run) > 1 and static else None
            parts = []
            for i in run:
                sym = f"{prefix}_kernel{i}"
                extent, grain = km.add_stage(sched.stages[i], sym, lead=lead)
                parts.append((i, sym, extent, grain))
                progress.advance(item=f"{sym}: {sched.stages[i].op} {sched.stages[i].name}")
            for group in _groups(km, parts, sched.stages):
                if len(group) == 1:
                    i, sym, extent, grain = group[0]
                else:
                    i, sym = group[0][0], f"{prefix}_group{group[0][0]}"
                    km.add_group(sym, [(psym, e) for _, psym, e, _ in group])
                    extent, grain = sum(e for _, _, e, _ in group), group[0][3]
                steps.append((sym, extent, grain, km.split.get(sym, CHUNKS_PER_THREAD)))
                step_stages.append([g[0] for g in group])
                first = sched.stages[group[0][0]]
                label = f"{sym}: {first.op} {first.name}" + (f" (+{len(group) - 1} pieces)" if len(group) > 1 else "")
                functions.append((label, {sym} | {psym for _, psym, _, _ in group}))
            k = run[-1] + 1
    with stage("llvm" + suffix, total=len(functions), unit="kernels", detail=f"O{opt}") as progress:
        objects = km.compile_parts(opt, functions, lambda name: progress.advance(item=name))
    return objects, steps, {"triple": triple, "cpu": desc, "scratch_bytes": km.scratch_bytes,
                        "gemm_symbols": km.gemm_symbols, "gemm_tiles": km.gemm_tiles, "window_kinds": km.window_kinds,
                        "narrow_paths": km.narrow_paths,
                        "step_stages": step_stages}


def _slice_run(stages, k: int) -> List[int]:
    """Stage k and the stages after it that write slices of the same buffer along the same axis (the
    pieces of a split concatenation, :func:`cuvil.kernels.schedule.split_piecewise`)."""
    st = stages[k]
    if st.region is None or st.region[0] == len(st.buf.shape) - 1:   # pieces of rows: their loops differ
        return [k]
    j = k + 1
    while j < len(stages) and stages[j].region is not None and stages[j].buf is st.buf \
            and stages[j].region[0] == st.region[0]:
        j += 1
    return list(range(k, j))


def _groups(km, parts, stages) -> List[list]:
    """Consecutive generic loop-nest pieces with constant extents become one step (DenseNet-121's
    BatchNorm + Relu over each dense layer's concatenation: 594 steps -> 58); each other piece keeps
    its own, and so does a stage storing a run-time size (the runtime reads it between steps)."""
    out, cur = [], []
    for part in parts:
        i, sym, extent, _ = part
        if sym not in km.gemm_symbols and sym not in km.window_kinds and isinstance(extent, int) \
                and stages[i].buf.base != km.dims_index:
            cur.append(part)
            continue
        out.extend([cur] if cur else [])
        out.append([part])
        cur = []
    out.extend([cur] if cur else [])
    return out
