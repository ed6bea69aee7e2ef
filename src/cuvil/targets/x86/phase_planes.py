"""The pass that stores a convolution's input as phase planes (:mod:`cuvil.kernels.phase_planes`) for the int8
(:mod:`cuvil.targets.x86.gemm_int8`, groups of four channel bytes) and bf16 (:mod:`cuvil.targets.x86.gemm_planes`,
pairs of bfloat16 channels) micro-kernels: 4 bytes a position either way, so 16 positions are one 64-byte store.

A unit is one plane (image, channel group, phase). Per grid row and 16 positions, each channel row of the group
is one masked load (padding and the channels past the last read the fill; a strided row takes every ``sw``-th
element), and the kernel's ``word`` turns the rows into the 64 bytes stored. A row's last store runs on into the
next row (stored after it) or the plane's tail; the tail past the grid is filled last.
"""
from __future__ import annotations

from typing import Callable, List, Tuple

import llvmlite.ir as ir

from ..llvm.types import I32, I64, PTR, splat

I8 = ir.IntType(8)
LANES = 16


def emit_phase_planes(km, st, sym: str, spec, per_group: int, elem: ir.Type, fill, word: Callable[[List], ir.Value],
                      tail: ir.Constant) -> Tuple[int, int]:
    """Emit the stage ``st`` (``sym``) storing ``spec``'s planes (an Int8Planes or PairPlanes: ``x``, channels,
    groups, in_hw, begin, strides, phases, grid, plane); ``per_group`` channels a group; ``elem`` the LLVM type
    of x's elements and ``fill`` their padding value; ``word(b, rows)`` the 64-byte vector of 16 positions from the
    group's channel rows (``<16 x elem>`` each, in channel order); ``tail`` the 64-byte vector past the grid.
    Returns (parallel extent, grain)."""
    sh, sw = spec.strides
    xs = spec.x.strides
    esize = elem.width // 8 if isinstance(elem, ir.IntType) else 4
    C, (H, W), (ph0, pw0) = spec.channels, spec.in_hw, spec.begin
    G, F, PL, (Hq, Wq), cols = spec.groups, spec.num_phases, spec.plane, spec.grid, spec.phases[1]
    row_stride = xs[2] if len(xs) == 4 else 0          # (a 1-D convolution's input: one row, H = 1)
    width = LANES * sw
    vt = ir.VectorType(elem, width)
    mt = ir.VectorType(ir.IntType(1), width)
    suffix = f"i{elem.width}" if isinstance(elem, ir.IntType) else "f32"
    mload = km.declare(f"llvm.masked.load.v{width}{suffix}.p0", vt, [PTR, I32, mt, vt])
    fill_v = ir.Constant(vt, [fill] * width)
    lanes = ir.Constant(ir.VectorType(I32, width), list(range(width)))
    pick = ir.Constant(ir.VectorType(I32, LANES), [j * sw for j in range(LANES)])
    em, begin, end = km.kernel(sym)
    b = em.b
    x0 = b.gep(em.base(spec.x), [I64(spec.x.offset)], source_etype=I8, inbounds=True)
    out0 = b.gep(em.base(st.buf), [I64(st.buf.offset)], source_etype=I8, inbounds=True)

    def store(value, ptr):
        b.store(value, b.bitcast(ptr, value.type.as_pointer()), align=4)

    def unit(u):
        n = b.sdiv(u, I64(G * F))
        g, f = b.sdiv(b.srem(u, I64(G * F)), I64(F)), b.srem(u, I64(F))
        rh, rw = b.sdiv(f, I64(cols)), b.srem(f, I64(cols))
        plane = b.gep(out0, [b.mul(u, I64(PL * 4))], source_etype=I8, inbounds=True)
        chans = []
        for i in range(per_group):
            c = b.add(b.mul(g, I64(per_group)), I64(i))
            ok = b.icmp_signed("<", c, I64(C))
            c = b.select(ok, c, I64(C - 1))
            at = b.add(b.mul(n, I64(xs[0])), b.mul(c, I64(xs[1])))
            chans.append((ok, b.gep(x0, [b.mul(at, I64(esize))], source_etype=I8, inbounds=True)))

        def grid_row(a):
            ih = b.sub(b.add(b.mul(a, I64(sh)), rh), I64(ph0))
            row_ok = b.and_(b.icmp_signed(">=", ih, I64(0)), b.icmp_signed("<", ih, I64(H)))
            ih = b.select(row_ok, ih, I64(0))

            def chunk(k):
                b0 = b.mul(k, I64(LANES))
                iw0 = b.sub(b.add(b.mul(b0, I64(sw)), rw), I64(pw0))     # the first lane's input column
                cols_v = b.add(splat(b, b.trunc(iw0, I32), width), lanes)
                in_row = b.and_(b.icmp_signed(">=", cols_v, ir.Constant(lanes.type, [0] * width)),
                                b.icmp_signed("<", cols_v, ir.Constant(lanes.type, [W] * width)))
                rows = []
                for ok, base in chans:
                    mask = b.select(b.and_(ok, row_ok), in_row, ir.Constant(mt, [0] * width))
                    # the address of column iw0 (possibly before the row: only unmasked lanes are read)
                    off = b.mul(b.add(b.mul(ih, I64(row_stride)), iw0), I64(esize))
                    v = b.call(mload, [b.gep(base, [off], source_etype=I8), I32(esize), mask, fill_v])
                    rows.append(b.shuffle_vector(v, ir.Constant(vt, ir.Undefined), pick) if sw > 1 else v)
                store(word(b, rows), b.gep(plane, [b.mul(b.add(b.mul(a, I64(Wq)), b0), I64(4))], source_etype=I8,
                                        inbounds=True))
            em.loop_range(I64(0), I64(-(-Wq // LANES)), chunk)
        em.loop_range(I64(0), I64(Hq), grid_row)

        def tail_store(k):     # positions past the grid: the last store ends at the plane's end
            q = b.add(I64(Hq * Wq), b.mul(k, I64(LANES)))
            q = b.select(b.icmp_signed("<", q, I64(PL - LANES)), q, I64(PL - LANES))
            store(tail, b.gep(plane, [b.mul(q, I64(4))], source_etype=I8, inbounds=True))
        em.loop_range(I64(0), I64(-(-(PL - Hq * Wq) // LANES)), tail_store)

    em.loop_range(begin, end, unit)
    b.ret_void()
    return spec.x.shape[0] * G * F, 1
