"""The part of the GPU matrix-product kernels that walks tiles and chunks, shared by the tensor-core kernel
(:mod:`cuvil.targets.ptx.matmul_mma`) and the SIMT float32 kernel (:mod:`cuvil.targets.ptx.matmul_simt`):
which tile a block id names (and the batch indices it binds), which tile elements each thread loads per
chunk, and the register fetch of those elements through the stage's own expression at clamped indices.

Each function emits the same instructions in the same order as the inline code it replaced (the generated
PTX is byte-identical: ``scripts/ptx_digest.py``)."""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import llvmlite.ir as ir

from ..llvm.types import I32, I64


def divmod_c(b: ir.IRBuilder, x, d: int):
    """(x / d, x % d) of an unsigned 32-bit index by a constant."""
    return b.udiv(x, I32(d)), b.urem(x, I32(d))


def clamp(b: ir.IRBuilder, x, hi: int):
    """``min(x, hi - 1)`` of an unsigned index: rows past the matrix read its last row (never stored)."""
    return b.select(b.icmp_unsigned("<", x, I32(hi)), x, I32(hi - 1))


def load_slot_indices(b: ir.IRBuilder, tid, threads: int, tk: int, n: int, rows: int,
                      kfast: bool) -> List[Tuple[ir.Value, ir.Value]]:
    """(row, k) within the chunk tile of each of the thread's ``n`` load slots: slot j is the element
    ``e = tid + j * threads``, (row, k) = divmod(e, tk) when k varies fastest in memory, else (e % rows, e // rows)."""
    out = []
    for j in range(n):
        e = b.add(tid, I32(j * threads))
        if kfast:
            r, kk = divmod_c(b, e, tk)
        else:
            kk, r = divmod_c(b, e, rows)
        out.append((r, kk))
    return out


def bind_tile(b: ir.IRBuilder, em, bid64, plan, bvars: Sequence[str]):
    """The first row and column (m0, n0) of the output tile of block ``bid64`` (tiles numbered n fastest, then
    m, then the batch indices of ``plan.batch``, which are bound in ``em.env`` to the stage's ``bvars``)."""
    bid = b.trunc(bid64, I32)
    rest, nt = divmod_c(b, bid, plan.tiles_n)
    bb, mt = divmod_c(b, rest, plan.tiles_m)
    m0 = b.mul(mt, I32(plan.bm))
    n0 = b.mul(nt, I32(plan.bn))
    bidx = []
    r_ = bb
    for d in reversed(plan.batch[1:]):
        r_, q = divmod_c(b, r_, d)
        bidx.append(q)
    if plan.batch:
        bidx.append(r_)
    bidx = bidx[::-1]
    for v, x in zip(bvars, bidx):
        em.env[v] = b.zext(x, I64)
    return m0, n0


def fetch_chunk(b: ir.IRBuilder, em, k0, operands, kv: str, K: int, tk: int,
                value: Callable, zero: ir.Constant) -> None:
    """Each operand's elements of the chunk at ``k0`` into the thread's registers: ``operands`` holds
    (registers, slots, factor, tile origin, extent, index variable) per operand; the factor is evaluated by
    ``value`` with its row index clamped into the matrix and ``k`` clamped into ``[0, K)``, and a term past
    ``K`` is ``zero``."""
    for regs, slots, f, base, hi, var in operands:
        for reg, (r, kk) in zip(regs, slots):
            k = b.add(k0, kk)
            em.memo.append(dict(em.memo[-1]))
            em.env[var] = b.zext(clamp(b, b.add(base, r), hi), I64)
            em.env[kv] = b.zext(clamp(b, k, K) if K % tk else k, I64)
            v = value(f)
            em.memo.pop()
            if K % tk:
                v = b.select(b.icmp_unsigned("<", k, I32(K)), v, zero)
            b.store(v, reg)
