"""Strict float32 MatMul / Gemm kernels for the GPU: register-tiled SIMT (no tensor cores), every product and
sum an IEEE float32 operation.

Which stages: the matrix products of :func:`~cuvil.targets.ptx.matmul_mma.matmul_parts` (batched MatMul with
either operand transposed, Gemm; the fused bias / GELU / residual epilogue kept) that the tensor-core kernel
does not take, i.e. strict float32 (no ``allow_tf32``, no fp16/bf16 precision), on any architecture.

Numerics (the float32 path's contract, as for the element and lane-split kernels): each term is one
``fma.rn.f32`` when the reduction is an ``fma`` one (contraction allowed, the default), else a ``mul.rn.f32``
then an ``add.rn.f32`` (no contraction: LLVM's ``contract`` flag is stripped); no flush-to-zero, no reduced
precision. The order of the sum is fixed by the plan and the same on every run (deterministic): each K group
(below) sums its terms in increasing ``k``; with one group (``ks == 1``) that is exactly the sequential order
of the one-thread-per-element kernel, bit for bit; with ``ks`` groups the sum is split into ``ks`` partial
sums over interleaved 16-term chunks, added in group order (a reassociation, as the lane-split kernels do).

The kernel: a group of T = (BM / TM) x (BN / TN) threads computes a BM x BN output tile, each thread a TM x
TN register tile (4 x 4, or 8 x 4 for 128 x 64 tiles), walking K in chunks of :data:`TK` = 16 terms. Per
chunk the group loads the TK x BM slice of ``A`` and the TK x BN slice of ``B`` into shared memory, both
stored ``k``-major (``sa[k][m]``, ``sb[k][n]``; rows padded by :data:`PAD` floats so the 16-byte alignment
holds and transposed stores conflict at most 2-way) through the thread-to-element mapping that follows the
operand's contiguous index (coalesced global loads for row-major and transposed operands alike; each
element is evaluated through the stage's own expression at clamped in-range indices, terms past K select
zero; :meth:`~cuvil.targets.ptx.bounds_patterns.GpuPatterns.simt_accesses` states this chunk walk to the
bounds prover, as it does the tensor-core kernel's); then every thread reads its TM values of ``A`` and TN
of ``B`` per term with 16-byte shared loads (``ld.shared.v4.f32``) and does TM x TN fmas. The next chunk's
global loads are issued into registers before this chunk's fmas (register double buffering, no branch around
them). Split-K: a block holds ``ks`` groups, group g taking chunks g, g + ks, ...
(:func:`~cuvil.targets.ptx.matmul_mma.chunk_of`); at the end groups 1..ks-1 leave their sums in shared memory
and group 0 adds them in group order and runs the epilogue.

Which tile and ``ks`` (:func:`plan_simt`): a small cost model over the candidates, :func:`cost`: waves of
blocks over the H200's 132 SMs (resident blocks per SM from threads, shared memory and an estimated
register count) times the rounds of chunks, each round the larger of its fma issue time and a global-load
latency floor, plus the group reduction. BERT's 128-row products (few tiles, K up to 3072) get small tiles
and several K groups; large products 64 x 64 or 128 x 64 tiles.
"""
from __future__ import annotations

from typing import List, Tuple

import attrs
import llvmlite.ir as ir

from ...kernels.schedule import Stage
from ..llvm.types import F32, I32, I64
from .emitter import PtxEmitter, set_contraction
from .matmul_mma import _stride, _V
from .tile_walk import bind_tile, fetch_chunk, load_slot_indices
from .tile_walk import divmod_c as tile_divmod

TK = 16            # reduction terms per chunk
PAD = 4            # floats of padding per shared row (keeps 16-byte alignment of sa[k][4i])
SMS = 132          # streaming multiprocessors of an H200
SMEM_LIMIT = 48 * 1024        # static shared memory per block
SM_SMEM = 227 * 1024          # shared memory per SM
SM_THREADS = 2048
SM_REGS = 65536
FMA_PER_CLK = 128             # float32 fma lanes per SM
LATENCY_CLK = 700             # a chunk's global-load latency and two barriers (the floor of one round)
# (BM, BN, TM, TN): block tile and per-thread register tile
TILES = ((128, 64, 8, 4), (64, 64, 4, 4), (64, 32, 4, 4), (32, 64, 4, 4), (32, 32, 4, 4), (16, 64, 4, 4),
         (32, 16, 4, 4), (16, 32, 4, 4))
KS_CHOICES = (1, 2, 4, 8)


@attrs.define
class SimtPlan:
    bm: int
    bn: int
    tm: int
    tn: int
    batch: Tuple[int, ...]
    m: int
    n: int
    k: int
    a_kfast: bool     # A's load mapping: k varies fastest (A contiguous along k), else m does
    b_kfast: bool     # B's: k fastest (B transposed, contiguous along k), else n
    ks: int = 1       # K groups per block
    tk: int = TK      # reduction terms per chunk

    @property
    def group_threads(self) -> int:
        return (self.bm // self.tm) * (self.bn // self.tn)

    @property
    def threads(self) -> int:
        return self.group_threads * self.ks

    @property
    def chunks(self) -> int:
        return -(-self.k // self.tk)

    @property
    def rounds(self) -> int:
        return -(-self.chunks // self.ks)

    @property
    def tiles_m(self) -> int:
        return -(-self.m // self.bm)

    @property
    def tiles_n(self) -> int:
        return -(-self.n // self.bn)

    @property
    def batches(self) -> int:
        r = 1
        for d in self.batch:
            r *= d
        return r

    @property
    def blocks(self) -> int:
        return self.batches * self.tiles_m * self.tiles_n

    @property
    def sa_stride(self) -> int:
        return self.bm + PAD

    @property
    def sb_stride(self) -> int:
        return self.bn + PAD

    def tile_floats(self) -> int:
        """Shared floats of one group's A and B chunk tiles."""
        return self.tk * (self.sa_stride + self.sb_stride)

    def smem_floats(self) -> int:
        """Static shared memory (floats): the groups' tiles, or the partial sums of groups 1..ks-1 (which
        reuse it after the last chunk) when those are more."""
        return max(self.ks * self.tile_floats(), (self.ks - 1) * self.bm * self.bn)

    def regs(self) -> int:
        """Registers per thread to plan with (and the ``maxnreg`` given to ptxas): it used 80-128 for the 4 x 4
        tiles (sm_90; it hoists a chunk's shared loads ahead of the fmas) and spilled when a block of 1024
        threads capped it at 64; the 8 x 4 tile spilled a little at 128."""
        return 168 if self.tm * self.tn >= 32 else 128

    def load_slots(self, which: str):
        """(slots per thread, rows, kfast) of the A (``rows = BM``) or B (``BN``) chunk tile: for slot j the
        element ``e = tid + j * T`` is (row, k) = divmod(e, tk) when k varies fastest, else (e % rows, e // rows)."""
        rows = self.bm if which == "a" else self.bn
        return rows * self.tk // self.group_threads, rows, self.a_kfast if which == "a" else self.b_kfast


def fits(plan: SimtPlan) -> bool:
    """Launchable: within static shared memory, every group with a first chunk, and the registers (ptxas holds
    a block of ``threads`` to 64K / threads each) not below :meth:`SimtPlan.regs` (so at most 512 threads)."""
    return (plan.threads <= 1024 and 4 * plan.smem_floats() <= SMEM_LIMIT
            and (plan.ks == 1 or plan.chunks >= 2 * plan.ks)
            and plan.regs() <= SM_REGS // plan.threads)


def cost(plan: SimtPlan) -> float:
    """Estimated clocks of the kernel (see the module docstring); only the ranking is used."""
    per_sm = min(SM_THREADS // plan.threads, SM_SMEM // max(4 * plan.smem_floats(), 1), 32,
                 SM_REGS // (plan.threads * plan.regs()))
    per_sm = max(per_sm, 1)
    waves = -(-plan.blocks // (SMS * per_sm))
    resident = min(per_sm, -(-plan.blocks // SMS))
    # shared-memory reads per fma: (TM + TN) / (TM * TN) words; 4 x 4 tiles issue more of them
    eff = 1.0 if plan.tm * plan.tn >= 32 else 0.8
    chunk = max(resident * plan.threads * plan.tm * plan.tn * plan.tk / (FMA_PER_CLK * eff), LATENCY_CLK)
    reduce = (plan.ks - 1) * plan.bm * plan.bn / max(plan.group_threads, 1) * 8 if plan.ks > 1 else 0
    return waves * (plan.rounds * chunk + reduce)


def plan_simt(st: Stage, parts, force: tuple = (), tk: int = TK) -> SimtPlan:
    """The cheapest launchable (tile, ks) by :func:`cost` (ties: fewer K groups, then the larger tile);
    ``force`` = (BM, BN, ks): that one where it is launchable (an A/B of the model)."""
    red, a, b, _swapped = parts
    shape = [int(d) for d in st.buf.shape]
    m, n, k = shape[-2], shape[-1], int(red.attr[2][0])
    kv = red.attr[1][0].attr
    mv, nv = st.vars[-2].attr, st.vars[-1].attr
    a_kfast = _stride(a, kv) == 1 or _stride(a, mv) != 1
    b_kfast = _stride(b, kv) == 1 and _stride(b, nv) != 1
    best = None
    for i, (bm, bn, tm, tn) in enumerate(TILES):
        for ks in KS_CHOICES:
            p = SimtPlan(bm, bn, tm, tn, tuple(shape[:-2]), m, n, k, a_kfast, b_kfast, ks, tk)
            if not fits(p):
                continue
            key = (cost(p), ks, i)
            if force and (bm, bn, ks) == tuple(force):
                return p
            if best is None or key < best[0]:
                best = (key, p)
    return best[1]


def simt_applies(plan: SimtPlan) -> bool:
    """Products big enough for the tile kernel (a vector product, or a sum shorter than a chunk, is better
    served by the lane-split and element kernels)."""
    return plan.m >= 16 and plan.n >= 16 and plan.k >= plan.tk


# --- emission ---------------------------------------------------------------------------------------------

def emit_simt(km, st: Stage, sym: str, parts, plan: SimtPlan) -> int:
    """Emit the kernel ``sym`` of a float32 matmul stage; returns the launch size in threads."""
    red, afac, bfac, _ = parts
    fn = km.kernel_fn(sym)
    km.module.add_named_metadata("nvvm.annotations", [fn, "maxntidx", I32(plan.threads)])
    # ptxas' own choice for 256 threads was sometimes 80 registers and spills: give it what the plan assumed
    km.module.add_named_metadata("nvvm.annotations", [fn, "maxnreg", I32(min(plan.regs(), SM_REGS // plan.threads))])
    bufs, _n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = PtxEmitter(km, fn, b, bufs, st.buf)
    BN, TM, TN, M, N, K, KS = plan.bn, plan.tm, plan.tn, plan.m, plan.n, plan.k, plan.ks
    TK = plan.tk
    T = plan.group_threads
    SA, SB = plan.sa_stride, plan.sb_stride
    kv = red.attr[1][0].attr
    mv, nv = st.vars[-2].attr, st.vars[-1].attr
    bvars = [v.attr for v in st.vars[:-2]]
    fma_kind = red.attr[0] == "fma"
    fmaf = em.fma_fn(red.dtype) if fma_kind else None

    sbase = em.shared_array(f"{sym}_t", F32, plan.smem_floats())
    V4 = ir.VectorType(F32, 4)
    bar = km.declare("llvm.nvvm.barrier0", ir.VoidType(), [])

    def sptr(idx):
        return b.gep(sbase, [idx.v if isinstance(idx, _V) else idx], source_etype=F32, inbounds=True)

    def load4(idx):
        p = b.bitcast(sptr(idx), ir.PointerType(V4, addrspace=3))
        v = b.load(p, typ=V4, align=16)
        return [b.extract_element(v, I32(i)) for i in range(4)]

    def divmod_c(x, d: int):
        return tile_divmod(b, x, d)

    tid_all = b.trunc(km.sreg(b, "tid.x"), I32)
    if KS > 1:
        grp, tid = divmod_c(tid_all, T)
    else:
        grp, tid = I32(0), tid_all
    a_base = _V(b, b.mul(grp, I32(plan.tile_floats())))
    b_base = a_base + TK * SA
    ty, tx = divmod_c(tid, BN // TN)
    row_t = b.mul(ty, I32(TM))         # the thread's first row and column in the tile
    col_t = b.mul(tx, I32(TN))
    accs = [em.alloca(F32) for _ in range(TM * TN)]
    a_n, a_rows, a_kfast = plan.load_slots("a")
    b_n, b_rows, b_kfast = plan.load_slots("b")
    aregs = [em.alloca(F32) for _ in range(a_n)]
    bregs = [em.alloca(F32) for _ in range(b_n)]

    a_slots = load_slot_indices(b, tid, T, TK, a_n, a_rows, a_kfast)
    b_slots = load_slot_indices(b, tid, T, TK, b_n, b_rows, b_kfast)

    def tile_body(bid64):
        m0, n0 = bind_tile(b, em, bid64, plan, bvars)
        for a_ in accs:
            b.store(ir.Constant(F32, 0.0), a_)

        def fetch(k0):
            """This thread's elements of the chunk at k0 into registers (clamped rows, zero past K)."""
            fetch_chunk(b, em, k0, ((aregs, a_slots, afac, m0, M, mv), (bregs, b_slots, bfac, n0, N, nv)),
                        kv, K, TK, em.emit, ir.Constant(F32, 0.0))

        def rnd(r64):
            c = b.add(b.mul(b.trunc(r64, I32), I32(KS)), grp)        # chunk_of(round, grp, KS)
            active = b.icmp_unsigned("<", c, I32(plan.chunks)) if plan.chunks % KS else None

            def stage():
                for regs, slots, base, stride in ((aregs, a_slots, a_base, SA), (bregs, b_slots, b_base, SB)):
                    for reg, (r, kk) in zip(regs, slots):
                        b.store(b.load(reg, typ=F32), sptr(base + _V(b, b.add(b.mul(kk, I32(stride)), r))))
            if active is None:
                stage()
            else:
                with b.if_then(active):
                    stage()
            b.call(bar, [])
            # the next chunk's loads fly meanwhile; unconditional (past the last chunk it loads the last one
            # again, unused), so no copy at the end of a branch can wait for them before this chunk's fmas
            # (on the H200 it timed within +-10% of the branched form: bench/gpu/RESULTS.md, 2026-12-03)
            nxt = b.add(c, I32(KS))
            last = I32(plan.chunks - 1)
            fetch(b.mul(b.select(b.icmp_unsigned("<", nxt, last), nxt, last), I32(TK)))

            def fmas():
                acc = [b.load(a_, typ=F32) for a_ in accs]
                for kk in range(TK):
                    av = []
                    for i in range(TM // 4):
                        av += load4(a_base + _V(b, b.add(row_t, I32(kk * SA + 4 * i))))
                    bv = []
                    for j in range(TN // 4):
                        bv += load4(b_base + _V(b, b.add(col_t, I32(kk * SB + 4 * j))))
                    for i in range(TM):
                        for j in range(TN):
                            q = i * TN + j
                            if fma_kind:
                                acc[q] = b.call(fmaf, [av[i], bv[j], acc[q]])
                            else:
                                acc[q] = b.fadd(acc[q], b.fmul(av[i], bv[j]))
                for a_, v in zip(accs, acc):
                    b.store(v, a_)
            if active is None:
                fmas()
            else:
                with b.if_then(active):
                    fmas()
            b.call(bar, [])
        fetch(b.mul(grp, I32(TK)))         # plan_simt keeps KS <= chunks / 2: every group has a first chunk
        em.loop_range(I64(0), I64(plan.rounds), rnd)
        if KS > 1:
            # groups 1..KS-1 leave their sums in shared memory (over the tiles, no longer read); group 0 adds
            # them in group order (deterministic) and runs the epilogue
            nacc = len(accs)

            def red_slot(gv, i):
                return sptr(b.add(b.mul(gv, I32(nacc * T)), b.add(I32(i * T), tid)))
            with b.if_then(b.icmp_unsigned("!=", grp, I32(0))):
                for i, a_ in enumerate(accs):
                    b.store(b.load(a_, typ=F32), red_slot(b.sub(grp, I32(1)), i))
            b.call(bar, [])
            with b.if_then(b.icmp_unsigned("==", grp, I32(0))):
                for gi in range(1, KS):
                    for i, a_ in enumerate(accs):
                        b.store(b.fadd(b.load(a_, typ=F32), b.load(red_slot(I32(gi - 1), i), typ=F32)), a_)
            lead = b.icmp_unsigned("==", grp, I32(0))
        else:
            lead = None

        def epilogue():
            r0 = b.add(m0, row_t)
            c0 = b.add(n0, col_t)
            for i in range(TM):
                m = b.add(r0, I32(i))
                for j in range(TN):
                    n = b.add(c0, I32(j))
                    ok = b.and_(b.icmp_unsigned("<", m, I32(M)), b.icmp_unsigned("<", n, I32(N)))
                    with b.if_then(ok):
                        idx = [em.env[v] for v in bvars] + [b.zext(m, I64), b.zext(n, I64)]
                        em.memo.append(dict(em.memo[-1]))
                        em.memo[-1][red.uid] = b.load(accs[i * TN + j], typ=F32)
                        em.store_element(st, idx)
                        em.memo.pop()
        if lead is None:
            epilogue()
        else:
            with b.if_then(lead):
                epilogue()
        if KS > 1:
            b.call(bar, [])        # the next tile's stores may not overwrite sums group 0 still reads
    em.loop_range(km.sreg(b, "ctaid.x"), I64(plan.blocks), tile_body, km.sreg(b, "nctaid.x"))
    b.ret_void()
    set_contraction(fn, False)
    km.kernels.append(sym)
    return plan.blocks * plan.threads


def describe(plan: SimtPlan) -> List[str]:
    """One line per plan for reports."""
    return [f"{plan.batch}x{plan.m}x{plan.n}x{plan.k}: tile {plan.bm}x{plan.bn} ({plan.tm}x{plan.tn}/thread), "
            f"ks {plan.ks}, {plan.blocks} blocks of {plan.threads}"]
