"""Register-blocked GEMM micro-kernels for contraction stages (convolutions; see :mod:`cuvil.kernels.contraction`).

A stage whose output element is ``epilogue(contract(n, m, o...))`` is computed tile by tile: a tile is
``MR`` output channels x ``NR`` output positions of one image and group, ``NR = NV * VW`` (``VW`` floats
per vector register: 8 with AVX2, 16 with AVX-512; ``(MR, NR)`` is the contraction's ``(mr, cols)``, chosen
per convolution among :func:`tile_shapes`). The k-loop keeps the ``MR x NV`` accumulators in vector
registers: per k it loads ``NV`` vectors of a B panel, broadcasts ``MR`` packed weights and issues
``MR * NV`` fused multiply-adds. The tile is then spilled to a small stack array, the stage's epilogue
(bias, folded BatchNorm, residual add, activation: whatever was fused into the stage) runs over it in place
through the generic emitter, and the rows are copied to the output.

With a *channel-lane* tile (``Contraction.channel_lanes``, AVX-512: 32 x 7, 48 x 7, 64 x 6, 32 x 8) the roles swap:
per k the kernel loads ``MR / VW`` vectors of packed weights and broadcasts ``NR`` packed positions, so
``NR`` may be any count (7: one row of a 7x7 map, which position vectors would pad to 64); the weight panel
is k-blocked to ``A_BLOCK_BYTES`` instead of the B panel, since every position panel re-reads it. Its
accumulators are transposed in registers into channel rows of ``w`` lanes (the power of two >= ``NR``,
:func:`transpose_lanes`) for the vector epilogue (columns masked to the panel's positions), or stored
transposed for the spilled-tile one. They are offered for reductions of at least ``CHANNEL_FLOOR_K`` (16), their
work weighted more below ``CHANNEL_MIN_K`` (128: ``contraction.short_k_weight``); the algorithm choice prices
them from 256, ``choose.CHOICE_CHANNEL_MIN_K``.

B panels (``K x NR`` floats, the im2col of ``NR`` positions) are packed into the calling thread's scratch
(``bufs[scratch]``, one region per thread, see runtime.c) from the stored input: a contiguous copy when the
panel's positions are consecutive in the input, a gather otherwise; positions past ``P`` repeat the last
one (their columns are never stored). The parallel range is chosen so the smaller operand cycles:

* ``Mg <= P`` (*panel* order): a unit is one panel of positions; it is packed once and every weight panel
  runs over it while it sits in L1/L2;
* ``Mg > P`` (*weights* order): a unit is one weight panel; all B panels of the image are packed once per
  kernel call (per thread) and reused by every weight panel of the call's range.
"""
from __future__ import annotations

import itertools
import math
from typing import Optional, Tuple

import llvmlite.ir as ir

from ...ir.dim import SymExpr
from ...ir.dtype import DType
from ...kernels.contraction import AMX_TILE, CHANNEL_LANES, MR, Contraction
from ...kernels.contraction_nhwc import is_channels_last
from ...kernels.schedule import Stage
from ...kernels.texpr import E, contains, top_level
from ..llvm.types import F16, F32, I32, I64, PTR, const_value, splat
from .emitter import X86Emitter
from ..llvm.narrow import I16, bfloat16_to_memory
from .amx import AMX_BF16_PATH, Tiles, bf16_tile_loop
from .gemm_bf16 import AVX512_BF16, BF16_FEATURE, BFLOAT, PAIRS, dpbf16, interleaved_pairs, narrow_path, to_bf16
from .tuning import DEFAULT_TUNING, X86Tuning

# Cores with AVX-512 have 32 vector registers, AVX2 16: NV vectors per row keep MR*NV accumulators + NV
# B vectors + 1 broadcast in registers.
_NV = {512: 4, 256: 2, 128: 2}


def vector_op(b, em, e: E, args: list, vmath=None):
    """An epilogue node's arithmetic on vectors of its operands ``args`` (float ops, compare, select, logic;
    ``call`` through ``vmath``, a :class:`~cuvil.targets.llvm.vecmath.VectorMath`), the one lowering both
    vector epilogues (this module's and :func:`cuvil.targets.x86.matmul.lane_epilogue`) share."""
    op = e.op
    if op == "call":
        return getattr(vmath, e.attr)(*args)
    if op in ("add", "sub", "mul", "div"):
        return getattr(b, "f" + op)(*args)
    if op == "neg":
        return b.fneg(args[0])
    if op == "cmp":
        return em.compare(e.attr, args[0], args[1], e.args[0].dtype)
    if op == "select":
        return b.select(*args)
    if op == "not":
        return b.not_(args[0])
    out = args[0]
    for a in args[1:]:
        out = getattr(b, op + "_")(out, a)
    return out


def tile_cols(vector_bits: int) -> int:
    """Columns per MatMul micro-kernel tile (weight panel width) for a target with ``vector_bits``
    registers; also the widest convolution tile of :func:`tile_shapes`."""
    return max(4, vector_bits // 32) * _NV.get(vector_bits, 2)


def tile_shapes(vector_bits: int, tuning: X86Tuning = DEFAULT_TUNING) -> tuple:
    """The convolution register tiles ``(rows, cols[, lanes | CHANNEL_LANES])`` of a target, in the order
    :func:`cuvil.kernels.contraction.choose_tile` breaks ties. AVX-512's 32 registers hold 12x2, 8x3 or 6x4
    accumulator vectors of positions beside the B vectors and a broadcast, or (channel lanes) 7x3, 6x4, 7x2
    or 8x2 vectors of channels beside the weight vectors (7x4 spilled: 28 accumulators + 4 + a broadcast;
    ``tuning.channel_tiles``); AVX2's 16 hold 6x2."""
    vw = max(4, vector_bits // 32)
    if vector_bits >= 512:
        lanes = tuple((nvec * vw, cols, CHANNEL_LANES) for nvec, cols in tuning.channel_tiles)
        rows_vecs = ((12, 2), (8, 3), (MR, 4)) if tuning.conv_tiles is None else tuning.conv_tiles
        return tuple((rows, nvec * vw, vw) for rows, nvec in rows_vecs) + lanes
    return ((MR, tile_cols(vector_bits)),)


def matmul_tile(cpu, tuning: X86Tuning = DEFAULT_TUNING) -> Tuple[int, int]:
    """The (rows, cols) register tile of float32 products with constant weights on ``cpu`` (a
    :class:`cuvil.targets.x86.cpu.CpuDescription`): ``tuning.matmul_tile`` when set; on Intel cores with
    AVX-512, 8 rows x 48 columns (24 accumulators, 3 panel vectors: 192 bytes of weight panel per k, read
    from L2, for 24 FMAs instead of 6 x 64's 256); elsewhere MR x :func:`tile_cols`. BERT-base's dense
    layers (768 -> 3072 and 3072 -> 768 with the bias, S = 32 / 128 / 384, one library for S 1..512, 1
    thread, CPU time) on a 2-core Intel Xeon VM (family 6, model 167 as reported, stepping 8; AVX-512 and AMX,
    a Sapphire Rapids-class core): 8 x 48
    ran 2-25% faster than 6 x 64 (at S = 32 and 128 also because 8 divides S; 9 x 48 within noise of it,
    12 x 32, 5 x 80 and 4 x 96 slower than 8 x 48; `python3 bench/matmul_tiles.py`). AMD's cores keep 6 x 64, which the
    Zen 5 figures of matmul.py were measured with (8 x 48 not measured there). Zen 4 takes 8 x 48 (EPYC, family
    25, model 17; bench/results/zen4-session34/): alone, BERT-base's two FFN products ran within 1% of 6 x 64 at
    S = 32 / 100 / 128 once the last row tile ran exactly the rows left over (111-113 GFLOP/s, 95-97% of the
    core's FMA peak; 11-12% ahead at S = 32 before, when 6 x 64 computed 36 rows for 32). Whole models, one
    process, both libraries freshly written (2 MiB pages: bench/weights_pages.py shows what the page cache's state
    alone moves), the same bits: BERT-base (one library for S 1..512) x0.965 / 0.990 at S = 32 / 128, 1 thread; the
    GPT-2 decode step (the one-row tile over 48-column panels) x1.045 / 1.029 at past 128 / 1,023: slower. Kept
    for BERT, whose goal is the open one; an earlier A/B (BERT x0.924-0.985, decode x0.902 / 0.930) compared
    libraries whose page-cache state was not controlled."""
    if tuning.matmul_tile is not None:
        return tuning.matmul_tile
    bits = cpu.vector_bits
    intel = cpu.vendor == "GenuineIntel" if cpu.is_host else not cpu.llvm_name.startswith("znver")
    if bits >= 512 and (intel or is_zen4(cpu)):
        return (8, 48)
    return (MR, tile_cols(bits))


def is_zen4(cpu) -> bool:
    """An AMD Zen 4 core: the host's cpuid family 25 with AVX-512 (Zen 3, also family 25, has none), or the CPU
    named ``znver4`` (a named CPU has no cpuid: AMD's are LLVM's ``znver*``, the other AVX-512 names Intel's)."""
    if cpu.is_host:
        return cpu.vendor == "AuthenticAMD" and cpu.family == 25 and cpu.vector_bits >= 512
    return cpu.llvm_name == "znver4"


def find_contraction(st: Stage, op: str = "contract") -> Optional[E]:
    """The stage's micro-kernel node (``op``: contract, window) when the stage stores exactly its elements
    (its index arguments are the stage's own loop variables) and it is the only one at the top level."""
    found, reductions = top_level(st.expr, op)
    if len(found) != 1 or any(contains(r, op) for r in reductions):
        return None
    c = found[0]
    idx = c.args[:len(st.vars)] if op == "wino_out" else c.args[:-1]   # wino_out: [vars, direct, sum]
    if len(idx) != len(st.vars) or any(a.op != "var" or a.attr != v.attr for a, v in zip(idx, st.vars)):
        return None
    return c


# A k-block of one B panel. In an ad-hoc A/B on this 2-core Zen 3 (AVX2, 16-wide panels; the script was not
# kept, so treat it as a hint) 16 KiB blocks and unblocked panels ran within noise of each other on ResNet's
# 3x3 layers, so blocks are sized for L2 and only split the long reductions (K > 1024 here; any K > 256 with
# AVX-512's 64-wide panels, which were never run).
B_BLOCK_BYTES = 64 * 1024
A_BLOCK_BYTES = 64 * 1024   # channel-lane tiles: the weight panel k-block every position panel re-reads (L2; not tuned)

# The packed weights stream from memory once per inference (ResNet-50 has 100 MB of them); the hardware
# prefetcher does not follow a k-block of a weight panel (a few KB, the next block a panel further on), so
# the k-loop prefetches the weights it reads PREFETCH_K steps ahead. On a 2-core Zen 5, a chain of eight
# 512-channel 7x7 3x3 layers (9.4 MB of weights each): 1.64 ms per layer without, 1.24 / 1.25 / 1.21 ms at
# 64 / 128 / 256 steps (1.22 ms when the weights sit in L3; `python3 bench/x86_layers.py --only chain7`);
# ResNet-50 1 thread 42.3 -> 37.7 ms in kernels (`python3 bench/x86_profile.py resnet50`).
PREFETCH_K = 128
# A convolution in weight-block order (more output channels than positions: ResNet-50's 14x14 and 7x7 layers,
# SqueezeNet's 13x13 expands, Winograd GEMMs of small maps) runs every position panel over one k-block of a
# weight block (k_block: A_BLOCK_BYTES of weights for channel-lane tiles, B_BLOCK_BYTES of positions for
# position-lane ones) before the next; the first panel pulls that block from memory at the pace of its FMAs (a
# 32 x 7 channel-lane tile: 128 bytes of weights per 14 FMAs, 7 cycles at two FMAs a cycle), several times what
# one core's memory delivers (17-19 GB/s here). The k-loops of all the block's panels prefetch the next k-block
# among them into L2 instead. Session 31 (Intel Xeon family 6 model 207), 1 thread, weights evicted, bit-identical
# outputs, `python3 bench/knobs_ab.py MODEL "base,NEXT_CHUNK_PREFETCH=False"`: ResNet-50 39.77 against 42.20 ms
# without (x0.942; bench/results/xeon-session31/next-chunk-prefetch.txt, which has the other models and 2 threads
# too). The vdpbf16ps kernels (a weight row: MR pair words per step, the same lines per step as float32's MR
# floats) had it off until session 37: on a Zen 4 (family 25 model 17) ResNet-50 bf16's GEMMs 0.987x / 0.990x
# in kernels at 1 / 2 threads with it, the same bits (bench/results/zen4-session37/ab-bf16-next-chunk-prefetch.txt).
NEXT_CHUNK_PREFETCH = True
# A convolution in panel order whose units (position panels, per image and group) are at most this many is cut
# into one chunk per panel instead of codegen.CHUNKS_PER_THREAD chunks a thread: each panel packs its own B panel,
# so a chunk repeats no set-up work, and the threads then split the step within a panel where whole chunks left
# them up to a quarter of a share apart (a 28x28 map on 48-position tiles: 17 panels, the last a third full, in 8
# chunks of 2-3). Session 37, Zen 4 (family 25 model 17), ResNet-50 at 2 threads, per-step minima of 9
# alternating profile rounds: those layers 5-7% faster (fp32 1.182 -> 1.096 ms, bf16 0.258 -> 0.243), the model's
# kernels bf16 18.03 -> 17.75 and 17.96 -> 17.70 ms in two runs, fp32 32.31 -> 31.80 (39.10 -> 38.56 in a slower
# minute); in kernels DenseNet-121 0.969-0.972x, ShuffleNet 0.980-1.003x, SqueezeNet and Inception-v1 0.998-1.022x;
# the same bits (bench/results/zen4-session37/panel-chunks.txt). 1 thread: no chunks. Static unit counts only (a
# symbolic batch's generic kernels keep the default) and not the AMX kernels (a call per panel would repeat their
# tile configuration; not measured).
PANEL_CHUNK_UNITS = 64
# An AMX convolution prefetches its next position panel's lines (X86Tuning.next_panel_prefetch) where the
# tensor it streams (a 1x1 reader's input, an epilogue's output and residual) is at least this large: smaller
# ones stay in L2 (2 MB a core on this session's Xeon) from their producer, where the prefetches can only cost
# issue slots (with them everywhere, the 3x3 layers at 14x14 and 7x7 ran 1.02-1.03x in the best of 16 rounds
# of `bench/amx_resnet_ab.py --steps`, load 7-8: within that VM's noise, but no gain to pay for)
STREAM_PREFETCH_BYTES = 1 << 20


def k_block(spec: Contraction) -> int:
    """k-block length: the B panel block fits B_BLOCK_BYTES (with channel lanes: the weight panel block,
    which every position panel re-reads, fits A_BLOCK_BYTES); K is split into equal blocks."""
    kc = max(64, (A_BLOCK_BYTES // (spec.mr * 4)) if spec.channel_lanes else B_BLOCK_BYTES // (spec.cols * 4))
    nblocks = -(-spec.k // kc)
    return -(-spec.k // nblocks)


# A large AMX 1x1 convolution (ResNet-50's 64 -> 256 expansions and projection at 56x56) sweeps every position
# panel with one block of 32 output channels before the next block (X86Tuning.channel_sweep), instead of every
# channel block per panel: its epilogue then streams 32 output rows (and residual rows) front to back, where
# panel order touched all 256 rows 6-12 KB apart at every panel, too many streams for the hardware prefetcher.
# All the image's pair panels are packed first, so only where they stay in L2 (SWEEP_PANEL_BYTES; at K = 256
# the 1.6 MB of panels made the 56x56 reduces slower: 0.32 -> 0.53 ms best round) and the output is large
# (m x p x 2 bytes at least STREAM_PREFETCH_BYTES). The epilogue prefetches SWEEP_AHEAD panels ahead along the
# rows (0 / 2 / 6 panels measured, bench/PRECISION.md: 2 the best). Same bits either way.
SWEEP_PANEL_BYTES = 512 * 1024
SWEEP_AHEAD = 2


def channel_sweep(spec: Contraction) -> bool:
    """Whether an AMX contraction in panel order (m <= p) would sweep instead (see SWEEP_PANEL_BYTES): a 1x1
    kernel, a bf16 output of at least STREAM_PREFETCH_BYTES, all its pair panels within SWEEP_PANEL_BYTES."""
    return (spec.amx and spec.m <= spec.p and all(kd == 1 for kd in spec.kernel)
            and 2 * spec.m * spec.p >= STREAM_PREFETCH_BYTES
            and spec.p_blocks * spec.pair_rows * spec.cols * 4 <= SWEEP_PANEL_BYTES)


def panel_major(spec: Contraction, sweep: bool = False) -> bool:
    """The loop order: every weight block per position panel (True), or (False: m > p, or a channel sweep where
    ``sweep`` allows it) every panel per weight block, the image's panels packed once."""
    return spec.m <= spec.p and not (sweep and channel_sweep(spec))


def packed_floats(spec: Contraction, sweep: bool = False) -> int:
    if spec.precision == "bf16":
        return 0         # panels are rounded into pair panels as they are gathered
    panels = 1 if panel_major(spec, sweep) else spec.p_blocks
    return panels * spec.k * spec.cols


def scratch_bytes(spec: Contraction, sweep: bool = False) -> int:
    """Per-thread scratch of a contraction stage: packed B panels, then one accumulator slot (MR x cols
    floats) per tile of a unit for the partial sums between k-blocks; a bf16 contraction's panels again as
    bfloat16 pairs (ceil(K/2) x cols words each) after them."""
    slots = spec.m_blocks if panel_major(spec, sweep) else spec.p_blocks
    return (packed_floats(spec, sweep) + slots * spec.mr * spec.cols + bf16_panel_words(spec, sweep)) * 4


def bf16_panel_words(spec: Contraction, sweep: bool = False) -> int:
    """32-bit words of a bf16 contraction's pair panels in scratch (0 for a float32 one)."""
    if spec.precision != "bf16":
        return 0
    panels = 1 if panel_major(spec, sweep) else spec.p_blocks
    return panels * spec.pair_rows * spec.cols


def emit_gemm_stage(km, st: Stage, sym: str) -> Optional[Tuple[int, int]]:
    c = find_contraction(st)
    if (c is None or km.scratch_index is None or not isinstance(c.attr, Contraction) or c.attr.pads
            or c.attr.x.dtype not in (DType.FLOAT, DType.BFLOAT16)   # the GPU lowering's forms (unpadded,
            or c.attr.x.pitch is not None):                          # float16), a channels-last input: the
        return None                                                  # generic kernel
    spec: Contraction = c.attr
    if not batch_only(spec.x.shape, st.buf.shape):
        return None
    vw = max(4, km.vector_bits // 32)
    nr = spec.cols
    MR = spec.mr
    cl = spec.channel_lanes          # vectors along the tile's MR channels, its nr positions broadcast
    if (MR if cl else nr) % vw:
        return None
    path = narrow_path(km, spec)
    if path == AMX_BF16_PATH and (cl or MR != 2 * AMX_TILE or nr != 2 * AMX_TILE):
        path = "fp32 fallback"           # (the lowering gives AMX contractions 32 x 32 tiles)
    if path is not None and path not in (AVX512_BF16, AMX_BF16_PATH):
        km.narrow_paths[sym] = path
        return None          # the generic loop nest evaluates the contraction's (bf16-rounding) expression
    # bf16: panels rounded once into pair panels as they are packed; then vdpbf16ps over pairs of k
    # (gemm_bf16.py) or, amx, 2 x 2 tdpbf16ps tiles of 16 channels x 16 positions (amx.py)
    bf = path in (AVX512_BF16, AMX_BF16_PATH)
    amx = path == AMX_BF16_PATH
    # an input stored as bfloat16 (the scheduler's bf16_storage): packed into pair panels as 16-bit words, no
    # rounding (its values are bfloat16 already); only the bf16 kernels read it
    x16 = spec.x.dtype == DType.BFLOAT16
    if x16 and not bf:
        return None
    nv = MR // vw if cl else nr // vw    # accumulator vectors per broadcast row
    npv = -(-nr // vw)               # vectors per packed panel row (the last one masked when nr % vw)
    vec = ir.VectorType(F32, vw)
    sweep = amx and km.channel_sweep
    km.scratch_bytes = max(km.scratch_bytes, scratch_bytes(spec, sweep))

    em, begin, end = km.kernel(sym)
    km.gemm_tiles[sym] = f"{MR}x{nr}{CHANNEL_LANES if cl else ''}"
    if bf:
        km.narrow_paths[sym] = path
    b, bufs = em.b, em.bufs
    fma = km.declare(f"llvm.fma.v{vw}f32", vec, [vec, vec, vec])
    tile = em.alloca(vec, MR * nr // vw)   # stored as vectors, read back as floats
    tile_f = b.bitcast(tile, ir.PointerType(F32))
    offs = em.alloca(I64, nr)        # input offset of each position of the panel being packed
    packed_key = em.alloca(I64)
    b.store(I64(-1), packed_key)
    mvec = ir.VectorType(ir.IntType(1), vw)
    tstore = km.declare(f"llvm.masked.store.v{vw}f32.p0", ir.VoidType(), [vec, PTR, I32, mvec])
    lanes_lt = lambda n_: ir.Constant(mvec, [l < n_ for l in range(vw)])

    G, M, K, P, Mb, Pb = spec.groups, spec.m, spec.k, spec.p, spec.m_blocks, spec.p_blocks
    panel_order = panel_major(spec, sweep)
    zero = zero_f = ir.Constant(vec, [0.0] * vw)
    xs = spec.x.shape
    in_strides = spec.x.strides      # elements
    scratch = b.load(b.gep(bufs, [I64(km.scratch_index)], source_etype=PTR), typ=PTR)
    mac = bf_base = istore = hstore = None
    if bf:       # the pair panels after the float32 panels and the accumulator slots (scratch_bytes)
        mac = dpbf16(km, b)
        bf_base = b.gep(scratch, [I64(scratch_bytes(spec, sweep) // 4 - bf16_panel_words(spec, sweep))],
                        source_etype=F32, inbounds=True)
        istore = km.declare(f"llvm.masked.store.v{vw}i32.p0", ir.VoidType(), [PAIRS, PTR, I32, mvec])
        hstore = km.declare(f"llvm.masked.store.v{2 * vw}i16.p0", ir.VoidType(),
                            [ir.VectorType(I16, 2 * vw), PTR, I32, ir.VectorType(ir.IntType(1), 2 * vw)])

    def fptr(base, off):
        return b.gep(base, [off], source_etype=F32, inbounds=True)

    # the input's elements: float32, or (x16) bfloat16 bit patterns, loaded as <vw x i16> and interleaved
    # into pairs as they are; widened (exactly) to float32 only where a path rounds row by row
    xel = I16 if x16 else F32
    xvec_t = ir.VectorType(xel, vw)
    xzero = ir.Constant(xvec_t, [0] * vw) if x16 else zero_f
    xload_m = km.declare(f"llvm.masked.load.v{vw}{'i16' if x16 else 'f32'}.p0", xvec_t, [PTR, I32, mvec, xvec_t])

    def xptr(base, off):
        return b.gep(base, [off], source_etype=xel, inbounds=True)

    def xload(ptr, mask=None):
        """vw elements of x at ``ptr`` (masked lanes: zero)."""
        if mask is None:
            return b.load(ptr, typ=xvec_t, align=2 if x16 else 4)
        return b.call(xload_m, [ptr, I32(2 if x16 else 4), mask, xzero])

    def widen(x):
        """x's lanes as float32 (a bfloat16 pattern is the high half of its float32)."""
        if not x16:
            return x
        wide = ir.VectorType(I32, x.type.count)
        return b.bitcast(b.shl(b.zext(x, wide), ir.Constant(wide, [16] * x.type.count)), ir.VectorType(F32, x.type.count))

    def xpairs(x0, x1):
        """Two rows of x (k, k + 1) as the 16 pairs (x0[i], x1[i]): float32 rounded, bfloat16 interleaved."""
        if not x16:
            return interleaved_pairs(b, x0, x1)
        idx = [i // 2 + (vw if i % 2 else 0) for i in range(2 * vw)]
        return b.bitcast(b.shuffle_vector(x0, x1, ir.Constant(ir.VectorType(I32, 2 * vw), idx)), PAIRS)

    k_stride = in_strides[1] * (G if spec.interleaved else 1)    # floats from one input channel of a group to the next

    def k_offsets(kidx):
        """For k = (input channel, kernel offsets...): its offset in the input and its row of the panel."""
        c_, ks = kidx[0], kidx[1:]
        koff = b.mul(c_, I64(k_stride))
        for kd, dd, stv in zip(ks, spec.dilations, in_strides[2:]):
            koff = b.add(koff, b.mul(kd, I64(dd * stv)))
        kflat = c_
        for kd, ext in zip(ks, spec.kernel):
            kflat = b.add(b.mul(kflat, I64(ext)), kd)
        return koff, kflat

    # bf16: the input offset of every k row as a constant table, so that the packing walks k in pairs (rows
    # 2i and 2i+1 rounded and interleaved into whole pair words: one full store per 16 pairs instead of a
    # masked 16-bit store per row) without dividing k into (channel, kernel offsets) per pair
    koff_table = None
    if bf:
        vals = []
        for kidx in itertools.product(range(spec.cin), *[range(e) for e in spec.kernel]):
            o = kidx[0] * k_stride
            for kd, dd, stv in zip(kidx[1:], spec.dilations, in_strides[2:]):
                o += kd * dd * stv
            vals.append(o)
        if K % 2:
            vals.append(vals[-1])            # the odd half of the last pair: read again, zeroed after packing
        if len(vals) <= 1 << 16 and max(vals) < 1 << 31:
            arr = ir.ArrayType(I32, len(vals))
            koff_table = ir.GlobalVariable(km.module, arr, name=f"{sym}.koff")
            koff_table.global_constant = True
            koff_table.linkage = "internal"
            koff_table.initializer = ir.Constant(arr, vals)

    def k_pairs(per_pair):
        """``per_pair(k2, koff_even, koff_odd)`` for every pair of k rows (koff_table's offsets)."""
        def step(k2):
            at = lambda i: b.sext(b.load(b.gep(koff_table, [I32(0), i], inbounds=True), typ=I32), I64)
            per_pair(k2, at(b.mul(k2, I64(2))), at(b.add(b.mul(k2, I64(2)), I64(1))))
        em.loop_range(I64(0), I64((K + 1) // 2), step)

    def x_at(n, g):
        """The input's element 0 of image n, group g's first channel."""
        xb = b.gep(em.base(spec.x), [I64(spec.x.offset)], source_etype=ir.IntType(8), inbounds=True)
        return xptr(xb, b.mul(b.add(b.mul(n, I64(xs[1])), g if spec.interleaved else b.mul(g, I64(spec.cin))),
                              I64(in_strides[1])))

    # bf16, a 1x1 stride-1 contraction over its whole input (positions = input elements, in order): a full
    # panel is rounded into pairs straight from the input's rows (no float32 copy first)
    direct_rows = (bf and all(kd == 1 for kd in spec.kernel) and all(sd == 1 for sd in spec.strides)
                   and tuple(xs[2:]) == tuple(spec.out_spatial) and in_strides[-1] == 1)

    def pair_put(panel, kflat, col, x, lanes=None):
        """bf16: row ``kflat`` of a panel, columns col.. (``x``: vw floats; ``lanes``: the <vw x i1> columns
        stored, default all), rounded into their halves of the pair panel ``panel``: words
        (kflat / 2) * nr + col.., the low half for an even kflat (vmovdqu16 with a lane mask)."""
        word = b.add(b.mul(b.sdiv(kflat, I64(2)), I64(nr)), col)
        ptr = b.gep(panel, [b.mul(word, I64(2))], source_etype=I16, inbounds=True)
        dup = b.shuffle_vector(to_bf16(b, x), ir.Constant(ir.VectorType(BFLOAT, vw), ir.Undefined),
                               ir.Constant(ir.VectorType(I32, 2 * vw), [i // 2 for i in range(2 * vw)]))
        odd = b.icmp_signed("!=", b.and_(kflat, I64(1)), I64(0))
        m32 = ir.VectorType(ir.IntType(1), 2 * vw)
        mask = b.select(odd, ir.Constant(m32, [i % 2 == 1 for i in range(2 * vw)]),
                        ir.Constant(m32, [i % 2 == 0 for i in range(2 * vw)]))
        if lanes is not None:
            mask = b.and_(mask, b.shuffle_vector(lanes, ir.Constant(mvec, ir.Undefined),
                                                 ir.Constant(ir.VectorType(I32, 2 * vw), [i // 2 for i in range(2 * vw)])))
        b.call(hstore, [b.bitcast(dup, ir.VectorType(I16, 2 * vw)), ptr, I32(2), mask])

    def pair_put_scalar(panel, kflat, col, value):
        """One element of a panel (``value``: float32, rounded; x16: its bfloat16 bits, as they are)."""
        word = b.add(b.mul(b.sdiv(kflat, I64(2)), I64(nr)), col)
        half = b.add(b.mul(word, I64(2)), b.and_(kflat, I64(1)))
        b.store(value if x16 else bfloat16_to_memory(b, value), b.gep(panel, [half], source_etype=I16, inbounds=True))

    def pack(n, g, pb_lo, count, pairs_at=None):
        """Panels pb_lo .. pb_lo+count-1 of image n, group g into scratch (K x nr floats each); bf16: the one
        panel pb_lo straight into the pair panel ``pairs_at`` (rounded as it is gathered: k rows in pairs from
        koff_table where it exists, else row by row with pair_put; partial panels gather, pair_put_scalar)."""
        xb = x_at(n, g)

        def one(i):
            pb = b.add(pb_lo, i)
            panel = pairs_at if bf else fptr(scratch, b.mul(i, I64(K * nr)))

            def position(j):
                p = b.add(b.mul(pb, I64(nr)), j)
                p = b.select(b.icmp_signed("<", p, I64(P)), p, I64(P - 1))
                off, rest = I64(0), p
                for d in reversed(range(len(spec.out_spatial))):
                    od = b.srem(rest, I64(spec.out_spatial[d])) if d else rest
                    rest = b.sdiv(rest, I64(spec.out_spatial[d])) if d else rest
                    off = b.add(off, b.mul(od, I64(spec.strides[d] * in_strides[2 + d])))
                b.store(off, b.gep(offs, [j], source_etype=I64, inbounds=True))
            em.loop_range(I64(0), I64(nr), position)
            first = b.load(offs, typ=I64)
            last = b.load(b.gep(offs, [I64(nr - 1)], source_etype=I64, inbounds=True), typ=I64)
            # nr distinct, increasing offsets spanning nr - 1 are consecutive; a partial panel repeats its
            # last position, so it always gathers
            full = b.icmp_signed("<=", b.mul(b.add(pb, I64(1)), I64(nr)), I64(P))
            contiguous = b.and_(full, b.icmp_signed("==", b.sub(last, first), I64(nr - 1)))

            s_last = spec.strides[-1]
            ow = spec.out_spatial[-1]
            # a full panel that is not one contiguous span is copied in runs along the last output axis:
            # within a run, position i reads input element first_of_run + i*s (s = the last stride), so it
            # is a vector copy (s = 1) or a wide masked load split by a stride-s shuffle; the per-element
            # gather is left for partial panels (their last position repeats) and other strides
            by_runs = 1 <= s_last <= 4 and in_strides[-1] == 1
            if by_runs:
                span = vw * s_last
                wide = ir.VectorType(xel, span)
                i1s = lambda n: ir.VectorType(ir.IntType(1), n)
                mload = km.declare(f"llvm.masked.load.v{span}{'i16' if x16 else 'f32'}.p0", wide, [PTR, I32, i1s(span), wide])
                mstore = km.declare(f"llvm.masked.store.v{vw}f32.p0", ir.VoidType(), [vec, PTR, I32, i1s(vw)])
                ivec = lambda n: ir.VectorType(I32, n)
                picks = ir.Constant(ivec(vw), [l * s_last for l in range(vw)])

                def lanes_below(limit, n):
                    """<n x i1>: lane i has i < limit (an i32)."""
                    return b.icmp_signed("<", ir.Constant(ivec(n), list(range(n))), splat(b, limit, n))

                def run(j0, length):
                    src0 = b.load(b.gep(offs, [j0], source_etype=I64, inbounds=True), typ=I64)
                    chunks = []
                    for v in range(npv):
                        left = b.trunc(b.sub(length, I64(v * vw)), I32)
                        # lanes of the wide load: i <= (left - 1) * s, i.e. i < (left - 1) * s + 1
                        wl = lanes_below(b.add(b.mul(b.sub(left, I32(1)), I32(s_last)), I32(1)), span)
                        chunks.append((b.icmp_signed(">", left, I32(0)), wl, lanes_below(left, vw)))

                    if koff_table is not None:
                        def per_pair(k2, ke, ko):
                            se, so = xptr(xb, b.add(ke, src0)), xptr(xb, b.add(ko, src0))
                            for v, (live, wl, sl) in enumerate(chunks):
                                with b.if_then(live):
                                    undef = ir.Constant(wide, ir.Undefined)
                                    xs_ = [b.call(mload, [xptr(src, I64(v * span)), I32(2 if x16 else 4), wl, undef]) for src in (se, so)]
                                    if s_last > 1:
                                        xs_ = [b.shuffle_vector(x, ir.Constant(wide, ir.Undefined), picks) for x in xs_]
                                    word = b.add(b.mul(k2, I64(nr)), b.add(j0, I64(v * vw)))
                                    b.call(istore, [xpairs(*xs_), ipt(panel, word), I32(4), sl])
                        k_pairs(per_pair)
                        return

                    def per_k(kidx):
                        koff, kflat = k_offsets(kidx)
                        dst = None if bf else fptr(panel, b.add(b.mul(kflat, I64(nr)), j0))
                        src = xptr(xb, b.add(koff, src0))
                        for v, (live, wl, sl) in enumerate(chunks):
                            with b.if_then(live):
                                x = b.call(mload, [xptr(src, I64(v * span)), I32(2 if x16 else 4), wl, ir.Constant(wide, ir.Undefined)])
                                if s_last > 1:
                                    x = b.shuffle_vector(x, ir.Constant(wide, ir.Undefined), picks)
                                if bf:
                                    pair_put(panel, kflat, b.add(j0, I64(v * vw)), widen(x), sl)
                                else:
                                    b.call(mstore, [x, fptr(dst, I64(v * vw)), I32(4), sl])
                    em.loops([spec.cin] + list(spec.kernel), per_k)

            def rows(gather):
                if bf and not gather and koff_table is not None:
                    def per_pair(k2, ke, ko):
                        se, so = xptr(xb, b.add(ke, first)), xptr(xb, b.add(ko, first))
                        row = ipt(panel, b.mul(k2, I64(nr)))
                        for v in range(npv):
                            if (v + 1) * vw <= nr:
                                x0 = xload(xptr(se, I64(v * vw)))
                                x1 = xload(xptr(so, I64(v * vw)))
                                b.store(xpairs(x0, x1),
                                        b.bitcast(ipt(row, I64(v * vw)), PAIRS.as_pointer()), align=4)
                            else:
                                tail = lanes_lt(nr - v * vw)
                                x0 = xload(xptr(se, I64(v * vw)), tail)
                                x1 = xload(xptr(so, I64(v * vw)), tail)
                                b.call(istore, [xpairs(x0, x1), ipt(row, I64(v * vw)), I32(4), tail])
                    k_pairs(per_pair)
                    return

                def per_k(kidx):
                    koff, kflat = k_offsets(kidx)
                    dst = None if bf else fptr(panel, b.mul(kflat, I64(nr)))
                    if gather:
                        def col(j):
                            o = b.load(b.gep(offs, [j], source_etype=I64, inbounds=True), typ=I64)
                            x = b.load(xptr(xb, b.add(koff, o)), typ=xel)
                            if bf:
                                pair_put_scalar(panel, kflat, j, x)
                            else:
                                b.store(x, fptr(dst, j))
                        em.loop_range(I64(0), I64(nr), col)
                    else:
                        src = xptr(xb, b.add(koff, first))
                        for v in range(npv):
                            if (v + 1) * vw <= nr:
                                x = xload(xptr(src, I64(v * vw)))
                                if bf:
                                    pair_put(panel, kflat, I64(v * vw), widen(x))
                                else:
                                    b.store(x, b.gep(dst, [I64(v)], source_etype=vec, inbounds=True), align=4)
                            else:        # a panel row narrower than the vectors: masked to it
                                tail = lanes_lt(nr - v * vw)
                                x = xload(xptr(src, I64(v * vw)), tail)
                                if bf:
                                    pair_put(panel, kflat, I64(v * vw), widen(x), tail)
                                else:
                                    b.call(tstore, [x, fptr(dst, I64(v * vw)), I32(4), tail])
                em.loops([spec.cin] + list(spec.kernel), per_k)
            with b.if_else(contiguous) as (then, otherwise):
                with then:
                    rows(False)
                with otherwise:
                    if not by_runs:
                        rows(True)
                    else:
                        with b.if_else(full) as (then2, otherwise2):
                            with then2:
                                p0 = b.mul(pb, I64(nr))
                                runs_along_last_axis(em, I64(nr), lambda j0: b.sub(I64(ow), b.srem(b.add(p0, j0), I64(ow))), run)
                            with otherwise2:
                                rows(True)
        if not bf:
            em.loop_range(I64(0), count, one)
            return

        if pairs_at is not None:
            one(I64(0))
            if K % 2:            # the odd half of the last pair: zero
                for v in range(npv):
                    pair_put(pairs_at, I64(K), I64(v * vw), zero, lanes_lt(min(vw, nr - v * vw)))
            return

        def one_bf16(i):         # each panel rounded into its pair panel as it is gathered
            dst = ipt(bf_base, b.mul(i, I64(K2s * nr)))
            if not direct_rows:
                pack(n, g, b.add(pb_lo, i), I64(1), dst)
                return
            pb = b.add(pb_lo, i)
            with b.if_else(b.icmp_signed("<=", b.mul(b.add(pb, I64(1)), I64(nr)), I64(P))) as (full, partial):
                with full:       # a full panel's rows are nr consecutive floats of each input channel
                    to_pairs(xptr(x_at(n, g), b.mul(pb, I64(nr))), dst, k_stride,
                             ahead=nr if amx and km.next_panel_prefetch and x_bytes >= STREAM_PREFETCH_BYTES else 0)
                with partial:    # the live positions' rows, masked; zeros past them (not gathered one by one)
                    to_pairs(xptr(x_at(n, g), b.mul(pb, I64(nr))), dst, k_stride, live=b.sub(I64(P), b.mul(pb, I64(nr))))
        em.loop_range(I64(0), count, one_bf16)

    K2 = (K + 1) // 2
    K2s = spec.pair_rows              # rows of a stored pair panel (amx: whole B tiles)

    def ipt(base, off):
        return b.gep(base, [off], source_etype=I32, inbounds=True)

    def to_pairs(src, dst, row=None, ahead=0, live=None):
        """A panel of x's elements (K rows of nr, ``row`` apart: default nr, packed; float32, or x16
        bfloat16) as bfloat16 pairs (K2 x nr words: rows 2i and 2i+1 interleaved; past K zero), vector by
        vector (masked to nr). ``ahead`` (elements, 0: none): each line read is prefetched that far on (the
        next panel's; a 1x1 reader's channel rows are too many streams for the hardware prefetcher).
        ``live`` (an i64 below nr, a partial panel): only the rows' first ``live`` elements are read, the
        panel's other columns are zero (their outputs are not stored)."""
        row = nr if row is None else row
        masks = None
        if live is not None:     # <vw x i1> per vector of the row: its lanes below live
            lane_ids = ir.Constant(ir.VectorType(I32, vw), list(range(vw)))
            masks = [b.icmp_signed("<", lane_ids, splat(b, b.trunc(b.sub(live, I64(v * vw)), I32), vw))
                     for v in range(npv)]
        pf = km.declare("llvm.prefetch.p0", ir.VoidType(), [PTR, I32, I32, I32]) if ahead else None
        esize = 2 if x16 else 4

        def step(k2):
            even = xptr(src, b.mul(k2, I64(2 * row)))
            has_odd = b.icmp_signed("<", b.add(b.mul(k2, I64(2)), I64(1)), I64(K))
            odd = xptr(even, b.select(has_odd, I64(row), I64(0)))
            if pf is not None:
                for line in range(0, nr * esize, 64):
                    for r_ in (even, odd):
                        at = b.gep(r_, [I64(ahead + line // esize)], source_etype=xel, inbounds=False)
                        b.call(pf, [b.bitcast(at, PTR), I32(0), I32(3), I32(1)])
            for v in range(npv):
                if masks is not None:
                    x0 = xload(xptr(even, I64(v * vw)), masks[v])
                    x1 = xload(xptr(odd, I64(v * vw)), masks[v])
                elif (v + 1) * vw <= nr:
                    x0 = xload(xptr(even, I64(v * vw)))
                    x1 = xload(xptr(odd, I64(v * vw)))
                else:
                    tail = lanes_lt(nr - v * vw)
                    x0 = xload(xptr(even, I64(v * vw)), tail)
                    x1 = xload(xptr(odd, I64(v * vw)), tail)
                x1 = b.select(has_odd, x1, xzero)
                words = xpairs(x0, x1)
                at = ipt(dst, b.add(b.mul(k2, I64(nr)), I64(v * vw)))
                if (v + 1) * vw <= nr:
                    b.store(words, b.bitcast(at, PAIRS.as_pointer()), align=4)
                else:
                    b.call(istore, [words, at, I32(4), lanes_lt(nr - v * vw)])
        em.loop_range(I64(0), I64(K2), step)

    nacc = MR * nr // vw

    def kloop(a_ptr, b_ptr, k0: int, k1: int, acc_in, acc_out, b_stride=None, chunk_share=None, live=None):
        """MR x nr accumulators over k in [k0, k1) (nacc vectors: MR rows x nv, or with channel lanes nr
        rows x nv): start from zero (acc_in None) or the vectors at acc_in, end stored at acc_out (the tile,
        or an accumulator slot between k-blocks; None: not stored). Returns the accumulator values.
        ``live`` (position lanes: fewer than nv, a last panel's): only each row's first ``live`` vectors
        (MR x live values, row-major; stored and loaded at their places in the MR x nv layout).
        ``b_stride``: floats from one B row to the next (default nr: a packed panel). ``chunk_share`` (pb,
        panels): this is position panel pb of the ``panels`` that read this k-block of weights (weight-block
        order); its k-loop then prefetches its even share of the next k-block's weights into L2
        (NEXT_CHUNK_PREFETCH), so that the next block's first panel does not wait on memory."""
        lv = nv if live is None else live
        init = [zero] * (nacc // nv * lv) if acc_in is None else [
            b.load(b.gep(acc_in, [I64(i)], source_etype=vec, inbounds=True), typ=vec, align=4)
            for i in tile_slots(lv)]
        a_row = lambda k: fptr(a_ptr, b.mul(k, I64(MR)))
        b_row = lambda k: fptr(b_ptr, b.mul(k, I64(nr) if b_stride is None else b_stride))
        if bf:                   # pairs of k: 32-bit words, MR per weight row, nr per panel row
            a_row = lambda k: ipt(a_ptr, b.mul(k, I64(MR)))
            b_row = lambda k: ipt(b_ptr, b.mul(k, I64(nr)))
            wl = lambda row, i: b.load(ipt(row, I64(i)), typ=I32, align=4)
            vl = lambda row, i: b.load(b.bitcast(ipt(row, I64(i)), PAIRS.as_pointer()), typ=PAIRS, align=4)
            if cl:
                vectors = lambda k: [vl(a_row(k), v * vw) for v in range(nv)]
                scalars = lambda k: [wl(b_row(k), j) for j in range(nr)]
            else:
                vectors = lambda k: [vl(b_row(k), v * vw) for v in range(lv)]
                scalars = lambda k: [wl(a_row(k), r) for r in range(MR)]
        elif cl:
            vectors = lambda k: [b.load(fptr(a_row(k), I64(v * vw)), typ=vec, align=4) for v in range(nv)]
            scalars = lambda k: [b.load(fptr(b_row(k), I64(j)), typ=F32, align=4) for j in range(nr)]
        else:
            vectors = lambda k: [b.load(fptr(b_row(k), I64(v * vw)), typ=vec, align=4) for v in range(lv)]
            scalars = lambda k: [b.load(fptr(a_row(k), I64(r)), typ=F32, align=4) for r in range(MR)]
        # every cache line of the weight row PREFETCH_K steps ahead (a channel-lane row is 2-4 lines)
        lines = range(0, -(-MR * 4 // 64)) if cl else range(1)
        chunk = []
        kc_ = k1 - k0
        L = -(-kc_ * MR * 4 // 64)                       # cache lines of a k-block of weights
        if chunk_share is not None and L <= chunk_share[1] * kc_:
            # the next k-block's weights (they follow this one's: pack_weights lays a group's weight blocks
            # out as [Mb, K, MR], pack_weights_bf16 as [Mb, K2, MR] pair words, k0 and k1 then counting
            # pairs; so after this block's rows come the next block's, after a weight block's
            # last rows the next block's first): panel pb's step k fetches line ((pb * kc + k - k0) * L) /
            # (panels * kc) of its L lines, a 32.32 fixed-point step (each line at least once over the
            # panels: L <= panels * kc steps). Addresses past the last block are only hints (not inbounds).
            pb, panels = chunk_share
            step = (L << 32) // (panels * kc_)
            nxt = b.gep(a_ptr, [I64(k1 * MR)], source_etype=F32)

            def chunk(k):
                at = even_share_line(b, pb, I64(kc_), b.sub(k, I64(k0)), I64(step))
                return [(b.gep(nxt, [b.mul(at, I64(16))], source_etype=F32), 2)]
        new = fma_tile_loop(em, fma, I64(k0), I64(k1), init, lv, vectors, scalars,
                            prefetch=lambda k: [fptr(fptr(a_ptr, b.mul(b.add(k, I64(PREFETCH_K)), I64(MR))), I64(16 * ln))
                                                for ln in lines] + (chunk(k) if chunk else []), mac=mac)
        if acc_out is not None:
            store_tile(new, acc_out, lv)
        return new

    def tile_slots(live):
        """The vector slots of a tile's accumulators (row-major MR x nv), each row's first ``live``."""
        return [i for i in range(nacc) if i % nv < live] if live < nv else list(range(nacc))

    def store_tile(values, dst, live=None):
        for v, i in zip(values, tile_slots(nv if live is None else live)):
            b.store(v, b.gep(dst, [I64(i)], source_etype=vec, inbounds=True), align=4)

    # full tiles of an epilogue made of per-channel and same-position operands run on the accumulators
    vplan = (vector_epilogue_plan(st, c) if (km.cheap_masks or not cl) and st.region is None
             and tuple(st.buf.shape[2:]) == tuple(spec.out_spatial) else None)

    # bytes of one image's input, and of its output plus the residuals its epilogue reads at the output positions
    per_image = lambda shape: math.prod(shape[1:])
    x_bytes = per_image(xs) * (2 if x16 else 4) if all(isinstance(d, int) for d in xs[1:]) else 0
    out_bytes = (per_image(st.buf.shape) * (2 if st.buf.dtype == DType.BFLOAT16 else 4)
                 if all(isinstance(d, int) for d in st.buf.shape[1:]) else 0)
    epilogue_bytes = out_bytes * (1 + sum(1 for k_ in (vplan or {}).values() if k_.startswith("position")))
    a_base = b.gep(em.base(spec.a), [I64(spec.a.offset)], source_etype=ir.IntType(8), inbounds=True)
    # k-blocks: a block of the B panel (kc x nr floats) stays in cache while every tile of the unit passes it;
    # partial sums wait in per-thread accumulator slots (after the packed panels in scratch)
    kc = k_block(spec)
    blocks = [(k0, min(K, k0 + kc)) for k0 in range(0, K, kc)]
    if bf:                       # as many blocks, over the K2 pairs
        kc2 = -(-K2 // len(blocks))
        blocks = [(k0, min(K2, k0 + kc2)) for k0 in range(0, K2, kc2)]
    if amx:                      # one block: the accumulators stay in tile registers over all of K
        blocks = [(0, K2s)]
        tiles = Tiles(km, b)
        # the pair panels' rows past K2 are zero: the tiles read them (stale scratch could hold NaN bit
        # patterns, and 0 * NaN is NaN); zeroed at every call, since other stages share the scratch
        pad_words = (K2s - K2) * nr
        if pad_words:
            pvec = ir.VectorType(I32, vw)
            for pnl in range(1 if panel_order else Pb):
                at = ipt(bf_base, I64(pnl * K2s * nr + K2 * nr))
                em.loop_range(I64(0), I64(pad_words // vw), lambda i, at=at: b.store(
                    ir.Constant(pvec, [0] * vw), b.bitcast(ipt(at, b.mul(i, I64(vw))), pvec.as_pointer()), align=4))
    acc_base = fptr(scratch, I64(packed_floats(spec, sweep)))

    def amx_tile(a_ptr, panel, nj: int = 2):
        """The 32 x 32 tile on 2 x 2 AMX tiles: A = 16 channels x 16 pairs of the weights (a step's MR rows
        of 16 pairs contiguous, step after step: pack_weights_amx), B = 16 pairs x 16 positions of the pair panel
        (rows nr words apart); stored to the stack tile (rows of nr positions) and read back as the accumulator
        vectors. ``nj`` = 1: only the first 16 positions (2 x 1 tiles: a last panel of at most 16 positions;
        the stack tile's other columns are left as they are, and the epilogue masks them off)."""
        acc = bf16_tile_loop(em, tiles, I64(K2s // AMX_TILE),
                             lambda s_, i: ipt(a_ptr, b.add(b.mul(s_, I64(MR * AMX_TILE)), I64(i * AMX_TILE * AMX_TILE))),
                             AMX_TILE * 4,
                             lambda s_, j: ipt(panel, b.add(b.mul(s_, I64(AMX_TILE * nr)), I64(j * AMX_TILE))), nr * 4,
                             2, nj)
        for t_, tv in enumerate(acc):
            i, j = divmod(t_, nj)
            tiles.store(tv, fptr(tile_f, I64(i * AMX_TILE * nr + j * AMX_TILE)), nr * 4)
        return _StoredTile(b, tile, vec, nacc)

    # the last position panel holds P - (Pb - 1) nr positions: where that is 16 or fewer (ResNet-50's 14 x 14
    # maps: 196 = 6 x 32 + 4), it takes half the tile's products (2 x 1 AMX tiles), the same values in its
    # valid columns
    half_last = amx and 0 < P - (Pb - 1) * nr <= AMX_TILE

    def amx_unit(a_ptr, panel, pb):
        if not half_last:
            return amx_tile(a_ptr, panel)
        with b.if_else(b.icmp_signed("==", pb, I64(Pb - 1))) as (last, whole):
            with last:
                amx_tile(a_ptr, panel, nj=1)
            with whole:
                amx_tile(a_ptr, panel)
        return _StoredTile(b, tile, vec, nacc)

    # A position-lane tile's last panel holds P - (Pb - 1) nr positions; where they fill fewer of its nv
    # vectors, that panel runs a k-loop of only those (0: none such). A single panel needs none (its stores
    # past P are masked off at compile time, and LLVM drops the products behind them). SqueezeNet's 512 ->
    # 1000 13x13 layer: 169 = 3 x 48 + 25 positions, 2 of 3 vectors in the last panel, 192 -> 176 positions'
    # products. (The AMX tiles have their own: half_last.)
    last_live = -(-(P - (Pb - 1) * nr) // vw) if isinstance(P, int) and isinstance(Pb, int) else nv
    last_live = last_live if not amx and not cl and Pb != 1 and last_live < nv else 0

    def tile_at(n, g, mb, pb, panel, slot, blk, b_stride=None):
        k0, k1 = blocks[blk]
        a_ptr = (ipt(a_base, b.mul(b.add(b.mul(g, I64(Mb)), mb), I64(K2 * MR))) if bf else
                 fptr(a_base, b.mul(b.add(b.mul(g, I64(Mb)), mb), I64(K * MR))))
        acc = b.bitcast(fptr(acc_base, b.mul(slot, I64(MR * nr))), ir.PointerType(vec))
        last = blk == len(blocks) - 1
        if amx:
            a_ptr = ipt(a_base, b.mul(b.add(b.mul(g, I64(Mb)), mb), I64(MR * K2s)))
            finish(amx_unit(a_ptr, panel, pb), n, g, mb, pb, last, nv)
            return
        # weight-block order: Pb position panels read each k-block of weights, the first from memory;
        # they prefetch the next k-block among them (kloop: where their steps cover its lines)
        share = (pb, Pb) if not panel_order and NEXT_CHUNK_PREFETCH and Pb > 1 else None
        run = lambda live=None: kloop(a_ptr, panel, k0, k1, None if blk == 0 else acc, None if last else acc, b_stride,
                                      share, live)
        if not last_live:
            finish(run(), n, g, mb, pb, last, nv)
            return
        with b.if_else(b.icmp_signed("==", pb, I64(Pb - 1))) as (last_panel, whole):
            with last_panel:
                em.memo.append(dict(em.memo[-1]))
                finish(run(last_live), n, g, mb, pb, last, last_live)
                em.memo.pop()
            with whole:
                em.memo.append(dict(em.memo[-1]))
                finish(run(), n, g, mb, pb, last, nv)
                em.memo.pop()

    def finish(new, n, g, mb, pb, last, live):
        """The tile's epilogue after its last k-block (``live``: accumulator vectors a row, ``new``'s)."""
        if not last:
            return
        m0 = b.mul(mb, I64(MR))
        p0 = b.mul(pb, I64(nr))
        left = b.sub(I64(P), p0)
        ncols = b.select(b.icmp_signed("<", left, I64(nr)), left, I64(nr))
        mleft = b.sub(I64(M), m0)
        nrows = b.select(b.icmp_signed("<", mleft, I64(MR)), mleft, I64(MR))
        if vplan is None:
            if not amx:          # (the AMX tiles are in the stack tile already)
                store_tile(new, tile, live)
            epilogue(n, g, m0, p0, nrows, ncols)
            return
        mbase = b.add(b.mul(g, I64(M)), m0)
        if cl:                   # channel rows of positions, transposed in registers; columns always masked
            rows, w = transpose_lanes(b, new, nr, nv)
            em.memo.append(dict(em.memo[-1]))
            vector_epilogue(em, st, c, vplan, n, mbase, p0, rows, MR, 1, spec.out_spatial, nrows, ncols)
            em.memo.pop()
            return
        if live < nv:            # the last panel: never a full tile
            em.memo.append(dict(em.memo[-1]))
            if km.cheap_masks:
                vector_epilogue(em, st, c, vplan, n, mbase, p0, new, MR, live, spec.out_spatial, nrows, ncols)
            else:
                store_tile(new, tile, live)
                epilogue(n, g, m0, p0, nrows, ncols)
            em.memo.pop()
            return
        full = b.and_(b.icmp_signed("==", nrows, I64(MR)), b.icmp_signed("==", ncols, I64(nr)))
        with b.if_else(full) as (then, otherwise):
            with then:
                em.memo.append(dict(em.memo[-1]))
                vector_epilogue(em, st, c, vplan, n, mbase, p0, new, MR, nv, spec.out_spatial,
                                ahead=nr * (1 if panel_order else SWEEP_AHEAD) if amx and km.next_panel_prefetch
                                and (panel_order or M <= P) and epilogue_bytes >= STREAM_PREFETCH_BYTES else 0)
                em.memo.pop()
            with otherwise:
                em.memo.append(dict(em.memo[-1]))
                if km.cheap_masks:     # partial tiles: rows skipped, columns masked
                    vector_epilogue(em, st, c, vplan, n, mbase, p0, new, MR, nv, spec.out_spatial, nrows, ncols)
                else:
                    if not amx:
                        store_tile(new, tile)
                    epilogue(n, g, m0, p0, nrows, ncols)
                em.memo.pop()

    # A 1x1 stride-1 contraction over its whole input (positions = input elements, in order) in panel order
    # reads a full panel's B rows where they are, k_stride floats apart, instead of packing them: the copy
    # cost more than the FMAs where few weight panels share it (SqueezeNet's 16-64-channel squeezes,
    # DenseNet-121's 32-channel Winograd GEMMs; position lanes only).
    in_place = (panel_order and not cl and not bf and all(kd == 1 for kd in spec.kernel) and all(sd == 1 for sd in spec.strides)
                and tuple(xs[2:]) == tuple(spec.out_spatial) and in_strides[-1] == 1)

    def ensure_packed(key, n, g, pb_lo, count):
        fresh = b.icmp_signed("!=", b.load(packed_key, typ=I64), key)
        with b.if_then(fresh):
            pack(n, g, pb_lo, count)
            b.store(key, packed_key)

    def body(t):
        inner = Pb if panel_order else Mb
        u = b.srem(t, I64(inner))
        ng = b.sdiv(t, I64(inner))
        g = b.srem(ng, I64(G))
        n = b.sdiv(ng, I64(G))
        if in_place:   # a full panel is nr consecutive positions of every input row
            full = b.icmp_signed("<=", b.mul(b.add(u, I64(1)), I64(nr)), I64(P))
            with b.if_then(b.not_(full)):
                ensure_packed(t, n, g, u, I64(1))
            panel = b.select(full, fptr(x_at(n, g), b.mul(u, I64(nr))), scratch)
            stride = b.select(full, I64(k_stride), I64(nr))
            for blk in range(len(blocks)):
                em.loop_range(I64(0), I64(Mb), lambda mb: tile_at(n, g, mb, u, panel, mb, blk, stride))
            return
        for blk in range(len(blocks)):
            if panel_order:      # u = pb: pack it, then every weight panel
                if blk == 0:
                    ensure_packed(t, n, g, u, I64(1))
                em.loop_range(I64(0), I64(Mb), lambda mb: tile_at(n, g, mb, u, bf_base if bf else scratch, mb, blk))
            else:                # u = mb: all panels of (n, g) packed once per call
                if blk == 0:
                    ensure_packed(ng, n, g, I64(0), I64(Pb))
                em.loop_range(I64(0), I64(Pb), lambda pb: tile_at(
                    n, g, u, pb, ipt(bf_base, b.mul(pb, I64(K2s * nr))) if bf else fptr(scratch, b.mul(pb, I64(K * nr))),
                    pb, blk))

    out_sp = spec.out_spatial

    def tile_index(r, j):
        """The tile element of channel r, position j: rows of nr positions, or with channel lanes the
        stored accumulators' order, nr rows of MR channels."""
        return b.add(b.mul(j, I64(MR)), r) if cl else b.add(b.mul(r, I64(nr)), j)

    def epilogue(n, g, m0, p0, nrows, ncols):
        """The tile's positions in runs along the last output axis, within which every index is affine in
        the column (no division per element), so the epilogue's loads and stores vectorise, when output rows
        are at least a tile wide, or (AVX-512) at least a vector wide: 56- and 28-wide rows cut a 64-wide
        tile into 2-3 runs, and per-position stores there cost a 1x1 64->256 convolution over 56x56 as much
        as its FMAs (0.61 -> 0.50 ms, 0.78 -> 0.49 ms with a residual add; Zen 5). Narrower rows (7x7,
        14x14 maps) would cut a tile into several short runs with remainder loops, and constant-bound tiles
        of per-element divisions unroll into too much code (both measured slower on ShuffleNet's 7x7 and
        14x14 layers with AVX2; within noise with AVX-512): positions are unflattened one by one there."""
        mbase = b.add(b.mul(g, I64(M)), m0)
        if out_sp[-1] < (vw if km.cheap_masks else nr):
            def index_p(r, j):
                return [n, b.add(mbase, r)] + unflatten(b, b.add(p0, j), out_sp)

            def slot_p(r, j):
                return b.gep(tile_f, [tile_index(r, j)], source_etype=F32, inbounds=True)
            tile_epilogue(em, st, c, slot_p, index_p, nrows, ncols)
            return

        def run(j0, length):
            lead = unflatten(b, b.add(p0, j0), out_sp)
            w0 = lead.pop()

            def index(r, j):
                return [n, b.add(mbase, r)] + lead + [b.add(w0, j)]

            def slot(r, j):
                return b.gep(tile_f, [tile_index(r, b.add(j0, j))], source_etype=F32, inbounds=True)
            tile_epilogue(em, st, c, slot, index, nrows, length, full=(MR, nr))
        runs_along_last_axis(em, ncols, lambda j0: b.sub(I64(out_sp[-1]), b.srem(b.add(p0, j0), I64(out_sp[-1]))), run)

    em.loop_range(begin, end, body)
    b.ret_void()
    units = spec.n * G * (Pb if panel_order else Mb)
    if not panel_order:
        km.split[sym] = 1       # every chunk packs all the image's panels: one chunk per thread
    elif isinstance(units, int) and units <= PANEL_CHUNK_UNITS and not amx:
        km.split[sym] = units   # a chunk per panel (split is chunks per thread: the runtime caps it at the units)
    return units, 1


class _StoredTile:
    """The accumulator vectors of a tile stored on the stack (``count`` vectors of type ``vec`` at ``tile``),
    loaded where they are used: an AMX tile's 64 vectors read row by row by the epilogue, instead of all
    loaded first (which spilled them to the stack again: 64 loads, stores and reloads per tile)."""

    def __init__(self, b, tile, vec, count: int):
        self.b, self.tile, self.vec, self.count = b, tile, vec, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        return self.b.load(self.b.gep(self.tile, [I64(i)], source_etype=self.vec, inbounds=True), typ=self.vec, align=4)


_VEC_OPS = {"add", "sub", "mul", "div", "neg", "cmp", "select", "and", "or", "not", "const"}


def epilogue_loads(st: Stage, node: E, classify) -> Optional[dict]:
    """Whether the stage's epilogue over the micro-kernel ``node`` is float arithmetic, comparisons and selects
    over loads that ``classify`` names: ``classify(load, widened)`` (``widened``: a bfloat16 load widened to
    float32, the cast around it) returns the load's kind, or None where a vector epilogue cannot read it.
    ``{uid of the load (or of its widening cast): kind}``, or None."""
    kinds, seen = {}, set()

    def ok(e: E) -> bool:
        if e.uid in seen:
            return True
        seen.add(e.uid)
        if e is node:
            return True
        if e.op == "cast" and e.dtype == DType.FLOAT and e.args[0].op == "load" and e.args[0].dtype == DType.BFLOAT16:
            kind = classify(e.args[0], True)
            if kind is not None:
                kinds[e.uid] = kind
            return kind is not None
        if e.op == "load":
            kind = classify(e, False) if e.dtype.is_float and all(a.op in ("const", "var") for a in e.args) else None
            if kind is not None:
                kinds[e.uid] = kind
            return kind is not None
        if e.op not in _VEC_OPS or (e.op not in ("cmp", "and", "or", "not", "select") and not e.dtype.is_float):
            return False
        if e.op == "cmp" and not e.args[0].dtype.is_float:
            return False
        return all(ok(a) for a in e.args)
    return kinds if ok(st.expr) else None


def vector_epilogue_plan(st: Stage, node: E) -> Optional[dict]:
    """Whether the stage's epilogue over the micro-kernel ``node`` can run on whole accumulator vectors:
    float arithmetic, comparisons and selects (bias, folded BatchNorm, Relu/Clip, residual adds) over
    operands that are per-channel (loads indexed by constants, the image and the channel only) or at the
    output position itself (loads indexed by exactly the stage's variables, from a buffer with the output's
    spatial extents: the tile's positions are then consecutive in memory there as in the output), into a
    float32 or bfloat16 output (the scheduler's bf16_storage: rounded by ``vcvtneps2bf16``). Returns
    ``{load uid: "channel" | "position"}``, or None (the spilled-tile epilogue then runs). (Channel-planar
    buffers only: a channels-last one, kernels.contraction_nhwc, has no consecutive positions.)"""
    names = [v.attr for v in st.vars]
    if len(names) < 3 or is_channels_last(st.buf) or st.buf.dtype not in (DType.FLOAT, DType.BFLOAT16):
        return None
    per_channel = set(names[:2])

    def classify(ld: E, widened: bool) -> Optional[str]:
        at_output = ([a.attr if a.op == "var" else None for a in ld.args] == names and
                     tuple(ld.attr.shape[2:]) == tuple(st.buf.shape[2:]) and not is_channels_last(ld.attr))
        if widened:          # a bfloat16 operand at the output position (a residual stored as bfloat16)
            return "position16" if at_output else None
        if all(a.op == "const" or a.attr in per_channel for a in ld.args):
            return "channel"
        return "position" if at_output else None
    return epilogue_loads(st, node, classify)


def vector_epilogue(em, st: Stage, node: E, kinds: dict, n, mbase, p0, accs, mr: int, nv: int, out_sp,
                    nrows=None, ncols=None, ahead: int = 0):
    """The epilogue of a tile on its accumulators (``accs``: mr x nv vectors, row-major), stored straight
    to the output (see :func:`vector_epilogue_plan`). ``nrows`` / ``ncols`` (run-time values): a partial
    tile, whose rows past nrows are skipped and whose columns past ncols are masked off (loads and stores);
    None: a full tile. ``ahead`` (positions, 0: none): each line the epilogue reads at the output position
    (a residual) or writes is prefetched ``ahead`` positions further on, for the tile that comes back to these
    channels ``ahead`` positions later (a hint: prefetches never fault, past the buffer's end included).

    A pitched output (``st.buf.pitch``: the interior of its reader's padded buffer,
    :mod:`cuvil.kernels.pad_in_place`) has rows ``pitch[-2]`` elements apart, more than their width: a vector of
    consecutive positions that crosses a row end is stored in segments, one masked store per output row it
    touches (lanes of row h + j at ``j * (pitch[-2] - W)`` elements further on)."""
    b = em.b
    vec = accs[0].type
    vw = vec.count
    lead = unflatten(b, p0, out_sp)
    pf = em.km.declare("llvm.prefetch.p0", ir.VoidType(), [PTR, I32, I32, I32]) if ahead else None

    def prefetch(ptr, etype, v, write):
        """Line of ``ptr`` (vector v of a row, elements of ``etype``) ``ahead`` elements on: once per 64 bytes."""
        size = 2 if etype is I16 else 4
        if pf is not None and masks is None and (v * vw * size) % 64 == 0:
            at = b.gep(ptr, [I64(ahead)], source_etype=etype, inbounds=False)
            b.call(pf, [b.bitcast(at, PTR), I32(1 if write else 0), I32(3), I32(1)])
    names = [v.attr for v in st.vars]
    masks = None
    if ncols is not None:
        i1v = ir.VectorType(ir.IntType(1), vw)
        mload = em.km.declare(f"llvm.masked.load.v{vw}f32.p0", vec, [PTR, I32, i1v, vec])
        mstore = em.km.declare(f"llvm.masked.store.v{vw}f32.p0", ir.VoidType(), [vec, PTR, I32, i1v])
        lanes = ir.Constant(ir.VectorType(I64, vw), list(range(vw)))
        masks = [b.icmp_signed("<", lanes, splat(b, b.sub(ncols, I64(v * vw)), vw)) for v in range(nv)]

    segments = None      # pitched output, a tile crossing a row end: per vector, its first position's indices
    # (a pitched output of one spatial axis, Winograd's M, has longer channel rows: no tile crosses a row's end, and
    # the row-major path addresses it through its strides)
    pitched = st.buf.pitch is not None and len(out_sp) > 1    # and (shift, lanes) per output row it touches

    def make_segments():
        width, gap = out_sp[-1], st.buf.pitch[-2] - out_sp[-1]
        lanes = ir.Constant(ir.VectorType(I64, vw), list(range(vw)))
        out = []
        for v in range(nv):
            at = unflatten(b, b.add(p0, I64(v * vw)), out_sp)
            col = b.add(splat(b, at[-1], vw), lanes)        # each lane's column counted from its first row
            parts = []
            for j in range(1 + -(-(vw - 1) // width)):
                mj = b.and_(b.icmp_signed(">=", col, splat(b, I64(j * width), vw)),
                            b.icmp_signed("<", col, splat(b, I64((j + 1) * width), vw)))
                parts.append((j * gap, mj if masks is None else b.and_(mj, masks[v])))
            out.append((at, parts))
        return out

    def row(r):
        m = b.add(mbase, I64(r))
        em.env[names[0]], em.env[names[1]] = n, m
        scalars = {}
        for v in range(nv):
            memo = {}

            def emit(e: E):
                if e.uid in memo:
                    return memo[e.uid]
                if e is node:
                    out = accs[r * nv + v]
                elif e.op == "const":
                    out = splat(b, const_value(e.attr, e.dtype), vw)
                elif kinds.get(e.uid) == "position16":       # 16 bfloat16 words widened to float32
                    ld = e.args[0]
                    ptr = b.gep(em.address(ld.attr, [n, m] + lead), [I64(v * vw)], source_etype=I16, inbounds=True)
                    prefetch(ptr, I16, v, False)
                    hvec = ir.VectorType(I16, vw)
                    if masks is None:
                        h = b.load(b.bitcast(ptr, hvec.as_pointer()), typ=hvec, align=2)
                    else:
                        hload = em.km.declare(f"llvm.masked.load.v{vw}i16.p0", hvec, [PTR, I32, masks[v].type, hvec])
                        h = b.call(hload, [ptr, I32(2), masks[v], ir.Constant(hvec, [0] * vw)])
                    wide = ir.VectorType(I32, vw)
                    out = b.bitcast(b.shl(b.zext(h, wide), ir.Constant(wide, [16] * vw)), vec)
                elif e.op == "load" and kinds[e.uid] == "channel":
                    if e.uid not in scalars:
                        em.memo.append({})      # the row's own channel: nothing emitted for another row
                        scalars[e.uid] = splat(b, em.emit(e), vw)
                        em.memo.pop()
                    out = scalars[e.uid]
                elif e.op == "load":
                    ptr = b.gep(em.address(e.attr, [n, m] + lead), [I64(v * vw)], source_etype=F32, inbounds=True)
                    prefetch(ptr, F32, v, False)
                    if masks is None:
                        out = b.load(b.bitcast(ptr, vec.as_pointer()), typ=vec, align=4)
                    else:
                        out = b.call(mload, [ptr, I32(4), masks[v], ir.Constant(vec, [0.0] * vw)])
                else:
                    out = vector_op(b, em, e, [emit(a) for a in e.args])
                memo[e.uid] = out
                return out
            if segments is not None:
                value = emit(st.expr)
                at, parts = segments[v]
                dst = em.address(st.buf, [n, m] + at)
                prefetch(dst, I16 if st.buf.dtype == DType.BFLOAT16 else F32, v, True)
                for gap_, mj in parts:
                    put(value, b.gep(dst, [I64(gap_)], source_etype=I16 if st.buf.dtype == DType.BFLOAT16 else F32,
                                     inbounds=False), mj)
                continue
            dst = out_ptr(m)(v)
            prefetch(dst, I16 if st.buf.dtype == DType.BFLOAT16 else F32, v, True)
            if paired:           # (v even: kept for its odd neighbour; v odd: both rounded by one instruction)
                held.append(emit(st.expr))
                if v % 2:
                    put_pair(held.pop(0), held.pop(0), out_ptr(m)(v - 1))
                continue
            put(emit(st.expr), dst, None if masks is None else masks[v])

    # a full tile into a bfloat16 output, an even number of vectors a row: two vectors rounded by one
    # vcvtne2ps2bf16 and stored as one 64-byte vector (a whole line of a 32-position row) instead of two
    # vcvtneps2bf16 and two 32-byte stores; the same rounding (nearest even), the same bits
    # (only where the target has AVX512_BF16, as every bf16-storing build does: the intrinsic has no fallback)
    paired = (st.buf.dtype == DType.BFLOAT16 and masks is None and not pitched and nv % 2 == 0 and vw == 16
              and BF16_FEATURE in em.km.cpu_features)
    held = []

    cvt2 = (em.km.declare("llvm.x86.avx512bf16.cvtne2ps2bf16.512", ir.VectorType(BFLOAT, 2 * vw), [vec, vec])
            if paired else None)

    def put_pair(lo, hi, ptr):
        # (LLVM splits an fptrunc of 32 floats into two vcvtneps2bf16: the instruction's own intrinsic, whose
        # first operand is rounded into the upper half)
        h = b.bitcast(b.call(cvt2, [hi, lo]), ir.VectorType(I16, 2 * vw))
        b.store(h, b.bitcast(ptr, ir.VectorType(I16, 2 * vw).as_pointer()), align=2)

    if st.buf.dtype == DType.BFLOAT16:       # rounded to bfloat16 (nearest even), 16 bits per position
        hvec = ir.VectorType(I16, vw)
        hstore = em.km.declare(f"llvm.masked.store.v{vw}i16.p0", ir.VoidType(),
                               [hvec, PTR, I32, ir.VectorType(ir.IntType(1), vw)])

        def out_ptr(m):
            return lambda v: b.gep(em.address(st.buf, [n, m] + lead), [I64(v * vw)], source_etype=I16, inbounds=True)

        def put(value, ptr, mask):
            h = b.bitcast(b.fptrunc(value, ir.VectorType(BFLOAT, vw)), hvec)     # (vw: 8 on channel-lane rows)
            if mask is None:
                b.store(h, b.bitcast(ptr, hvec.as_pointer()), align=2)
            else:
                b.call(hstore, [h, ptr, I32(2), mask])
    else:
        if pitched and masks is None:
            i1v = ir.VectorType(ir.IntType(1), vw)
            mstore = em.km.declare(f"llvm.masked.store.v{vw}f32.p0", ir.VoidType(), [vec, PTR, I32, i1v])

        def out_ptr(m):
            return lambda v: b.gep(em.address(st.buf, [n, m] + lead), [I64(v * vw)], source_etype=F32, inbounds=True)

        def put(value, ptr, mask):
            if mask is None:
                b.store(value, b.bitcast(ptr, vec.as_pointer()), align=4)
            else:
                b.call(mstore, [value, ptr, I32(4), mask])

    def rows():
        for r in range(mr):
            if nrows is None or r == 0:
                row(r)
                continue
            with b.if_then(b.icmp_signed(">", nrows, I64(r))):
                em.memo.append(dict(em.memo[-1]))
                row(r)
                em.memo.pop()
    if not pitched:
        rows()
        return
    # a tile within one output row stores as into a row-major buffer (its positions consecutive there too);
    # one that crosses a row end (3 of 7 32-position tiles of a 56-wide map) in segments
    with b.if_else(b.icmp_signed("<=", b.add(lead[-1], I64(nv * vw)), I64(out_sp[-1]))) as (then, otherwise):
        with then:
            em.memo.append(dict(em.memo[-1]))
            rows()
            em.memo.pop()
        with otherwise:
            em.memo.append(dict(em.memo[-1]))
            segments = make_segments()
            rows()
            em.memo.pop()


def transpose_lanes(b: ir.IRBuilder, accs: list, nr: int, nv: int) -> Tuple[list, int]:
    """A channel-lane tile's accumulators (``nr`` positions x ``nv`` vectors of ``vw`` channels, row-major)
    as channel rows: ``nv * vw`` vectors of ``w`` lanes (``w``: the power of two >= nr; lanes past nr are
    zero), in channel order, and ``w``. Per group of vw channels, log2(w) rounds of two-input shuffles
    double the positions each vector holds per channel and halve its channels; the last vectors (vw / w
    channels each) are split into rows."""
    vec = accs[0].type
    vw = vec.count
    w = 1
    while w < nr:
        w *= 2
    assert w <= vw
    zero = ir.Constant(vec, [0.0] * vw)
    rows = []
    for v in range(nv):
        # level s: vectors of (vw / s) channels x s positions, each channel's positions in consecutive lanes;
        # a vector is (first channel, its lanes)
        cur = [(0, accs[j * nv + v] if j < nr else zero) for j in range(w)]
        s = 1
        while s < w:
            nxt = []
            half = vw // s // 2           # channels in each output vector
            for i in range(0, len(cur), 2):
                (c0, lo), (_, hi) = cur[i], cur[i + 1]
                for part in range(2):
                    idx = []
                    for t in range(vw):
                        q, within = t // (2 * s) + part * half, t % (2 * s)
                        idx.append(q * s + within if within < s else vw + q * s + within - s)
                    nxt.append((c0 + part * half, b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, vw), idx))))
            # the next level pairs vectors of one channel range holding consecutive position blocks: a stable
            # sort by channel range keeps the blocks in order
            cur = sorted(nxt, key=lambda e: e[0])
            s *= 2
        narrow = ir.VectorType(I32, w)
        by_channel = {}
        for c0, x in cur:
            for q in range(vw // w):
                by_channel[c0 + q] = b.shuffle_vector(x, x, ir.Constant(narrow, list(range(q * w, q * w + w))))
        rows += [by_channel[q] for q in range(vw)]
    return rows, w


def even_share_line(b, part, steps, k, step):
    """The line that step ``k`` of ``part`` prefetches when ``parts`` parts of ``steps`` steps each share the
    ``L`` lines of a block evenly: ``((part * steps + k) * L) / (parts * steps)``, with ``step`` the 32.32
    fixed-point ``(L << 32) // (parts * steps)`` (every line at least once where L <= parts * steps). The next
    weight panel of a MatMul (matmul.py) and the next k-block of a convolution's weights (kloop) use it."""
    return b.lshr(b.mul(b.add(b.mul(part, steps), k), step), I64(32))


def fma_tile_loop(em, fma, k0, k1, init, nv: int, vectors, scalars, prefetch=None, mac=None, unroll: int = 1) -> list:
    """The register tile's k-loop, for k in [k0, k1): ``len(scalars(k))`` rows x ``nv`` vectors of
    accumulators (phis starting at ``init``, row-major), each updated with fma(splat(scalars(k)[r]),
    vectors(k)[v], acc). ``prefetch(k)``: addresses to prefetch into cache at step k (a hint: they may
    lie past the operand). ``mac(splat, vector, acc)``: the update instead of the fma (the bf16 kernels'
    ``vdpbf16ps`` over pairs, :mod:`cuvil.targets.x86.gemm_bf16`; scalars and vectors are then i32 words).
    ``unroll``: steps per trip of the loop (the caller guarantees that it divides k1 - k0; each step keeps its
    own prefetches). Returns the accumulators' values after the loop (k1 > k0 assumed)."""
    b, fn = em.b, em.fn
    vec = init[0].type
    vw = vec.count
    pre = b.block
    head = fn.append_basic_block("k")
    done = fn.append_basic_block("k_done")
    b.branch(head)
    b.position_at_end(head)
    k = b.phi(I64)
    k.add_incoming(k0, pre)
    accs = []
    for x in init:
        ph = b.phi(vec)
        ph.add_incoming(x, pre)
        accs.append(ph)
    pf = em.km.declare("llvm.prefetch.p0", ir.VoidType(), [PTR, I32, I32, I32]) if prefetch is not None else None
    cur = list(accs)
    for u in range(unroll):
        ku = k if u == 0 else b.add(k, I64(u))
        if pf is not None:
            for addr in prefetch(ku):
                # read, data; keep in all levels, or (an (address, locality) pair) in the outer ones only
                addr, locality = addr if isinstance(addr, tuple) else (addr, 3)
                b.call(pf, [addr, I32(0), I32(locality), I32(1)])
        bv = vectors(ku)
        new = []
        for r, a in enumerate(scalars(ku)):
            svec = ir.VectorType(a.type, vw)
            v0 = b.insert_element(ir.Constant(svec, ir.Undefined), a, I32(0))
            av = b.shuffle_vector(v0, ir.Constant(svec, ir.Undefined), ir.Constant(ir.VectorType(I32, vw), [0] * vw))
            for v in range(nv):
                new.append(mac(av, bv[v], cur[r * nv + v]) if mac is not None else b.call(fma, [av, bv[v], cur[r * nv + v]]))
        cur = new
    kn = b.add(k, I64(unroll))
    k.add_incoming(kn, b.block)
    for ph, x in zip(accs, new):
        ph.add_incoming(x, b.block)
    b.cbranch(b.icmp_signed("<", kn, k1), head, done)
    b.position_at_end(done)
    return new


def runs_along_last_axis(em: X86Emitter, total, room, body):
    """``body(j0, length)`` for consecutive runs covering columns [0, total): each run is as long as
    ``room(j0)`` allows (the columns left before the last axis wraps), so it never crosses a row."""
    b, fn = em.b, em.fn
    pre = b.block
    head = fn.append_basic_block("run")
    inner = fn.append_basic_block("run_body")
    done = fn.append_basic_block("run_done")
    b.branch(head)
    b.position_at_end(head)
    j0 = b.phi(I64)
    j0.add_incoming(I64(0), pre)
    b.cbranch(b.icmp_signed("<", j0, total), inner, done)
    b.position_at_end(inner)
    left = b.sub(total, j0)
    fits = room(j0)
    length = b.select(b.icmp_signed("<", left, fits), left, fits)
    body(j0, length)
    j0.add_incoming(b.add(j0, length), b.block)
    b.branch(head)
    b.position_at_end(done)


def batch_only(*shapes) -> bool:
    """Only the leading (batch) dim of these shapes is symbolic: the micro-kernels' geometry is static and
    the batch only scales their parallel range."""
    return not any(isinstance(d, SymExpr) for shape in shapes for d in shape[1:])


def unflatten(b: ir.IRBuilder, p, dims) -> list:
    """Row-major indices of ``p`` over ``dims`` (0 <= p < prod(dims))."""
    rest, out = p, []
    for d in reversed(dims[1:]):
        out.append(b.srem(rest, I64(d)))
        rest = b.sdiv(rest, I64(d))
    out.append(rest)
    return list(reversed(out))


def tile_epilogue(em: X86Emitter, st: Stage, node: E, slot, index, nrows, ncols, full: Tuple[int, int] = None):
    """The stage's fused epilogue over a spilled tile, in two passes: in place on the stack (stores there
    cannot alias the buffers the epilogue reads, so LLVM vectorises it), then a copy to the output.
    ``slot(r, j)`` is the tile element's address, ``index(r, j)`` its output index, ``node`` the micro-kernel
    node whose value the tile holds. ``full = (rows, cols)``: the tile's full size; when ``nrows x ncols`` is
    exactly that, the passes run with constant trip counts (LLVM then vectorises them at full width with no
    remainder loops, and the row copies become vector moves instead of memcpy calls)."""
    b = em.b
    if full is not None:
        is_full = b.and_(b.icmp_signed("==", nrows, I64(full[0])), b.icmp_signed("==", ncols, I64(full[1])))
        with b.if_else(is_full) as (then, otherwise):
            with then:
                tile_epilogue(em, st, node, slot, index, I64(full[0]), I64(full[1]))
            with otherwise:
                tile_epilogue(em, st, node, slot, index, nrows, ncols)
        return

    def apply(r, j):
        for v, i in zip(st.vars, index(r, j)):
            em.env[v.attr] = i
        em.memo[-1][node.uid] = b.load(slot(r, j), typ=F32)
        value = em.emit(st.expr)
        if value.type == F16:    # a float16 output (a float16 model's product): kept exactly, stored below
            value = b.fpext(value, F32)
        b.store(value, slot(r, j))

    def copy(r, j):      # (a bfloat16 or float16 output: rounded as it is stored)
        value = b.load(slot(r, j), typ=F32)
        value = b.fptrunc(value, F16) if st.buf.dtype == DType.FLOAT16 else em.to_memory(value, st.buf.dtype)
        b.store(value, em.address(st.buf, index(r, j)))

    def apply_store(r, j):   # a non-float output (a comparison, an integer Cast fused after the product)
        at = index(r, j)
        for v, i in zip(st.vars, at):
            em.env[v.attr] = i
        em.memo[-1][node.uid] = b.load(slot(r, j), typ=F32)
        b.store(em.to_memory(em.emit(st.expr), st.buf.dtype), em.address(st.buf, at))
    passes = (apply, copy) if st.buf.dtype in (DType.FLOAT, DType.FLOAT16, DType.BFLOAT16) else (apply_store,)
    for pass_ in passes:
        em.loop_range(I64(0), nrows, lambda r: em.loop_range(I64(0), ncols, lambda j: pass_(r, j)))
