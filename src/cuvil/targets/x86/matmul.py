"""Register-blocked micro-kernels for products with constant weights (MatMul / Gemm; see
:class:`cuvil.kernels.contraction.MatContraction`).

A unit of the parallel range is a tile of ``MR`` rows of A and one weight panel (``cols = NV * VW``
output columns, packed at compile time as ``Wp[mb, k, :]``), panels fastest, so a single-row product still
spreads over the threads (ResNet-50's classifier: 16 panels of 2048 x 64). The k-loop keeps ``MR x NV`` accumulators in
vector registers: per k it loads ``NV`` vectors of the panel, broadcasts ``A[p, k]`` of each of the
``MR`` rows (read in place: rows of A are contiguous, no packing) and issues ``MR * NV`` fused
multiply-adds. A full tile runs the stage's fused epilogue (bias, residual, activation such as GELU's erf, Gemm's
alpha/beta) on the accumulator vectors themselves and stores each vector to the output (``out[p, m0:m0 +
cols]`` is contiguous; :func:`lane_epilogue_plan` says which epilogues can); otherwise the tile is spilled to a
stack array, the epilogue runs over it in place, and rows are copied out.
The number of rows may be symbolic (batch x sequence): it is read at run time; the last row tile runs a k-loop of
exactly the rows left over (:func:`tile_row_counts`; the bf16 path runs MR rows, its row pointers clamped to the
last row) and stores only the rows that exist.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import llvmlite.ir as ir

from ...ir.dim import SymExpr
from ...ir.dtype import DType
from ...kernels.contraction import MatContraction
from ...kernels.schedule import Stage
from ...kernels.texpr import E
from ..llvm.types import F32, I32, I64, PTR, splat
from ..llvm.vecmath import VECTOR_FUNCTIONS, VectorMath
from .gemm import PREFETCH_K, even_share_line, find_contraction, fma_tile_loop, tile_epilogue, vector_op
from .amx import AMX_BF16_PATH, TILE_ROWS, Tiles, bf16_tile_loop
from .gemm_bf16 import AVX512_BF16, PAIRS, convert_rows, dpbf16, narrow_path, row_stride_pairs
from .gemm_fp16 import F16C_PATH, HALF, fp16_supported


def emit_matmul_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """Emit a MatContraction stage; returns (parallel extent, grain) or None if ``st`` is not one."""
    c = find_contraction(st)
    if c is None or not isinstance(c.attr, MatContraction) or st.region is not None:
        return None
    spec: MatContraction = c.attr
    MR = spec.mr
    vw = max(4, km.vector_bits // 32)
    nr = spec.cols
    if nr % vw or any(isinstance(d, SymExpr) for d in st.buf.shape[-1:]):
        return None
    nv = nr // vw
    vec = ir.VectorType(F32, vw)
    K, M, Mb = spec.k, spec.m, spec.m_blocks
    path = narrow_path(km, spec)
    half = spec.precision == "fp16"     # float16 weight panels, widened as loaded (gemm_fp16.py)
    if half:
        path = F16C_PATH if fp16_supported(km) else "fp32 fallback"
    if path == AMX_BF16_PATH and nr % 16 == 0:
        return _emit_amx(km, st, sym, c, spec)
    if path == AMX_BF16_PATH:           # (the lowering's panels are 64 columns wide on AVX-512)
        path = "fp32 fallback"
    if path is not None and path not in (AVX512_BF16, F16C_PATH):
        km.narrow_paths[sym] = path
        return None          # the generic loop nest evaluates the contraction's (rounding) expression
    bf = path == AVX512_BF16      # vdpbf16ps over pairs of k (gemm_bf16.py): K2 steps, A rounded per unit
    K2, a_stride = (K + 1) // 2, row_stride_pairs(K)

    em, begin, end = km.kernel(sym)
    b = em.b
    if bf or half:
        km.narrow_paths[sym] = path
    wel, wsize = (HALF, 2) if half else (F32, 4)     # a weight panel's elements
    hvec = ir.VectorType(HALF, vw)
    if bf:
        km.scratch_bytes = max(km.scratch_bytes, MR * a_stride * 4)
        scratch = b.load(b.gep(em.bufs, [I64(km.scratch_index)], source_etype=PTR), typ=PTR)
        converted = em.alloca(I64)          # the row tile whose rows of A the scratch holds (-1: none)
        b.store(I64(-1), converted)
        mac = dpbf16(km, b)
    fma = km.declare(f"llvm.fma.v{vw}f32", vec, [vec, vec, vec])
    tile = em.alloca(vec, MR * nv)
    tile_f = b.bitcast(tile, ir.PointerType(F32))
    zero = ir.Constant(vec, [0.0] * vw)
    rows_total = em.index(spec.rows)
    lead = list(st.buf.shape[:-1])

    def fptr(base, off):
        return b.gep(base, [off], source_etype=F32, inbounds=True)

    a_base = b.gep(em.base(spec.a), [I64(spec.a.offset)], source_etype=ir.IntType(8), inbounds=True)
    w_base = b.gep(em.base(spec.w), [I64(spec.w.offset)], source_etype=ir.IntType(8), inbounds=True)
    last_row = b.sub(rows_total, I64(1))
    lanes = None if bf else lane_epilogue_plan(km, st, c)

    row_tiles = b.sdiv(b.add(rows_total, I64(MR - 1)), I64(MR))

    def wptr(base, off):
        return b.gep(base, [off], source_etype=wel, inbounds=True)

    def wload(ptr):
        """A vector of a weight panel row as float32 (float16 panels: widened, exact)."""
        if half:
            return b.fpext(b.load(ptr, typ=hvec, align=2), vec)
        return b.load(ptr, typ=vec, align=4)

    # cache lines per panel row (float32 panels: whole lines; a float16 row of 48 columns, 96 bytes, touches 2)
    lines = -(-nr * wsize // 64) if half else nr * wsize // 64
    # two panels and the rows of A fit the L2 budget (known at run time: the rows may be symbolic); the spread
    # prefetch (NEXT_PANEL_SPREAD) counts the two panels only: it brings the next one in no faster than the
    # row tiles consume the current one, and A's rows stream from L3 anyway where they exceed L2
    a_bytes = I64(0) if NEXT_PANEL_SPREAD else b.mul(rows_total, I64(K * 4))
    fits = b.icmp_signed("<=", b.add(I64(2 * K * nr * wsize), a_bytes), I64(NEXT_PANEL_L2_BYTES))

    # The next panel's lines, spread evenly over the k steps of all row tiles of this panel: row tile t's
    # step k prefetches line ((t * K + k) * L) / (T * K) of the next panel's L lines (a 32.32 fixed-point
    # step, one division per unit), so the panel streams in at the pace the tiles consume theirs.
    panel_lines = -(-K * nr * wsize // 64)
    spread = None
    if NEXT_PANEL_PREFETCH and NEXT_PANEL_SPREAD:
        tiles = b.select(b.icmp_signed(">", row_tiles, I64(0)), row_tiles, I64(1))   # (no rows: no units run)
        spread = b.udiv(I64(panel_lines << 32), b.mul(tiles, I64(K)))

    def next_panel(w_ptr, t, k):
        """Row tile t's share of the next weight panel, prefetched into L2 while this one runs. With at least
        ``lines`` row tiles a panel (NEXT_PANEL_SPREAD): every tile takes an even share of the panel's lines
        (above); with fewer (a decode step's one row), or NEXT_PANEL_SPREAD False: line t % lines of each row
        (``lines`` consecutive row tiles fetch it all; fewer than ``lines`` tiles, only their share of the
        lines, the hardware prefetcher the rest). Off with NEXT_PANEL_PREFETCH False. Addresses past the last
        panel are only hints."""
        if not NEXT_PANEL_PREFETCH:
            return []
        line = b.mul(b.srem(t, I64(max(1, lines))), I64(64 // wsize))
        here = b.add(b.mul(k, I64(nr)), line)
        if spread is not None:
            even = b.mul(even_share_line(b, t, I64(K), k, spread), I64(64 // wsize))
            # (where the two panels do not fit the budget, ``here`` stays the row of this panel the k-loop
            # prefetches anyway: a no-op, as below)
            here = b.select(b.and_(fits, b.icmp_signed(">=", row_tiles, I64(max(1, lines)))), even, here)
        ahead = b.select(fits, I64(K * nr), I64(MATMUL_PREFETCH_K * nr))   # else a row of this panel, a no-op
        return [(wptr(w_ptr, b.add(ahead, here)), 2)]

    def unit(u):
        """Unit u = (weight panel u // T, row tile u % T), T row tiles: consecutive units share a weight
        panel, which stays in L2 (K x cols floats: 768 KiB for K = 3072) while every row tile of the
        thread's range runs over it; a single-row product (a classifier's last layer) still has Mb units
        for the threads. Row tiles fastest instead of panels: BERT-base's 768 -> 3072 and 3072 -> 768
        products (bias fused) at 128 / 384 rows, 1 thread, 174-200 -> 213-231 GFLOP/s (2-core Zen 5). A
        k-blocked variant (32 or 64 KiB slices of the panel, eight row tiles over each, partial sums in
        scratch) ran 1-4% slower than this unblocked one."""
        mb, t = b.sdiv(u, row_tiles), b.srem(u, row_tiles)
        p0 = b.mul(t, I64(MR))
        left = b.sub(rows_total, p0)
        nrows = b.select(b.icmp_signed("<", left, I64(MR)), left, I64(MR))
        rows = []
        for r in range(MR):
            p = b.add(p0, I64(r))
            p = b.select(b.icmp_signed("<", p, rows_total), p, last_row)
            rows.append(fptr(a_base, b.mul(p, I64(K))))

        def panel_bf16(mb):
            with b.if_then(b.icmp_signed("!=", b.load(converted, typ=I64), t)):
                convert_rows(em, rows, scratch, K)
                b.store(t, converted)
            w_ptr = b.gep(w_base, [b.mul(mb, I64(K2 * nr))], source_etype=I32, inbounds=True)

            def ip(base, off):
                return b.gep(base, [off], source_etype=I32, inbounds=True)
            # a panel row (one k pair) is nr words: nr * 4 // 64 cache lines
            return fma_tile_loop(em, None, I64(0), I64(K2), [zero] * (MR * nv), nv,
                                 lambda k: [b.load(ip(ip(w_ptr, b.mul(k, I64(nr))), I64(v * vw)), typ=PAIRS, align=4)
                                            for v in range(nv)],
                                 lambda k: [b.load(ip(scratch, b.add(I64(r * a_stride), k)), typ=I32, align=4)
                                            for r in range(MR)],
                                 prefetch=lambda k: [ip(w_ptr, b.add(b.mul(b.add(k, I64(PREFETCH_K)), I64(nr)), I64(v * 16)))
                                                     for v in range(nr * 4 // 64)],
                                 mac=mac)

        def outputs(mb):
            """Weight panel ``mb``'s columns: (their count, a tile element's output index, its stack slot)."""
            m0 = b.mul(mb, I64(nr))
            mleft = b.sub(I64(M), m0)
            ncols = b.select(b.icmp_signed("<", mleft, I64(nr)), mleft, I64(nr))

            def index(r, j) -> List[ir.Value]:
                return _unflatten(em, b.add(p0, r), lead) + [b.add(m0, j)]

            def slot(r, j):
                return b.gep(tile_f, [b.add(b.mul(r, I64(nr)), j)], source_etype=F32, inbounds=True)
            return ncols, index, slot

        def panel(mb, R=MR, epilogue=True, first=None, spilled_to=None):
            """The tile's ``R`` register rows over weight panel ``mb`` (R = 1: a one-row tile, below; the bf16
            path always runs MR rows). ``first`` (an IR value): the rows are the tile's rows first .. first + R - 1
            (all of them exist), else its rows 0 .. R - 1 (clamped to the last row). ``epilogue`` False: the sums
            are left in the stack tile at their rows, rows ``nr`` floats apart, for the shared spilled epilogue
            (below). ``spilled_to`` (a block): a tile the register epilogue cannot take (a partial panel) is
            spilled and continues there, at the shared spilled epilogue, instead of its own copy of it."""
            w_ptr = wptr(w_base, b.mul(mb, I64(K * nr)))
            if first is None:
                mine = rows[:R]
            else:
                mine = [fptr(a_base, b.mul(b.add(p0, b.add(first, I64(r))), I64(K))) for r in range(R)]
            new = panel_bf16(mb) if bf else fma_tile_loop(em, fma, I64(0), I64(K), [zero] * (R * nv), nv,
                                lambda k: [wload(wptr(wptr(w_ptr, b.mul(k, I64(nr))), I64(v * vw))) for v in range(nv)],
                                lambda k: [b.load(fptr(mine[r], k), typ=F32, align=4) for r in range(R)],
                                prefetch=lambda k: [wptr(w_ptr, b.add(b.mul(b.add(k, I64(MATMUL_PREFETCH_K)), I64(nr)), I64(v * 64 // wsize)))
                                                    for v in range(lines)] + next_panel(w_ptr, t, k),
                                unroll=MATMUL_UNROLL_K if K % MATMUL_UNROLL_K == 0 else 1)

            def spill():
                at = None if first is None else b.mul(first, I64(nv))
                for i in range(R * nv):
                    slot_i = I64(i) if at is None else b.add(at, I64(i))
                    b.store(new[i], b.gep(tile, [slot_i], source_etype=vec, inbounds=True), align=4)
            if not epilogue:
                spill()
                return
            ncols, index, slot = outputs(mb)

            def spilled(full):
                spill()
                if spilled_to is not None:
                    b.branch(spilled_to)
                    return
                tile_epilogue(em, st, c, slot, index, nrows, ncols, full=full)
            if lanes is None:
                spilled((R, nr))
                return
            is_full = b.and_(b.icmp_signed("==", nrows, I64(R)), b.icmp_signed("==", ncols, I64(nr)))
            with b.if_else(is_full) as (then, otherwise):
                with then:
                    lane_epilogue(em, st, c, lanes, new, R, nv, index)
                with otherwise:
                    spilled(None)
        if bf:                  # (the bf16 path always runs MR rows)
            panel(mb)
            return
        counts = tile_row_counts(spec.rows, MR)
        if len(counts) == 1:
            panel(mb, counts[0])
            return
        # The last row tile holds the rows left over (S = 32 with 6-row tiles: 2): it computes those rows only,
        # not MR rows of which the clamped copies of the last row are computed and dropped (MR / left x the
        # FMAs for its rows; BERT-base's products at S = 32 on 6-row tiles: 36 rows' work for 32). Full tiles
        # (the common case) keep their register epilogue, and one row (a decode step's GEMV) its own; other
        # counts run as sub-tiles of the powers of two in their binary form (7 = 4 + 2 + 1 rows, each over the
        # same weight panel, read again from L2), their sums spilled to the stack tile at their rows for one
        # shared epilogue, which a full tile over a partial panel spills to as well. A k-loop per power of two:
        # a k-loop and register epilogue per count made BERT-base's compile 1.45x longer (6-row tiles), a k-loop per
        # count with a shared epilogue 1.05x (8-row tiles: 7 loops; 77.6 s); this form 72.2 s, against 74.0 s
        # for the MR clamped rows (8 x 48, 2-core Zen 4), the same speed and bits as a loop per count.
        left_over = [R for R in counts if 1 < R < MR]
        done = em.fn.append_basic_block("rows_done")
        full = em.fn.append_basic_block("rows_full")
        partial = em.fn.append_basic_block("rows_partial") if left_over else None
        shared = em.fn.append_basic_block("rows_spilled") if left_over else None
        one = em.fn.append_basic_block("rows_1") if 1 in counts else None
        sw = b.switch(nrows, full)
        if one is not None:
            sw.add_case(I64(1), one)
            b.position_at_end(one)
            panel(mb, 1)
            b.branch(done)
        if partial is not None:
            for R in left_over:
                sw.add_case(I64(R), partial)
            b.position_at_end(partial)
            bits = sorted({1 << j for R in left_over for j in range(R.bit_length()) if R >> j & 1}, reverse=True)
            first = I64(0)
            for size in bits:           # the sub-tile of `size` rows where the count has that bit
                has = b.icmp_signed("!=", b.and_(nrows, I64(size)), I64(0))
                with b.if_then(has):
                    panel(mb, size, epilogue=False, first=first)
                first = b.add(first, b.select(has, I64(size), I64(0)))
            b.branch(shared)
            b.position_at_end(shared)   # (also where a full tile of a partial panel spills to)
            ncols, index, slot = outputs(mb)
            tile_epilogue(em, st, c, slot, index, nrows, ncols)
            b.branch(done)
        b.position_at_end(full)
        panel(mb, spilled_to=shared if lanes is not None else None)
        if b.block.terminator is None:
            b.branch(done)
        b.position_at_end(done)

    em.loop_range(begin, end, unit)
    b.ret_void()
    return ((spec.rows + MR - 1) // MR) * Mb, 1


def tile_row_counts(rows, mr: int) -> List[int]:
    """The row counts a row tile of ``mr`` rows can have over ``rows`` rows (an int, or a symbol whose value
    is read at run time), MR first where full tiles occur: every count 1..mr for a symbolic count, else the
    full tiles and the one remainder."""
    if not isinstance(rows, int):
        return [mr] + list(range(1, mr))
    if rows <= mr:
        return [max(1, rows)]
    return [mr] + ([rows % mr] if rows % mr else [])


_LANE_OPS = {"add", "sub", "mul", "div", "neg", "cmp", "select", "and", "or", "not"}


def lane_epilogue_plan(km, st: Stage, node: E) -> Optional[dict]:
    """Whether the stage's epilogue over the product ``node`` can run on the tile's accumulator vectors (a
    vector: one row, ``vw`` consecutive output columns): float arithmetic, comparisons, selects and the vector
    math functions (exp, erf, tanh, log: GELU) over constants, operands along the columns (loads whose last
    index is the column and no other index is: the bias, a residual row) and operands that do not depend on
    the column (broadcast), into a row-major float32 output. Returns ``{load uid: "columns" | "broadcast"}``,
    or None (the spilled-tile epilogue then runs)."""
    if st.buf.dtype != DType.FLOAT or st.buf.pitch is not None or not st.vars or st.buf.strides[-1] != 1:
        return None
    col = st.vars[-1].attr
    kinds, seen = {}, set()

    def ok(e: E) -> bool:
        if e.uid in seen or e is node:
            return True
        seen.add(e.uid)
        if e.op == "const":
            return e.dtype == DType.FLOAT
        if e.op == "load":
            if e.dtype != DType.FLOAT or any(a.op not in ("const", "var") for a in e.args):
                return False
            along = [a.op == "var" and a.attr == col for a in e.args]
            if not any(along):
                kinds[e.uid] = "broadcast"
                return True
            if along[-1] and not any(along[:-1]) and e.attr.pitch is None and e.attr.strides[-1] == 1:
                kinds[e.uid] = "columns"
                return True
            return False
        if e.op == "call":
            if e.attr not in VECTOR_FUNCTIONS or e.dtype != DType.FLOAT or km.math != "vector":
                return False
        elif e.op not in _LANE_OPS:
            return False
        elif e.op not in ("cmp", "select", "and", "or", "not") and e.dtype != DType.FLOAT:
            return False
        elif e.op == "cmp" and e.args[0].dtype != DType.FLOAT:
            return False
        return all(ok(a) for a in e.args)
    return kinds if ok(st.expr) else None


def lane_epilogue(em, st: Stage, node: E, kinds: dict, accs: list, rows: int, nv: int, index):
    """The epilogue of a full ``rows`` x ``nv`` vector tile on its accumulators (``accs``, row-major), each
    result vector stored to the output (see :func:`lane_epilogue_plan`); ``index(r, j)``: the output index of
    row r, column j of the tile. Each lane runs the scalar epilogue's instructions (the vector math's lanes
    too): the same bits as the spilled tile's epilogue, which LLVM vectorised at 8 lanes over a stack copy."""
    b = em.b
    vec = accs[0].type
    vw = vec.count
    vmath = VectorMath(b, em.km.declare, vw, scalef=em.km.scalef)
    names = [v.attr for v in st.vars]
    for r in range(rows):
        for v in range(nv):
            at = index(I64(r), I64(v * vw))
            for name, i in zip(names, at):
                em.env[name] = i
            em.memo.append({})          # scalar values of this row and column only
            memo = {}

            def emit(e: E):
                if e.uid in memo:
                    return memo[e.uid]
                if e is node:
                    out = accs[r * nv + v]
                elif e.op == "const":
                    out = splat(b, em.emit(e), vw)
                elif e.op == "load" and kinds[e.uid] == "broadcast":
                    out = splat(b, em.emit(e), vw)
                elif e.op == "load":
                    ptr = em.address(e.attr, [em.emit(a) for a in e.args])
                    out = b.load(b.bitcast(ptr, vec.as_pointer()), typ=vec, align=4)
                else:
                    out = vector_op(b, em, e, [emit(a) for a in e.args], vmath)
                memo[e.uid] = out
                return out
            value = emit(st.expr)
            em.memo.pop()
            b.store(value, b.bitcast(em.address(st.buf, at), vec.as_pointer()), align=4)


def _emit_amx(km, st: Stage, sym: str, c, spec: MatContraction) -> Tuple[object, int]:
    """The MatContraction on AMX tiles (:mod:`cuvil.targets.x86.amx`): a unit is 16 rows of A x one weight
    panel (``cols`` = 16 * nj columns, stored ``[Mb, K2p, cols, 2]``: 16 pairs x 16 columns of it are a B
    tile, rows ``cols`` words apart). The unit's rows of A are rounded to bfloat16 once into per-thread
    scratch (rows of ``row_stride_pairs(K)`` = K2p words, zero past K: the A tiles), the k-loop keeps the 1 x nj
    float32 tiles in tile registers, they are stored to a stack tile and the stage's epilogue runs over it as
    in the vector kernels (rows past the last clamped and not stored)."""
    nr, K, M, Mb = spec.cols, spec.k, spec.m, spec.m_blocks
    R = TILE_ROWS
    a_stride = row_stride_pairs(K)       # words per rounded row: K2p, a multiple of 16
    nj = nr // 16
    em, begin, end = km.kernel(sym)
    b = em.b
    km.narrow_paths[sym] = AMX_BF16_PATH
    # every row tile of A rounded at most once per call where all of A fits AMX_A_BYTES of scratch (a flag
    # per row tile); else the scratch holds one row tile, rounded again when the unit's row tile changes
    tiles_of_a = -(-spec.rows // R) if isinstance(spec.rows, int) else 0
    whole = 0 < tiles_of_a * R * a_stride * 4 <= AMX_A_BYTES
    km.scratch_bytes = max(km.scratch_bytes, (tiles_of_a if whole else 1) * R * a_stride * 4)
    scratch = b.load(b.gep(em.bufs, [I64(km.scratch_index)], source_etype=PTR), typ=PTR)
    converted = em.alloca(I64)          # the row tile whose rows of A the scratch holds (-1: none)
    b.store(I64(-1), converted)
    if whole:
        flags = em.alloca(ir.IntType(8), tiles_of_a)
        em.loop_range(I64(0), I64(tiles_of_a), lambda i: b.store(
            ir.Constant(ir.IntType(8), 0), b.gep(flags, [i], source_etype=ir.IntType(8), inbounds=True)))
    tile_f = em.alloca(F32, R * nr)
    tiles = Tiles(km, b)
    rows_total = em.index(spec.rows)
    lead = list(st.buf.shape[:-1])
    a_base = b.gep(em.base(spec.a), [I64(spec.a.offset)], source_etype=ir.IntType(8), inbounds=True)
    w_base = b.gep(em.base(spec.w), [I64(spec.w.offset)], source_etype=ir.IntType(8), inbounds=True)
    last_row = b.sub(rows_total, I64(1))
    row_tiles = b.sdiv(b.add(rows_total, I64(R - 1)), I64(R))

    def ip(base, off):
        return b.gep(base, [off], source_etype=I32, inbounds=True)

    def unit(u):
        mb, t = b.sdiv(u, row_tiles), b.srem(u, row_tiles)
        p0 = b.mul(t, I64(R))
        left = b.sub(rows_total, p0)
        nrows = b.select(b.icmp_signed("<", left, I64(R)), left, I64(R))
        rows = []
        for r in range(R):
            p = b.add(p0, I64(r))
            p = b.select(b.icmp_signed("<", p, rows_total), p, last_row)
            rows.append(b.gep(a_base, [b.mul(p, I64(K))], source_etype=F32, inbounds=True))
        if whole:
            a_rows = ip(scratch, b.mul(t, I64(R * a_stride)))
            flag = b.gep(flags, [t], source_etype=ir.IntType(8), inbounds=True)
            with b.if_then(b.icmp_signed("==", b.load(flag, typ=ir.IntType(8)), ir.Constant(ir.IntType(8), 0))):
                convert_rows(em, rows, a_rows, K)
                b.store(ir.Constant(ir.IntType(8), 1), flag)
        else:
            a_rows = scratch
            with b.if_then(b.icmp_signed("!=", b.load(converted, typ=I64), t)):
                convert_rows(em, rows, scratch, K)
                b.store(t, converted)
        w_ptr = ip(w_base, b.mul(mb, I64(a_stride * nr)))
        acc = bf16_tile_loop(em, tiles, I64(a_stride // 16),
                             lambda s_, i: ip(a_rows, b.mul(s_, I64(16))), a_stride * 4,
                             lambda s_, j: ip(w_ptr, b.add(b.mul(s_, I64(16 * nr)), I64(16 * j))), nr * 4, 1, nj)
        for j, tv in enumerate(acc):
            tiles.store(tv, b.gep(tile_f, [I64(16 * j)], source_etype=F32, inbounds=True), nr * 4)
        m0 = b.mul(mb, I64(nr))
        mleft = b.sub(I64(M), m0)
        ncols = b.select(b.icmp_signed("<", mleft, I64(nr)), mleft, I64(nr))

        def index(r, j) -> List[ir.Value]:
            return _unflatten(em, b.add(p0, r), lead) + [b.add(m0, j)]

        def slot(r, j):
            return b.gep(tile_f, [b.add(b.mul(r, I64(nr)), j)], source_etype=F32, inbounds=True)
        tile_epilogue(em, st, c, slot, index, nrows, ncols, full=(R, nr))

    em.loop_range(begin, end, unit)
    b.ret_void()
    return ((spec.rows + R - 1) // R) * Mb, 1


#: scratch an AMX MatMul may use to keep all of A rounded (BERT-base at S = 128: 128 x 3072 -> 768 KiB)
AMX_A_BYTES = 1024 * 1024

# The float32 k-loop (not the bf16 one) prefetches its weight panel's rows this many steps ahead into L1.
# Unlike a convolution's weights (gemm.PREFETCH_K = 128: they stream from memory once per inference), a MatMul
# panel is read by every row tile of the thread's range and sits in L2 after the first: the prefetch only has
# to cover L2's latency, and 128 rows of an 8 x 48 tile's panel ahead (24 KiB) kept half of L1 (48 KiB) in
# flight beside the 8 rows of A. BERT-base's dense layers (768 -> 768, 768 -> 3072, 3072 -> 768 with the bias,
# S = 32 / 128 / 384, one library for S 1..512, 1 thread, CPU time) in 3 interleaved A/B runs of 7-11 rounds
# (load 3-6) on the 2-core Intel Xeon of session 15 (family 6, model 167): 32 steps ran faster than 128 at 22
# of 27 points (4 slower, 1 tie), by 2-10%; 16 and 64 within noise of 32 (`python3 bench/matmul_prefetch.py`;
# BERT-base width, 2 layers: 0.94x the time at S = 32, within noise at 128 and 384). AMD hosts: not measured.
MATMUL_PREFETCH_K = 32

# k steps per trip of the float32 k-loop (1: no unrolling; taken where it divides K). Session 20 (the Xeon above,
# whole BERT-base, 1 thread, weights evicted, `python3 bench/knobs_ab.py bert "base,MATMUL_UNROLL_K=4" --seq S`,
# bit-identical outputs): 4 steps a trip x0.977-0.988 at S = 128, x1.014 at S = 32, x1.003 at S = 384; 2 and 8
# within noise (bench/results/xeon-session20/matmul-unroll-ab.txt). The loop's 3 control and 1 next-panel
# instructions per 24 FMAs are not what holds the GEMMs at ~73% of peak, so it stays 1.
MATMUL_UNROLL_K = 1

NEXT_PANEL_PREFETCH = True
# The next panel's prefetch spread evenly over all row tiles of the current panel (at least ``lines`` of them),
# not fetched whole by its first ``lines`` row tiles (line t % lines of each row). Session 31 (2-core Intel Xeon,
# family 6, model 207: Emerald Rapids, 2 MiB L2, fp32 peak 227 GFLOP/s a core), bench/gemm_schedules.c's 8 x 48
# tile over BERT-base's products with the weights evicted and A and C warm (as in the model), variant 5 against
# Cuvil's order 0, two runs (bench/results/xeon-session31/gemm-schedules-spread.txt): 768 -> 3072 at 128 rows
# 3.10 / 3.16 -> 2.74 / 2.84 ms (all warm: 2.67 / 2.93), 3072 -> 768 3.01 / 3.42 -> 2.98 / 2.97 (warm 2.75 / 2.94),
# 768 -> 768 0.84 / 0.76 -> 0.77 / 0.76 (warm 0.70 / 0.67), 768 -> 3072 at 32 rows 0.95 / 0.94 -> 0.91 / 0.86 (warm
# 0.73 / 0.74): the first ``lines`` tiles had to stream the next panel at T / lines times the pace its tiles
# consume it, faster than one core's share of memory bandwidth.
# Whole BERT-base (`python3 bench/knobs_ab.py bert "base,NEXT_PANEL_SPREAD=False" --seq S --rounds 9`, 1 thread,
# CPU time, weights evicted before each run, bit-identical outputs): S = 32 32.47 / 34.85 ms (x0.932), S = 128
# 104.50 / 112.59 (x0.928), S = 384 349.25 / 357.90 (x0.976); with the budget below counting the two panels only
# (the 3072 -> 768 products at S = 384 then prefetch too; measured as no budget at all, the same for BERT-base):
# S = 384 x0.983 more (bench/results/xeon-session31/next-panel-spread.txt). Not measured: products whose two
# panels alone exceed the budget (K > 10922 at 48 columns: no next-panel prefetch, as before) and row counts
# past BERT's 512 at K = 768 (the budget no longer counts A there).
NEXT_PANEL_SPREAD = True
# The next-panel prefetch runs while two panels and the rows of A (with NEXT_PANEL_SPREAD: the two panels) fit
# this many bytes: BERT-base's
# 768 -> 3072 product at 32 / 128 rows 5-8% / 3% less CPU time with it, within noise at 384 rows and for
# 3072 -> 768, 1 thread, 2-core Zen 5 (1 MiB budget then). Session 19 (2-core Intel Xeon, family 6, model 167,
# 2 MiB L2, weights streaming from memory: 340 MB a run), whole BERT-base, B = 1, fixed S, 1 thread, CPU time, a
# 700 MB buffer read between runs so that no weights stay cached (`python3 bench/knobs_ab.py bert
# "NEXT_PANEL_L2_BYTES=1<<20,base" --seq S`): 1 -> 4 MiB, which adds the 3072 -> 768 products (768 KiB panels)
# at S <= 128 and the 768-input ones at S = 246..1269, ran S = 32 54.4 -> 51.8 ms (x0.952), S = 128 150.4 -> 147.4
# (x0.980), S = 384 451.1 -> 441.7 (x0.979); a prefetch at every size (no budget) was 1.3% slower at S = 384.
# Over this L2's size on purpose: A is read once per panel, and its rows past the tile's are not all needed in L2
# at once. Measured on this one CPU only: on cores with 1-1.25 MiB of L2 (Zen 4, Skylake-SP) two 3072 -> 768
# panels alone exceed it (Zen 5 at the 1 MiB budget: no gain there, see above).
NEXT_PANEL_L2_BYTES = 4 * 1024 * 1024


def _unflatten(em, p, dims) -> List[ir.Value]:
    """Row-major indices of row ``p`` over ``dims`` (symbolic dims read at run time)."""
    b = em.b
    rest, out = p, []
    for d in reversed(dims[1:]):
        out.append(b.srem(rest, em.index(d)))
        rest = b.sdiv(rest, em.index(d))
    out.append(rest)
    return list(reversed(out))
