"""PTX for scheduled stages: one LLVM module (triple ``nvptx64-nvidia-cuda``) with one kernel per stage,
lowered by llvmlite's NVPTX backend.

Each stage becomes ``ptx_kernel void <prefix>_k<i>(ptr bufs, i64 n)``: thread ``blockIdx.x * blockDim.x +
threadIdx.x`` computes output element ``i`` of the flattened output (row-major), then ``i`` advances by
``gridDim.x * blockDim.x`` (grid-stride loop) while ``i < n``; so any grid size is correct and the launcher
may cap it. The element's indices are unflattened from ``i``, the stage's expression is evaluated by the
PTX emitter (:mod:`cuvil.targets.ptx.emitter`, over the shared :mod:`cuvil.targets.llvm.emitter`; reductions
become loops inside the thread) and the value is stored. A stage with few outputs and a long float sum
instead gives each element 2-32 consecutive threads that split its reduction (:func:`split_lanes`, :meth:`PtxKernelModule.add_split_stage`).
A sequential stage (a recurrent layer's steps, :mod:`cuvil.kernels.sequential`) runs one thread block per
row, its threads sharing each assignment and meeting at a barrier after it
(:meth:`PtxKernelModule.add_sequential_stage`).

Memory: ``bufs[b]`` are global-memory pointers (0 arena, 1 weights, then inputs and outputs). Every buffer
a stage reads and does not write is constant while the kernel runs, so its loads carry ``!invariant.load``
and NVPTX emits them as ``ld.global.nc`` (read-only data cache).

Math: sqrt, fabs, floor, ceil, roundeven, trunc, fma, min/max lower to PTX instructions (sqrt and division
correctly rounded; no flush-to-zero); exp, log, tanh, erf, pow, fmod, ... call NVIDIA's libdevice, which
is linked into the module, internalised, and everything unused is dropped before optimisation.

Kernel rules (``on kernel``, :mod:`cuvil.kernels.kernel_rules`) rewrite every stage's expression before
it is emitted: by default the built-in ones (``rules/kernel.rule``) that are proved, the ``prove real``
ones (fma contraction) only with ``fma=True``. Floating point contraction happens only through them: LLVM's
``contract`` flag is stripped from every instruction, so an ``fma`` in the PTX is one a rule put there (and
the manifest counts it), and without ``fma`` every operation rounds separately (``add.rn`` / ``mul.rn``,
which ptxas does not fuse either), as the graph rules' exactness arguments assume. ``fma`` E nodes and
fused multiply-accumulate reductions (``reduce[fma]``) lower to ``llvm.fma`` (``fma.rn.f32`` /
``fma.rn.f16``).

Float16 (``Pipeline.compile(..., enable_fp16=True)``, :mod:`cuvil.rewrite_rules.precision`): half values are
stored and computed in half; a float16 ``sum`` reduction is widened here to accumulate in float32
(:func:`widen_half_reductions`), its result rounded to half once.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Tuple

import attrs
import llvmlite.binding as llvm
import llvmlite.ir as ir

from ...errors import CuvilError, UnsupportedOpError
from ...ir.dtype import DType
from ...kernels.bounds import Certificate
from ...kernels.kernel_rules import rewrite_stages, select_kernel_rules
from ...kernels.schedule import Schedule, Stage, schedule
from ...kernels.texpr import E, cast, const, nodes
from ...progress import stage
from ..llvm.module import LLVMKernelModule, initialize_all
from ..llvm.types import F32, I32, I64, PTR, const_value, ll
from .archs import arch_number, check_arch
from .attention import attention_node, emit_attention, emit_attention_merge, plan_attention
from .attention import scratch_buf as attention_scratch
from .attention_mma import emit_flash, plan_flash
from .bounds_patterns import arena_limit, prove_gpu_stages
from .conv import TILE_CHANNELS, accumulation, combine_stage, conv_node, emit_conv, plan_conv, scratch_buf
from .conv_mma import conv_mma_format, emit_conv_mma, plan_conv_mma
from .emitter import PtxEmitter, set_contraction, shared_global
from .kernel_shapes import (TILE_K, WARP_MIN_TERMS, coarsen_factor, single_sum, split_lanes, tile_factors,
                            tile_shape)
from .gemv import emit_gemv, plan_gemv
from .libdevice import libdevice_module
from .regpressure import sms_for
from .matmul_mma import combine_stage as mm_combine_stage
from .matmul_mma import emit_matmul, matmul_parts, mma_format, plan_matmul
from .matmul_mma import scratch_buf as mm_scratch_buf
from .matmul_simt import emit_simt, plan_simt, simt_applies
from .row_chain import chain_threads, emit_row_chain, row_chain_at
from .tuning import DEFAULT_TUNING, PtxTuning, product_sms

TRIPLE = "nvptx64-nvidia-cuda"
BLOCK = 256
GRID_CAP = 65535          # blocks per launch at most; the grid-stride loop covers the rest


@attrs.define
class KernelDesc:
    """How to launch one kernel: ``grid = ceil(n_elements / block)`` blocks of ``block`` threads (1-D),
    capped at :data:`GRID_CAP` (the kernel's grid-stride loop does the rest); arguments ``(bufs, n)`` with
    ``n = n_elements``. A kernel with ``n_elements == 0`` need not be launched. ``n_elements`` counts
    threads: output elements x ``lanes`` (32 for a warp-per-element kernel, else 1)."""
    name: str
    n_elements: int
    block: int = BLOCK
    stage: str = ""        # the schedule stage it computes (for reports)
    lanes: int = 1         # threads per output element (split kernels)
    # element, split, coarse (several channels per thread), tiled (shared memory), sequential (a block per row),
    # row (row reductions and their element stage, a block per row), matmul_*, gemm_fp32, gemv (one-row products), conv*,
    # attention (a block per query row), attention_mma (the flash kernel: 16 query rows a warp, tensor cores)
    kind: str = "element"

    @property
    def grid(self) -> int:
        return min(-(-self.n_elements // self.block), GRID_CAP)


def element_vec(st: Stage, tuning: PtxTuning) -> int:
    """Elements a thread of the plain element stage ``st`` computes: ``tuning.element_vec`` where the stage has
    at least ``tuning.element_vec_min`` elements, its last dim is a multiple of it and it reduces nothing, else 1."""
    shape = [int(d) for d in st.buf.shape]
    total = 1
    for d in shape:
        total *= d
    v = tuning.element_vec
    if v <= 1 or not shape or total < tuning.element_vec_min or shape[-1] % v:
        return 1
    # windows and other reductions (a max pool) keep a thread per output: the copies and elementwise stages are
    # what is bound by the bytes a thread has in flight
    return 1 if any(x.op == "reduce" for x in nodes(st.expr)) else v


def target_machine(arch: str = "sm_90", opt: int = 3, ptx_isa: int = 0):
    """An NVPTX target machine for GPU architecture ``arch`` (``sm_<number>``). ``ptx_isa`` (e.g. 84 for PTX ISA
    8.4, which E4M3 ``mma`` needs): at least that ISA version in the PTX's ``.version`` (0: LLVM's own minimum
    for the arch, which older drivers accept)."""
    check_arch(arch, flag="arch")
    initialize_all()
    target = llvm.Target.from_triple(TRIPLE)
    return target.create_target_machine(cpu=arch, features=f"+ptx{ptx_isa}" if ptx_isa else "",
                                        opt=min(max(opt, 0), 3))


#: the PTX ISA version the fp8 (E4M3) ``mma`` needs
FP8_PTX_ISA = 84


# --- code generation ------------------------------------------------------------------------------------

class PtxKernelModule(LLVMKernelModule):
    """The GPU kernels of one schedule: each stage one or two ``ptx_kernel`` entries (:meth:`add_stage`),
    compiled to PTX text by :meth:`compile_ptx`."""

    def __init__(self, name: str, tm, *, fma: bool = False, block: int = BLOCK, narrow_index: bool = False,
                 scratch_offset: int = 0, conv_target_blocks: int = 0, arch: str = "sm_90",
                 fused_splitk: bool = False, tuning: PtxTuning = DEFAULT_TUNING, allow_tf32: bool = False,
                 precisions: Optional[Dict[str, str]] = None,
                 precision_scales: Optional[Dict[str, Tuple[int, int]]] = None):
        super().__init__(name, tm, TRIPLE)
        self.allow_tf32 = allow_tf32          # float32 matmuls may run on TF32 tensor cores (matmul_mma.py)
        # stage name -> its node's precision: "fp16"/"bf16"/"fp8" (MatMul, Gemm), "fp16"/"bf16" (Conv)
        self.precisions = precisions or {}
        # stage name -> (e_a, e_b): a fp8 product's power-of-two operand scales (matmul_mma.stage_scales)
        self.precision_scales = precision_scales or {}
        # stage name -> why: products whose tensor-core / SIMT access pattern was refuted (bounds_patterns),
        # computed by the plain kernels instead
        self.plain_products: Dict[str, List[str]] = {}
        self.sm = arch_number(arch)      # compute capability x 10 (sm_90a -> 90)
        # SMs the tensor-core products' split-K plans fill: the GPU's, shared by tuning.concurrency calls in flight
        self.sms = product_sms(sms_for(arch), tuning)
        self.scratch_offset = -(-scratch_offset // 256) * 256   # split-K counters and partials go after the arena
        self.scratch_bytes = 0
        self.counter_bytes = 0      # set by plan_scratch: one int32 per tile of the largest split convolution
        self.conv_target_blocks = conv_target_blocks or tuning.target_blocks
        self.fused_splitk = fused_splitk   # split-K partials added by the last slice (else a sum kernel)
        self.tuning = tuning
        self.fma = fma
        self.block = block
        self.kernels: List[str] = []
        self.needs_libdevice = False
        self.narrow_index = narrow_index
        self.empty_md = self.module.add_metadata([])

    def grid_stride(self, b: ir.IRBuilder):
        """(global thread index, threads in the grid): the start and step of a grid-stride loop."""
        ntid = self.sreg(b, "ntid.x")
        gid = b.add(b.mul(self.sreg(b, "ctaid.x"), ntid), self.sreg(b, "tid.x"))
        return gid, b.mul(self.sreg(b, "nctaid.x"), ntid)

    def sreg(self, b: ir.IRBuilder, name: str) -> ir.Value:
        f = self.declare(f"llvm.nvvm.read.ptx.sreg.{name}", I32, [])
        return b.zext(b.call(f, []), I64)

    def add_stage(self, st: Stage, sym: str) -> KernelDesc:
        """The kernel(s) for a stage: a convolution lowered as a packed contraction takes the implicit-GEMM
        kernels (:meth:`add_conv_stage`); other stages with one float sum are shaped by output count
        (thresholds measured on an H200, bench/gpu/RESULTS.md, most of them in :attr:`tuning`): few outputs and
        a long sum: lanes split it (``warp_max_outputs``, ``split_*``); the largest stages: shared-memory tiles
        (TILE_*, ``tile_*``); large ones: several channels per thread (COARSEN*, ``coarsen``); else one thread
        per output."""
        if attention_node(st) is not None:
            return self.add_attention_stage(st, sym)
        node = conv_node(st) if self.tuning.conv_enabled else None
        if node is not None:
            return self.add_conv_stage(st, sym, node)
        if st.expr.op == "sequential":
            return self.add_sequential_stage(st, sym)
        return self.add_stage_plain(st, sym)

    def add_sequential_stage(self, st: Stage, sym: str) -> KernelDesc:
        """A :func:`~cuvil.kernels.sequential.sequential` stage: one thread block per row (grid-stride over
        rows, so every thread of a block runs the same steps); the block's threads share each assignment's
        loop nest and meet at a barrier after it (:meth:`PtxEmitter.assign`), so a step's recurrent product
        is spread over the block and the next assignment sees every element the last one stored."""
        rows = 1
        for d in st.buf.shape:
            rows *= int(d)
        widest = 1
        for a in st.expr.attr.assigns():
            n = 1
            for x in a.extents:
                n *= int(x)
            widest = max(widest, n)
        threads = min(max(32, -(-widest // 32) * 32), self.block)
        fn = self.kernel_fn(sym)
        bufs, _ = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        em = PtxEmitter(self, fn, b, bufs, st.buf)
        em.lanes = (self.sreg(b, "tid.x"), self.sreg(b, "ntid.x"))
        shape = [int(d) for d in st.buf.shape]

        def row(r):
            idx: List[ir.Value] = [None] * len(shape)
            for d in reversed(range(len(shape))):
                if d == 0:
                    idx[d] = r
                else:
                    idx[d] = b.urem(r, I64(shape[d]))
                    r = b.udiv(r, I64(shape[d]))
            em.store_element(st, idx)
        em.loop_range(self.sreg(b, "ctaid.x"), I64(rows), row, self.sreg(b, "nctaid.x"))
        b.ret_void()
        set_contraction(fn, False)
        self.kernels.append(sym)
        return KernelDesc(sym, rows * threads, threads, st.name, 1, "sequential")

    def flash_plan(self, st: Stage):
        """The tensor-core flash kernel's plan for the stage's FusedAttention, or None where the row kernel takes
        it (:func:`~cuvil.targets.ptx.attention_mma.plan_flash`)."""
        if not self.tuning.attention_mma:
            return None
        return plan_flash(st.expr.attr, self.sm, self.tuning.target_blocks)

    def attention_plan(self, st: Stage):
        """How the stage's FusedAttention is split over blocks (:func:`~cuvil.targets.ptx.attention.plan_attention`);
        one block per row (no split, no partials in the scratch area) where the flash kernel takes it."""
        if self.flash_plan(st) is not None:
            return plan_attention(st.expr.attr, 1, 0)
        return plan_attention(st.expr.attr, self.tuning.target_blocks, self.tuning.attention_split_keys,
                              self.tuning.attention_stage_keys)

    def add_attention_stage(self, st: Stage, sym: str):
        """A FusedAttention's node (:class:`~cuvil.kernels.attention.AttentionRows`): a block per query row, or
        per split of its keys with a merge kernel ``<sym>m`` (flash-decoding; the partials in the scratch area
        after the arena, where the split-K products' go: one stage runs at a time) (:mod:`cuvil.targets.ptx.attention`)."""
        flash = self.flash_plan(st)
        if flash is not None:
            units, threads = emit_flash(self, st, sym, flash)
            return KernelDesc(sym, units * threads, threads, st.name, 1, "attention_mma")
        plan = self.attention_plan(st)
        if plan.splits == 1:
            units, threads = emit_attention(self, st, sym, plan)
            return KernelDesc(sym, units * threads, threads, st.name, 1, "attention")
        scratch = attention_scratch(plan, self.scratch_offset + self.counter_bytes)
        self.scratch_bytes = max(self.scratch_bytes, self.counter_bytes + 4 * plan.scratch_floats)
        if self.tuning.attention_fused_merge:      # plan_scratch reserved a counter per row
            units, threads = emit_attention(self, st, sym, plan, scratch, counters=self.scratch_offset)
            return KernelDesc(sym, units * threads, threads, st.name, 1, "attention")
        units, threads = emit_attention(self, st, sym, plan, scratch)
        return [KernelDesc(sym, units * threads, threads, st.name, 1, "attention"),
                KernelDesc(sym + "m", emit_attention_merge(self, st, sym + "m", plan, scratch), 64, st.name, 1,
                           "attention_merge")]

    def add_row_chain(self, chain: List[Stage], sym: str) -> KernelDesc:
        """Row reductions and the element stage reading them as one kernel, a block per row
        (:mod:`cuvil.targets.ptx.row_chain`)."""
        threads = chain_threads(chain, self.block)
        rows = emit_row_chain(self, chain, sym, threads)
        return KernelDesc(sym, rows * threads, threads, chain[-1].name, 1, "row")

    def add_stage_plain(self, st: Stage, sym: str) -> KernelDesc:
        """The kernel shapes for stages that are not implicit-GEMM convolutions (see :meth:`add_stage`)."""
        mm = self.matmul_plan(st) if self.tuning.mma else None
        if mm is not None:
            return self.add_matmul_stage(st, sym, *mm)
        simt = self.simt_plan(st) if self.tuning.simt_matmul else None
        if simt is not None:
            threads = emit_simt(self, st, sym, *simt)
            return KernelDesc(sym, threads, simt[1].threads, st.name, 1, "gemm_fp32")
        gemv = self.gemv_plan(st) if self.tuning.gemv else None
        if gemv is not None:
            return KernelDesc(sym, emit_gemv(self, st, sym, *gemv), gemv[1].threads, st.name, 1, "gemv")
        red = single_sum(st)
        if red is None:
            return self.add_element_stage(st, sym, vec=element_vec(st, self.tuning))
        terms = 1
        for x in red.attr[2]:
            terms *= int(x)
        outputs = 1
        for d in st.buf.shape:
            outputs *= int(d)
        if terms >= WARP_MIN_TERMS and outputs <= self.tuning.warp_max_outputs:
            lanes = split_lanes(outputs, terms, int(red.attr[2][0]), self.tuning)
            if lanes > 1:
                return self.add_split_stage(st, sym, red, lanes)
        factors = tile_factors(st, red, self.tuning) if self.tuning.tile_enabled else None
        if factors is not None:
            return self.add_tiled_stage(st, sym, red, *factors)
        co = coarsen_factor(st, red, self.tuning)
        if co > 1:
            return self.add_coarse_stage(st, sym, red, co)
        return self.add_element_stage(st, sym)

    def matmul_plan(self, st: Stage):
        """(parts, plan) when the stage is a matrix product the tensor cores compute in a format its
        precision allows (:mod:`cuvil.targets.ptx.matmul_mma`), else None."""
        parts = matmul_parts(st) if st.name not in self.plain_products else None
        if parts is None:
            return None
        fmt = mma_format(st, parts, self.sm, self.allow_tf32, self.precisions.get(st.name, ""))
        if fmt is None:
            return None
        plan = plan_matmul(st, parts, fmt, self.tuning.mma_min_blocks, self.tuning.mma_max_ks,
                           self.tuning.mma_sm_groups, self.sms, self.tuning.mma_vec, self.tuning.mma_async,
                           self.tuning.mma_splits, self.tuning.mma_async_costs, self.tuning.mma_split_filled)
        if plan.m < 16 or plan.n < 8 or plan.k < 16:
            return None      # a vector product: the float32 kernels waste less
        if plan.splits > 1 and (self.scratch_offset + self.counter_bytes) // 4 + plan.scratch_floats >= 2 ** 31:
            plan = attrs.evolve(plan, splits=1)      # the partial sums would need 64-bit addresses
        return parts, plan

    def add_matmul_stage(self, st: Stage, sym: str, parts, plan):
        """A product on the tensor cores (:mod:`cuvil.targets.ptx.matmul_mma`); with split-K the slices'
        partial sums go to the scratch area after the arena (where the convolutions' go: one product or
        convolution runs at a time) and a second kernel ``<sym>s`` adds them in slice order and runs the
        epilogue (with ``tuning.mma_fused_splitk``: the last slice of each output tile to finish does, a counter
        per tile, :attr:`counter_bytes`). Returns the launch descriptions."""
        kind = "matmul_" + plan.fmt
        if plan.splits == 1:
            threads = emit_matmul(self, st, sym, parts, plan)
            return KernelDesc(sym, threads, plan.threads, st.name, 1, kind)
        scratch = mm_scratch_buf(plan, self.scratch_offset + self.counter_bytes)
        self.scratch_bytes = max(self.scratch_bytes, self.counter_bytes + 4 * plan.scratch_floats)
        if self.tuning.mma_fused_splitk:     # the last slice of each tile adds the partials (counters first)
            threads = emit_matmul(self, st, sym, parts, plan, scratch, counters=self.scratch_offset)
            return KernelDesc(sym, threads, plan.threads, st.name, 1, "matmul_splitk_" + plan.fmt)
        threads = emit_matmul(self, st, sym, parts, plan, scratch)
        return [KernelDesc(sym, threads, plan.threads, st.name, 1, "matmul_splitk_" + plan.fmt),
                self.add_element_stage(mm_combine_stage(st, parts[0], plan, scratch), sym + "s",
                                       kind="matmul_sum")]

    def gemv_plan(self, st: Stage):
        """(parts, plan) when the stage is a one-row product whose weight reads the output column
        contiguously (:mod:`cuvil.targets.ptx.gemv`), else None."""
        parts = matmul_parts(st) if st.name not in self.plain_products else None
        plan = plan_gemv(st, parts, self.tuning.gemv_min_blocks)
        return (parts, plan) if plan is not None else None

    def simt_plan(self, st: Stage):
        """(parts, plan) when the stage is a float32 matrix product for the register-tiled SIMT kernel
        (:mod:`cuvil.targets.ptx.matmul_simt`: the products the tensor cores do not take), else None."""
        parts = matmul_parts(st) if st.name not in self.plain_products else None
        if parts is None or st.buf.dtype != DType.FLOAT:
            return None
        plan = plan_simt(st, parts, self.tuning.simt_force, self.tuning.simt_tk)
        return (parts, plan) if simt_applies(plan) else None

    def add_conv_stage(self, st: Stage, sym: str, node: E):
        """A convolution lowered as a packed contraction: the implicit-GEMM tile kernel
        (:mod:`cuvil.targets.ptx.conv`). With split-K the slices' partial sums are kept after the arena
        (:attr:`scratch_bytes`) and a second kernel ``<sym>s`` adds them in slice order and runs the epilogue
        (with ``fused_splitk``, measured slower: the last slice of each tile to finish does, a
        counter per tile, :attr:`counter_bytes`, zeroed before each run). Returns the launch descriptions."""
        plan = self.conv_plan(st, node)
        if plan.splits > 1 and (self.scratch_offset + self.counter_bytes) // 4 + plan.scratch_floats >= 2 ** 31:
            return self.add_stage_plain(st, sym)      # the partial sums would need 64-bit addresses
        scratch = None
        fused = self.fused_splitk and not hasattr(plan, "fmt")
        if plan.splits > 1:
            scratch = scratch_buf(plan, self.scratch_offset + self.counter_bytes)
            self.scratch_bytes = max(self.scratch_bytes, self.counter_bytes + 4 * plan.scratch_floats)
        if hasattr(plan, "fmt"):     # tensor cores over the whole batch (conv_mma.py)
            fused = self.tuning.conv_mma_fused_splitk
            threads = emit_conv_mma(self, st, sym, node, plan, scratch,
                                    counters=self.scratch_offset if fused and scratch is not None else None)
            kind = ("conv" if plan.splits == 1 else "conv_splitk") + "_mma_" + plan.fmt
        else:
            threads = emit_conv(self, st, sym, node, plan, scratch,
                                counters=self.scratch_offset if fused and scratch is not None else None)
            kind = ("conv" if plan.splits == 1 else "conv_splitk") + ("_mma" if plan.mma else "")
        descs = [KernelDesc(sym, threads, plan.threads, st.name, 1, kind)]
        if scratch is not None and not fused:
            descs.append(self.add_element_stage(combine_stage(st, node, plan, scratch), sym + "s", kind="conv_sum"))
        return descs

    def conv_plan(self, st: Stage, node: E):
        """The kernel plan of the convolution ``node`` that stage ``st`` computes: conv_mma.py's tensor-core tiles
        in the format of :func:`conv_mma_format` (``precisions``: the policy's fp16 / bf16 of its Conv node), else
        conv.py's."""
        red = accumulation(node)
        # tensor cores only where contraction is allowed (the fma default): an mma's internal sum of 16
        # products rounds like no chain of separate operations (nor of proved fma steps, see docs/rules.md)
        mma = self.tuning.mma and self.sm >= 80 and red.attr[0] == "fma"
        fmt = conv_mma_format(node.attr, red, self.sm, self.allow_tf32, self.precisions.get(st.name, "")) \
            if mma and self.tuning.conv_mma_batch else None
        if fmt is not None:
            plan = plan_conv_mma(node.attr, fmt, self.conv_target_blocks, self.tuning.ldmatrix,
                                 self.tuning.conv_mma_async, self.tuning.conv_mma_tap_major)
            if plan is not None:
                return plan
        return plan_conv(node.attr, self.conv_target_blocks, mma)

    def plan_scratch(self, stages) -> None:
        """Reserve the counters (256-aligned) before any kernel is emitted: one int32 per output tile of the
        largest split convolution (conv.py's with ``fused_splitk``, conv_mma.py's with
        ``tuning.conv_mma_fused_splitk``) or tensor-core product (with ``tuning.mma_fused_splitk``), or per query
        row of the largest split attention (with ``attention_fused_merge``); they sit first in the scratch area,
        partials after, and are zeroed before each run."""
        tiles = 0
        for st in stages:
            conv = conv_node(st) if self.tuning.conv_enabled else None
            if conv is not None and (self.fused_splitk or self.tuning.conv_mma_fused_splitk):
                p = self.conv_plan(st, conv)
                if p.splits > 1 and hasattr(p, "fmt") and self.tuning.conv_mma_fused_splitk:
                    tiles = max(tiles, p.tiles)
                elif p.splits > 1 and not hasattr(p, "fmt") and self.fused_splitk:
                    tiles = max(tiles, p.n * p.groups * p.tiles_m * p.tiles_p)
            if self.tuning.mma_fused_splitk and self.tuning.mma and conv is None and st.expr.op != "sequential":
                mm = self.matmul_plan(st)     # (arena_limit's and GpuPatterns' conditions for a product)
                if mm is not None and mm[1].splits > 1:
                    tiles = max(tiles, mm[1].tiles)
            if self.tuning.attention_fused_merge and attention_node(st) is not None:
                a = self.attention_plan(st)
                if a.splits > 1:
                    tiles = max(tiles, a.rows)
        self.counter_bytes = -(-4 * tiles // 256) * 256 if tiles else 0

    def add_tiled_stage(self, st: Stage, sym: str, red: E, wfac: E, xfac: E) -> KernelDesc:
        """Shared-memory tiled reduction: the output is a (channel = dim 1) x (position = every other dim,
        flattened) matrix; a block of 256 threads computes a TM x TP tile of it, each thread a 4 x 4 register
        tile. The reduction runs in chunks of TK terms: the block loads ``wfac`` (depends on the channel and
        the reduction, not the position: weights) for TM channels and ``xfac`` (depends on the position and
        the reduction: the input window) for TP positions into shared memory, synchronises, and every thread
        accumulates its 16 products per term from shared memory, so each value loaded from global memory is
        used TP (resp. TM) / 4 times. Terms past the reduction, channels past M and positions past P load
        zero. Then each thread runs the fused epilogue for its 16 outputs and stores those that exist."""
        fn = self.kernel_fn(sym)
        bufs, _n = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        em = PtxEmitter(self, fn, b, bufs, st.buf)
        shape = [int(d) for d in st.buf.shape]
        M = shape[1]
        rest_dims = [shape[0]] + shape[2:]
        P = 1
        for d in rest_dims:
            P *= d
        kind, vs, extents = red.attr
        extents = [int(x) for x in extents]
        R = 1
        for x in extents:
            R *= x
        TM, TP = tile_shape(M, P)
        TK = TILE_K
        tiles_m, tiles_p = -(-M // TM), -(-P // TP)
        ntiles = tiles_m * tiles_p
        sa, sb = shared_global(self, f"{sym}_sa", F32, TK * TM), shared_global(self, f"{sym}_sb", F32, TK * TP)
        bar = self.declare("llvm.nvvm.barrier0", ir.VoidType(), [])
        fmaf = self.declare("llvm.fma.f32", F32, [F32, F32, F32])
        tid = self.sreg(b, "tid.x")
        ty = b.udiv(tid, I64(TP // 4))          # 0 .. TM/4 - 1: which 4 channels
        tx = b.urem(tid, I64(TP // 4))          # 0 .. TP/4 - 1: which 4 positions
        nthreads = (TM // 4) * (TP // 4)
        per_a, per_b = TK * TM // nthreads, TK * TP // nthreads
        accs = [em.alloca(F32) for _ in range(16)]

        sbase = {}

        def sptr(g, idx):
            if g.name not in sbase:
                sbase[g.name] = em.shared_pointer(g, F32)
            return b.gep(sbase[g.name], [idx], source_etype=F32, inbounds=True)

        def divmod32(x, d: int):
            """(x // d, x % d) for 0 <= x < 2^31 in 32-bit arithmetic (a 64-bit division by a constant is a
            multi-word multiply on the GPU), widened back."""
            t = b.trunc(x, I32)
            return b.zext(b.udiv(t, I32(d)), I64), b.zext(b.urem(t, I32(d)), I64)

        def unflat_rest(p):
            """Index of the stage's output for channel ``m`` at flattened position ``p``."""
            out = []
            rest = p
            for d in reversed(rest_dims[1:]):
                rest, rem = divmod32(rest, d)
                out.append(rem)
            out.append(rest)
            out.reverse()
            return out

        def bind_out(m, p):
            r = unflat_rest(p)
            idx = [r[0], m] + r[1:]
            for v, x in zip(st.vars, idx):
                em.env[v.attr] = x
            return idx

        def bind_red(r):
            rr = r
            for v, ext in reversed(list(zip(vs, extents))):
                if ext > 1:
                    rr, em.env[v.attr] = divmod32(rr, ext)
                else:
                    em.env[v.attr] = I64(0)

        def guarded(cond, make):
            """make() where cond holds, else 0.0 (no load out of bounds)."""
            pre = b.block
            yes = fn.append_basic_block("in")
            join = fn.append_basic_block("join")
            b.cbranch(cond, yes, join)
            b.position_at_end(yes)
            em.memo.append(dict(em.memo[-1]))
            v = make()
            em.memo.pop()
            yes_end = b.block
            b.branch(join)
            b.position_at_end(join)
            phi = b.phi(F32)
            phi.add_incoming(ir.Constant(F32, 0.0), pre)
            phi.add_incoming(v, yes_end)
            return phi

        def tile_body(tile):
            tm = b.udiv(tile, I64(tiles_p))
            tp = b.urem(tile, I64(tiles_p))
            m0 = b.mul(tm, I64(TM))
            p0 = b.mul(tp, I64(TP))
            for a in accs:
                b.store(ir.Constant(F32, 0.0), a)

            def stage(g, per, width, lo, limit, fac, bind, k0):
                """Row kk of the TK x width tile in shared memory ``g``: term k0 + kk of ``fac`` at lo + column
                (zero past the reduction or past ``limit``)."""
                for j in range(per):
                    e = b.add(b.mul(tid, I64(per)), I64(j))
                    kk, col = divmod32(e, width)
                    r, q = b.add(k0, kk), b.add(lo, col)
                    ok = b.and_(b.icmp_unsigned("<", r, I64(R)), b.icmp_unsigned("<", q, I64(limit)))

                    def value():
                        bind(q)
                        bind_red(r)
                        return em.emit(fac)
                    b.store(guarded(ok, value), sptr(g, e))

            def chunk(k0):
                stage(sa, per_a, TM, m0, M, wfac, lambda m: bind_out(m, p0), k0)   # weights: TM channels a row
                stage(sb, per_b, TP, p0, P, xfac, lambda p: bind_out(m0, p), k0)   # input: TP positions a row
                b.call(bar, [])

                def term(kk):
                    av = [b.load(sptr(sa, b.add(b.mul(kk, I64(TM)), b.add(b.mul(ty, I64(4)), I64(i)))), typ=F32)
                          for i in range(4)]
                    bv = [b.load(sptr(sb, b.add(b.mul(kk, I64(TP)), b.add(b.mul(tx, I64(4)), I64(j)))), typ=F32)
                          for j in range(4)]
                    for i in range(4):
                        for j in range(4):
                            a_ = accs[i * 4 + j]
                            b.store(b.call(fmaf, [av[i], bv[j], b.load(a_, typ=F32)]), a_)
                em.loop_range(I64(0), I64(TK), term)
                b.call(bar, [])
            em.loop_range(I64(0), I64(R), chunk, I64(TK))
            for i in range(4):
                for j in range(4):
                    m = b.add(m0, b.add(b.mul(ty, I64(4)), I64(i)))
                    p = b.add(p0, b.add(b.mul(tx, I64(4)), I64(j)))
                    ok = b.and_(b.icmp_unsigned("<", m, I64(M)), b.icmp_unsigned("<", p, I64(P)))
                    with b.if_then(ok):
                        em.memo.append(dict(em.memo[-1]))
                        idx = bind_out(m, p)
                        em.memo[-1][red.uid] = b.load(accs[i * 4 + j], typ=F32)
                        b.store(em.to_memory(em.emit(st.expr), st.buf.dtype), em.address(st.buf, idx))
                        em.memo.pop()
        em.loop_range(self.sreg(b, "ctaid.x"), I64(ntiles), tile_body, self.sreg(b, "nctaid.x"))
        b.ret_void()
        set_contraction(fn, False)
        self.kernels.append(sym)
        return KernelDesc(sym, ntiles * nthreads, nthreads, st.name, 1, "tiled")

    def add_coarse_stage(self, st: Stage, sym: str, red: E, co: int) -> KernelDesc:
        """Each thread computes ``co`` consecutive output channels at one position: one loop over the
        reduction accumulates all ``co`` sums, so every load that does not depend on the channel (the input
        window of a convolution) is issued once for all of them (``!invariant.load`` lets LLVM merge the
        copies); then each element's epilogue runs and is stored. Threads enumerate (n, c / co, rest...)
        row-major, so neighbouring threads still read neighbouring positions."""
        fn = self.kernel_fn(sym)
        bufs, n = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        em = PtxEmitter(self, fn, b, bufs, st.buf)
        shape = [int(d) for d in st.buf.shape]
        grid_shape = [shape[0], shape[1] // co] + shape[2:]
        total = 1
        for d in grid_shape:
            total *= d
        kind, vs, extents = red.attr
        dt = red.dtype
        t = ll(dt)
        fmaf = em.fma_fn(dt) if kind == "fma" else None
        gid, stride = self.grid_stride(b)
        accs = [em.alloca(t) for _ in range(co)]

        def thread(i):
            rest = i
            idx: List[ir.Value] = [None] * len(shape)
            for d in reversed(range(len(shape))):
                if d == 0:
                    idx[d] = rest
                else:
                    idx[d] = b.urem(rest, I64(grid_shape[d]))
                    rest = b.udiv(rest, I64(grid_shape[d]))
            c0 = b.mul(idx[1], I64(co))
            elems = [idx[:1] + [b.add(c0, I64(j))] + idx[2:] for j in range(co)]
            for a in accs:
                b.store(const_value(0.0, dt), a)

            def bind(j):
                for v, x in zip(st.vars, elems[j]):
                    em.env[v.attr] = x

            def term(ridx):
                for v, x in zip(vs, ridx):
                    em.env[v.attr] = x
                for j in range(co):
                    bind(j)
                    em.memo.append(dict(em.memo[-1]))
                    a = b.load(accs[j], typ=t)
                    if kind == "fma":
                        b.store(b.call(fmaf, [em.emit(red.args[0]), em.emit(red.args[1]), a]), accs[j])
                    else:
                        b.store(b.fadd(a, em.emit(red.args[0])), accs[j])
                    em.memo.pop()
            em.loops(list(extents), term)
            for j in range(co):
                bind(j)
                em.memo.append(dict(em.memo[-1]))
                em.memo[-1][red.uid] = b.load(accs[j], typ=t)
                val = em.emit(st.expr)
                val = em.to_memory(val, st.buf.dtype)
                b.store(val, em.address(st.buf, elems[j]))
                em.memo.pop()
        em.loop_range(gid, n, thread, stride)
        b.ret_void()
        set_contraction(fn, False)
        self.kernels.append(sym)
        return KernelDesc(sym, total, self.block, st.name, 1, "coarse")

    def kernel_fn(self, sym: str) -> ir.Function:
        """A new kernel entry ``ptx_kernel void sym(ptr bufs, i64 n)``."""
        fn = self.function(sym, [PTR, I64])
        fn.calling_convention = "ptx_kernel"     # LLVM >= 20 marks kernels by calling convention
        if llvm.llvm_version_info < (20,):         # older LLVM: the nvvm.annotations "kernel" entry
            self.module.add_named_metadata("nvvm.annotations", [fn, "kernel", I32(1)])
        return fn

    def add_split_stage(self, st: Stage, sym: str, red: E, lanes: int) -> KernelDesc:
        """``lanes`` consecutive threads (a power of two <= 32) per output element: lane l sums its part of
        the element's reduction (``tuning.split_mode`` "outer": input channels l, l + lanes, ... with the tap loops
        nested; "strided": flattened terms l, l + lanes, ...), a butterfly of
        ``shfl.sync.bfly`` within the lane group adds the partial sums (every lane ends with the total), and
        lane 0 evaluates the rest of the stage's expression (the fused epilogue) and stores. The grid-stride
        step is a multiple of 32, so a group's lanes always work on the same element together, in one warp."""
        fn = self.kernel_fn(sym)
        bufs, n = fn.args
        b = ir.IRBuilder(fn.append_basic_block("entry"))
        em = PtxEmitter(self, fn, b, bufs, st.buf)
        shape = [int(d) for d in st.buf.shape]
        total = 1
        for d in shape:
            total *= d
        kind, vs, extents = red.attr
        extents = [int(x) for x in extents]
        terms = 1
        for x in extents:
            terms *= x
        dt = red.dtype
        t = ll(dt)
        gid, stride = self.grid_stride(b)
        lane = b.and_(gid, I64(lanes - 1))
        shift = lanes.bit_length() - 1
        shfl = self.declare("llvm.nvvm.shfl.sync.bfly.f32", F32, [I32, F32, I32, I32])
        fmaf = em.fma_fn(dt) if kind == "fma" else None

        def element(i):
            e = b.lshr(i, I64(shift))
            rest = e
            idx: List[ir.Value] = [None] * len(shape)
            for d in reversed(range(len(shape))):
                if d == 0:
                    idx[d] = rest
                else:
                    idx[d] = b.urem(rest, I64(shape[d]))
                    rest = b.udiv(rest, I64(shape[d]))
            for v, x in zip(st.vars, idx):
                em.env[v.attr] = x
            acc = em.alloca(t)
            b.store(const_value(0.0, dt), acc)

            def term(r):
                rr, ridx = r, []
                for ext in reversed(extents):
                    ridx.insert(0, b.urem(rr, I64(ext)) if ext > 1 else I64(0))
                    rr = b.udiv(rr, I64(ext)) if ext > 1 else rr
                term_at(ridx)

            def term_at(ridx):
                for v, x in zip(vs, ridx):
                    em.env[v.attr] = x
                a = b.load(acc, typ=t)
                if kind == "fma":
                    b.store(b.call(fmaf, [em.emit(red.args[0]), em.emit(red.args[1]), a]), acc)
                else:
                    b.store(b.fadd(a, em.emit(red.args[0])), acc)
            if self.tuning.split_mode == "outer":
                def outer(c):
                    em.env[vs[0].attr] = c
                    em.loops(extents[1:], lambda inner: term_at([c] + inner))
                em.loop_range(lane, I64(extents[0]), outer, I64(lanes))
            else:
                em.loop_range(lane, I64(terms), term, I64(lanes))
            total_v = b.load(acc, typ=t)
            for off in [x for x in (16, 8, 4, 2, 1) if x < lanes]:
                total_v = b.fadd(total_v, b.call(shfl, [I32(0xFFFFFFFF), total_v, I32(off), I32(0x1F)]))
            with b.if_then(b.icmp_unsigned("==", lane, I64(0))):
                em.memo.append(dict(em.memo[-1]))
                em.memo[-1][red.uid] = total_v
                val = em.emit(st.expr)
                val = em.to_memory(val, st.buf.dtype)
                b.store(val, em.address(st.buf, idx))
                em.memo.pop()
        em.loop_range(gid, n, element, stride)
        b.ret_void()
        set_contraction(fn, False)
        self.kernels.append(sym)
        return KernelDesc(sym, total * lanes, self.block, st.name, lanes, "split")

    def add_element_stage(self, st: Stage, sym: str, kind: str = "element", vec: int = 1) -> KernelDesc:
        """One thread per output element, or per ``vec`` consecutive elements along the last dim (which ``vec``
        divides: :func:`element_vec`): the thread unflattens its first index once and computes the ``vec``
        elements after it, their loads issued together (more bytes in flight per thread for a large copy)."""
        fn = self.kernel_fn(sym)
        bufs, n = fn.args
        entry = fn.append_basic_block("entry")
        b = ir.IRBuilder(entry)
        em = PtxEmitter(self, fn, b, bufs, st.buf)
        shape = [int(d) for d in st.buf.shape]
        total = 1
        for d in shape:
            total *= d
        assert vec == 1 or (shape and shape[-1] % vec == 0)
        if vec > 1:
            shape[-1] //= vec

        gid, stride = self.grid_stride(b)

        def element(i):  # grid-stride loop: for (i = gid; i < n; i += stride)
            idx: List[ir.Value] = [None] * len(shape)
            # register pressure (opt-in): with fewer than 2^31 elements the element index is unflattened in 32
            # bits (32-bit mul.hi for the divisions by constants, fewer registers), then widened
            narrow = self.narrow_index and total < 2 ** 31
            it = I32 if narrow else I64
            rest = b.trunc(i, I32) if narrow else i
            for d in reversed(range(len(shape))):
                if d == 0:
                    idx[d] = rest
                else:
                    idx[d] = b.urem(rest, it(shape[d]))
                    rest = b.udiv(rest, it(shape[d]))
            if narrow:
                idx = [b.zext(x, I64) for x in idx]
            if vec == 1:
                em.store_element(st, idx)
                return
            last = b.mul(idx[-1], I64(vec))
            em.store_elements(st, [idx[:-1] + [b.add(last, I64(u))] for u in range(vec)])
        em.loop_range(gid, n, element, stride)
        b.ret_void()
        set_contraction(fn, False)   # contraction only through kernel rules (explicit llvm.fma)
        self.kernels.append(sym)
        return KernelDesc(sym, total // vec, self.block, st.name, 1, kind)

    def compile_ptx(self, opt: int, libdevice: Optional[str] = None) -> str:
        try:
            mod = llvm.parse_assembly(str(self.module))
            mod.verify()
        except RuntimeError as e:
            raise CuvilError(f"generated NVPTX LLVM IR does not verify: {e}") from None
        if self.needs_libdevice:
            mod.link_in(libdevice_module(libdevice, mod.triple, mod.data_layout))
            keep = set(self.kernels)
            for f in mod.functions:
                if not f.is_declaration and f.name not in keep:
                    f.linkage = llvm.Linkage.internal
            for g in mod.global_variables:
                if not g.is_declaration:
                    g.linkage = llvm.Linkage.internal
            pm = llvm.create_new_module_pass_manager()
            pm.add_global_dead_code_eliminate_pass()
            pb = llvm.create_pass_builder(self.tm, llvm.create_pipeline_tuning_options(speed_level=0))
            pm.run(mod, pb)
        # at -O0 too: the pipeline's start runs NVVMReflect, which resolves libdevice's __nvvm_reflect
        pto = llvm.create_pipeline_tuning_options(speed_level=min(max(opt, 0), 3))
        pto.loop_vectorization = False
        pto.slp_vectorization = False
        pb = llvm.create_pass_builder(self.tm, pto)
        pb.getModulePassManager().run(mod, pb)
        undefined = sorted(f.name for f in mod.functions
                           if f.is_declaration and not f.name.startswith("llvm.") and f.name.strip())
        if undefined:
            raise CuvilError(f"PTX module would call undefined functions: {', '.join(undefined)}")
        ptx = self.tm.emit_assembly(mod)
        if ".extern .func" in ptx:   # a libcall the backend introduced (e.g. for an operation PTX lacks)
            ext = sorted(set(re.findall(r"\.extern \.func[^(]*?(\w+)\s*\(", ptx)))
            raise CuvilError(f"PTX module calls undefined functions: {', '.join(ext) or '?'}")
        return ptx


def _sanitize(prefix: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_]", "_", prefix) or "cuvil"
    return s if not s[0].isdigit() else "_" + s


@attrs.define
class PtxResult:
    """What :func:`build_ptx` produced: the module's text, how to launch each kernel, which kernel rules ran
    (name -> obligation) and how often each fired (name -> count), and the float16 reductions widened."""
    ptx: str
    kernels: List[KernelDesc]
    kernel_rules: Dict[str, str]
    kernel_rule_counts: Dict[str, int]
    widened_reductions: int = 0
    scratch_bytes: int = 0     # split-K tile counters then partial sums: the arena must be scratch_offset + this long
    scratch_offset: int = 0
    counter_bytes: int = 0     # the counters at scratch_offset: zeroed before each run
    memory_safety: Optional[Certificate] = None   # the bounds proof of every kernel (ptx/bounds_patterns.py)
    # per kernel, the stages it computes (a row chain's several; both kernels of a split stage its one): what
    # ptx/launch_deps.py reads their bytes from
    kernel_stages: List[List[Stage]] = attrs.field(factory=list)


def widen_half_reductions(e: E, stats: Optional[dict] = None) -> E:
    """Float16 ``sum``/``prod`` reductions accumulate in float32: ``reduce_f16(body)`` becomes
    ``cast_f16(reduce_f32(widen(body)))`` where a half product is widened operand by operand (exact in
    float32). A half ``div``/``mul`` of such a widened reduction by a constant (a mean) is done in float32
    too, so the sum is rounded to half once, after the division, and cannot overflow half on the way."""
    H, F = DType.FLOAT16, DType.FLOAT
    memo: Dict[int, E] = {}

    def wide(x: E) -> E:
        if x.op == "mul" and x.dtype == H:
            return E("mul", (cast(x.args[0], F), cast(x.args[1], F)), F)
        return cast(x, F)

    def go(x: E) -> E:
        if x.uid in memo:
            return memo[x.uid]
        args = [go(a) for a in x.args]
        y = x if all(a is b for a, b in zip(args, x.args)) else E(x.op, args, x.dtype, x.attr)
        if y.op == "reduce" and y.dtype == H and y.attr[0] in ("sum", "prod"):
            y = cast(E("reduce", (wide(args[0]),), F, y.attr), H)
            if stats is not None:
                stats["widened"] = stats.get("widened", 0) + 1
        elif (y.op in ("div", "mul") and y.dtype == H and args[0].op == "cast" and args[0].args[0].op == "reduce"
              and args[0].args[0].dtype == F and args[1].op == "const"):
            y = cast(E(y.op, (args[0].args[0], const(args[1].attr, F)), F), H)
        memo[x.uid] = y
        return y

    return go(e)


def build_ptx(sched: Schedule, arch: str = "sm_90", opt: int = 3, *, fma: bool = False, kernel_rules=None,
              prefix: str = "cuvil", block: int = BLOCK, libdevice: Optional[str] = None,
              narrow_index: bool = False, fused_splitk: bool = False,
              tuning: PtxTuning = DEFAULT_TUNING, allow_tf32: bool = False,
              precisions: Optional[Dict[str, str]] = None,
              precision_scales: Optional[Dict[str, Tuple[int, int]]] = None) -> PtxResult:
    """PTX for every stage of ``sched`` (one module, one kernel per stage, in schedule order).

    ``kernel_rules``: None for the built-in ``on kernel`` rules, a list of rules (graph rules in it are
    ignored), or ``[]``/False for none. Only proved rules run, and ``prove real`` ones (fma contraction) only
    with ``fma=True``; without ``fma`` every operation rounds separately. ``narrow_index`` (off by default):
    kernels of fewer than 2^31 elements unflatten their element index in 32-bit arithmetic: fewer registers
    and higher theoretical occupancy, but ResNet-50 ran slower on an H200 with it (``bench/gpu/RESULTS.md``,
    2026-11-29 kernel rules section), so it is opt-in.

    ``fused_splitk`` (off by default): a split-K convolution's last slice to finish a tile adds the partial
    sums (one zeroed int32 counter per tile, :attr:`PtxResult.counter_bytes`) instead of a second sum
    kernel. Correct on an H200 (9/9 light models) but ResNet-50 ran 0.976 ms against 0.708 ms with the sum
    kernels (``bench/gpu/results/conv_variants5_fused_2026-12-01.json``): the last block's S dependent L2
    reads per output serialise behind each other, where the sum kernel spreads them over a whole grid.
    ``tuning``: the kernel-shape settings benchmarks vary (:class:`~cuvil.targets.ptx.tuning.PtxTuning`);
    give the same one to :func:`gpu_schedule`. ``allow_tf32`` (off: strict float32): float32 matrix products
    may run on TF32 tensor cores; ``precisions`` (stage name -> "fp16"/"bf16", from the nodes' ``precision``,
    :func:`~cuvil.targets.ptx.matmul_mma.stage_precisions`, and for convolutions
    :func:`~cuvil.targets.ptx.conv_mma.conv_stage_precisions`): those products run on tensor cores in that
    format (:mod:`cuvil.targets.ptx.matmul_mma`, :mod:`cuvil.targets.ptx.conv_mma`); a fp8 one with its operands' power-of-two scales from
    ``precision_scales`` (:func:`~cuvil.targets.ptx.matmul_mma.stage_scales`), and the module's PTX at ISA
    8.4 (:data:`FP8_PTX_ISA`)."""
    if block <= 0 or block > 1024:
        raise CuvilError(f"block size {block}: expected 1..1024 threads")
    fp8 = any(f == "fp8" for f in (precisions or {}).values())
    tm = target_machine(arch, opt, FP8_PTX_ISA if fp8 else 0)
    prefix = _sanitize(prefix)
    stages = list(sched.stages)
    stats: dict = {}
    if any(_has_half(st.expr) for st in stages):
        stages = [attrs.evolve(st, expr=widen_half_reductions(st.expr, stats)) for st in stages]
    rules = [] if kernel_rules is False else select_kernel_rules(kernel_rules, fma=fma)
    counts: Dict[str, int] = {}
    if rules:
        stages, counts = rewrite_stages(stages, rules)
    km = PtxKernelModule(prefix, tm, fma=fma, block=block, narrow_index=narrow_index,
                         scratch_offset=sched.arena_bytes, arch=arch, fused_splitk=fused_splitk, tuning=tuning,
                         allow_tf32=allow_tf32, precisions=precisions, precision_scales=precision_scales)
    # the memory-safety proof of the stages as they are emitted (copies: guards rewrite them, not the schedule)
    stages = [attrs.evolve(st) for st in stages]
    with stage("memory safety", detail=f"{len(stages)} kernels") as s:
        cert = prove_gpu_stages(sched, stages, km)
        s.detail(cert.summary())
    for k in cert.kernels:
        if k.status == "unproved":
            raise CuvilError(f"kernel {k.stage} (gpu) is not proved memory-safe even with run-time guards: "
                             f"{k.failures[0]}; report it")
    limit = arena_limit(km, sched, stages)
    descs: List[KernelDesc] = []
    covered: List[List[Stage]] = []     # per kernel, the stages it computes (PtxResult.kernel_stages)
    with stage("llvm IR", total=len(stages), unit="kernels") as progress:
        k = 0
        while k < len(stages):
            chain = row_chain_at(stages, k) if tuning.row_chains else 0
            if chain:      # row reductions and their element stage as one kernel (LayerNorm, Softmax)
                descs.append(km.add_row_chain(stages[k:k + chain], f"{prefix}_k{k}"))
                covered.append(stages[k:k + chain])
                for st in stages[k:k + chain]:
                    progress.advance(item=f"{prefix}_k{k}: {st.op} {st.name}")
                k += chain
                continue
            st = stages[k]
            d = km.add_stage(st, f"{prefix}_k{k}")
            d = d if isinstance(d, list) else [d]
            descs.extend(d)
            covered.extend([[st]] * len(d))
            progress.advance(item=f"{prefix}_k{k}: {st.op} {st.name}")
            k += 1
    arena = km.scratch_offset + km.scratch_bytes if km.scratch_bytes else sched.arena_bytes
    if arena != limit:       # the proof checked every buffer against the arena the bundle allocates
        raise CuvilError(f"internal: the GPU arena is {arena} B, its memory-safety proof assumed {limit} B; "
                         f"report it")
    with stage("llvm", detail=f"optimising {len(stages)} kernels at O{opt} and emitting PTX for {arch}"):
        ptx = km.compile_ptx(opt, libdevice)
    return PtxResult(ptx, descs, {r.name: r.proof for r in rules}, counts,
                     stats.get("widened", 0), km.scratch_bytes, km.scratch_offset, km.counter_bytes, cert, covered)


GPU_GEMM_COLS = 64   # the GPU lowering's packed contractions (schedule's gemm_cols; x86 panels are unrelated)


def gpu_schedule(g, unpadded: bool = True, tuning: PtxTuning = DEFAULT_TUNING) -> Schedule:
    """The GPU schedule of ``g``: convolutions as packed contractions with weight panels of
    :data:`~cuvil.targets.ptx.conv.TILE_CHANNELS` channels (chosen per convolution), computed by the
    implicit-GEMM kernels of :mod:`cuvil.targets.ptx.conv`; plain reductions when ``tuning.conv_enabled`` is
    off. ``unpadded`` (default): a padded convolution reads its input unpadded, its kernel testing bounds (no
    padded copy stored); off: the input is padded into a copy first."""
    for n in g.nodes:
        if n.op == "LoopState":   # a Loop/Scan run at run time: a backward branch only the x86 runtime takes
            kind = n.attrs.get("kind", "Loop")
            count = "trip count" if kind == "Loop" else "sequence length"
            raise UnsupportedOpError(kind, n.attrs.get("loop", n.name), g.opset, detail=(
                f"its {count} is known only at run time (or is over the unrolling limit), so it runs as a "
                f"run-time loop, which the GPU bundle (one captured CUDA graph) cannot express yet: compile "
                f"for x86, or make the {count} a constant <= frontend.subgraphs.MAX_UNROLLED_TRIPS"))
    if not tuning.conv_enabled:
        return schedule(g)
    return schedule(g, gemm_cols=GPU_GEMM_COLS, gemm_tiles=tuple((m, GPU_GEMM_COLS) for m in TILE_CHANNELS),
                    unpadded_contractions=unpadded, matmul_panels=False, half_contractions=True,
                    scaled_operands=tuning.scaled_operands, gpu_attention=tuning.fused_attention,
                    inline_views=tuning.inline_views, gpu_heads_merged=tuning.attention_heads_merged)


def _has_half(e: E) -> bool:
    return any(x.dtype == DType.FLOAT16 for x in nodes(e))


def generate_ptx(sched: Schedule, arch: str = "sm_90", opt: int = 3, *, fma: bool = False, kernel_rules=None,
                 prefix: str = "cuvil", block: int = BLOCK, libdevice: Optional[str] = None,
                 narrow_index: bool = False, fused_splitk: bool = False,
                 tuning: PtxTuning = DEFAULT_TUNING) -> Tuple[str, List[KernelDesc]]:
    """PTX text for every stage of ``sched`` and how to launch each (:func:`build_ptx` without its report).
    ``fma`` allows contracting ``a * b + c`` into one fused multiply-add, through the proved kernel rules
    (off: every operation rounds separately, as the graph rules' exactness arguments assume)."""
    r = build_ptx(sched, arch, opt, fma=fma, kernel_rules=kernel_rules, prefix=prefix, block=block,
                  libdevice=libdevice, narrow_index=narrow_index, fused_splitk=fused_splitk, tuning=tuning)
    return r.ptx, r.kernels
