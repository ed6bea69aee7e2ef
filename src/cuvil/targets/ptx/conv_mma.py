"""Implicit-GEMM convolutions on the tensor cores at batch: large block tiles over the whole batch.

The same packed contraction as :mod:`cuvil.targets.ptx.conv` (weights in panels ``Ap[g, m // TM, k, m % TM]``,
the input read unpadded through its window), computed as one GEMM per group: ``out[m, q] = sum_k A[m, k] *
B[k, q]`` where the column ``q = n * P + p`` runs over every image's positions together (the per-image
tiling of ``conv.py`` wastes most of a 64-wide tile on a 7 x 7 map, and at batch 32 the columns number
1,568 to 100,352). Which stages: a convolution whose numbers the tensor cores may take (see
:func:`conv_mma_format`): float16 weights and input (``--enable-fp16``), float32 ones whose Conv node
the precision policy narrowed to fp16 or bf16 (both operands rounded to it as they are staged,
``cvt.rn.{f16,bf16}x2.f32``), or float32 with ``allow_tf32``; fma contraction allowed (an ``mma`` rounds its
sum of products once); sm_80 and later; 2-D, ungrouped, undilated (the geometries the GPU test checks; the
others keep ``conv.py``'s kernels).

ResNet-50 at batch 32 on an H100 (session 24): float16 3.54 ms, bf16 under the precision policy (float32
activations) 5.18, TF32 6.22; torch.compile fp16 / TF32 1.69 / 3.07 ms (bench/gpu/RESULTS.md; on an H200 before
the shared output tile and tap-major order, float16 5.08 ms against ``conv.py``'s per-image tiles' 9.30).

The kernel (:func:`emit_conv_mma`), per block tile of BM x BN (128 x 128, 64 x 128 or 64 x 64, the largest
that still gives :attr:`~cuvil.targets.ptx.tuning.PtxTuning.target_blocks` blocks, else split-K as in
``conv.py``; chosen per convolution, so per batch bucket of a profile bundle):

* 8 (or 4) warps, each a WM x WN sub-tile of ``mma.sync.aligned.m16n8k16`` (float16, float32 accumulators)
  or ``m16n8k8 .tf32`` tiles; fragment layouts are :mod:`cuvil.targets.ptx.matmul_mma`'s (the PTX ISA's);
* the reduction in chunks of TK terms (32 halves, 16 tf32), through two shared-memory stages ``k``-contiguous
  (``sa[m][k]``, ``sb[q][k]``, rows padded to 20 words so fragment loads hit 32 banks): chunk ``i`` is
  stored into stage ``i % 2``, one barrier, the next chunk's global loads issued into registers, then this
  chunk's ``mma``s: one barrier per chunk, the loads in flight during the products. The staged registers
  hold the raw loaded values and an in-bounds flag; zeroing, float16 packing (two ``k`` per 32-bit word)
  and the TF32 rounding (``cvt.rna.tf32.f32``) happen when they are stored, after the products, so no
  instruction waits on a load before the ``mma``s are issued;
* float16 fragments come from shared memory by ``ldmatrix.sync.aligned.m8n8.x4`` (one instruction per 16 x 16
  A fragment or pair of 8-column B fragments; 32-bit ``ld.shared`` with ``ldmatrix=False``);
* weights: each thread loads 4 consecutive channels (``float4`` / 4 halves, the panel's contiguous axis)
  for ``BM * TK / threads / 4`` consecutive terms, and stores them k-contiguous as 32/64-bit words;
* window: a thread keeps one column for the whole tile (its image, position, input corner computed once
  per tile) and loads a run of consecutive terms per chunk: the channel and kernel tap of the first
  unflattened by division, the rest stepped with carries (no division per element), padding by an unsigned
  bounds test on the input coordinate (out of range: the address clamped, the value zeroed when stored).
  Its run is stored as 128-bit words into ``sb[q][k..]``.

Pointwise float16 convolutions (:func:`async_vec`: 1 x 1, stride 1, unpadded, P a multiple of 2, 4 or 8) take a
second main loop: the window is then the plain matrix ``B[c][n * P + p]``, so both operands are copied with
``cp.async`` (weights: 16 bytes = 8 channels of a panel row; window: ``vec`` consecutive positions of one
image, zero-filled past K or the batch) into 2-4 shared stages laid out ``sa[k][m]``, ``sb[k][q]`` (rows
padded by 16 bytes), ``NS - 1`` chunks ahead of the products, one ``cp.async.wait_group`` and one barrier per
chunk; fragments by ``ldmatrix.x4.trans``. No register staging, no per-element index arithmetic.

Options (``PtxTuning.conv_mma_staged_out`` / ``conv_mma_tap_major``, on by default since their first H200 run,
session 14: ResNet-50 fp16 b32 4.79 -> 3.55 ms): float16 outputs of an unsplit reduction are rounded to half into
a shared tile (``[BM][BN + 8]``, the stages' memory) and read back one column per thread, so the fused epilogue's
loads (bias, residual) and stores run along consecutive positions (a warp: 64 contiguous bytes) and a column's
image and position are unflattened once per tile; the value and its rounding are the same as the per-fragment
epilogue's (float32 outputs keep it). And the reduction of a convolution with several taps and whole chunks of
channels runs tap by tap (:func:`plan_conv_mma`).

Columns past N x P re-read the last column (computed, never stored); rows past M exist in the panels
(zero weights) or are never stored; terms past K are zeroed. Split-K slices write partial sums that the
``conv.py`` combining kernel adds in slice order.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import attrs
import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.contraction import Contraction
from ...kernels.schedule import Stage
from ...kernels.texpr import Buf, E
from ..llvm.types import F16, F32, I32, I64
from .emitter import PtxEmitter, set_contraction, shared_global
from .matmul_mma import FRAGMENTS, _V

# (BM, BN, warps along m, warps along n), largest first
TILES = ((128, 128, 2, 4), (64, 128, 2, 4), (64, 64, 2, 2))
TK = {"fp16": 32, "bf16": 32, "tf32": 16}       # terms per chunk
ROW_WORDS = 20                      # 32-bit words per shared row: TK halves / tf32 words + 4 words of padding
MIN_SPLIT_TERMS = 128
#: the node precisions (the policy's, ``Node.precision``) a float32 convolution runs on the tensor cores in
NARROW = ("fp16", "bf16")
NARROWED_OPS = ("Conv",)      # the ops whose contraction this module narrows (the precision policy's hook)
PTX_TYPE = {"fp16": "f16", "bf16": "bf16"}     # their PTX type names
SMEM_LIMIT = 48 * 1024
ASYNC_PAD = 8                       # halves of padding per shared row of the cp.async kernel
MAX_STAGES = 4


@attrs.define
class ConvMmaPlan:
    fmt: str
    bm: int
    bn: int
    warps_m: int
    warps_n: int
    splits: int
    kchunk: int
    n: int
    groups: int
    m: int           # output channels per group
    p: int           # output positions per image
    k: int
    m_pad: int       # channels per group in the packed panels
    tm: int          # panel width
    ldmatrix: bool = True
    vec: int = 0     # pointwise kernels (:func:`async_vec`): halves per cp.async window copy (0: register staging)
    stages: int = 2  # shared stages (cp.async pipeline depth with ``vec``)
    tap_major: bool = False   # the reduction runs tap by tap, channels inside (see :func:`plan_conv_mma`)

    @property
    def tk(self) -> int:
        return TK[self.fmt]

    @property
    def per_reg(self) -> int:
        return FRAGMENTS[self.fmt].per_reg

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    @property
    def wm(self) -> int:
        return self.bm // self.warps_m

    @property
    def wn(self) -> int:
        return self.bn // self.warps_n

    @property
    def cols(self) -> int:
        return self.n * self.p

    @property
    def tiles_m(self) -> int:
        return -(-self.m // self.bm)

    @property
    def tiles_q(self) -> int:
        return -(-self.cols // self.bn)

    @property
    def tiles(self) -> int:
        """Output tiles (each summed by ``splits`` blocks; one split-K counter each)."""
        return self.groups * self.tiles_m * self.tiles_q

    @property
    def blocks(self) -> int:
        return self.tiles * self.splits

    @property
    def scratch_floats(self) -> int:
        return self.splits * self.n * self.groups * self.m * self.p if self.splits > 1 else 0

    # per-thread load shapes
    @property
    def a_terms(self) -> int:
        """Consecutive terms per thread in the A tile (each a vector of 4 channels)."""
        return self.bm * self.tk // self.threads // 4

    @property
    def b_terms(self) -> int:
        """Consecutive terms per thread in the B tile (one column)."""
        return self.bn * self.tk // self.threads

    def a_slot(self, tid: int):
        """(first channel, first term) of thread ``tid``'s A loads (ints; the emitter does the same)."""
        mq, kq = divmod(tid, self.tk // self.a_terms)
        return 4 * mq, kq * self.a_terms

    def b_slot(self, tid: int):
        """(column, first term) of thread ``tid``'s B loads."""
        h, j = divmod(tid, self.bn)
        return j, h * self.b_terms

    def smem_bytes(self) -> int:
        if self.vec:
            return self.stages * async_stage_bytes(self.bm, self.bn, self.tk)
        return 2 * (self.bm + self.bn) * ROW_WORDS * 4

    # the cp.async pointwise kernel: 16-byte pieces of the weight rows, ``vec``-half pieces of the window rows
    @property
    def a_pieces(self) -> int:
        return self.tk * self.bm // 8 // self.threads

    @property
    def b_pieces(self) -> int:
        return self.tk * self.bn // self.vec // self.threads


def async_stage_bytes(bm: int, bn: int, tk: int) -> int:
    """One shared stage of the cp.async kernel: ``sa[k][m]`` then ``sb[k][q]``, rows padded by 8 halves
    (16 bytes: the 8 rows an ``ldmatrix`` phase reads start 4 banks apart, and every row stays 16-byte
    aligned for the copies)."""
    return tk * (bm + ASYNC_PAD + bn + ASYNC_PAD) * 2


def async_vec(spec: Contraction, fmt: str, p: int) -> int:
    """Halves per window copy for the cp.async kernel (8, 4 or 2: 16-, 8- or 4-byte ``cp.async``), 0 where
    the window is not a plain matrix. A 1 x 1, stride-1, unpadded, ungrouped float16 convolution reads its
    input ``x[n, c, p]`` as the GEMM operand ``B[c][n * P + p]``: each row of a chunk is ``vec`` consecutive
    positions of one image when ``vec`` divides P (so no piece crosses an image) and the buffer offsets keep
    every piece aligned to its size. The weight panels must keep their 16-byte rows aligned too."""
    if fmt != "fp16" or spec.x.dtype != DType.FLOAT16 or spec.groups != 1 or any(int(k) != 1 for k in spec.kernel):
        return 0
    if any(int(s) != 1 for s in spec.strides) or any(int(x) != 0 for x in (spec.pads or ())):
        return 0
    if int(spec.mr) % 8 or not isinstance(spec.a.offset, int) or spec.a.offset % 16:
        return 0
    xs = spec.x.strides
    if int(xs[1]) != p or int(xs[0]) != spec.cin * p or not isinstance(spec.x.offset, int):
        return 0
    for vec in (8, 4, 2):
        if p % vec == 0 and spec.x.offset % (2 * vec) == 0:
            return vec
    return 0


def conv_mma_format(spec: Contraction, red: E, sm: int, allow_tf32: bool, precision: str = "") -> Optional[str]:
    """The tensor-core format of a convolution (None: the SIMT kernels of ``conv.py``): fp16 for a float16
    convolution (``--enable-fp16``); for a float32 one, its node's ``precision`` where the precision policy
    narrowed it to fp16 or bf16 (:data:`NARROW`: both operands rounded to that format as they are staged, float32
    sums, float32 output), else tf32 with ``allow_tf32``."""
    if sm < 80 or red.attr[0] != "fma" or spec.precision:
        return None
    if spec.x.dtype == DType.FLOAT16:
        return "fp16"
    if spec.x.dtype != DType.FLOAT or spec.a.dtype != DType.FLOAT:
        return None
    if precision in NARROW:
        return precision
    return "tf32" if allow_tf32 else None


def narrowed_convs(graph, sched) -> Dict[str, object]:
    """Stage name -> the Conv node (``precision`` fp16 / bf16, the policy's) whose packed contraction the stage
    computes: found by its weight panels, which the lowering names ``<node>_packed``
    (:func:`cuvil.kernels.lower.conv.conv_as_gemm`; node names are unique). A stage whose convolution is not a
    float32 packed contraction of such a node is left out (it computes in float32)."""
    from .conv import conv_node
    convs = {f"{nd.name}_packed": nd for nd in graph.nodes
             if nd.op in NARROWED_OPS and getattr(nd, "precision", "") in NARROW}
    if not convs:
        return {}
    out = {}
    for st in sched.stages:
        node = conv_node(st)
        nd = convs.get(node.attr.a.name) if node is not None else None
        if nd is not None and not node.attr.precision and node.attr.x.dtype == DType.FLOAT:
            out[st.name] = nd
    return out


def conv_stage_precisions(graph, sched) -> Dict[str, str]:
    """Stage name -> the ``precision`` (fp16 / bf16) of the narrowed Conv it computes (:func:`narrowed_convs`)."""
    return {name: nd.precision for name, nd in narrowed_convs(graph, sched).items()}


def narrowed_convs_run(graph, sched, kernels) -> List[str]:
    """The Conv nodes narrowed by the policy (``precision`` fp16 / bf16) that did *not* run on a tensor-core
    kernel of that format (``kernels``: the build's KernelDesc list): grouped, dilated or not 2-D convolutions,
    those too small for a packed contraction (``conv.py``'s float32 kernels or a loop nest), those the bounds
    prover refuted. The manifest records them as float32."""
    ran = {d.stage: d.kind.rsplit("_", 1)[-1] for d in kernels if "_mma_" in d.kind}
    done = {nd.name for name, nd in narrowed_convs(graph, sched).items() if ran.get(name) == nd.precision}
    return [nd.name for nd in graph.nodes if nd.op in NARROWED_OPS and getattr(nd, "precision", "") in NARROW
            and nd.name not in done]


def plan_conv_mma(spec: Contraction, fmt: str, target_blocks: int, ldmatrix: bool = True,
                  async_copy: bool = True, tap_major: bool = False) -> Optional[ConvMmaPlan]:
    """The largest tile giving ``target_blocks`` blocks, else the smallest with the reduction split (each
    slice a multiple of TK terms, at least :data:`MIN_SPLIT_TERMS` on average). ResNet-50 fp16 at batch 32
    on an H200: 5.05 ms with this rule, 5.56 ms when half as many blocks sufficed for the larger tiles
    (bench/gpu/RESULTS.md). None when no tile fits
    the panels (BM must divide the packed channels of a group), and for grouped, dilated or other than 2-D
    convolutions, which the GPU tests do not cover yet. With ``async_copy`` (and ``ldmatrix``), pointwise
    convolutions whose window is a plain matrix (:func:`async_vec`) take the cp.async kernel, with as many
    shared stages (2-4) as fit in 48 KiB. With ``tap_major``, a convolution with several taps and a multiple
    of TK input channels takes its reduction terms in the order (tap, channel) instead of the panels'
    (channel, tap): every chunk is then one kernel tap and TK consecutive channels, so a thread's window
    terms share one bounds test and step by a plane (a constant offset), the weight rows by the tap count."""
    if spec.groups != 1 or len(spec.out_spatial) != 2 or any(int(x) != 1 for x in spec.dilations):
        return None     # the geometries checked on a GPU (tests/test_gpu_conv_mma.py); the rest: conv.py
    p = 1
    for d in spec.out_spatial:
        p *= int(d)
    tm = int(spec.mr)
    m_pad = -(-spec.m // tm) * tm
    k = spec.k
    tk = TK[fmt]
    cands = []
    for bm, bn, wm_, wn_ in TILES:
        if m_pad % bm or bm % 4:
            continue
        cands.append(ConvMmaPlan(fmt, bm, bn, wm_, wn_, 1, -(-k // tk) * tk, spec.n, spec.groups, spec.m, p, k,
                                 m_pad, tm, ldmatrix and fmt in ("fp16", "bf16")))
    if not cands:
        return None
    plan = next((c for c in cands if c.blocks >= target_blocks), None)
    if plan is None:
        plan = cands[-1]
        s = 1
        while plan.blocks * s < target_blocks and k // (2 * s) >= MIN_SPLIT_TERMS:
            s *= 2
        kchunk = -(-(-(-k // s)) // tk) * tk
        plan = attrs.evolve(plan, splits=-(-k // kchunk), kchunk=kchunk)
    taps = 1
    for t in spec.kernel:
        taps *= int(t)
    vec = async_vec(spec, fmt, p) if async_copy and plan.ldmatrix else 0
    if tap_major and taps > 1 and spec.cin % tk == 0 and not vec:
        plan = attrs.evolve(plan, tap_major=True)
    if vec:
        stages = min(MAX_STAGES, SMEM_LIMIT // async_stage_bytes(plan.bm, plan.bn, tk))
        if stages >= 2 and (tk * plan.bn // vec) % plan.threads == 0 and (tk * plan.bm // 8) % plan.threads == 0:
            plan = attrs.evolve(plan, vec=vec, stages=stages)
    return plan


# --- fragment addressing (32-bit words of a stage; the numpy replay in the tests uses the same) ----------

def a_word(plan: ConvMmaPlan, row, g, t, ks: int, reg: int):
    """Word of A register ``reg`` for lane (g, t), 16-row tile at ``row`` (``sa[row][k]``)."""
    dr, dc = FRAGMENTS[plan.fmt].a[reg]
    return (row + g + dr) * ROW_WORDS + t + (ks + dc) // plan.per_reg


def b_word(plan: ConvMmaPlan, col, g, t, ks: int, reg: int):
    """Word of B register ``reg`` for lane (g, t), 8-column tile at ``col`` (``sb[col][k]``)."""
    return (col + g) * ROW_WORDS + t + (ks + FRAGMENTS[plan.fmt].b[reg]) // plan.per_reg


def lane_digits(lane: int):
    """(lane % 8, lane // 8 % 2, lane // 16): which row of which of ldmatrix.x4's four 8 x 8 matrices lane
    ``lane`` gives the address of."""
    return lane % 8, lane // 8 % 2, lane // 16


def ldmatrix_a_word(row, r, m2, d2, ks: int):
    """The row address (word) a lane with digits (r, m2, d2) gives ``ldmatrix.x4`` for the 16 x 16 A
    fragment at ``row``: matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) = A registers
    0..3 (float16: two terms per word)."""
    return (row + r + 8 * m2) * ROW_WORDS + ks // 2 + 4 * d2


def ldmatrix_b_word(col, r, m2, d2, ks: int):
    """... for the two 8-column B fragments at ``col`` and ``col + 8``: matrices (cols 0-7, k 0-7),
    (0-7, 8-15), (8-15, 0-7), (8-15, 8-15) = registers 0, 1 of the first tile, 0, 1 of the second."""
    return (col + r + 8 * d2) * ROW_WORDS + ks // 2 + 4 * m2


def async_a_half(plan: ConvMmaPlan, row, r, m2, d2, ks: int):
    """The cp.async kernel (``sa[k][m]``, m contiguous): the half a lane with digits (r, m2, d2) gives
    ``ldmatrix.x4.trans`` for the 16 x 16 A fragment at ``row``: stored 8 x 8 blocks (k 0-7, m 0-7),
    (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15), transposed into A registers 0..3."""
    return (ks + r + 8 * d2) * (plan.bm + ASYNC_PAD) + row + 8 * m2


def async_b_half(plan: ConvMmaPlan, col, r, m2, d2, ks: int):
    """... (``sb[k][q]``) for the two 8-column B fragments at ``col``, ``col + 8``: blocks (k 0-7, q 0-7),
    (k 8-15, q 0-7), (k 0-7, q 8-15), (k 8-15, q 8-15) = registers 0, 1 of the first tile, 0, 1 of the second."""
    return (ks + r + 8 * m2) * (plan.bn + ASYNC_PAD) + col + 8 * d2


def warp_tiles(plan: ConvMmaPlan):
    return [(i * 16, j * 8) for i in range(plan.wm // 16) for j in range(plan.wn // 8)]


# --- emission -------------------------------------------------------------------------------------------

def emit_conv_mma(km, st: Stage, sym: str, node: E, plan: ConvMmaPlan, scratch: Optional[Buf],
                  counters: Optional[int] = None) -> int:
    """Emit the kernel ``sym`` (see the module docstring); returns the launch size in threads. With split-K the
    slices store their partial sums in ``scratch``; with ``counters`` (the byte offset of one int32 per output
    tile in its buffer, zeroed before each run) the last slice of each tile to finish
    (:meth:`~cuvil.targets.ptx.emitter.PtxEmitter.last_arrival`) adds them in slice order from 0, as
    ``conv.py``'s sum kernel does (the same bits), and runs the epilogue; without, that kernel does."""
    from .conv import accumulation
    spec: Contraction = node.attr
    red = accumulation(node)
    fmt = plan.fmt
    frag = FRAGMENTS[fmt]
    half = fmt in ("fp16", "bf16")          # 16-bit fragment elements, two k per 32-bit word
    stored_half = spec.x.dtype == DType.FLOAT16     # the operands in memory (else float32, rounded when staged)
    ET = F16 if stored_half else F32
    esize = 2 if stored_half else 4
    fn = km.kernel_fn(sym)
    km.module.add_named_metadata("nvvm.annotations", [fn, "maxntidx", I32(plan.threads)])
    if km.tuning.conv_mma_min_blocks > 1:     # ptxas keeps registers low enough for this many blocks per SM
        km.module.add_named_metadata("nvvm.annotations", [fn, "minctasm", I32(km.tuning.conv_mma_min_blocks)])
    bufs, _n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = PtxEmitter(km, fn, b, bufs, st.buf)
    BM, BN, T, TKc = plan.bm, plan.bn, plan.threads, plan.tk
    M, P, K, G, N = plan.m, plan.p, plan.k, plan.groups, plan.n
    COLS, S = plan.cols, plan.splits
    TM = plan.tm
    mb_total = plan.m_pad // TM
    xstr = spec.x.strides
    out_sp = [int(d) for d in spec.out_spatial]
    in_sp = [int(d) for d in spec.x.shape[2:]]
    pads = bool(spec.pads)        # the lowering records pads per spatial dimension, or none
    kshape = [spec.cin] + [int(x) for x in spec.kernel]
    STAGE = (BM + BN) * ROW_WORDS          # words per shared stage: A rows then B rows

    smem_words = plan.smem_bytes() // 4
    tiles_g = shared_global(km, f"{sym}_t", I32, smem_words)
    bar = km.declare("llvm.nvvm.barrier0", ir.VoidType(), [])
    sbase = em.shared_pointer(tiles_g, I32)

    def swp(idx, typ=I32):
        p = b.gep(sbase, [idx], source_etype=I32, inbounds=True)
        return p if typ is I32 else b.bitcast(p, ir.PointerType(typ, addrspace=3))

    def V(x):
        return x if isinstance(x, _V) else _V(b, c32(x))

    def c32(v):
        return v if isinstance(v, ir.Value) else I32(int(v))

    def add(*xs):
        out = None
        for x in xs:
            if not isinstance(x, ir.Value) and int(x) == 0:
                continue
            out = c32(x) if out is None else b.add(out, c32(x))
        return out if out is not None else I32(0)

    def mul(x, k: int):
        return x if k == 1 else b.mul(x, I32(k))

    def divmod_c(x, d: int):
        return b.udiv(x, I32(d)), b.urem(x, I32(d))

    def unflatten(x, dims):
        out, rest = [], x
        for d in reversed(dims[1:]):
            rest, r = divmod_c(rest, d)
            out.append(r)
        out.append(rest)
        return out[::-1]

    mma_op = ir.InlineAsm(
        ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4),
        frag.ptx + " {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
    ldsm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([I32] * 4), [I64]),
                        "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l")
    tf32_cvt = ir.InlineAsm(ir.FunctionType(I32, [F32]), "cvt.rna.tf32.f32 $0, $1;", "=r,f")
    # a float32 pair rounded to nearest even in the fragment format and packed: {hi, lo} in one word (sm_80+)
    pair_cvt = ir.InlineAsm(ir.FunctionType(I32, [F32, F32]), f"cvt.rn.{PTX_TYPE[fmt]}x2.f32 $0, $1, $2;", "=r,f,f") \
        if half and not stored_half else None
    if plan.vec:
        # (side effects: kept in order with the copies and barriers around them)
        ldsm_t = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([I32] * 4), [I64]),
                              "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0,$1,$2,$3}, [$4];",
                              "=r,=r,=r,=r,l,~{memory}", side_effect=True)
        cp_ops = {n: ir.InlineAsm(ir.FunctionType(ir.VoidType(), [I64, I64, I32]),
                                  f"cp.async.{'cg' if n == 16 else 'ca'}.shared.global [$0], [$1], {n}, $2;",
                                  "l,l,r,~{memory}", side_effect=True) for n in (4, 8, 16)}
        cp_commit = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "~{memory}",
                                 side_effect=True)
        cp_wait = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {plan.stages - 2};",
                               "~{memory}", side_effect=True)

    if S > 1 and counters is not None:
        flag = shared_global(km, f"{sym}_last", I32, align=None)
        fence = km.declare("llvm.nvvm.membar.gl", ir.VoidType(), [])
        ld_cg = ir.InlineAsm(ir.FunctionType(F32, [I64]), "ld.global.cg.f32 $0, [$1];", "=f,l,~{memory}",
                             side_effect=True)
    tid = b.trunc(km.sreg(b, "tid.x"), I32)
    lane = b.urem(tid, I32(32))
    warp = b.udiv(tid, I32(32))
    wmi, wni = divmod_c(warp, plan.warps_n)
    g_, t_ = b.lshr(lane, I32(2)), b.and_(lane, I32(3))
    lane8 = b.and_(lane, I32(7))                                 # ldmatrix: row within its matrix
    lane_m2 = b.and_(b.lshr(lane, I32(3)), I32(1))               # matrix index % 2
    lane_d2 = b.lshr(lane, I32(4))                               # matrix index // 2
    tiles = warp_tiles(plan)
    accs = [em.alloca(F32) for _ in range(4 * len(tiles))]

    # A slots: 4 channels x a_terms consecutive terms (register-staged kernel)
    AT = plan.a_terms
    a_m, a_k = divmod_c(tid, TKc // AT)
    a_m = mul(a_m, 4)
    a_k = mul(a_k, AT)
    VT = ir.VectorType(ET, 4)
    a_regs = [em.alloca(VT) for _ in range(AT)]
    # B slots: one column, b_terms consecutive terms
    BT = plan.b_terms
    b_h, b_j = divmod_c(tid, BN)
    b_k = mul(b_h, BT)
    b_regs = [em.alloca(ET) for _ in range(BT)]
    b_oks = [em.alloca(ir.IntType(1)) for _ in range(BT)]
    a_kb = em.alloca(I32) if K % TKc else None      # the staged chunk's first term (terms >= K are zeroed)

    abuf, xbuf = em.base(spec.a), em.base(spec.x)
    a_off, x_off = spec.a.offset // esize, spec.x.offset // esize
    per = plan.per_reg

    def load(buf, idx, typ, align):
        v = b.load(b.gep(buf, [b.zext(idx, I64)], source_etype=ET, inbounds=True), typ=typ, align=align)
        v.set_metadata("invariant.load", km.empty_md)
        return v

    def to_word(v):
        """A float32 / float16 value as its 32-bit (tf32) or 16-bit (half) raw bits."""
        return b.call(tf32_cvt, [v]) if not half else b.bitcast(v, ir.IntType(16))

    def pack(lo, hi):
        return b.or_(b.zext(lo, I32), b.shl(b.zext(hi, I32), I32(16)))

    def words_of(vals):
        """Staged values (consecutive k) as the stage's 32-bit words: tf32 one per word; half formats two per
        word, low k in the low half (float16 in memory: their bits; float32: rounded by ``cvt.rn``)."""
        if not half:
            return [to_word(x) for x in vals]
        if pair_cvt is not None:
            return [b.call(pair_cvt, [vals[j + 1], vals[j]]) for j in range(0, len(vals), 2)]
        return [pack(to_word(vals[j]), to_word(vals[j + 1])) for j in range(0, len(vals), 2)]

    def store_words(word_idx, words: List[ir.Value]):
        """Consecutive words at ``word_idx`` (aligned to the run's size by construction), 128-bit at most."""
        i = 0
        while i < len(words):
            n = 4 if len(words) - i >= 4 else 2 if len(words) - i >= 2 else 1
            at = add(word_idx, i)
            if n == 1:
                b.store(words[i], swp(at), align=4)
            else:
                vt = ir.VectorType(I32, n)
                v = ir.Constant(vt, None)
                for q in range(n):
                    v = b.insert_element(v, words[i + q], I32(q))
                b.store(v, swp(at, vt), align=4 * n)
            i += n

    if plan.vec:
        sbase64 = b.ptrtoint(sbase, I64)
        PA, PB, VEC, NS = plan.a_pieces, plan.b_pieces, plan.vec, plan.stages
        ROW_A, ROW_B = BM + ASYNC_PAD, BN + ASYNC_PAD          # halves per shared row
        B_AT = TKc * ROW_A * 2                                 # bytes: B's rows after A's in a stage
        STG = async_stage_bytes(BM, BN, TKc)
        a_seg, a_row = divmod_c(tid, BM // 8)[::-1]            # fixed 16-byte column of the A rows
        b_seg, b_row = divmod_c(tid, BN // VEC)[::-1]
        a_rows_step, b_rows_step = T // (BM // 8), T // (BN // VEC)
        abase64 = b.ptrtoint(abuf, I64)
        xbase64 = b.ptrtoint(xbuf, I64)

    def saddr(byte_off):
        return b.add(sbase64, b.zext(byte_off, I64))

    def async_chunks(g, m0, q0, klo, khi):
        """The reduction of one tile through NS shared stages filled by cp.async: chunk i is copied into
        stage i % NS, NS - 1 chunks ahead of the products; one wait and one barrier per chunk (the barrier
        also frees the stage the next copies overwrite: every warp has finished the chunk before)."""
        # weights: 8 channels (16 bytes) of panel row k; the channel block m0 + 8 * a_seg sits in one panel
        am = add(m0, mul(a_seg, 8))
        arow0 = add(mul(add(mul(g, mb_total), b.udiv(am, I32(TM))), K), 0)     # panel row of term 0
        acol = add(b.urem(am, I32(TM)), a_off)
        # window: VEC positions of one image starting at column q (all in or all out: VEC divides P and BN)
        q = add(q0, mul(b_seg, VEC))
        qok = b.icmp_unsigned("<", q, I32(COLS))
        nn, pp = divmod_c(q, P)
        xcol = add(mul(nn, int(xstr[0])), mul(mul(g, spec.cin), int(xstr[1])), pp, x_off)
        nch = b.udiv(b.add(b.sub(khi, klo), I32(TKc - 1)), I32(TKc))

        def copy(size, dst, base64, idx, ok):
            src = b.add(base64, b.zext(b.mul(b.select(ok, idx, I32(0)), I32(esize)), I64))
            b.call(cp_ops[size], [dst, src, b.select(ok, I32(size), I32(0))])

        def issue(i):
            """Copies of chunk ``i`` (i < nch) into stage i % NS."""
            k0 = add(klo, mul(i, TKc))
            st_ = mul(b.urem(i, I32(NS)), STG)
            for j in range(PA):
                r = add(a_row, j * a_rows_step)
                k = add(k0, r)
                ok = b.icmp_unsigned("<", k, I32(K))
                dst = saddr(add(st_, mul(r, ROW_A * 2), mul(a_seg, 16)))
                copy(16, dst, abase64, add(mul(add(arow0, k), TM), acol), ok)
            for j in range(PB):
                r = add(b_row, j * b_rows_step)
                c = add(k0, r)
                ok = b.and_(qok, b.icmp_unsigned("<", c, I32(K)))
                dst = saddr(add(st_, B_AT, mul(r, ROW_B * 2), mul(b_seg, VEC * 2)))
                copy(VEC * 2, dst, xbase64, add(xcol, mul(c, int(xstr[1]))), ok)

        for i in range(NS - 1):            # the prologue: the first NS - 1 chunks in flight
            with b.if_then(b.icmp_unsigned("<", I32(i), nch)):
                issue(I32(i))
            b.call(cp_commit, [])

        def step(i64):
            i = b.trunc(i64, I32)
            b.call(cp_wait, [])
            b.call(bar, [])
            nxt = add(i, NS - 1)
            with b.if_then(b.icmp_unsigned("<", nxt, nch)):
                issue(nxt)
            b.call(cp_commit, [])
            async_mmas(mul(b.urem(i, I32(NS)), STG))
        em.loop_range(I64(0), b.zext(nch, I64), step, I64(1))

    def async_mmas(st_off):
        row_w = mul(wmi, plan.wm)
        col_w = mul(wni, plan.wn)
        bst = add(st_off, TKc * (BM + ASYNC_PAD) * 2)
        for ks in range(0, TKc, frag.k):
            afr, bfr = {}, {}
            for r0 in sorted({r for r, _ in tiles}):
                h = async_a_half(plan, V(row_w) + r0, V(lane8), V(lane_m2), V(lane_d2), ks)
                out = b.call(ldsm_t, [saddr(add(st_off, mul(h.v, 2)))])
                afr[r0] = [b.extract_value(out, q) for q in range(4)]
            cols_ = sorted({c for _, c in tiles})
            for c0 in cols_[::2]:
                h = async_b_half(plan, V(col_w) + c0, V(lane8), V(lane_m2), V(lane_d2), ks)
                out = b.call(ldsm_t, [saddr(add(bst, mul(h.v, 2)))])
                bfr[c0] = [b.extract_value(out, 0), b.extract_value(out, 1)]
                bfr[c0 + 8] = [b.extract_value(out, 2), b.extract_value(out, 3)]
            for ti, (r0, c0) in enumerate(tiles):
                cs = accs[4 * ti:4 * ti + 4]
                out = b.call(mma_op, afr[r0] + bfr[c0] + [b.load(c_, typ=F32) for c_ in cs])
                for q_, c_ in enumerate(cs):
                    b.store(b.extract_value(out, q_), c_)

    # float16 outputs of an unsplit reduction: the epilogue reads the tile back from shared memory
    OUT_ROW, OUT_ROWS = BN + ASYNC_PAD, T // BN      # halves per staged output row; rows per pass
    out_staged = (km.tuning.conv_mma_staged_out and S == 1 and node.dtype == DType.FLOAT16
                  and BM * OUT_ROW * 2 <= plan.smem_bytes() and BM % OUT_ROWS == 0
                  and list(frag.c) == [(0, 0), (0, 1), (8, 0), (8, 1)])

    def tile_body(bid64):
        bid = b.trunc(bid64, I32)
        rest, qt = divmod_c(bid, plan.tiles_q)
        rest, mt = divmod_c(rest, plan.tiles_m)
        s, g = divmod_c(rest, G)
        m0 = mul(mt, BM)
        q0 = mul(qt, BN)
        klo = mul(s, plan.kchunk)
        kend = add(klo, plan.kchunk)
        khi = b.select(b.icmp_unsigned("<", kend, I32(K)), kend, I32(K))
        # A: the panel row of (group g, channel m0 + a_m, term 0)
        am = add(m0, a_m)
        apanel = add(mul(add(mul(g, mb_total), b.udiv(am, I32(TM))), K), 0)
        a_col = b.urem(am, I32(TM))
        # B: this thread's column
        q = add(q0, b_j)
        q = b.select(b.icmp_unsigned("<", q, I32(COLS)), q, I32(COLS - 1))
        nn, pp = divmod_c(q, P)
        o = unflatten(pp, out_sp)
        xrow = add(mul(nn, int(xstr[0])), mul(mul(g, spec.cin), int(xstr[1])))
        corner = []
        if pads:
            corner = [b.sub(mul(od, int(spec.strides[d])), I32(int(spec.pads[d]))) for d, od in enumerate(o)]
        else:
            for d, od in enumerate(o):
                xrow = add(xrow, mul(od, int(spec.strides[d]) * int(xstr[2 + d])))
        for a_ in accs:
            b.store(ir.Constant(F32, 0.0), a_)

        def window(off, ok, taps):
            """``off`` moved to the input position of kernel taps ``taps`` (one per spatial dimension; a
            dimension of kernel extent 1 adds nothing), and ``ok`` and-ed with each padded dimension's bounds
            test (None: no test yet)."""
            for d, kd in enumerate(taps):
                dil = int(spec.dilations[d])
                if pads:
                    qd = add(corner[d], mul(kd, dil))
                    inside = b.icmp_unsigned("<", qd, I32(in_sp[d]))
                    ok = inside if ok is None else b.and_(ok, inside)
                    off = add(off, mul(qd, int(xstr[2 + d])))
                elif spec.kernel[d] != 1:
                    off = add(off, mul(kd, dil * int(xstr[2 + d])))
            return off, ok

        def fetch_tap_major(k0):
            """Chunk k0 in (tap, channel) order: tap k0 // C, channels k0 % C + 0..TK-1 (C a multiple of TK)."""
            tap, c0 = divmod_c(k0, spec.cin)
            ntaps = K // spec.cin
            for j, reg in enumerate(a_regs):       # the panel's row of (channel, tap) is channel * taps + tap
                row = add(mul(add(c0, a_k, j), ntaps), tap)
                idx = add(b.mul(add(apanel, row), I32(TM)), a_col, a_off)
                b.store(load(abuf, idx, VT, 4 * esize), reg)
            off, ok = window(add(xrow, mul(add(c0, b_k), int(xstr[1]))), None,
                             unflatten(tap, [int(t) for t in spec.kernel]))
            for j in range(BT):       # BT consecutive channels: one plane apart, one bounds test for all
                idx = add(off, j * int(xstr[1]))
                if ok is not None:
                    idx = b.select(ok, idx, I32(0))
                b.store(load(xbuf, add(idx, x_off), ET, esize), b_regs[j])
                b.store(ok if ok is not None else ir.Constant(ir.IntType(1), 1), b_oks[j])

        def fetch(k0):
            if plan.tap_major:
                return fetch_tap_major(k0)
            # weights: AT terms of 4 channels
            ka = add(k0, a_k)
            if a_kb is not None:
                b.store(ka, a_kb)
            for j, reg in enumerate(a_regs):
                k = add(ka, j)
                if K % TKc:
                    k = b.select(b.icmp_unsigned("<", k, I32(K)), k, I32(K - 1))
                idx = add(b.mul(add(apanel, k), I32(TM)), a_col, a_off)
                b.store(load(abuf, idx, VT, 4 * esize), reg)
            # window: BT consecutive terms of one column; the first unflattened, the rest stepped
            kb = add(k0, b_k)
            digits = unflatten(kb, kshape)      # c, taps...
            for j in range(BT):
                if j:
                    carry = None
                    new = list(digits)
                    for d in reversed(range(1, len(kshape))):
                        if kshape[d] == 1:
                            continue
                        nxt = add(new[d], 1) if carry is None else b.add(new[d], b.zext(carry, I32))
                        wrap = b.icmp_unsigned("==", nxt, I32(kshape[d]))
                        new[d] = b.select(wrap, I32(0), nxt)
                        carry = wrap
                    new[0] = add(new[0], 1) if carry is None else b.add(new[0], b.zext(carry, I32))
                    digits = new
                c, *taps = digits
                ok = b.icmp_unsigned("<", add(kb, j), I32(K)) if K % TKc else None
                off, ok = window(add(xrow, mul(c, int(xstr[1]))), ok, taps)
                if ok is not None:
                    off = b.select(ok, off, I32(0))
                b.store(load(xbuf, add(off, x_off), ET, esize), b_regs[j])
                b.store(ok if ok is not None else ir.Constant(ir.IntType(1), 1), b_oks[j])

        def stage_store(base):
            """The staged registers into the stage at word ``base`` (zeroed, converted, packed)."""
            vals = [b.load(r, typ=VT) for r in a_regs]
            zero = ir.Constant(ET, 0.0)
            aoks = None
            if a_kb is not None:
                ka = b.load(a_kb, typ=I32)
                aoks = [b.icmp_unsigned("<", add(ka, j), I32(K)) for j in range(AT)]
            for i in range(4):      # channel a_m + i: AT consecutive terms
                col = [b.extract_element(v, I32(i)) for v in vals]
                if aoks is not None:
                    col = [b.select(ok, x, zero) for ok, x in zip(aoks, col)]
                words = words_of(col)
                store_words(add(base, mul(add(a_m, i), ROW_WORDS), b.udiv(a_k, I32(per)) if per > 1 else a_k),
                            words)
            col = [b.select(b.load(okr, typ=ir.IntType(1)), b.load(r, typ=ET), zero) for r, okr in zip(b_regs, b_oks)]
            words = words_of(col)
            store_words(add(base, BM * ROW_WORDS, mul(b_j, ROW_WORDS), b.udiv(b_k, I32(per)) if per > 1 else b_k),
                        words)

        row_w = mul(wmi, plan.wm)
        col_w = mul(wni, plan.wn)

        def mmas(base):
            abase = base
            bbase = add(base, BM * ROW_WORDS)
            for ks in range(0, TKc, frag.k):
                afr, bfr = {}, {}
                for r0 in sorted({r for r, _ in tiles}):
                    if plan.ldmatrix:
                        w = V(abase) + ldmatrix_a_word(V(row_w) + r0, V(lane8), V(lane_m2), V(lane_d2), ks)
                        out = b.call(ldsm, [b.ptrtoint(swp(w.v), I64)])
                        afr[r0] = [b.extract_value(out, q) for q in range(4)]
                    else:
                        afr[r0] = [b.load(swp((V(abase) + a_word(plan, V(row_w) + r0, V(g_), V(t_), ks, q)).v),
                                          typ=I32, align=4) for q in range(4)]
                cols_ = sorted({c for _, c in tiles})
                for c0 in cols_:
                    if c0 in bfr:
                        continue
                    if plan.ldmatrix and c0 + 8 in cols_:
                        w = V(bbase) + ldmatrix_b_word(V(col_w) + c0, V(lane8), V(lane_m2), V(lane_d2), ks)
                        out = b.call(ldsm, [b.ptrtoint(swp(w.v), I64)])
                        bfr[c0] = [b.extract_value(out, 0), b.extract_value(out, 1)]
                        bfr[c0 + 8] = [b.extract_value(out, 2), b.extract_value(out, 3)]
                    else:
                        bfr[c0] = [b.load(swp((V(bbase) + b_word(plan, V(col_w) + c0, V(g_), V(t_), ks, q)).v),
                                          typ=I32, align=4) for q in range(2)]
                for ti, (r0, c0) in enumerate(tiles):
                    cs = accs[4 * ti:4 * ti + 4]
                    out = b.call(mma_op, afr[r0] + bfr[c0] + [b.load(c_, typ=F32) for c_ in cs])
                    for q_, c_ in enumerate(cs):
                        b.store(b.extract_value(out, q_), c_)

        def chunk(k0_64):
            k0 = b.trunc(k0_64, I32)
            par = b.and_(b.udiv(b.sub(k0, klo), I32(TKc)), I32(1))
            base = mul(par, STAGE)
            stage_store(base)
            b.call(bar, [])
            nxt = add(k0, TKc)
            with b.if_then(b.icmp_unsigned("<", nxt, khi)):
                fetch(nxt)
            mmas(base)
        if plan.vec:
            async_chunks(g, m0, q0, klo, khi)
        else:
            fetch(klo)
            em.loop_range(b.zext(klo, I64), b.zext(khi, I64), chunk, I64(TKc))

        def finish(m, nn_, sp, val):
            """The stage's epilogue at output (nn_, g * M + m, sp...) of the convolution's value ``val``."""
            mm = add(mul(g, M), m)
            idx = [b.zext(x, I64) for x in [nn_, mm] + sp]
            for v, x in zip(st.vars, idx):
                em.env[v.attr] = x
            em.memo.append(dict(em.memo[-1]))
            em.memo[-1][node.uid] = val
            b.store(em.emit(st.expr), em.address(st.buf, idx))
            em.memo.pop()

        def partial(m, nn_, pp_, s_=None):
            mm = add(mul(g, M), m)
            flat = add(mul(add(mul(add(mul(s if s_ is None else s_, N), nn_), G * M), mm), P), pp_)
            dst = b.gep(em.base(scratch), [I64(scratch.offset)], source_etype=ir.IntType(8), inbounds=True)
            return b.gep(dst, [b.zext(flat, I64)], source_etype=F32, inbounds=True)

        if out_staged:
            # the tile rounded to half through shared memory (the value the epilogue starts from either
            # way), then read back one column per thread: a warp's epilogue loads and stores run along 32
            # consecutive positions instead of 8 channels x 4 pairs, and the column's image and position
            # are unflattened once per tile, not once per element
            b.call(bar, [])     # every warp's last products are done: the stages may be overwritten
            shalf = b.bitcast(sbase, ir.PointerType(F16, addrspace=3))
            for ti, (r0, c0) in enumerate(tiles):
                for q_ in (0, 2):
                    dr, _dc = frag.c[q_]
                    r = add(row_w, r0 + dr, g_)
                    c = add(col_w, c0, mul(t_, 2))
                    lo, hi = (b.bitcast(b.fptrunc(b.load(accs[4 * ti + q_ + e], typ=F32), F16), ir.IntType(16))
                              for e in (0, 1))
                    b.store(pack(lo, hi), swp(b.lshr(add(mul(r, OUT_ROW), c), I32(1))), align=4)
            b.call(bar, [])
            j, r_first = b.urem(tid, I32(BN)), b.udiv(tid, I32(BN))
            col = add(q0, j)
            nn_, pp_ = divmod_c(col, P)
            sp = unflatten(pp_, out_sp)
            with b.if_then(b.icmp_unsigned("<", col, I32(COLS))):
                for i in range(BM // OUT_ROWS):
                    r = add(r_first, i * OUT_ROWS)
                    m = add(m0, r)
                    with b.if_then(b.icmp_unsigned("<", m, I32(M))):
                        v = b.load(b.gep(shalf, [add(mul(r, OUT_ROW), j)], source_etype=F16, inbounds=True),
                                   typ=F16, align=2)
                        finish(m, nn_, sp, v)
        else:
            def outputs(body):
                """``body(accumulator, m, image, position)`` for each of this thread's fragment outputs in the
                output (channel m < M, column < N * P)."""
                for ti, (r0, c0) in enumerate(tiles):
                    for q_ in range(4):
                        dr, dc = frag.c[q_]
                        m = add(m0, row_w, r0 + dr, g_)
                        col = add(q0, col_w, c0 + dc, mul(t_, 2))
                        ok = b.and_(b.icmp_unsigned("<", m, I32(M)), b.icmp_unsigned("<", col, I32(COLS)))
                        with b.if_then(ok):
                            body(accs[4 * ti + q_], m, *divmod_c(col, P))

            def rounded(v):
                return b.fptrunc(v, F16) if node.dtype == DType.FLOAT16 else v

            def own(acc, m, nn_, pp_):
                v = b.load(acc, typ=F32)
                if S > 1:
                    b.store(v, partial(m, nn_, pp_))
                else:
                    finish(m, nn_, unflatten(pp_, out_sp), rounded(v))

            def combined(_acc, m, nn_, pp_):
                tot = ir.Constant(F32, 0.0)
                for s_ in range(S):
                    tot = b.fadd(tot, b.call(ld_cg, [b.ptrtoint(partial(m, nn_, pp_, I32(s_)), I64)]))
                finish(m, nn_, unflatten(pp_, out_sp), rounded(tot))
            outputs(own)
            if S > 1 and counters is not None:
                tile = add(mul(add(mul(g, plan.tiles_m), mt), plan.tiles_q), qt)
                last, cptr = em.last_arrival(scratch, counters, b.zext(tile, I64), S, flag,
                                             b.icmp_unsigned("==", tid, I32(0)))
                with b.if_then(last):
                    b.call(fence, [])
                    outputs(combined)
                    with b.if_then(b.icmp_unsigned("==", tid, I32(0))):
                        b.store(I32(0), cptr)     # ready for the next run (the runtime also zeroes them first)
        b.call(bar, [])      # the next tile's first stores may not overwrite a stage still being read
    em.loop_range(km.sreg(b, "ctaid.x"), I64(plan.blocks), tile_body, km.sreg(b, "nctaid.x"))
    b.ret_void()
    set_contraction(fn, False)
    km.kernels.append(sym)
    return plan.blocks * T

