"""int8 GEMM micro-kernels for quantized convolutions (``E("qgemm")``, :mod:`cuvil.kernels.contraction_int8`)
with AVX512-VNNI's ``vpdpbusd``: per instruction, 16 int32 lanes each add four u8 x s8 products.

A unit of the parallel range is one weight panel (``MR`` channels) over one B panel (``NR = 16 * NV``
positions of one image), panels of weights fastest, so consecutive units of a thread reuse the B panel while
it sits in L1/L2. The k-loop runs over groups of four k's: per group it loads ``NV`` vectors of the B panel
(16 positions x 4 unsigned bytes each), broadcasts each channel's four weight bytes (one 32-bit load) and
issues ``MR * NV`` ``vpdpbusd`` into int32 accumulators held in registers (8 x 3 = 24 of AVX-512's 32). The
epilogue requantises in registers, as the reference lowering does (the same float32 operations in the same
order: ``float(acc + comp) * mult``, round half to even, ``+ y_zero_point``, clamp, convert), and stores 16
bytes per vector into the output row of the channel (masked past the last position).

Dispatch: the kernels need ``avx512vnni`` (and AVX-512 BW for the byte stores) in the target CPU's features
(the host's, or ``--cpu``'s); without them the stage computes the node's plain value, the reference form
(each step's ``kernel`` in the manifest says which: ``int8_vnni512`` or ``loop``). A library built with
them is refused by the loader on a CPU that lacks them (cuvil.targets.x86.cpu.check_runs_here), like every
other feature it was built for.
"""
from __future__ import annotations

from typing import Optional, Tuple

import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.contraction_int8 import LANES_I8, Int8Contraction, Int8Pack
from ...kernels.schedule import Stage
from ..llvm.types import F32, I32, I64, PTR
from .gemm import find_contraction

#: The CPU features the int8 micro-kernels need (LLVM spellings).
VNNI512_FEATURES = ("avx512vnni", "avx512bw", "avx512f")
KIND = "int8_vnni512"
PACK_KIND = "int8_pack"
I8 = ir.IntType(8)


def has_vnni512(features) -> bool:
    return all(f in features for f in VNNI512_FEATURES)


def emit_qgemm_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """Emit a qgemm stage as VNNI micro-kernels; (parallel extent, grain), or None (the generic loop nest)."""
    if st.expr.op != "qgemm" or not isinstance(st.expr.attr, Int8Contraction) or st.region is not None:
        return None
    if find_contraction(st, "qgemm") is not st.expr or not has_vnni512(getattr(km, "cpu_features", ())):
        return None
    spec: Int8Contraction = st.expr.attr
    vw = LANES_I8
    nv = spec.nr // vw
    MR, KG, NR, M, P = spec.mr, spec.kg, spec.nr, spec.m, spec.p
    MB, PB = spec.m_blocks, spec.p_blocks
    vi32 = ir.VectorType(I32, vw)
    vf32 = ir.VectorType(F32, vw)
    dpbusd = km.declare("llvm.x86.avx512.vpdpbusd.512", vi32, [vi32, vi32, vi32])
    roundeven = km.declare("llvm.roundeven.v16f32", vf32, [vf32])
    # vpmovdb with a memory operand and a mask: narrows 16 int32 lanes to bytes and stores the masked ones.
    # (trunc + llvm.masked.store.v16i8 is miscompiled by LLVM 22 when the mask folds to one lane: a 4-byte
    # vmovd store, which clobbers the next three bytes, another thread's channels)
    pmovdb = km.declare("llvm.x86.avx512.mask.pmov.db.mem.512", ir.VoidType(), [PTR, vi32, ir.IntType(16)])

    em, begin, end = km.kernel(sym)
    b = em.b

    def byte_ptr(buf, off):
        base = b.gep(em.base(buf), [I64(buf.offset)], source_etype=I8, inbounds=True)
        return b.gep(base, [off], source_etype=I8, inbounds=True)

    def splat(x, vt):
        v0 = b.insert_element(ir.Constant(vt, ir.Undefined), x, I32(0))
        return b.shuffle_vector(v0, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(I32, vw), [0] * vw))

    zero = ir.Constant(vi32, [0] * vw)
    lanes = ir.Constant(vi32, list(range(vw)))
    lo, hi = spec.out_dtype.int_range
    f_lo, f_hi = ir.Constant(vf32, [float(lo)] * vw), ir.Constant(vf32, [float(hi)] * vw)
    f_zp = ir.Constant(vf32, [float(spec.y_zero_point)] * vw)

    def unit(u):
        n = b.sdiv(u, I64(PB * MB))
        rest = b.srem(u, I64(PB * MB))
        pb, mb = b.sdiv(rest, I64(MB)), b.srem(rest, I64(MB))
        b_panel = byte_ptr(spec.b, b.mul(b.add(b.mul(n, I64(PB)), pb), I64(KG * NR * 4)))
        w_panel = byte_ptr(spec.w, b.mul(mb, I64(KG * MR * 4)))
        # the k-loop over groups of four, MR x nv accumulators as phis
        pre = b.block
        head, done = em.fn.append_basic_block("kg"), em.fn.append_basic_block("kg_done")
        b.branch(head)
        b.position_at_end(head)
        kg = b.phi(I64)
        kg.add_incoming(I64(0), pre)
        accs = []
        for _ in range(MR * nv):
            ph = b.phi(vi32)
            ph.add_incoming(zero, pre)
            accs.append(ph)
        brow = b.gep(b_panel, [b.mul(kg, I64(NR * 4))], source_etype=I8, inbounds=True)
        bv = [b.load(b.gep(brow, [I64(v * vw * 4)], source_etype=I8, inbounds=True), typ=vi32, align=1)
              for v in range(nv)]
        wrow = b.gep(w_panel, [b.mul(kg, I64(MR * 4))], source_etype=I8, inbounds=True)
        new = []
        for r in range(MR):
            wv = splat(b.load(b.gep(wrow, [I64(r * 4)], source_etype=I8, inbounds=True), typ=I32, align=1), vi32)
            for v in range(nv):
                new.append(b.call(dpbusd, [accs[r * nv + v], bv[v], wv]))
        kn = b.add(kg, I64(1))
        kg.add_incoming(kn, b.block)
        for ph, x in zip(accs, new):
            ph.add_incoming(x, b.block)
        b.cbranch(b.icmp_signed("<", kn, I64(KG)), head, done)
        b.position_at_end(done)

        # epilogue: requantise each channel row, store its positions
        m0 = b.mul(mb, I64(MR))
        p_base = b.mul(pb, I64(NR))
        out_base = b.gep(em.base(st.buf), [I64(st.buf.offset)], source_etype=I8, inbounds=True)
        comp_base = b.gep(em.base(spec.comp), [I64(spec.comp.offset)], source_etype=I8, inbounds=True)
        mult_base = b.gep(em.base(spec.mult), [I64(spec.mult.offset)], source_etype=I8, inbounds=True)
        for r in range(MR):
            m = b.add(m0, I64(r))
            with b.if_then(b.icmp_signed("<", m, I64(M))):
                comp = splat(b.load(b.gep(comp_base, [m], source_etype=I32, inbounds=True), typ=I32, align=4), vi32)
                mult = splat(b.load(b.gep(mult_base, [m], source_etype=F32, inbounds=True), typ=F32, align=4), vf32)
                row = b.gep(out_base, [b.mul(b.add(b.mul(n, I64(M)), m), I64(P))], source_etype=I8, inbounds=True)
                for v in range(nv):
                    p0 = b.add(p_base, I64(v * vw))
                    with b.if_then(b.icmp_signed("<", p0, I64(P))):
                        x = b.sitofp(b.add(new[r * nv + v], comp), vf32)
                        x = b.call(roundeven, [b.fmul(x, mult)])
                        x = b.call(roundeven, [b.fadd(x, f_zp)])
                        x = b.select(b.fcmp_ordered(">", x, f_lo), x, f_lo)
                        x = b.select(b.fcmp_ordered("<", x, f_hi), x, f_hi)
                        y = b.fptosi(x, vi32)
                        left = b.trunc(b.sub(I64(P), p0), I32)
                        mask = b.bitcast(b.icmp_signed("<", lanes, splat(left, vi32)), ir.IntType(16))
                        b.call(pmovdb, [b.gep(row, [p0], source_etype=I8, inbounds=True), y, mask])

    em.loop_range(begin, end, unit)
    b.ret_void()
    km.window_kinds[sym] = KIND
    return spec.n * PB * MB, 1


def emit_qpack_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """Emit the im2col panels of an int8 convolution (``E("qpack")``): a unit is one panel (image, ``nr``
    positions); the positions' offsets in an input plane are computed once per unit, then per group of four
    k's each position's four bytes are read from the four (channel, tap) rows and stored as one 32-bit word.
    Only where the VNNI kernels run (the panels' one reader); else the generic loop nest."""
    if st.expr.op != "qpack" or not isinstance(st.expr.attr, Int8Pack) or st.region is not None:
        return None
    if find_contraction(st, "qpack") is not st.expr or not has_vnni512(getattr(km, "cpu_features", ())):
        return None
    spec: Int8Pack = st.expr.attr
    N, C, Hp, Wp = spec.x.shape
    OH, OW = spec.out_spatial
    KH, KW = spec.kernel
    (sh, sw), (dh, dw) = spec.strides, spec.dilations
    NR, KG, K, P, PB = spec.nr, spec.kg, spec.k, spec.p, spec.p_blocks
    em, begin, end = km.kernel(sym)
    b = em.b
    pos = em.alloca(I64, NR)
    x0 = b.gep(em.base(spec.x), [I64(spec.x.offset)], source_etype=I8, inbounds=True)
    out0 = b.gep(em.base(st.buf), [I64(st.buf.offset)], source_etype=I8, inbounds=True)
    flip = I32(0x80808080 - (1 << 32)) if spec.shift else None
    dense = (KH, KW, sh, sw) == (1, 1, 1, 1) and (Hp, Wp) == (OH, OW)

    def unit(u):
        n, pb = b.sdiv(u, I64(PB)), b.srem(u, I64(PB))
        xn = b.gep(x0, [b.mul(n, I64(C * Hp * Wp))], source_etype=I8, inbounds=True)

        def position(j):
            p = b.add(b.mul(pb, I64(NR)), j)
            p = b.select(b.icmp_signed("<", p, I64(P)), p, I64(P - 1))
            oh, ow = b.sdiv(p, I64(OW)), b.srem(p, I64(OW))
            b.store(b.add(b.mul(oh, I64(sh * Wp)), b.mul(ow, I64(sw))),
                    b.gep(pos, [j], source_etype=I64, inbounds=True))
        em.loop_range(I64(0), I64(NR), position)

        def group(kg):
            rows = []
            for i in range(4):
                k = b.add(b.mul(kg, I64(4)), I64(i))
                k = b.select(b.icmp_signed("<", k, I64(K)), k, I64(K - 1))
                c, r = b.sdiv(k, I64(KH * KW)), b.srem(k, I64(KH * KW))
                kh, kw = b.sdiv(r, I64(KW)), b.srem(r, I64(KW))
                off = b.add(b.add(b.mul(c, I64(Hp * Wp)), b.mul(kh, I64(dh * Wp))), b.mul(kw, I64(dw)))
                rows.append(b.gep(xn, [off], source_etype=I8, inbounds=True))
            dst = b.gep(out0, [b.mul(b.add(b.mul(u, I64(KG)), kg), I64(NR * 4))], source_etype=I8, inbounds=True)

            def copy(offset):
                def body(j):
                    off = offset(j)
                    word = None
                    for i, row in enumerate(rows):
                        v = b.zext(b.load(b.gep(row, [off], source_etype=I8, inbounds=True), typ=I8), I32)
                        v = b.shl(v, I32(8 * i)) if i else v
                        word = v if word is None else b.or_(word, v)
                    if flip is not None:
                        word = b.xor(word, flip)
                    b.store(word, b.gep(dst, [b.mul(j, I64(4))], source_etype=I8, inbounds=True), align=1)
                em.loop_range(I64(0), I64(NR), body)

            def table(j):
                return b.load(b.gep(pos, [j], source_etype=I64, inbounds=True), typ=I64)
            if dense:   # a whole panel of a 1x1 stride-1 map: consecutive bytes of each row (vectorised)
                p0 = b.mul(pb, I64(NR))
                with b.if_else(b.icmp_signed("<=", b.add(p0, I64(NR)), I64(P))) as (whole, part):
                    with whole:
                        copy(lambda j: b.add(p0, j))
                    with part:
                        copy(table)
            else:
                copy(table)
        em.loop_range(I64(0), I64(KG), group)

    em.loop_range(begin, end, unit)
    b.ret_void()
    km.window_kinds[sym] = PACK_KIND
    return N * PB, 1
