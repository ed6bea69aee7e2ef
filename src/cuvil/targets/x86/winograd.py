"""Transform kernels of Winograd convolutions (see :class:`cuvil.kernels.contraction.WinogradInput` /
:class:`~cuvil.kernels.contraction.WinogradOutput`; the GEMM between them is the packed contraction of
:mod:`cuvil.targets.x86.gemm`).

Both vectorise over ``VW`` neighbouring tiles of one tile row, with the matrices' entries as constants in
straight-line code (zeros skipped, +-1 as adds and subtracts):

* input (unit: image, channel, tile row): for each of the m+2 input rows, two wide loads, masked to the
  unpadded input (the padding and the last tiles' overhang read as zeros; rows outside it load nothing),
  cover the ``VW`` tiles' columns and stride-m shuffles split them into the m+2 column vectors; then ``Bt d B``
  (rows, then columns) gives the (m+2)^2 transformed vectors, each stored as ``VW`` consecutive tiles of
  its row of V (masked on the last, partial block);
* output (unit: image, output channel, tile row): the (m+2)^2 vectors of M are read (consecutive tiles),
  ``At M A`` gives m x m vectors, interleaved into m output rows of ``m*VW`` pixels on a stack tile; the
  stage's epilogue (bias, activation, residual add) runs over the tile and copies the rows out
  (:func:`cuvil.targets.x86.gemm.tile_epilogue`).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import llvmlite.ir as ir

from ...ir.dim import product
from ...ir.dtype import DType
from ...ir.ops.winograd import MATRICES
from ...kernels.contraction import WinogradInput, WinogradOutput, fallback_weights
from ...kernels.schedule import Stage
from ..llvm.narrow import I16
from ..llvm.types import F32, I1, I32, I64, PTR, splat
from .gemm import batch_only, find_contraction, tile_epilogue
from .gemm_bf16 import to_bf16


def _vec_tools(km, em, n: int):
    b = em.b
    vec = ir.VectorType(F32, n)
    mvec = ir.VectorType(I1, n)
    lanes = ir.Constant(ir.VectorType(I64, n), list(range(n)))


    def mask(limit):
        """Lanes l < limit (an i64 value)."""
        return b.icmp_signed("<", lanes, splat(b, limit, n))
    store = km.declare(f"llvm.masked.store.v{n}f32.p0", ir.VoidType(), [vec, PTR, I32, mvec])
    # Loads wider than the target's vectors (the input transform's m * vw floats) are issued as masked loads of
    # its width and concatenated: LLVM 22 split one v32f32 masked load on AVX2 into four vmaskmovps but emitted
    # a plain vmovups for a part whose lanes were all masked off, and its values reached the transform: wrong
    # outputs at the right edge of interior tile rows (SqueezeNet compiled for x86-64-v3: relative error
    # 6.4e-3 against onnxruntime; a 27x27 F(4x4) layer: 280 of 14,580 outputs off by up to 1.03;
    # tests/test_winograd.py::test_avx2_input_transform_edges)
    nat = min(n, max(4, km.vector_bits // 32))
    nvec = ir.VectorType(F32, nat)
    load = km.declare(f"llvm.masked.load.v{nat}f32.p0", nvec, [PTR, I32, ir.VectorType(I1, nat), nvec])
    nzero = ir.Constant(nvec, [0.0] * nat)

    def masked_load(p, m):
        if n == nat:
            return b.call(load, [p, I32(4), m, nzero])
        parts = [b.call(load, [b.gep(p, [I64(i)], source_etype=F32), I32(4),
                               b.shuffle_vector(m, ir.Constant(mvec, ir.Undefined),
                                                ir.Constant(ir.VectorType(I32, nat), list(range(i, i + nat)))), nzero])
                 for i in range(0, n, nat)]
        while len(parts) > 1:
            k = parts[0].type.count
            parts = [b.shuffle_vector(parts[j], parts[j + 1], ir.Constant(ir.VectorType(I32, 2 * k), list(range(2 * k))))
                     for j in range(0, len(parts), 2)]
        return parts[0]
    return vec, mask, masked_load, (lambda v, p, m: b.call(store, [v, p, I32(4), m]))


def transform_lanes(vw: int, tiles_per_row: int) -> int:
    """Tiles per vector of the transform kernels on a target with ``vw`` floats per vector: ``vw``, or 4 for
    rows of at most 4 tiles (7x7 and 14x14 maps), which would otherwise leave half the lanes idle and every
    store masked (the cost model counts the same, :func:`cuvil.targets.x86.choose.winograd_cost`). The output
    transform takes whole tile rows per vector where two or more fit (:func:`rows_per_vector`, session 36); the
    cost model still counts it this way, as the algorithm choice was fitted (choices unchanged)."""
    return 4 if tiles_per_row <= 4 else max(4, vw)


def _lanes(km, tiles_per_row: int) -> int:
    return transform_lanes(km.vector_bits // 32, tiles_per_row)


def rows_per_vector(vw: int, tiles_per_row: int, tile_rows: int) -> int:
    """Tile rows the output transform takes per vector of ``vw`` lanes: as many whole rows as fit where
    at least two do (a 13x13 map's F(4x4) rows of 4 tiles: 4 rows, all 16 of its tiles; 27x27's rows of 7:
    2 rows, 14 lanes, where one row per vector used 7 of 16 lanes), else 1 (rows of ``transform_lanes``
    lanes, in blocks); never more than the map's ``tile_rows``. M stores a channel's tiles row after row, so R
    rows are one contiguous load. Zen 4,
    whole libraries (bench/ab_libs.py, in kernels, 1 / 2 threads), the output transforms: SqueezeNet 0.73 /
    0.75, ResNet-50 fp32 0.83, bf16 0.93 / 0.93, Inception-v1 0.95 / 0.89; the same bits."""
    return min(vw // tiles_per_row, tile_rows) if 2 * tiles_per_row <= vw else 1


def _combine(b, coeffs, vals, vec):
    """sum of c * v over the non-zero coefficients (Fractions), +-1 without a multiply."""
    acc = None
    for c, v in zip(coeffs, vals):
        if c == 0:
            continue
        if c == 1 or c == -1:
            term, neg = v, c == -1
        else:
            term, neg = b.fmul(v, ir.Constant(vec, [float(abs(c))] * vec.count)), c < 0
        if acc is None:
            acc = b.fsub(ir.Constant(vec, [0.0] * vec.count), term) if neg else term
        else:
            acc = b.fsub(acc, term) if neg else b.fadd(acc, term)
    return acc if acc is not None else ir.Constant(vec, [0.0] * vec.count)


def _sandwich(b, left, tile: List[List[ir.Value]], right, vec):
    """left @ tile @ right.T on a grid of vectors."""
    rows = [[_combine(b, lr, [tile[p][q] for p in range(len(lr))], vec) for q in range(len(tile[0]))] for lr in left]
    return [[_combine(b, rr, row, vec) for rr in right] for row in rows]


def _tile_row(b, u, TH: int, TW: int, channels: int, a: int, interleaved: bool = False, row_len: int = 0):
    """Unit u of a transform kernel = (image n, channel ch, tile row th), th fastest: returns n*channels + ch,
    th, and the offset of the tile row in the transformed tensor [N, a*a*channels, TH*TW] (element 0): at
    row e*channels + ch of image n, or ch*a*a + e when ``interleaved`` (V, see WinogradInput). ``row_len``:
    elements from one row to the next (M's pitch, :func:`cuvil.kernels.contraction.winograd_m_row`; 0: TH*TW)."""
    th = b.srem(u, I64(TH))
    nch = b.sdiv(u, I64(TH))
    if interleaved:
        row = b.add(b.mul(nch, I64(a * a * TH * TW)), b.mul(th, I64(TW)))
        return nch, th, row
    ch = b.srem(nch, I64(channels))
    n = b.sdiv(nch, I64(channels))
    row = b.add(b.mul(b.add(b.mul(n, I64(a * a * channels)), ch), I64(row_len or TH * TW)), b.mul(th, I64(TW)))
    return nch, th, row


def emit_winograd_input(km, st: Stage, sym: str) -> Optional[Tuple[int, int]]:
    node = find_contraction(st, "wino_in")
    if node is None or not isinstance(node.attr, WinogradInput) or not batch_only(node.attr.x.shape, st.buf.shape) \
            or st.region is not None:
        return None
    spec: WinogradInput = node.attr
    m, a = spec.tile, spec.tile + 2
    bt, _, _ = MATRICES[m]
    C = spec.channels
    TH, TW = spec.tiles
    vw = _lanes(km, TW)
    T = TH * TW
    _, _, H, W = spec.x.shape
    pt, pl = spec.pads
    em, begin, end = km.kernel(sym)
    b = em.b
    wide, wmask, wload, _ = _vec_tools(km, em, vw * m)
    nones = ir.Constant(ir.VectorType(I1, vw * m), [0] * (vw * m))
    vec, vmask, _, vstore = _vec_tools(km, em, vw)
    x_base = b.gep(em.base(spec.x), [I64(spec.x.offset)], source_etype=ir.IntType(8), inbounds=True)
    v_base = b.gep(em.base(st.buf), [I64(st.buf.offset)], source_etype=ir.IntType(8), inbounds=True)
    # V stored as bfloat16 (a bf16 Winograd convolution's, lower/winograd.py): each vector rounded (nearest even)
    # as it is stored, half the bytes written here and read by the GEMM's pair packing
    v16 = st.buf.dtype == DType.BFLOAT16
    velt = I16 if v16 else F32
    h16 = ir.VectorType(I16, vw)
    hstore = (km.declare(f"llvm.masked.store.v{vw}i16.p0", ir.VoidType(), [h16, PTR, I32, ir.VectorType(I1, vw)])
              if v16 else None)

    def fptr(base, off):
        return b.gep(base, [off], source_etype=F32, inbounds=True)

    def vptr(base, off):
        return b.gep(base, [off], source_etype=velt, inbounds=True)
    split = [ir.Constant(ir.VectorType(I32, vw), [r + m * l for l in range(vw)]) for r in range(m)]
    blocks = -(-TW // vw)
    reach = (blocks - 1) * vw * m - pl + m + vw * m      # past a row's start, the last block's loads reach this far
    # Tile rows whose wide loads reach past the end of the input (in its last plane) or before its start (the
    # first plane's row 0, column -pl). Their masked-off lanes lie outside the buffer, and on AVX2 targets
    # LLVM 22 turned a fully masked-off 8-lane part of such a load into a plain load (a 26 x 26 map read 2
    # floats past the input: NaN outputs, or a segfault against an unmapped page;
    # tests/test_x86_gemm.py::test_winograd_reads_nothing_past_the_input): those units load lane by lane,
    # from addresses inside the buffer.
    rows_of = [[th * m + p - pt for p in range(a) if 0 <= th * m + p - pt < H] for th in range(TH)]
    last_edge = [th for th in range(TH) if any(r * W + reach > H * W for r in rows_of[th])]
    first_edge = [th for th in range(TH) if pl > 0 and 0 in rows_of[th]]

    def safe_wload(ptr, mask):
        """The masked load as lane-by-lane loads, each from an address inside the buffer."""
        n = vw * m
        v = ir.Constant(wide, [0.0] * n)
        for lane in range(n):
            ok = b.extract_element(mask, I32(lane))
            addr = b.select(ok, b.gep(ptr, [I64(lane)], source_etype=F32), x_base)
            v = b.insert_element(v, b.select(ok, b.load(addr, typ=F32), ir.Constant(F32, 0.0)), I32(lane))
        return v

    def unit(u):
        nc, th, row = _tile_row(b, u, TH, TW, C, a, interleaved=spec.interleaved)
        plane = fptr(x_base, b.mul(nc, I64(H * W)))
        vrow = vptr(v_base, row)       # V[n, e*C + c (or c*E + e), th*TW + tw] at e = 0
        estride = T if spec.interleaved else C * T
        edge = ir.Constant(I1, 0)
        if last_edge:
            last_nc = b.sub(b.mul(em.index(spec.x.shape[0]), I64(C)), I64(1))    # the batch may be symbolic
            edge = b.or_(edge, b.and_(b.icmp_signed("==", nc, last_nc), b.icmp_signed(">=", th, I64(min(last_edge)))))
        if first_edge:
            edge = b.or_(edge, b.and_(b.icmp_signed("==", nc, I64(0)), b.icmp_signed("<=", th, I64(max(first_edge)))))
        def block(blk, load_fn):
            tw0 = b.mul(blk, I64(vw))
            col0 = b.sub(b.mul(tw0, I64(m)), I64(pl))     # the input column of lane 0
            d = []
            cols = []                    # input columns col0 + h*m + [0, m*vw), masked to [0, W)
            for h in range(2):
                first = b.add(col0, I64(h * m))
                cols.append(b.and_(wmask(b.sub(I64(W), first)), b.not_(wmask(b.sub(I64(0), first)))))
            for p in range(a):
                src = b.sub(b.add(b.mul(th, I64(m)), I64(p)), I64(pt))    # the input row (may be outside)
                inside = b.and_(b.icmp_signed(">=", src, I64(0)), b.icmp_signed("<", src, I64(H)))
                # an outside row is all padding: its pointer is never dereferenced (every lane masked off;
                # no inbounds: lane 0 may lie before the buffer)
                row = b.gep(plane, [b.add(b.mul(b.select(inside, src, I64(0)), I64(W)), col0)], source_etype=F32)
                loads = [load_fn(b.gep(row, [I64(h * m)], source_etype=F32), b.select(inside, cols[h], nones))
                         for h in range(2)]
                d.append([b.shuffle_vector(loads[q // m], ir.Constant(wide, ir.Undefined), split[q % m])
                          for q in range(a)])
            v = _sandwich(b, bt, d, bt, vec)
            left = b.sub(I64(TW), tw0)

            def stores(keep):
                for i in range(a):
                    for j in range(a):
                        dst = vptr(vrow, b.add(I64((i * a + j) * estride), tw0))
                        if v16:
                            bits = b.bitcast(to_bf16(b, v[i][j]), h16)
                            if keep is None:
                                b.store(bits, b.bitcast(dst, h16.as_pointer()), align=2)
                            else:
                                b.call(hstore, [bits, dst, I32(2), keep])
                        elif keep is None:
                            b.store(v[i][j], b.bitcast(dst, vec.as_pointer()), align=4)
                        else:
                            vstore(v[i][j], dst, keep)
            # masked stores are slow (microcoded on AMD cores): only the last, partial block uses them
            with b.if_else(b.icmp_signed(">=", left, I64(vw))) as (full, partial):
                with full:
                    stores(None)
                with partial:
                    stores(vmask(left))

        with b.if_else(edge) as (slow, fast):
            with slow:
                em.loop_range(I64(0), I64(blocks), lambda blk: block(blk, safe_wload))
            with fast:
                em.loop_range(I64(0), I64(blocks), lambda blk: block(blk, wload))

    em.loop_range(begin, end, unit)
    b.ret_void()
    return spec.x.shape[0] * C * TH, 1


def emit_winograd_output(km, st: Stage, sym: str) -> Optional[Tuple[int, int]]:
    node = find_contraction(st, "wino_out")
    if node is None or not isinstance(node.attr, WinogradOutput) or not batch_only(node.attr.m.shape, st.buf.shape) \
            or st.region is not None:
        return None
    spec: WinogradOutput = node.attr
    m, a = spec.tile, spec.tile + 2
    _, _, at = MATRICES[m]
    K = spec.channels
    TH, TW = spec.tiles
    R = rows_per_vector(km.vector_bits // 32, TW, TH)
    vw = km.vector_bits // 32 if R > 1 else _lanes(km, TW)
    # floats from one row of M to the next: TH * TW, or M's pitch where its planes would alias in L1
    # (cuvil.kernels.contraction.winograd_m_row); a row's tiles are contiguous either way
    T = spec.m.strides[1]
    if spec.m.strides[2] != 1 or spec.m.strides[0] != a * a * K * T or T < TH * TW:
        return None
    OH, OW = spec.out_spatial
    em, begin, end = km.kernel(sym)
    b = em.b
    vec, vmask, vload, _ = _vec_tools(km, em, vw)
    wide = ir.VectorType(F32, vw * m)
    tile = em.alloca(wide, m * R)        # R tile rows of m output rows of m*vw pixels (R > 1: m*TW used)
    tile_f = b.bitcast(tile, ir.PointerType(F32))
    m_base = b.gep(em.base(spec.m), [I64(spec.m.offset)], source_etype=ir.IntType(8), inbounds=True)

    def fptr(base, off):
        return b.gep(base, [off], source_etype=F32, inbounds=True)
    # concatenations of vectors, then the interleave out[l*m + q] = o[q][l]
    inter = ir.Constant(ir.VectorType(I32, vw * m), [q * vw + l for l in range(vw) for q in range(m)])

    def concat(vs):
        while len(vs) > 1:
            n = vs[0].type.count
            vs = [b.shuffle_vector(vs[i], vs[i + 1], ir.Constant(ir.VectorType(I32, 2 * n), list(range(2 * n))))
                  for i in range(0, len(vs), 2)]
        return vs[0]

    # The direct convolution at one output (lower.py puts it before the Winograd sum), and a block's test:
    # Winograd's transforms scale the inputs up (F(4x4)'s Bt d B by up to 100), so activations near 1e37
    # overflow to inf and then NaN where the direct sum stays finite. A block with a value that is not finite
    # (v - v is NaN exactly for inf and NaN) is computed again directly, so the step is as finite as direct
    # convolution; finite blocks pay one subtract, compare and or per vector.
    direct = node.args[-2] if len(node.args) == 6 else None
    # W is not stored: each W element is rebuilt from 36 (F(2x2): 16) values of U's panels. Rebuilt once per
    # output channel and kernel call into the thread's scratch (C x 3 x 3 floats) rather than once per output
    # and tap, and summed with the block's outputs innermost, the fallback costs about a scalar direct
    # convolution (F(4x4), 64 -> 64 channels, 28 x 28, every tile tripping: ~50x faster,
    # bench/winograd_fallback.py). The element's and the sum's arithmetic (operations, order, flags) are the
    # direct expression's own, so the outputs are the same bit for bit.
    parts = fallback_weights(node) if direct is not None and km.scratch_index is not None else None
    if parts is not None:
        w_elem, x_term, w_ext = parts
        _, d_vars, _ = direct.attr
        km.scratch_bytes = max(km.scratch_bytes, product(w_ext) * 4)
        w_buf = b.load(b.gep(em.bufs, [I64(km.scratch_index)], source_etype=PTR), typ=PTR)
        w_key = em.alloca(I64)           # the output channel whose W is in scratch (-1: none yet)
        b.store(I64(-1), w_key)

        def w_slot(idx):
            flat = idx[0]
            for i, d in zip(idx[1:], w_ext[1:]):
                flat = b.add(b.mul(flat, I64(d)), i)
            return fptr(w_buf, flat)

        def rebuild(k):
            with b.if_then(b.icmp_signed("!=", b.load(w_key, typ=I64), k), likely=False):
                em.memo.append(dict(em.memo[-1]))
                em.env[node.args[1].attr] = k

                def one(idx):
                    for v, i in zip(d_vars, idx):
                        em.env[v.attr] = i
                    b.store(em.emit(w_elem), w_slot(idx))
                em.loops(list(w_ext), one)
                em.memo.pop()
                b.store(k, w_key)

        def direct_rows(slot, index, nrows, ncols):
            """direct's own reduction (llvm/emitter.py reduce: 0, then + W * x in (c, p, q) order) for every
            output of the block, W read from scratch; the outputs' loop is innermost (the row schedule's
            order, vectorisable), each output's sum still in order."""
            def row(r):
                em.loop_range(I64(0), ncols, lambda j: b.store(ir.Constant(F32, 0.0), slot(r, j)))

                def term(idx):
                    for v, i in zip(d_vars, idx):
                        em.env[v.attr] = i
                    wv = b.load(w_slot(idx), typ=F32)

                    def add(j):
                        for v, i in zip(st.vars, index(r, j)):
                            em.env[v.attr] = i
                        out = b.fadd(b.load(slot(r, j), typ=F32), b.fmul(wv, em.emit(x_term)))
                        out.flags.extend(["reassoc", "contract"])
                        b.store(out, slot(r, j))
                    em.loop_range(I64(0), ncols, add)
                em.loops(list(w_ext), term)
            em.loop_range(I64(0), nrows, row)

    def not_finite(o):
        bad = None
        for vs in o:
            for v in vs:
                d = b.fsub(v, v)
                u = b.fcmp_unordered("uno", d, d)
                bad = u if bad is None else b.or_(bad, u)
        bits = ir.IntType(vw)
        return b.icmp_unsigned("!=", b.bitcast(bad, bits), ir.Constant(bits, 0))

    def direct_tile(slot, index, nrows, ncols, k):
        def one(r, j):
            for v, i in zip(st.vars, index(r, j)):
                em.env[v.attr] = i
            b.store(em.emit(direct), slot(r, j))
        em.memo.append(dict(em.memo[-1]))     # values emitted in the branch stay in it
        if parts is not None:
            rebuild(k)
            direct_rows(slot, index, nrows, ncols)
        else:
            em.loop_range(I64(0), nrows, lambda r: em.loop_range(I64(0), ncols, lambda j: one(r, j)))
        em.memo.pop()

    def group(u):
        """R > 1: unit u = (image, channel, group of R tile rows); its R*TW tiles are one vector (lanes
        i*TW + tw: tile row g*R + i, column tw; a last group of fewer rows masked) and each output row of
        tile row i is the interleave of lanes i*TW .. i*TW + TW - 1 of the m column vectors."""
        G = -(-TH // R)
        g = b.srem(u, I64(G))
        nk = b.sdiv(u, I64(G))
        k = b.srem(nk, I64(K))
        n = b.sdiv(nk, I64(K))
        th0 = b.mul(g, I64(R))
        mrow = fptr(m_base, b.add(b.mul(b.add(b.mul(n, I64(a * a * K)), k), I64(T)), b.mul(th0, I64(TW))))
        tiles_left = b.mul(b.sub(I64(TH), th0), I64(TW))
        keep = vmask(b.select(b.icmp_signed("<", tiles_left, I64(R * TW)), tiles_left, I64(R * TW)))
        mv = [[vload(fptr(mrow, I64((i * a + j) * K * T)), keep) for j in range(a)] for i in range(a)]
        o = _sandwich(b, at, mv, at, vec)
        narrow = ir.VectorType(F32, m * TW)
        for r in range(m):
            cat = concat(o[r]) if m > 1 else o[r][0]
            for i in range(R):
                idx = ir.Constant(ir.VectorType(I32, m * TW), [q * vw + i * TW + t for t in range(TW) for q in range(m)])
                row = b.shuffle_vector(cat, ir.Constant(wide, ir.Undefined), idx) if m > 1 else \
                    b.shuffle_vector(cat, ir.Constant(vec, ir.Undefined), idx)
                dst = b.gep(tile, [I64(i * m + r)], source_etype=wide, inbounds=True)
                b.store(row, b.bitcast(dst, narrow.as_pointer()), align=4)
        rows_left = b.sub(I64(OH), b.mul(th0, I64(m)))
        nrows = b.select(b.icmp_signed("<", rows_left, I64(R * m)), rows_left, I64(R * m))
        ncols = I64(min(OW, m * TW))

        def index(r, j):
            return [n, k, b.add(b.mul(th0, I64(m)), r), j]

        def slot(r, j):
            return b.gep(tile_f, [b.add(b.mul(r, I64(m * vw)), j)], source_etype=F32, inbounds=True)
        if direct is not None:
            with b.if_then(not_finite(o), likely=False):
                direct_tile(slot, index, nrows, ncols, k)
        tile_epilogue(em, st, node, slot, index, nrows, ncols, full=(R * m, min(OW, m * TW)))

    def unit(u):
        nk, th, row = _tile_row(b, u, TH, TW, K, a, row_len=T)
        k = b.srem(nk, I64(K))
        n = b.sdiv(nk, I64(K))
        mrow = fptr(m_base, row)       # M[n, e*K + k, th*TW + tw] at e = 0
        rows_left = b.sub(I64(OH), b.mul(th, I64(m)))
        nrows = b.select(b.icmp_signed("<", rows_left, I64(m)), rows_left, I64(m))

        def block(blk):
            tw0 = b.mul(blk, I64(vw))
            keep = vmask(b.sub(I64(TW), tw0))
            mv = [[vload(fptr(mrow, b.add(I64((i * a + j) * K * T), tw0)), keep) for j in range(a)] for i in range(a)]
            o = _sandwich(b, at, mv, at, vec)
            for r in range(m):
                row = concat(o[r]) if m > 1 else o[r][0]
                row = b.shuffle_vector(row, ir.Constant(wide, ir.Undefined), inter)
                b.store(row, b.gep(tile, [I64(r)], source_etype=wide, inbounds=True), align=4)
            w0 = b.mul(tw0, I64(m))
            cols_left = b.sub(I64(OW), w0)
            ncols = b.select(b.icmp_signed("<", cols_left, I64(m * vw)), cols_left, I64(m * vw))

            def index(r, j):
                return [n, k, b.add(b.mul(th, I64(m)), r), b.add(w0, j)]

            def slot(r, j):
                return b.gep(tile_f, [b.add(b.mul(r, I64(m * vw)), j)], source_etype=F32, inbounds=True)
            if direct is not None:
                with b.if_then(not_finite(o), likely=False):
                    direct_tile(slot, index, nrows, ncols, k)
            tile_epilogue(em, st, node, slot, index, nrows, ncols, full=(m, m * vw))
        em.loop_range(I64(0), I64(-(-TW // vw)), block)

    if R > 1:
        em.loop_range(begin, end, group)
        b.ret_void()
        return spec.m.shape[0] * K * -(-TH // R), 1
    em.loop_range(begin, end, unit)
    b.ret_void()
    return spec.m.shape[0] * K * TH, 1
