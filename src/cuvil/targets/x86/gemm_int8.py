"""int8 micro-kernels for quantized convolutions (``E("qgemm")`` over phase planes, ``E("qplanes")``:
:mod:`cuvil.kernels.contraction_int8`): AMX-INT8 tiles where the CPU has them, else AVX512-VNNI.

* **AMX** (``tdpbsud``: a signed-byte tile times an unsigned-byte tile into int32): a unit is one block of
  32 output channels over 32 wide positions of one image, four 16 x 16 int32 accumulator tiles. Per tap and
  block of ``gb`` channel groups it loads two weight tiles (16 channels x ``gb * 4`` bytes, packed at compile
  time) and two position tiles straight from the phase planes (``gb`` rows, one per group, ``F * PL * 4``
  bytes apart; 16 positions x 4 channel bytes each) and issues four ``tdpbsud``. The tiles are stored to the
  stack and requantised row by row. LLVM configures the tiles (cuvil.targets.x86.amx).
* **VNNI** (``vpdpbusd``: 16 int32 lanes each add four u8 x s8 products): a unit is 8 channels over ``16 * NV``
  wide positions; per tap and channel group it loads ``NV`` vectors of the planes (16 positions x 4 bytes),
  broadcasts each channel's four weight bytes and issues ``8 * NV`` ``vpdpbusd`` into registers.

Units take weight blocks fastest, so consecutive units of a thread reuse the positions while they sit in
L1/L2. The epilogue requantises in registers as the reference lowering does (the same float32 operations in
the same order: ``float(acc + comp) * mult``, round half to even, ``+ y_zero_point``, clamp, convert); the
wide positions of a dropped column (``ow >= OW``) are squeezed out (``vpcompressd``) and the rest stored as
bytes to the output row of the channel (``vpmovdb``, masked).

The phase planes themselves (:func:`emit_planes_stage`) are an interleave of four channel rows (per 16
positions: four masked row loads, strided lanes picked for a strided convolution, one 64-byte store); no
im2col.

Dispatch from the target CPU's features (the host's, or ``--cpu``'s): AMX-INT8 (with AMX-TILE and AVX512-VNNI
for the epilogue; the lowering is told through the target's narrow formats, ``AMX_INT8_TILES``, which
``X86Tuning(amx=False)`` leaves out) for convolutions whose tile K is at least 16 bytes (four groups: a stem of
three channels stays on VNNI), AVX512-VNNI (and AVX-512 BW for the byte stores) else; without them the stages compute the
node's plain value, the reference form. Each step's ``kernel`` in the manifest says which (``int8_amx``,
``int8_vnni512``, ``int8_planes`` or ``loop``) and its ``path`` (``amx_int8``, ``avx512_vnni``). A library
built with them is refused by the loader on a CPU that lacks them (cuvil.targets.x86.cpu.check_runs_here);
its C side checks them too at session creation (CUVIL_ERR_UNSUPPORTED, never SIGILL), and asks Linux for the
tile state where AMX runs (:func:`int8_isa_checks`).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import llvmlite.ir as ir

from ...kernels.contraction_int8 import LANES_I8, Int8Contraction, Int8Planes, p_blocks, panel_positions
from ...kernels.schedule import Stage
from ..llvm.types import F32, I32, I64, PTR
from .amx import AMX_INT8, AMX_TILE, X86_AMX, Tiles, I16
from .gemm import find_contraction
from .phase_planes import emit_phase_planes

#: The CPU features the VNNI micro-kernels need (LLVM spellings).
VNNI512_FEATURES = ("avx512vnni", "avx512bw", "avx512f")
KIND = "int8_vnni512"
AMX_KIND = "int8_amx"
PLANES_KIND = "int8_planes"
#: the manifest's ``path`` of each kind (km.narrow_paths)
VNNI_PATH = "avx512_vnni"
AMX_PATH = "amx_int8"
I8 = ir.IntType(8)
VNNI_MR = 8          # channels per VNNI unit (8 x NV accumulators)
AMX_NR = 32          # wide positions per AMX unit (two B tiles)
MIN_AMX_GB = 4       # an AMX tile's K below 16 bytes wastes most of tdpbsud: VNNI instead


def has_vnni512(features) -> bool:
    return all(f in features for f in VNNI512_FEATURES)


def has_amx_int8(features) -> bool:
    return AMX_TILE in features and AMX_INT8 in features and has_vnni512(features)


def int8_isa_checks(*targets) -> list:
    """The features the library's C code checks at session creation for its int8 kernels (one of the code
    generator's results each, None skipped): AVX512-VNNI where a kernel runs it, AMX-TILE and AMX-INT8 (and the
    Linux tile permission, model_c.py) where one runs tiles."""
    paths = set()
    for t in targets:
        paths |= set((t or {}).get("narrow_paths", {}).values())
    out = []
    if VNNI_PATH in paths or AMX_PATH in paths:
        out.append("avx512vnni")
    if AMX_PATH in paths:
        out += [AMX_TILE, AMX_INT8]
    return out


def byte_ptr(em, buf, off):
    """An i8 pointer ``off`` bytes into ``buf`` (its base and offset)."""
    b = em.b
    base = b.gep(em.base(buf), [I64(buf.offset)], source_etype=I8, inbounds=True)
    return b.gep(base, [off], source_etype=I8, inbounds=True)


def _splat(b, x, vt):
    n = vt.count
    v0 = b.insert_element(ir.Constant(vt, ir.Undefined), x, I32(0))
    return b.shuffle_vector(v0, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(I32, n), [0] * n))


def carry_loop(em, count: int, vals: List, body) -> List:
    """``vals = body(i, vals)`` for i in [0, count), the values carried in phis; returns the last ones."""
    if count == 1:
        return body(I64(0), vals)
    b = em.b
    pre = b.block
    head = em.fn.append_basic_block("q_loop")
    done = em.fn.append_basic_block("q_done")
    b.branch(head)
    b.position_at_end(head)
    i = b.phi(I64)
    i.add_incoming(I64(0), pre)
    phis = []
    for v in vals:
        ph = b.phi(v.type)
        ph.add_incoming(v, pre)
        phis.append(ph)
    new = body(i, phis)
    nxt = b.add(i, I64(1))
    i.add_incoming(nxt, b.block)
    for ph, v in zip(phis, new):
        ph.add_incoming(v, b.block)
    b.cbranch(b.icmp_signed("<", nxt, I64(count)), head, done)
    b.position_at_end(done)
    return new


class _Epilogue:
    """Requantise int32 accumulator vectors of 16 wide positions and store the output bytes of one channel
    row: the positions of dropped columns squeezed out, the rest stored from the row's first output
    position."""

    def __init__(self, km, em, st: Stage, spec: Int8Contraction):
        self.b, self.em, self.spec, self.st = em.b, em, spec, st
        vw = LANES_I8
        self.vi32 = vi32 = ir.VectorType(I32, vw)
        self.vf32 = vf32 = ir.VectorType(F32, vw)
        self.roundeven = km.declare("llvm.roundeven.v16f32", vf32, [vf32])
        # vpmovdb with a memory operand and a mask: narrows 16 int32 lanes to bytes and stores the masked ones.
        # (trunc + llvm.masked.store.v16i8 is miscompiled by LLVM 22 when the mask folds to one lane: a 4-byte
        # vmovd store, which clobbers the next three bytes, another thread's channels)
        self.pmovdb = km.declare("llvm.x86.avx512.mask.pmov.db.mem.512", ir.VoidType(), [PTR, vi32, ir.IntType(16)])
        self.compress = km.declare("llvm.x86.avx512.mask.compress.v16i32", vi32,
                                   [vi32, vi32, ir.VectorType(ir.IntType(1), vw)])
        self.ctpop = km.declare("llvm.ctpop.i32", I32, [I32])
        self.zero = ir.Constant(vi32, [0] * vw)
        self.lanes = ir.Constant(vi32, list(range(vw)))
        lo, hi = spec.out_dtype.int_range
        self.f_lo, self.f_hi = ir.Constant(vf32, [float(lo)] * vw), ir.Constant(vf32, [float(hi)] * vw)
        self.f_zp = ir.Constant(vf32, [float(spec.y_zero_point)] * vw)
        self.out_base = byte_ptr(em, st.buf, I64(0))
        self.comp_base = byte_ptr(em, spec.comp, I64(0))
        self.mult_base = byte_ptr(em, spec.mult, I64(0))

    def positions(self, p0):
        """(first output position, store mask i16, squeeze mask or None) of the 16 wide positions from p0."""
        b, spec = self.b, self.spec
        oh_w, ow_w = spec.out_hw
        if spec.wq == ow_w:      # no dropped columns: the positions below P, in order
            left = b.trunc(b.sub(I64(spec.wide), p0), I32)
            mask = b.bitcast(b.icmp_signed("<", self.lanes, _splat(b, left, self.vi32)), ir.IntType(16))
            return p0, mask, None
        wp = b.add(_splat(b, b.trunc(p0, I32), self.vi32), self.lanes)
        valid = b.and_(b.icmp_signed("<", b.srem(wp, _splat(b, I32(spec.wq), self.vi32)), _splat(b, I32(ow_w), self.vi32)),
                       b.icmp_signed("<", wp, _splat(b, I32(spec.wide), self.vi32)))
        count = b.call(self.ctpop, [b.zext(b.bitcast(valid, ir.IntType(16)), I32)])
        smask = b.trunc(b.sub(b.shl(I32(1), count), I32(1)), ir.IntType(16))
        oh, ow = b.sdiv(p0, I64(spec.wq)), b.srem(p0, I64(spec.wq))
        first = b.select(b.icmp_signed("<", ow, I64(ow_w)), b.add(b.mul(oh, I64(ow_w)), ow),
                         b.mul(b.add(oh, I64(1)), I64(ow_w)))
        return first, smask, valid

    def channel(self, n, m):
        """(comp splat, mult splat, output row pointer) of channel ``m`` of image ``n``."""
        b, spec = self.b, self.spec
        comp = _splat(b, b.load(b.gep(self.comp_base, [m], source_etype=I32, inbounds=True), typ=I32, align=4), self.vi32)
        mult = _splat(b, b.load(b.gep(self.mult_base, [m], source_etype=F32, inbounds=True), typ=F32, align=4), self.vf32)
        row = b.gep(self.out_base, [b.mul(b.add(b.mul(n, I64(spec.m)), m), I64(spec.p))], source_etype=I8, inbounds=True)
        return comp, mult, row

    def store(self, acc, comp, mult, row, pos):
        b = self.b
        first, smask, valid = pos
        x = b.sitofp(b.add(acc, comp), self.vf32)
        # the reference rounds twice (roundeven(roundeven(v * mult) + yzp)); the second is the identity here (an
        # integer-valued float plus an integer zero point rounds to an integer-valued float), so it is left out
        x = b.fadd(b.call(self.roundeven, [b.fmul(x, mult)]), self.f_zp)
        x = b.select(b.fcmp_ordered(">", x, self.f_lo), x, self.f_lo)
        x = b.select(b.fcmp_ordered("<", x, self.f_hi), x, self.f_hi)
        y = b.fptosi(x, self.vi32)
        if valid is not None:
            y = b.call(self.compress, [y, self.zero, valid])
        # not inbounds: with an empty mask (a vector of dropped columns only) the address may be past the row
        b.call(self.pmovdb, [b.gep(row, [first], source_etype=I8), y, smask])


def emit_qgemm_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """Emit a qgemm stage as AMX or VNNI micro-kernels; (parallel extent, grain), or None (the generic loop
    nest)."""
    if st.expr.op != "qgemm" or not isinstance(st.expr.attr, Int8Contraction) or st.region is not None:
        return None
    if find_contraction(st, "qgemm") is not st.expr:
        return None
    feats = getattr(km, "cpu_features", ())
    spec: Int8Contraction = st.expr.attr
    if spec.amx and has_amx_int8(feats) and spec.gb >= MIN_AMX_GB:
        return _emit_amx(km, st, sym, spec)
    if has_vnni512(feats):
        return _emit_vnni(km, st, sym, spec)
    return None


def _emit_vnni(km, st: Stage, sym: str, spec: Int8Contraction):
    vw = LANES_I8
    NR = panel_positions(spec.wide)
    nv = NR // vw
    MR, T, G, gb, GB, F, PL = VNNI_MR, len(spec.taps), spec.groups, spec.gb, spec.g_blocks, spec.num_phases, spec.plane
    PB, M8 = p_blocks(spec.wide, NR), -(-spec.m // VNNI_MR)
    vi32 = ir.VectorType(I32, vw)
    dpbusd = km.declare("llvm.x86.avx512.vpdpbusd.512", vi32, [vi32, vi32, vi32])
    em, begin, end = km.kernel(sym)
    b = em.b
    ep = _Epilogue(km, em, st, spec)

    def unit(u):
        n = b.sdiv(u, I64(PB * M8))
        rest = b.srem(u, I64(PB * M8))
        pb, m8 = b.sdiv(rest, I64(M8)), b.srem(rest, I64(M8))
        mb, r0 = b.sdiv(m8, I64(4)), b.mul(b.srem(m8, I64(4)), I64(VNNI_MR))
        p0 = b.mul(pb, I64(NR))
        accs = [ep.zero] * (MR * nv)
        for t, (f_t, off_t) in enumerate(spec.taps):
            b_t = byte_ptr(em, spec.b, b.mul(b.add(b.mul(b.add(b.mul(n, I64(G * F)), I64(f_t)), I64(PL)),
                                                    b.add(p0, I64(off_t))), I64(4)))
            w_t = byte_ptr(em, spec.w, b.mul(b.add(b.mul(b.add(b.mul(mb, I64(T)), I64(t)), I64(GB * spec.mr)), r0),
                                              I64(gb * 4)))

            def block(gblk, accs, b_t=b_t, w_t=w_t):
                w_g = b.gep(w_t, [b.mul(gblk, I64(spec.mr * gb * 4))], source_etype=I8, inbounds=True)
                b_g = b.gep(b_t, [b.mul(gblk, I64(gb * F * PL * 4))], source_etype=I8, inbounds=True)

                def group(gi, accs):
                    brow = b.gep(b_g, [b.mul(gi, I64(F * PL * 4))], source_etype=I8, inbounds=True)
                    bv = [b.load(b.gep(brow, [I64(v * vw * 4)], source_etype=I8, inbounds=True), typ=vi32, align=1)
                          for v in range(nv)]
                    wrow = b.gep(w_g, [b.mul(gi, I64(4))], source_etype=I8, inbounds=True)
                    new = []
                    for r in range(MR):
                        wv = _splat(b, b.load(b.gep(wrow, [I64(r * gb * 4)], source_etype=I8, inbounds=True), typ=I32,
                                              align=1), vi32)
                        for v in range(nv):
                            new.append(b.call(dpbusd, [accs[r * nv + v], bv[v], wv]))
                    return new
                return carry_loop(em, gb, accs, group)
            accs = carry_loop(em, GB, accs, block)

        m0 = b.add(b.mul(mb, I64(spec.mr)), r0)
        pos = [ep.positions(b.add(p0, I64(v * vw))) for v in range(nv)]
        for r in range(MR):
            m = b.add(m0, I64(r))
            with b.if_then(b.icmp_signed("<", m, I64(spec.m))):
                comp, mult, row = ep.channel(n, m)
                for v in range(nv):
                    ep.store(accs[r * nv + v], comp, mult, row, pos[v])

    em.loop_range(begin, end, unit)
    b.ret_void()
    km.window_kinds[sym] = KIND
    km.narrow_paths[sym] = VNNI_PATH
    return spec.n * PB * M8, 1


class _Int8Tiles(Tiles):
    """The tile operations, and ``tdpbsud`` (signed weight bytes times unsigned activation bytes)."""

    def __init__(self, km, b):
        super().__init__(km, b)
        self._dpbsud = km.declare("llvm.x86.tdpbsud.internal", X86_AMX, [I16, I16, I16, X86_AMX, X86_AMX, X86_AMX])

    def dpbsud(self, c, a, w, k_bytes: int):
        """``c + a @ w``: ``c`` 16 x 16 int32, ``a`` 16 rows of k_bytes signed bytes, ``w`` k_bytes / 4 rows of
        16 x 4 unsigned bytes."""
        return self.b.call(self._dpbsud, [I16(16), I16(64), I16(k_bytes), c, a, w])


def _emit_amx(km, st: Stage, sym: str, spec: Int8Contraction):
    vw = LANES_I8
    NR, MR = AMX_NR, spec.mr
    T, G, gb, GB, F, PL = len(spec.taps), spec.groups, spec.gb, spec.g_blocks, spec.num_phases, spec.plane
    PB, MB = p_blocks(spec.wide, NR), spec.m_blocks
    vi32 = ir.VectorType(I32, vw)
    em, begin, end = km.kernel(sym)
    b = em.b
    tiles = _Int8Tiles(km, b)
    ep = _Epilogue(km, em, st, spec)
    cbuf = em.alloca(ir.ArrayType(I32, MR * NR))      # the four accumulator tiles, stored: [32 rows][32 positions]
    cbuf.align = 64
    g_stride = F * PL * 4

    def unit(u):
        n = b.sdiv(u, I64(PB * MB))
        rest = b.srem(u, I64(PB * MB))
        pb, mb = b.sdiv(rest, I64(MB)), b.srem(rest, I64(MB))
        p0 = b.mul(pb, I64(NR))
        accs = [tiles.zero() for _ in range(4)]
        for t, (f_t, off_t) in enumerate(spec.taps):
            b_t = byte_ptr(em, spec.b, b.mul(b.add(b.mul(b.add(b.mul(n, I64(G * F)), I64(f_t)), I64(PL)),
                                                    b.add(p0, I64(off_t))), I64(4)))
            w_t = byte_ptr(em, spec.w, b.mul(b.add(b.mul(mb, I64(T)), I64(t)), I64(GB * MR * gb * 4)))

            def block(gblk, accs, b_t=b_t, w_t=w_t):
                w_g = b.gep(w_t, [b.mul(gblk, I64(MR * gb * 4))], source_etype=I8, inbounds=True)
                b_g = b.gep(b_t, [b.mul(gblk, I64(gb * g_stride))], source_etype=I8, inbounds=True)
                a = [tiles.load(b.gep(w_g, [I64(x * 16 * gb * 4)], source_etype=I8, inbounds=True), gb * 4, 16, gb * 4)
                     for x in range(2)]
                bt = [tiles.load(b.gep(b_g, [I64(y * vw * 4)], source_etype=I8, inbounds=True), g_stride, gb, 64)
                      for y in range(2)]
                return [tiles.dpbsud(accs[2 * x + y], a[x], bt[y], gb * 4) for x in range(2) for y in range(2)]
            accs = carry_loop(em, GB, accs, block)
        for x in range(2):
            for y in range(2):
                tiles.store(accs[2 * x + y], b.gep(cbuf, [I64(0), I64(x * 16 * NR + y * vw)], source_etype=cbuf.allocated_type),
                            NR * 4, 16, 64)
        m0 = b.mul(mb, I64(MR))
        pos = [ep.positions(b.add(p0, I64(v * vw))) for v in range(NR // vw)]

        def row(r):
            m = b.add(m0, r)
            with b.if_then(b.icmp_signed("<", m, I64(spec.m))):
                comp, mult, out = ep.channel(n, m)
                for v in range(NR // vw):
                    acc = b.load(b.gep(cbuf, [I64(0), b.add(b.mul(r, I64(NR)), I64(v * vw))],
                                       source_etype=cbuf.allocated_type), typ=vi32, align=64)
                    ep.store(acc, comp, mult, out, pos[v])
        em.loop_range(I64(0), I64(MR), row)

    em.loop_range(begin, end, unit)
    b.ret_void()
    km.window_kinds[sym] = AMX_KIND
    km.narrow_paths[sym] = AMX_PATH
    return spec.n * PB * MB, 1


def emit_planes_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """Emit the phase planes of an int8 convolution's input (``E("qplanes")``): a unit is one plane (image,
    channel group, phase); per row of the grid and 16 positions, each of the four channel rows is one masked
    load (padding and a last partial group read the zero point; a strided row takes every ``sw``-th byte),
    and the four are interleaved into one 64-byte store. A row's last store runs into the next row (stored
    after it) or the plane's tail; the tail past the grid is filled. Only where the int8 kernels run (the
    planes' one reader); else the generic loop nest."""
    if st.expr.op != "qplanes" or not isinstance(st.expr.attr, Int8Planes) or st.region is not None:
        return None
    if find_contraction(st, "qplanes") is not st.expr or not has_vnni512(getattr(km, "cpu_features", ())):
        return None
    spec: Int8Planes = st.expr.attr
    if spec.strides[1] > 4 or spec.x.strides[-1] != 1:
        return None
    vw = LANES_I8
    fill_raw = (spec.fill ^ 0x80) if spec.shift else spec.fill     # the input's own zero point byte
    inter = ir.Constant(ir.VectorType(I32, 4 * vw), [i * vw + j for j in range(vw) for i in range(4)])
    flip = ir.Constant(ir.VectorType(I8, 4 * vw), [0x80] * (4 * vw))

    def word(b, rows):   # four channel rows of 16 bytes interleaved: each position's four channels adjacent
        cat = lambda p, q: b.shuffle_vector(p, q, ir.Constant(ir.VectorType(I32, 2 * vw), list(range(2 * vw))))
        w = b.shuffle_vector(cat(rows[0], rows[1]), cat(rows[2], rows[3]), inter)
        return b.xor(w, flip) if spec.shift else w
    done = emit_phase_planes(km, st, sym, spec, 4, I8, fill_raw, word,
                             ir.Constant(ir.VectorType(I8, 4 * vw), [spec.fill] * (4 * vw)))
    km.window_kinds[sym] = PLANES_KIND
    return done
