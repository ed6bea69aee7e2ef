"""Attention of many query rows as one tensor-core kernel (``PtxTuning.attention_mma``): flash attention for a
float16 build's FusedAttention (BERT's 128 query rows a head, a prefill), where the row kernel of
:mod:`cuvil.targets.ptx.attention` (a block per query row, scalar dot products) loses to separate tensor-core
products (bench/gpu/RESULTS.md, session 17: BERT-base fp16 1.678 ms row-fused against 1.113 unfused).

Which nodes (:func:`plan_flash`): a FusedAttention (:class:`~cuvil.kernels.attention.AttentionRows`) whose Q, K and
V are float16 values (the float16 pass's ``attention_in_half`` reads them where the graph stores them), head
sizes D and Dv multiples of 16 up to :data:`MAX_HEAD`, more than :data:`~cuvil.targets.ptx.attention.MAX_ROWS`
query rows, on sm_80 or later. The rules of ``rules/attention.rule`` introduce the node (``prove real``; their
verdict is ``bounded``: the obligation checked on bounded shapes, not proved for all)
(:func:`~cuvil.targets.ptx.attention.fuse_attention` with ``also`` = :func:`flash_shapes`, its test on the float32
graph; ``compile_bundle`` fuses only few rows where the float16 pass leaves an operand float32:
:func:`flash_operands_half`).

The kernel (:func:`emit_flash`), after FlashAttention-2 (Dao, 2023): a block of ``W`` warps takes ``16 W`` query
rows of one (batch, head); warp ``w`` owns rows ``16 w .. 16 w + 15``. The block copies its Q tile to shared
memory, then walks the keys in chunks of ``BK`` (64, or 32 for heads over 64), each chunk's K and V rows
copied into one of two shared stages while the previous chunk is computed (one barrier a chunk: after it the
copies of chunk c are complete and visible, and every warp is done with the stage chunk c + 1 then overwrites).
Per chunk a warp:

1. scores its 16 rows against the chunk's keys with ``mma.sync.m16n8k16`` (Q fragments kept in registers from
   ``ldmatrix.x4``, K fragments by ``ldmatrix.x4`` from the ``[key][d]`` rows: K is the ``col`` operand as
   stored), float32 sums; ``s = dot * scale + mask[i, key]``, ``-inf`` for a key past Sk;
2. an online softmax per row: the chunk's row maximum over the thread's 16 values and the row's 4 lanes
   (butterfly over lanes 1, 2), ``m' = max(m, chunk max)``, the shift ``c = m'`` (0 while every score is
   ``-inf``), ``r = exp(m - c)``, ``p = exp(s - c)`` rounded to float16 (the operand of the next product, as
   the unfused float16 graph stores the softmax), ``l = l r + sum p`` (the rounded ``p``: the weights the
   product uses), the output accumulators scaled by ``r``;
3. ``O += P V`` with ``mma.sync``: the score accumulators' layout (rows g, g + 8, columns 2t, 2t + 1 of each
   8-key tile) is the A fragment's of ``m16n8k16``, so ``P`` goes from registers to the product without
   shared memory; V fragments by ``ldmatrix.x4.trans`` from its ``[key][c]`` rows.

At the end ``O / l`` is stored for the rows below Sq (with ``zero_nan``, a row whose ``l`` is NaN or 0 stores
``sum_j 0 * V[j, c]`` in key order instead, as :func:`~cuvil.targets.ptx.attention.store_output` states).
Every sum has a fixed order (mma's, the lanes' butterflies, the chunks in key order): the same bits run to run.

Against the unfused float16 graph: the scores are float32 sums of the float16 products (in the ``mma``'s own
fixed order, not ``plain``'s sequential one, as the tensor-core products sum them), the scale multiplies them
once after the sum (the rules' ``prove real`` reassociation), the softmax is reassociated over chunks (the same
rules), ``P`` is rounded to float16 as the unfused graph rounds the softmax's output; the score matrix never
leaves registers (the unfused graph rounds it to float16 too).

A many-row FusedAttention whose operands are not all float16 after the float16 pass (a prefill over a KV cache the
pass keeps in float32) would take the row kernel, slower than the unfused products: ``compile_bundle`` then fuses
only attention of few rows (:func:`flash_operands_half`).

Copies (:func:`piece_ok`): an operand that is one float16 load with stride 1 along its head dim and 16-byte
aligned rows is copied by ``cp.async.cg`` 16 bytes at a time (zero-filled past Sq or Sk); another is read
element by element through its index expression and stored. Memory safety: every index expression is evaluated
at ``d < D``, ``key < Sk``, ``c < Dv``, ``i < Sq`` (a row past the matrix is clamped to its last row, its copy
zero-filled), the ranges over which the node's ``plain`` value reduces them, and a 16-byte piece starting at
``d0`` (a multiple of 8 below D) holds exactly the elements ``d0 .. d0 + 7`` (stride 1), each one of ``plain``'s
loads: the bounds prover's proof of ``plain`` covers the kernel's reads (ptx/bounds_patterns.py), and the
output is stored at the stage's own indices.
"""
from __future__ import annotations

from typing import Optional, Tuple

import attrs
import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.attention import AttentionRows
from ...kernels.schedule import Stage
from ...kernels.texpr import E, nodes
from ..llvm.types import F16, F32, I32, I64
from .attention import MAX_ROWS, store_output
from .emitter import PtxEmitter, set_contraction, shared_global
from .matmul_mma import FRAGMENTS, _const_term, _stride, async_asm

MAX_HEAD = 128          # head sizes (D, Dv) the kernel takes: the accumulators live in registers
SMEM_LIMIT = 48 * 1024  # static shared memory a block may declare
PAD = 8                 # halves of padding per shared row: ldmatrix's 8 rows of 16 bytes fall in 8 bank groups
PIECE = 8               # halves per cp.async copy (16 bytes)
MIN_SM = 80             # mma.sync.m16n8k16 with float16 operands, ldmatrix, cp.async


@attrs.frozen
class FlashPlan:
    """How a FusedAttention is laid over the GPU by :func:`emit_flash`: ``warps`` warps a block (16 query rows
    each), ``bk`` keys a chunk, ``units`` blocks' work items (batch x heads x query tiles, grid-stride), and
    which operands are copied by ``cp.async`` (else element by element)."""
    warps: int
    bk: int
    d: int
    dv: int
    tiles: int          # query tiles of 16 * warps rows per (batch, head)
    units: int
    q_async: bool
    k_async: bool
    v_async: bool

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def bq(self) -> int:
        return 16 * self.warps

    @property
    def smem_halves(self) -> int:
        return smem_halves(self.warps, self.bk, self.d, self.dv)


def smem_halves(warps: int, bk: int, d: int, dv: int) -> int:
    """The Q tile and two stages of K and V rows, each row padded by :data:`PAD` halves."""
    return 16 * warps * (d + PAD) + 2 * bk * (d + PAD) + 2 * bk * (dv + PAD)


def heads_ok(d: int, dv: int) -> bool:
    """Head sizes the kernel takes: multiples of 16 (the mma's k and two 8-column tiles), at most :data:`MAX_HEAD`."""
    return d % 16 == 0 and dv % 16 == 0 and 16 <= d <= MAX_HEAD and 16 <= dv <= MAX_HEAD


def flash_shapes(binding) -> bool:
    """Whether a match of the attention rules (``q [B, H, Sq, D]``, ``kt [B, H, D, Sk]``, ``v [B, H, Sk, Dv]``)
    has the static shapes this kernel takes with more than ``MAX_ROWS`` query rows: the rewrite's ``accept`` for
    a float16 build (the operands are float32 until the float16 pass; :func:`plan_flash` checks them again as
    lowered)."""
    shapes = [getattr(binding.values.get(n), "shape", None) for n in ("q", "kt", "v")]
    if any(s is None or len(s) != 4 or not all(isinstance(x, int) and x >= 1 for x in s) for s in shapes):
        return False
    q, kt, v = shapes
    return q[2] > MAX_ROWS and heads_ok(q[3], v[3]) and kt[2] == q[3] and kt[3] == v[2]


def flash_operands_half(g) -> bool:
    """Whether every FusedAttention of ``g`` with more than ``MAX_ROWS`` query rows reads float16 Q, K and V (after
    the float16 pass): the flash kernel's operands. ``compile_bundle`` fuses only few rows where one does not."""
    for n in g.nodes:
        if n.op != "FusedAttention":
            continue
        shape = n.inputs[0].shape
        if shape is not None and len(shape) == 4 and isinstance(shape[2], int) and shape[2] <= MAX_ROWS:
            continue
        if any(x is None or x.dtype != DType.FLOAT16 for x in n.inputs[:3]):
            return False
    return True


def piece_ok(e: E, along: str, others) -> bool:
    """Whether operand ``e`` is one float16 load whose elements along ``along`` are contiguous (stride 1) and
    whose 8-element pieces starting at multiples of 8 are 16-byte aligned: the buffer's byte offset a multiple of
    16, the constant term and every other variable's stride multiples of 8 elements."""
    if e.op != "load" or e.dtype != DType.FLOAT16 or _stride(e, along) != 1:
        return False
    strides = [_stride(e, v) for v in others]
    consts = [_const_term(i) for i in e.args]
    if any(x is None for x in strides + consts):
        return False
    flat0 = sum(c * int(s) for c, s in zip(consts, e.attr.strides))
    return int(e.attr.offset) % 16 == 0 and flat0 % PIECE == 0 and all(x % PIECE == 0 for x in strides)


def plan_flash(spec: AttentionRows, sm: int, target_blocks: int) -> Optional[FlashPlan]:
    """The plan for ``spec``, or None where the kernel does not apply (see the module docstring). Warps a
    block: the most of 4, 2, 1 whose grid still has ``target_blocks`` blocks (a block shares its K and V copies
    among its warps; more blocks fill more SMs), within :data:`SMEM_LIMIT`."""
    if sm < MIN_SM or spec.rows <= MAX_ROWS or not heads_ok(spec.d, spec.dv):
        return None
    if any(x.dtype != DType.FLOAT16 for x in (spec.q, spec.k, spec.v)):
        return None
    bk = 64 if max(spec.d, spec.dv) <= 64 else 32
    fits = [w for w in (4, 2, 1) if 2 * smem_halves(w, bk, spec.d, spec.dv) <= SMEM_LIMIT]
    heads = spec.batch * spec.heads

    def tiles(w):
        return -(-spec.rows // (16 * w))
    w = next((w for w in fits if heads * tiles(w) >= target_blocks), fits[-1])
    vb, vh, vi, vd, vkey, vc = (v.attr for v in spec.vars)
    return FlashPlan(w, bk, spec.d, spec.dv, tiles(w), heads * tiles(w),
                     piece_ok(spec.q, vd, (vb, vh, vi)), piece_ok(spec.k, vd, (vb, vh, vkey)),
                     piece_ok(spec.v, vc, (vb, vh, vkey)))


def emit_flash(km, st: Stage, sym: str, plan: FlashPlan) -> Tuple[int, int]:
    """Emit the kernel ``sym`` for the attention stage ``st`` (see the module docstring); returns (units,
    threads per block)."""
    spec: AttentionRows = st.expr.attr
    W, BK, D, DV, T = plan.warps, plan.bk, plan.d, plan.dv, plan.threads
    SQ, SK, H = spec.rows, spec.keys, spec.heads
    QS, KS, VS = D + PAD, D + PAD, DV + PAD            # shared row strides (halves)
    Q0 = 0
    K0 = plan.bq * QS                                  # stage s of K at K0 + s * BK * KS
    V0 = K0 + 2 * BK * KS                              # stage s of V at V0 + s * BK * VS
    fn = km.kernel_fn(sym)
    km.module.add_named_metadata("nvvm.annotations", [fn, "maxntidx", I32(T)])
    # every register a thread may have: without it ptxas capped the 4-warp kernel below its need on sm_80 and spilled
    km.module.add_named_metadata("nvvm.annotations", [fn, "maxnreg", I32(255)])
    bufs, _n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = PtxEmitter(km, fn, b, bufs, st.buf)
    I16 = ir.IntType(16)
    smem = shared_global(km, f"{sym}_s", I16, plan.smem_halves)
    sp = em.shared_pointer(smem, I16)
    with b.goto_block(em.entry):
        b.position_at_start(em.entry)
        s64 = b.ptrtoint(smem, I64)
    F = DType.FLOAT
    neg_inf, zero = ir.Constant(F32, float("-inf")), ir.Constant(F32, 0.0)
    bar = km.declare("llvm.nvvm.barrier0", ir.VoidType(), [])
    shfl = km.declare("llvm.nvvm.shfl.sync.bfly.f32", F32, [I32, F32, I32, I32])
    cp16, commit, wait, ldsm = async_asm()
    mma_op = ir.InlineAsm(
        ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * 6 + [F32] * 4),
        FRAGMENTS["fp16"].ptx + " {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
    vb, vh, vi, vd, vkey, vc = (v.attr for v in spec.vars)
    tid = km.sreg(b, "tid.x")
    lane = b.and_(tid, I64(31))
    warp = b.lshr(tid, I64(5))
    g_ = b.lshr(lane, I64(2))                   # the fragment's row (and the B fragment's column)
    t_ = b.and_(lane, I64(3))
    lane8 = b.and_(lane, I64(7))                # ldmatrix: the row this lane addresses in its matrix
    m2 = b.and_(b.lshr(lane, I64(3)), I64(1))   # ... its matrix's row half (A) or k half (B)
    d2 = b.lshr(lane, I64(4))                   # ... its column half (A) or column tile (B)

    def value(e: E, **env) -> ir.Value:
        em.memo.append({})
        for k, x in env.items():
            em.env[k] = x
        x = em.emit(e)
        em.memo.pop()
        return x

    def f32(e: E, **env) -> ir.Value:
        x = value(e, **env)
        return b.fpext(x, F32) if e.dtype == DType.FLOAT16 else x

    def copy_rows(e: E, async_: bool, here: dict, row_var: str, row0, rows: int, limit: int, col_var: str,
                  width: int, off, stride: int):
        """This thread's pieces of ``rows`` rows (from ``row0``; past ``limit`` zero) x ``width`` columns of
        operand ``e`` into shared rows of ``stride`` halves at half ``off``."""
        per_row = width // PIECE
        total = rows * per_row
        for j in range(-(-total // T)):
            p = b.add(tid, I64(j * T))

            def piece(p=p):
                r, c8 = b.udiv(p, I64(per_row)), b.mul(b.urem(p, I64(per_row)), I64(PIECE))
                row = b.add(row0, r)
                ok = b.icmp_unsigned("<", row, I64(limit))
                rowc = b.select(ok, row, I64(limit - 1))
                dst = b.add(off, b.add(b.mul(r, I64(stride)), c8))
                if async_:
                    em.memo.append({})
                    for k, x in {**here, row_var: rowc, col_var: c8}.items():
                        em.env[k] = x
                    ptr = em.address(e.attr, [em.emit(i) for i in e.args])
                    em.memo.pop()
                    b.call(cp16, [b.add(s64, b.mul(dst, I64(2))), b.ptrtoint(ptr, I64),
                                  b.select(ok, I32(16), I32(0))])
                    return
                xs = [value(e, **here, **{row_var: rowc, col_var: b.add(c8, I64(q))}) for q in range(PIECE)]
                for q, x in enumerate(xs):
                    x = b.select(ok, x, ir.Constant(F16, 0.0))
                    b.store(b.bitcast(x, I16), b.gep(sp, [b.add(dst, I64(q))], source_etype=I16, inbounds=True))
            if total % T and (j + 1) * T > total:
                with b.if_then(b.icmp_unsigned("<", p, I64(total))):
                    piece()
            else:
                piece()

    def frag(half, trans: bool):
        out = b.call(ldsm[trans], [b.add(s64, b.mul(half, I64(2)))])
        return [b.extract_value(out, q) for q in range(4)]

    def mma(a, bb, c):
        out = b.call(mma_op, list(a) + list(bb) + list(c))
        return [b.extract_value(out, q) for q in range(4)]

    def quad(v, kind):
        for off in (1, 2):
            v = em.combine(kind, v, b.call(shfl, [I32(0xFFFFFFFF), v, I32(off), I32(0x1F)]), F)
        return v

    def pack(x0, x1):
        vec = b.insert_element(ir.Constant(ir.VectorType(F16, 2), None), x0, I32(0))
        return b.bitcast(b.insert_element(vec, x1, I32(1)), I32)

    NJ, NO = BK // 8, DV // 8                   # score tiles (8 keys) and output tiles (8 columns) of a warp
    o_slots = [em.alloca(F32) for _ in range(4 * NO)]
    m_slots = [em.alloca(F32) for _ in range(2)]
    l_slots = [em.alloca(F32) for _ in range(2)]
    chunks = -(-SK // BK)
    fmaf = em.fma_fn(F) if km.fma else None
    mask_rows = spec.mask is not None and vi in {x.attr for x in _vars(spec.mask)}

    def unit(u):
        qt = b.urem(u, I64(plan.tiles))
        r2 = b.udiv(u, I64(plan.tiles))
        h = b.urem(r2, I64(H))
        bb = b.udiv(r2, I64(H))
        here = {vb: bb, vh: h}
        q0 = b.mul(qt, I64(plan.bq))

        def issue_kv(c, stage):
            k0 = b.mul(c, I64(BK))
            copy_rows(spec.k, plan.k_async, here, vkey, k0, BK, SK, vd, D, b.add(I64(K0), b.mul(stage, I64(BK * KS))), KS)
            copy_rows(spec.v, plan.v_async, here, vkey, k0, BK, SK, vc, DV, b.add(I64(V0), b.mul(stage, I64(BK * VS))), VS)
        copy_rows(spec.q, plan.q_async, here, vi, q0, plan.bq, SQ, vd, D, I64(Q0), QS)
        issue_kv(I64(0), I64(0))
        b.call(commit, [])
        b.call(wait(0), [])
        b.call(bar, [])
        wrow = b.mul(warp, I64(16))
        qf = [frag(b.add(I64(Q0), b.add(b.mul(b.add(wrow, b.add(lane8, b.mul(m2, I64(8)))), I64(QS)),
                                         b.add(I64(16 * kk), b.mul(d2, I64(8))))), False)
              for kk in range(D // 16)]
        for s_ in o_slots:
            b.store(zero, s_)
        for rr in range(2):
            b.store(neg_inf, m_slots[rr])
            b.store(zero, l_slots[rr])
        rows_i = [b.add(q0, b.add(wrow, b.add(g_, I64(8 * rr)))) for rr in range(2)]
        rows_c = [b.select(b.icmp_unsigned("<", i, I64(SQ)), i, I64(SQ - 1)) for i in rows_i]
        scale = f32(spec.scale)

        def chunk(c):
            # chunk c's copies (issued one chunk earlier) complete and visible, and every warp past chunk c - 1's
            # products, so the stage they read takes chunk c + 1's copies, which run during chunk c's products
            b.call(wait(0), [])
            b.call(bar, [])
            stage = b.and_(c, I64(1))
            nxt = b.add(c, I64(1))
            with b.if_then(b.icmp_unsigned("<", nxt, I64(chunks))):
                issue_kv(nxt, b.and_(nxt, I64(1)))
            b.call(commit, [])
            kbase = b.add(I64(K0), b.mul(stage, I64(BK * KS)))
            vbase = b.add(I64(V0), b.mul(stage, I64(BK * VS)))
            s = [[zero] * 4 for _ in range(NJ)]
            for kk in range(D // 16):
                for jp in range(NJ // 2):
                    x = frag(b.add(kbase, b.add(b.mul(b.add(I64(16 * jp), b.add(lane8, b.mul(d2, I64(8)))), I64(KS)),
                                                b.add(I64(16 * kk), b.mul(m2, I64(8))))), False)
                    s[2 * jp] = mma(qf[kk], x[:2], s[2 * jp])
                    s[2 * jp + 1] = mma(qf[kk], x[2:], s[2 * jp + 1])
            key0 = b.mul(c, I64(BK))
            masks = {}           # a mask without the row variable: one load per key, shared by rows g and g + 8
            for j in range(NJ):
                for q in range(4):
                    key = b.add(key0, b.add(I64(8 * j + (q & 1)), b.mul(t_, I64(2))))
                    inside = b.icmp_unsigned("<", key, I64(SK))
                    x = b.fmul(s[j][q], scale)
                    if spec.mask is not None:
                        at = (j, q) if mask_rows else (j, q & 1)
                        if at not in masks:
                            keyc = b.select(inside, key, I64(SK - 1))
                            masks[at] = f32(spec.mask, **here, **{vi: rows_c[q // 2], vkey: keyc})
                        x = b.fadd(x, masks[at])
                    s[j][q] = b.select(inside, x, neg_inf)
            ph = [[None] * 4 for _ in range(NJ)]
            scales = []
            for rr in range(2):
                mx = s[0][2 * rr]
                for j in range(NJ):
                    for q in (2 * rr, 2 * rr + 1):
                        if j or q != 2 * rr:
                            mx = em.combine("max", mx, s[j][q], F)
                mx = quad(mx, "max")
                m_old = b.load(m_slots[rr], typ=F32)
                m_new = em.combine("max", m_old, mx, F)
                shift = b.select(b.fcmp_ordered("==", m_new, neg_inf), zero, m_new)
                rescale = em.call("exp", [b.fsub(m_old, shift)], F)
                total = None
                for j in range(NJ):
                    for q in (2 * rr, 2 * rr + 1):
                        p = b.fptrunc(em.call("exp", [b.fsub(s[j][q], shift)], F), F16)
                        ph[j][q] = p
                        pw = b.fpext(p, F32)
                        total = pw if total is None else b.fadd(total, pw)
                total = quad(total, "sum")
                lv = b.load(l_slots[rr], typ=F32)
                b.store(b.call(fmaf, [lv, rescale, total]) if fmaf is not None else b.fadd(b.fmul(lv, rescale), total),
                        l_slots[rr])
                b.store(m_new, m_slots[rr])
                scales.append(rescale)
            acc = [[b.fmul(b.load(o_slots[4 * n + q], typ=F32), scales[q // 2]) for q in range(4)] for n in range(NO)]
            for kk in range(BK // 16):
                a = [pack(ph[2 * kk][0], ph[2 * kk][1]), pack(ph[2 * kk][2], ph[2 * kk][3]),
                     pack(ph[2 * kk + 1][0], ph[2 * kk + 1][1]), pack(ph[2 * kk + 1][2], ph[2 * kk + 1][3])]
                for np_ in range(NO // 2):
                    x = frag(b.add(vbase, b.add(b.mul(b.add(I64(16 * kk), b.add(lane8, b.mul(m2, I64(8)))), I64(VS)),
                                                b.add(I64(16 * np_), b.mul(d2, I64(8))))), True)
                    acc[2 * np_] = mma(a, x[:2], acc[2 * np_])
                    acc[2 * np_ + 1] = mma(a, x[2:], acc[2 * np_ + 1])
            for n in range(NO):
                for q in range(4):
                    b.store(acc[n][q], o_slots[4 * n + q])
        em.loop_range(I64(0), I64(chunks), chunk)
        for rr in range(2):
            i = rows_i[rr]
            total = b.load(l_slots[rr], typ=F32)
            zz = [zero] * (2 * NO)
            if spec.zero_nan:        # rows whose l is NaN or 0 (masked whole): sum_j 0 * V[j, c], keys in order
                zslots = [em.alloca(F32) for _ in range(2 * NO)]
                for zs in zslots:
                    b.store(zero, zs)
                bad = b.or_(b.fcmp_unordered("uno", total, total), b.fcmp_ordered("==", total, zero))
                with b.if_then(b.and_(bad, b.icmp_unsigned("<", i, I64(SQ)))):
                    def zkey(key):
                        for n in range(NO):
                            for e_ in range(2):
                                col = b.add(I64(8 * n + e_), b.mul(t_, I64(2)))
                                v = f32(spec.v, **here, **{vkey: key, vc: col})
                                zs = zslots[2 * n + e_]
                                b.store(b.fadd(b.load(zs, typ=F32), b.fmul(zero, v)), zs)
                    em.loop_range(I64(0), I64(SK), zkey)
                zz = [b.load(zs, typ=F32) for zs in zslots]
            with b.if_then(b.icmp_unsigned("<", i, I64(SQ))):
                for n in range(NO):
                    for e_ in range(2):
                        col = b.add(I64(8 * n + e_), b.mul(t_, I64(2)))
                        store_output(em, spec, st, b.load(o_slots[4 * n + 2 * rr + e_], typ=F32), total,
                                     zz[2 * n + e_], [bb, h, i, col])
        b.call(bar, [])              # the Q tile and the stages free for the block's next unit
    em.loop_range(km.sreg(b, "ctaid.x"), I64(plan.units), unit, km.sreg(b, "nctaid.x"))
    b.ret_void()
    set_contraction(fn, False)
    km.kernels.append(sym)
    return plan.units, T


def _vars(e: E):
    return [x for x in nodes(e) if x.op == "var"]
