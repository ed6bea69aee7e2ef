"""The x86 kernel of :class:`cuvil.kernels.contraction_nhwc.ChannelsLastContraction`: bf16 convolutions on AMX
tiles whose A tiles are the activations' channels-last rows, loaded in place.

A unit of the parallel range is 32 wide positions by one block of 32 output channels (units of one image,
channel blocks fastest, so a unit's rows of the input stay in L1 over the blocks; or position blocks fastest where
the weights outweigh an image's rows, so each weight block is read once per image: WEIGHT_MAJOR). Its four 16 x 16 float32
accumulators stay in tile registers over one loop of steps ``s = (tap, step of 32 input channels)``: the A tiles
are 16 grid rows of 64 bytes at the tap's shift (a constant table), ``Cp * 2`` bytes apart; the B tiles are the
weight block's next 2 KiB (one sequential stream). The last unit of an image starts at ``wide - 32`` (it
overlaps the one before; no row past the grid is read). The tile is stored to the stack and the stage's
epilogue runs per wide position that is an output (``ow < OW``, not computed by the unit before): on vectors of
16 channels where every operand is per-channel or a channels-last value at the output position and the output
is channels-last (bias, folded BatchNorm, Relu, a residual Add: stores of whole 32- or 64-byte runs), else
element by element through the output's strides (any layout, any epilogue). Where the schedule wrote the output
over the residual it reads (``Schedule.over_residuals``), each position's residual is read just before the same
bytes are stored.

The rows copy (:func:`emit_rows_stage`) writes the phase planes' rows the kernel reads.
"""
from __future__ import annotations

from typing import Optional, Tuple

import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.contraction import DepthwiseWindow
from ...kernels.contraction_nhwc import (CHANNEL_STEP, NHWC_MR, NHWC_NR, ChannelsLastContraction, ChannelsLastPart,
                                         ChannelsLastRows, channels_last_view, is_channels_last)
from ...kernels.schedule import Stage
from ...kernels.texpr import E, nodes
from ..llvm.narrow import I16
from ..llvm.types import F32, I32, I64, const_value, splat
from .amx import AMX_BF16_PATH, Tiles, bf16_tile_loop, has_amx
from .gemm import (epilogue_loads, find_contraction, transpose_lanes, vector_epilogue, vector_epilogue_plan,
                   vector_op)
from .gemm_bf16 import to_bf16
from .gemm_int8 import byte_ptr

KIND = "bf16_nhwc_amx"
#: the vector epilogue of a layer whose k-loop is at most PREFETCH_MAX_STEPS steps (K <= 64: the 64 -> 256
#: expansions of ResNet-50 at 56x56, where a unit is mostly its epilogue) prefetches, for each output position,
#: the lines of its operands at the position (a residual) and of its output PREFETCH_POSITIONS positions further
#: on, into L2 (0: never). Measured on a Xeon with AMX (family 6 model 207), ResNet-50 bf16, each step timed once
#: after a 30 ms pause, 15 rounds: those layers 0.90x; on every layer, the longer ones 1.03-1.10x (their
#: k-loops leave the hardware time to fetch the lines). A weight prefetch in the k-loop (32 lines a step, 8
#: steps ahead) ran 1.1-1.3x slower on all but the 7x7 layers: not kept.
PREFETCH_POSITIONS = 32
PREFETCH_MAX_STEPS = 2
#: units run position blocks fastest (each weight block read once per image) where a layer's packed weights
#: outweigh an image's rows; else weight blocks fastest (a position block's rows stay in L1 over the blocks).
#: ResNet-50 bf16 as above: 0.93x in all, the 7x7 layers' 4.7 MB of weights 0.72x.
WEIGHT_MAJOR = True
VW = 16
I8 = ir.IntType(8)


def channel_vector_plan(st: Stage, node: E) -> Optional[dict]:
    """Whether the stage's epilogue over ``node`` runs on vectors of 16 consecutive output channels: float
    arithmetic, comparisons and selects over per-channel operands (loads indexed by constants, the image and the
    channel, the channel at a unit stride or absent) and operands at the output position stored channels-last (a
    residual, float32 or bfloat16), into a channels-last float32 or bfloat16 output. ``{load uid: kind}`` (kinds
    "channel", "scalar", "position", "position16"), or None."""
    names = [v.attr for v in st.vars]
    if len(names) != 4 or st.buf.dtype not in (DType.FLOAT, DType.BFLOAT16) or not channels_last_view(st.buf):
        return None

    def classify(ld: E, widened: bool) -> Optional[str]:
        if not widened and ld.dtype != DType.FLOAT:      # (float32 vectors, or bfloat16 widened exactly)
            return None
        if ([a.attr if a.op == "var" else None for a in ld.args] == names and is_channels_last(ld.attr)
                and tuple(ld.attr.shape) == tuple(st.buf.shape)):
            return "position16" if widened else "position"
        used = [a.attr for a in ld.args if a.op == "var"]
        if widened or any(u not in names[:2] for u in used) or used.count(names[1]) > 1:
            return None
        if names[1] not in used:
            return "scalar"
        k = next(i for i, a in enumerate(ld.args) if a.op == "var" and a.attr == names[1])
        return "channel" if ld.attr.strides[k] == 1 else None
    return epilogue_loads(st, node, classify)


def emit_channels_last_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """Emit a channels-last convolution stage on AMX tiles; (parallel extent, grain), or None (the generic loop
    nest computes the node's plain value)."""
    c = find_contraction(st)
    if c is None or not isinstance(c.attr, ChannelsLastContraction) or st.region is not None or len(st.buf.shape) != 4:
        return None
    spec: ChannelsLastContraction = c.attr
    if not has_amx(getattr(km, "cpu_features", ())):
        km.narrow_paths[sym] = "fp32 fallback"      # (the loop nest computes the plain bf16 expression)
        return None
    MR, NR = NHWC_MR, NHWC_NR
    PB, MB, T, S = spec.p_blocks, spec.m_blocks, len(spec.taps), spec.steps
    OW, Wq, wide = spec.out_hw[1], spec.wq, spec.wide
    step_bytes = 16 * MR * 2 * 2          # one (tap, step) of a weight block: 16 rows of 32 output channels' pairs
    em, begin, end = km.kernel(sym)
    b = em.b
    cbuf = em.alloca(ir.ArrayType(F32, NR * MR))      # the unit's accumulators: [NR positions][MR channels]
    cbuf.align = 64
    tile_f = b.bitcast(cbuf, ir.PointerType(F32))
    tiles = Tiles(km, b)
    arr = ir.ArrayType(I64, T)            # per tap, bytes from a row to the row at its shift
    shifts = ir.GlobalVariable(km.module, arr, name=f"{sym}.shifts")
    shifts.global_constant, shifts.linkage = True, "internal"
    shifts.initializer = ir.Constant(arr, [spec.shift(t) * spec.row * 2 for t in range(T)])
    plan = channel_vector_plan(st, c) if spec.m % VW == 0 else None
    vector = _ChannelVectors(em, st, c, plan, tile_f, spec.m, PREFETCH_POSITIONS if spec.all_steps <= PREFETCH_MAX_STEPS else 0) \
        if plan is not None else None
    # a channel-planar output (a graph output, a value read by a pool) of a window whose wide positions are its
    # output positions (Wq == OW: a unit's 32 positions are consecutive there): the tile transposed in
    # registers, then the channel-planar kernels' vector epilogue (gemm.vector_epilogue: per channel, vectors of
    # 16 positions); else position by position
    planar = vector_epilogue_plan(st, c) if plan is None and Wq == OW and not is_channels_last(st.buf) else None

    by_weights = WEIGHT_MAJOR and MB * spec.all_steps * step_bytes > (spec.image + sum(p.image for p in spec.parts)) * 2

    def unit(u):
        if by_weights:
            pb, rest = b.srem(u, I64(PB)), b.sdiv(u, I64(PB))
            mb, n = b.srem(rest, I64(MB)), b.sdiv(rest, I64(MB))
        else:
            mb, rest = b.srem(u, I64(MB)), b.sdiv(u, I64(MB))
            pb, n = b.srem(rest, I64(PB)), b.sdiv(rest, I64(PB))
        first = b.mul(pb, I64(NR))
        p0 = b.select(b.icmp_signed(">", first, I64(wide - NR)), I64(wide - NR), first)
        a_n = byte_ptr(em, spec.a, b.mul(b.add(b.mul(n, I64(spec.image)), b.mul(p0, I64(spec.row))), I64(2)))
        w_mb = byte_ptr(em, spec.w, b.mul(mb, I64(spec.all_steps * step_bytes)))

        def a_at(s, i):
            t, cs = b.udiv(s, I64(S)), b.urem(s, I64(S))
            shift = b.load(b.gep(shifts, [I32(0), t], inbounds=True), typ=I64)
            off = b.add(shift, b.add(I64(i * 16 * spec.row * 2), b.mul(cs, I64(64))))
            return b.gep(a_n, [off], source_etype=I8, inbounds=True)

        def b_at(s, j):
            return b.gep(w_mb, [b.add(b.mul(s, I64(step_bytes)), I64(j * 64))], source_etype=I8, inbounds=True)
        accs = bf16_tile_loop(em, tiles, I64(T * S), a_at, spec.row * 2, b_at, MR * 4, 2, 2)
        done = T * S
        for part in spec.parts:          # further operands (a sum of 1x1 convolutions): the same tiles go on
            accs = _part_loop(em, tiles, part, n, p0, w_mb, done, accs)
            done += part.cin // CHANNEL_STEP
        for i in range(2):
            for j in range(2):
                tiles.store(accs[2 * i + j], b.gep(tile_f, [I64(i * 16 * MR + j * 16)], source_etype=F32), MR * 4)
        m0 = b.mul(mb, I64(MR))
        if planar is not None:
            _planar_epilogue(em, st, c, planar, tile_f, n, m0, p0, spec.m, spec.out_hw)
            return
        if vector is not None:
            vector.unit(n, m0)

        def row(r):
            p = b.add(p0, r)
            keep = b.icmp_signed(">=", p, first)
            if Wq != OW:
                oh, ow = b.sdiv(p, I64(Wq)), b.srem(p, I64(Wq))
                keep = b.and_(keep, b.icmp_signed("<", ow, I64(OW)))
                pos = b.add(b.mul(oh, I64(OW)), ow)
            else:
                pos = p
            with b.if_then(keep):
                em.memo.append({})
                if vector is not None:
                    vector.row(r, pos)
                else:
                    _element_epilogue(em, st, c, tile_f, r, n, m0, b.sdiv(pos, I64(OW)), b.srem(pos, I64(OW)), spec.m)
                em.memo.pop()
        em.loop_range(I64(0), I64(NR), row)

    em.loop_range(begin, end, unit)
    b.ret_void()
    km.window_kinds[sym] = KIND
    km.narrow_paths[sym] = AMX_BF16_PATH
    return spec.n * PB * MB, 1


def _part_loop(em, tiles: Tiles, part: ChannelsLastPart, n, p0, w_mb, first: int, accs: list) -> list:
    """The k-loop over a further operand of the unit (image ``n``, wide positions from ``p0``): its rows' steps
    of 32 channels against the weight block's steps from ``first`` on, accumulating into ``accs``."""
    b = em.b
    step_bytes = 16 * NHWC_MR * 2 * 2
    a_n = byte_ptr(em, part.a, b.mul(b.add(b.mul(n, I64(part.image)), b.mul(p0, I64(part.row))), I64(2)))

    def a_at(s, i):
        return b.gep(a_n, [b.add(I64(i * 16 * part.row * 2), b.mul(s, I64(64)))], source_etype=I8, inbounds=True)

    def b_at(s, j):
        return b.gep(w_mb, [b.add(b.mul(b.add(s, I64(first)), I64(step_bytes)), I64(j * 64))], source_etype=I8,
                     inbounds=True)
    return bf16_tile_loop(em, tiles, I64(part.cin // CHANNEL_STEP), a_at, part.row * 2, b_at, NHWC_MR * 4, 2, 2,
                          init=accs)


class _ChannelVectors:
    """The stage's epilogue on vectors of 16 channels (a plan of :func:`channel_vector_plan`): per unit, its
    per-channel operands loaded once (:meth:`unit`); per output position ``pos`` (``oh * OW + ow``) of the tile's
    row ``r``, the operands at the position and the output addressed as channels-last rows (:meth:`row`)."""

    def __init__(self, em, st: Stage, node: E, kinds: dict, tile_f, m_total: int, ahead: int = 0):
        self.em, self.b, self.st, self.node, self.kinds, self.tile_f = em, em.b, st, node, kinds, tile_f
        self.ahead = ahead
        self.m_total = m_total
        self.vec, self.h16 = ir.VectorType(F32, VW), ir.VectorType(I16, VW)
        self.names = [v.attr for v in st.vars]
        _, self.channels, h, w = st.buf.shape
        self.hw = h * w
        self.loaded = {}
        self.prefetch = em.km.declare("llvm.prefetch.p0", ir.VoidType(), [ir.PointerType(I8), I32, I32, I32])

    def unit(self, n, m0) -> None:
        em, b = self.em, self.b
        self.n, self.m0 = n, m0
        self.loaded = {}
        for uid, kind in self.kinds.items():
            if kind not in ("scalar", "channel"):
                continue
            e = _node(self.st.expr, uid)
            vecs = []
            for v in range(NHWC_MR // VW):
                m = b.add(m0, I64(v * VW))
                em.env[self.names[0]], em.env[self.names[1]] = n, m
                em.memo.append({})
                if kind == "scalar":
                    vecs.append(splat(b, em.emit(e), VW))
                else:        # (a block of 32 channels past M: only whole vectors below M are loaded)
                    ok = self.m_total % NHWC_MR == 0 or v == 0
                    ptr = b.bitcast(em.address(e.attr, [em.emit(a) for a in e.args]), self.vec.as_pointer())
                    if ok:
                        vecs.append(b.load(ptr, typ=self.vec, align=4))
                    else:
                        slot = em.alloca(self.vec)
                        b.store(ir.Constant(self.vec, [0.0] * VW), slot)
                        with b.if_then(b.icmp_signed("<", m, I64(self.m_total))):
                            b.store(b.load(ptr, typ=self.vec, align=4), slot)
                        vecs.append(b.load(slot, typ=self.vec))
                em.memo.pop()
            self.loaded[uid] = vecs

    def _at(self, buf, pos, m, inbounds: bool = True):
        """Address of element ``m`` of output position ``pos`` of image ``self.n`` in a channels-last ``buf``
        (``inbounds`` False: a prefetch's, which may lie past the buffer); a view of a padded buffer's interior
        (:func:`cuvil.kernels.contraction_nhwc.channels_last_view`) through its strides."""
        b = self.b
        if is_channels_last(buf):
            flat = b.add(b.mul(b.add(b.mul(self.n, I64(self.hw)), pos), I64(self.channels)), m)
        else:
            sn, _, sh, sw = buf.pitch
            oh, ow = b.sdiv(pos, I64(buf.shape[3])), b.srem(pos, I64(buf.shape[3]))
            flat = b.add(b.add(b.mul(self.n, I64(sn)), b.add(b.mul(oh, I64(sh)), b.mul(ow, I64(sw)))), m)
        base = b.gep(self.em.base(buf), [I64(buf.offset)], source_etype=I8, inbounds=True)   # (a view's own first byte)
        return b.gep(base, [flat], source_etype=I16 if buf.dtype == DType.BFLOAT16 else F32, inbounds=inbounds)

    def row(self, r, pos) -> None:
        b, st, vec, h16 = self.b, self.st, self.vec, self.h16
        if self.ahead:           # the lines a unit of a later position block reads and writes here
            ahead = b.add(pos, I64(self.ahead))
            bufs = [(_node(st.expr, uid).attr if kind == "position" else _node(st.expr, uid).args[0].attr, 0)
                    for uid, kind in self.kinds.items() if kind in ("position", "position16")] + [(st.buf, 1)]
            for buf, write in bufs:
                for line in range(0, NHWC_MR * buf.dtype.itemsize, 64):
                    at = b.gep(b.bitcast(self._at(buf, ahead, self.m0, False), ir.PointerType(I8)), [I64(line)],
                               source_etype=I8)
                    b.call(self.prefetch, [at, I32(write), I32(2), I32(1)])
        for v in range(NHWC_MR // VW):
            m = b.add(self.m0, I64(v * VW))
            memo = {}

            def emit(e: E):
                if e.uid in memo:
                    return memo[e.uid]
                kind = self.kinds.get(e.uid)
                if e is self.node:
                    ptr = b.gep(self.tile_f, [b.add(b.mul(r, I64(NHWC_MR)), I64(v * VW))], source_etype=F32)
                    out = b.load(b.bitcast(ptr, vec.as_pointer()), typ=vec, align=4)
                elif e.op == "const":
                    out = splat(b, const_value(e.attr, e.dtype), VW)
                elif kind in ("scalar", "channel"):
                    out = self.loaded[e.uid][v]
                elif kind == "position":
                    out = b.load(b.bitcast(self._at(e.attr, pos, m), vec.as_pointer()), typ=vec, align=4)
                elif kind == "position16":           # a bfloat16 residual, widened exactly
                    h = b.load(b.bitcast(self._at(e.args[0].attr, pos, m), h16.as_pointer()), typ=h16, align=2)
                    wide = ir.VectorType(I32, VW)
                    out = b.bitcast(b.shl(b.zext(h, wide), ir.Constant(wide, [16] * VW)), vec)
                else:
                    out = vector_op(b, self.em, e, [emit(a) for a in e.args])
                memo[e.uid] = out
                return out

            def body():
                value = emit(st.expr)
                dst = self._at(st.buf, pos, m)
                if st.buf.dtype == DType.BFLOAT16:
                    b.store(b.bitcast(to_bf16(b, value), h16), b.bitcast(dst, h16.as_pointer()), align=2)
                else:
                    b.store(value, b.bitcast(dst, vec.as_pointer()), align=4)
            if self.m_total % NHWC_MR == 0 or v == 0:
                body()
            else:
                with b.if_then(b.icmp_signed("<", m, I64(self.m_total))):
                    body()


def _node(expr: E, uid: int) -> E:
    return next(x for x in nodes(expr) if x.uid == uid)


def _planar_epilogue(em, st: Stage, node: E, kinds: dict, tile_f, n, m0, p0, m_total: int, out_hw) -> None:
    """The unit's tile (32 consecutive output positions from ``p0`` by 32 channels from ``m0``) into a
    channel-planar output: two 16 x 16 transposes per pair of 16 channels, then per channel two vectors of 16
    positions through :func:`cuvil.targets.x86.gemm.vector_epilogue` (the rows past M skipped). Positions a unit
    before already stored (the last unit's overlap) are stored again with the same values."""
    b = em.b
    vec = ir.VectorType(F32, VW)
    rows = [b.load(b.bitcast(b.gep(tile_f, [I64(r * NHWC_MR + v * VW)], source_etype=F32), vec.as_pointer()), typ=vec,
                   align=4) for r in range(NHWC_NR) for v in range(NHWC_MR // VW)]
    halves = [transpose_lanes(b, rows[h * VW * 2:(h + 1) * VW * 2], VW, NHWC_MR // VW)[0] for h in range(NHWC_NR // VW)]
    accs = [halves[h][ch] for ch in range(NHWC_MR) for h in range(NHWC_NR // VW)]
    left = b.sub(I64(m_total), m0)
    nrows = None if m_total % NHWC_MR == 0 else b.select(b.icmp_signed("<", left, I64(NHWC_MR)), left, I64(NHWC_MR))
    vector_epilogue(em, st, node, kinds, n, m0, p0, accs, NHWC_MR, NHWC_NR // VW, tuple(out_hw), nrows=nrows)


def _element_epilogue(em, st: Stage, node: E, tile_f, r, n, m0, oh, ow, m_total: int) -> None:
    """Position ``r`` of the tile, channel by channel through the output's strides (any epilogue, any layout)."""
    b = em.b
    names = [v.attr for v in st.vars]
    left = b.sub(I64(m_total), m0)
    count = b.select(b.icmp_signed("<", left, I64(NHWC_MR)), left, I64(NHWC_MR))

    def channel(j):
        at = [n, b.add(m0, j), oh, ow]
        for name, i in zip(names, at):
            em.env[name] = i
        em.memo.append({node.uid: b.load(b.gep(tile_f, [b.add(b.mul(r, I64(NHWC_MR)), j)], source_etype=F32), typ=F32)})
        b.store(em.to_memory(em.emit(st.expr), st.buf.dtype), em.address(st.buf, at))
        em.memo.pop()
    em.loop_range(I64(0), count, channel)


def emit_rows_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """Emit the channels-last phase planes of a convolution's input (``E("nhwc_rows")``): a unit is one grid row
    (image, phase, row); its positions inside the input are copied, every other byte of the row zeroed. An input
    stored channels-last is copied as whole rows of channels (bfloat16: one run for the row's inside columns at
    column stride 1 with no channels to pad; float32, whole vectors of 16 channels: rounded to bfloat16 as they are
    copied). A channel-planar input is transposed in registers, 16 channels by 16 positions at a time (masked row
    loads, gathers at a column stride, :func:`cuvil.targets.x86.gemm.transpose_lanes`, 32-byte stores of 16
    channels). Else None (the generic loop nest)."""
    if st.expr.op != "nhwc_rows" or not isinstance(st.expr.attr, ChannelsLastRows) or st.region is not None:
        return None
    spec: ChannelsLastRows = st.expr.attr
    if find_contraction(st, "nhwc_rows") is not st.expr or st.buf.dtype != DType.BFLOAT16 or len(st.buf.shape) != 4 \
            or spec.x.dtype not in (DType.BFLOAT16, DType.FLOAT) or len(spec.x.shape) != 4:
        return None
    planar = spec.x.pitch is None
    if not spec.in_place and (not planar and not is_channels_last(spec.x)
                              or not planar and spec.x.dtype == DType.FLOAT and spec.channels % VW):
        return None
    wide = spec.x.dtype == DType.FLOAT       # float32 values rounded to bfloat16 (nearest even) as they are copied
    vec, h16 = ir.VectorType(F32, VW), ir.VectorType(I16, VW)
    N, F, PL, Cp = st.buf.shape
    C, (H, W), (ph0, pw0), (sh, sw), (_, cols), (Hq, Wq) = (spec.channels, spec.in_hw, spec.begin, spec.strides,
                                                             spec.phases, spec.grid)
    item = spec.x.dtype.itemsize
    em, begin, end = km.kernel(sym)
    b = em.b
    memcpy = km.declare("llvm.memcpy.p0.p0.i64", ir.VoidType(), [ir.PointerType(I8), ir.PointerType(I8), I64, ir.IntType(1)])
    memset = km.declare("llvm.memset.p0.i64", ir.VoidType(), [ir.PointerType(I8), I8, I64, ir.IntType(1)])
    false = ir.Constant(ir.IntType(1), 0)
    i1v = ir.VectorType(ir.IntType(1), VW)
    fload = km.declare("llvm.masked.load.v16f32.p0", vec, [ir.PointerType(I8), I32, i1v, vec])
    hload = km.declare("llvm.masked.load.v16i16.p0", h16, [ir.PointerType(I8), I32, i1v, h16])
    ptrs = ir.VectorType(ir.PointerType(I8), VW)
    fgather = km.declare("llvm.masked.gather.v16f32.v16p0", vec, [ptrs, I32, i1v, vec])
    hgather = km.declare("llvm.masked.gather.v16i16.v16p0", h16, [ptrs, I32, i1v, h16])
    lanes = ir.Constant(ir.VectorType(I64, VW), list(range(VW)))
    strided = ir.Constant(ir.VectorType(I64, VW), [l * sw * item for l in range(VW)])

    def zero(ptr, nbytes):
        b.call(memset, [ptr, ir.Constant(I8, 0), nbytes, false])

    def at(ptr, off):
        return b.gep(ptr, [off], source_etype=I8, inbounds=True)

    def channels_last(dst, lo, hi, n, ih, rw):
        src_row = byte_ptr(em, spec.x, b.mul(b.mul(b.add(b.mul(n, I64(H)), ih), I64(W)), I64(C * item)))

        def src_at(j):
            iw = b.sub(b.add(b.mul(j, I64(sw)), rw), I64(pw0))
            return at(src_row, b.mul(iw, I64(C * item)))

        def rounded(j):
            d, s_ = at(dst, b.mul(j, I64(Cp * 2))), src_at(j)
            for v in range(C // VW):
                x = b.load(b.bitcast(at(s_, I64(v * VW * 4)), vec.as_pointer()), typ=vec, align=4)
                b.store(b.bitcast(to_bf16(b, x), h16), b.bitcast(at(d, I64(v * VW * 2)), h16.as_pointer()), align=2)
            if Cp > C:
                zero(at(d, I64(C * 2)), I64((Cp - C) * 2))

        def copied(j):
            d = at(dst, b.mul(j, I64(Cp * 2)))
            b.call(memcpy, [d, src_at(j), I64(C * 2), false])
            if Cp > C:
                zero(at(d, I64(C * 2)), I64((Cp - C) * 2))
        if wide:
            em.loop_range(lo, hi, rounded)
        elif sw == 1 and Cp == C:          # one run of whole rows
            b.call(memcpy, [at(dst, b.mul(lo, I64(Cp * 2))), src_at(lo), b.mul(b.sub(hi, lo), I64(C * 2)), false])
        else:
            em.loop_range(lo, hi, copied)

    def transposed(dst, lo, hi, n, ih, rw):
        plane = byte_ptr(em, spec.x, b.mul(b.add(b.mul(b.mul(n, I64(C)), I64(H * W)), b.mul(ih, I64(W))), I64(item)))
        blocks = b.sdiv(b.add(b.sub(hi, lo), I64(VW - 1)), I64(VW))

        def block(k):
            j0 = b.add(lo, b.mul(k, I64(VW)))
            count = b.sub(hi, j0)
            count = b.select(b.icmp_signed(">", count, I64(VW)), I64(VW), count)
            mask = b.icmp_signed("<", lanes, splat(b, count, VW))
            iw0 = b.sub(b.add(b.mul(j0, I64(sw)), rw), I64(pw0))

            def group(g):
                c0 = b.mul(g, I64(VW))
                rows = []
                for ci in range(VW):
                    c = b.add(c0, I64(ci))
                    src = at(plane, b.mul(b.add(b.mul(c, I64(H * W)), iw0), I64(item)))
                    live = b.and_(mask, splat(b, b.icmp_signed("<", c, I64(C)), VW))
                    if sw > 1:       # (a column stride: the lanes' elements sw apart)
                        at_ = b.gep(splat(b, src, VW), [strided], source_etype=I8)
                    if wide:
                        rows.append(b.call(fload, [src, I32(4), live, ir.Constant(vec, [0.0] * VW)]) if sw == 1 else
                                    b.call(fgather, [at_, I32(4), live, ir.Constant(vec, [0.0] * VW)]))
                    else:
                        h = (b.call(hload, [src, I32(2), live, ir.Constant(h16, [0] * VW)]) if sw == 1 else
                             b.call(hgather, [at_, I32(2), live, ir.Constant(h16, [0] * VW)]))
                        w32 = ir.VectorType(I32, VW)
                        rows.append(b.bitcast(b.shl(b.zext(h, w32), ir.Constant(w32, [16] * VW)), vec))
                cols_, _ = transpose_lanes(b, rows, VW, 1)
                for l, x in enumerate(cols_):
                    d = at(dst, b.mul(b.add(b.mul(b.add(j0, I64(l)), I64(Cp)), c0), I64(2)))
                    with b.if_then(b.icmp_signed("<", I64(l), count)):
                        b.store(b.bitcast(to_bf16(b, x), h16), b.bitcast(d, h16.as_pointer()), align=2)
            em.loop_range(I64(0), I64(Cp // VW), group)
        em.loop_range(I64(0), blocks, block)

    def unit(u):
        a, rest = b.srem(u, I64(Hq)), b.sdiv(u, I64(Hq))
        f, n = b.srem(rest, I64(F)), b.sdiv(rest, I64(F))
        rh, rw = b.sdiv(f, I64(cols)), b.srem(f, I64(cols))
        dst = byte_ptr(em, st.buf, b.mul(b.add(b.mul(b.add(b.mul(n, I64(F)), f), I64(PL)), b.mul(a, I64(Wq))), I64(Cp * 2)))
        ih = b.sub(b.add(b.mul(a, I64(sh)), rh), I64(ph0))
        inside = b.and_(b.icmp_signed(">=", ih, I64(0)), b.icmp_signed("<", ih, I64(H)))
        with b.if_else(inside) as (then, otherwise):
            with then:
                # inside columns: j with 0 <= j sw + rw - pw0 < W, i.e. lo <= j < hi
                # (0 <= lo <= hi <= Wq: a phase's columns may all lie in the padding, its begin pad past the
                # grid, or an end pad crop the input away)
                lo = b.sdiv(b.add(b.sub(I64(pw0), rw), I64(sw - 1)), I64(sw))
                lo = b.select(b.icmp_signed("<", lo, I64(0)), I64(0), lo)
                lo = b.select(b.icmp_signed(">", lo, I64(Wq)), I64(Wq), lo)
                hi = b.sdiv(b.add(b.sub(I64(W - 1 + pw0), rw), I64(sw)), I64(sw))
                hi = b.select(b.icmp_signed(">", hi, I64(Wq)), I64(Wq), hi)
                hi = b.select(b.icmp_signed("<", hi, lo), lo, hi)
                zero(dst, b.mul(lo, I64(Cp * 2)))
                zero(at(dst, b.mul(hi, I64(Cp * 2))), b.mul(b.sub(I64(Wq), hi), I64(Cp * 2)))
                if not spec.in_place:     # (in place: the producer wrote the interior, only the zeros are ours)
                    (transposed if planar else channels_last)(dst, lo, hi, n, ih, rw)
            with otherwise:
                zero(dst, I64(Wq * Cp * 2))

    em.loop_range(begin, end, unit)
    b.ret_void()
    km.window_kinds[sym] = "nhwc_rows"
    return N * F * Hq, 1


#: channel vectors a unit of the channels-last mean sums at once (4 x 16 channels: independent add chains)
MEAN_VECTORS = 4


def emit_channels_last_mean(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """The mean over the whole map of a float32 value stored channels-last (``DepthwiseWindow`` kind ``"sum"``,
    :func:`cuvil.kernels.lower.pool.channels_last_mean`): a unit is an image's block of up to 64 channels, whose
    positions' rows are added in window order into vectors of 16 channels (the loop nest's order, the same
    bits), then divided by the count; the output ``[N, C, 1, 1]`` stored as whole vectors (a last block past C
    through masked loads and stores: SqueezeNet's 1000 channels). Else None."""
    node = find_contraction(st, "window")
    if node is None or not isinstance(node.attr, DepthwiseWindow) or node.attr.kind != "sum" or st.region is not None:
        return None
    spec: DepthwiseWindow = node.attr
    x = spec.x
    e = st.expr
    if (not is_channels_last(x) or x.dtype != DType.FLOAT or st.buf.dtype != DType.FLOAT or len(st.buf.shape) != 4
            or tuple(st.buf.shape[2:]) != (1, 1) or st.buf.pitch is not None or e.op != "div" or e.args[0] is not node
            or e.args[1].op != "const"):
        return None
    N, C, H, W = x.shape
    if not isinstance(C, int):
        return None
    vec = ir.VectorType(F32, VW)
    em, begin, end = km.kernel(sym)
    b = em.b
    per = MEAN_VECTORS * VW
    blocks = -(-C // per)
    count = splat(b, const_value(e.args[1].attr, DType.FLOAT), VW)
    ragged = C % per != 0         # the last block's vectors past C: masked loads and stores
    i1v = ir.VectorType(ir.IntType(1), VW)
    mload = km.declare("llvm.masked.load.v16f32.p0", vec, [ir.PointerType(I8), I32, i1v, vec])
    mstore = km.declare("llvm.masked.store.v16f32.p0", ir.VoidType(), [vec, ir.PointerType(I8), I32, i1v])
    lanes = ir.Constant(ir.VectorType(I64, VW), list(range(VW)))
    zero = ir.Constant(vec, [0.0] * VW)

    def unit(u):
        blk, n = b.srem(u, I64(blocks)), b.sdiv(u, I64(blocks))
        c0 = b.mul(blk, I64(per))
        base = byte_ptr(em, x, b.mul(b.add(b.mul(n, I64(H * W * C)), c0), I64(4)))
        masks = [b.icmp_signed("<", lanes, splat(b, b.sub(I64(C), b.add(c0, I64(v * VW))), VW))
                 for v in range(MEAN_VECTORS)] if ragged else None
        slots = [em.alloca(vec) for _ in range(MEAN_VECTORS)]
        for sl in slots:
            b.store(zero, sl)

        def position(p):
            row = b.gep(base, [b.mul(p, I64(C * 4))], source_etype=I8, inbounds=True)
            for v, sl in enumerate(slots):
                at = b.gep(row, [I64(v * VW * 4)], source_etype=I8)
                got = (b.call(mload, [at, I32(4), masks[v], zero]) if ragged else
                       b.load(b.bitcast(at, vec.as_pointer()), typ=vec, align=4))
                b.store(b.fadd(b.load(sl, typ=vec), got), sl)
        em.loop_range(I64(0), I64(H * W), position)
        out = byte_ptr(em, st.buf, b.mul(b.add(b.mul(n, I64(C)), c0), I64(4)))
        for v, sl in enumerate(slots):
            at = b.gep(out, [I64(v * VW * 4)], source_etype=I8)
            value = b.fdiv(b.load(sl, typ=vec), count)
            if ragged:
                b.call(mstore, [value, at, I32(4), masks[v]])
            else:
                b.store(value, b.bitcast(at, vec.as_pointer()), align=4)

    em.loop_range(begin, end, unit)
    b.ret_void()
    return N * blocks, 1
