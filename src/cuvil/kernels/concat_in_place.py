"""Producers that write their slice of a concatenation in place: no copy pass for a stored Concat.

A Concat that is stored (its reader is a convolution or a pool, which read a buffer) is split into one stage per
piece (:func:`cuvil.kernels.schedule.split_piecewise`), each copying one input into its slice. Where a piece's
input ``A`` is itself stored (the output of a convolution: SqueezeNet's expand 1x1 and 3x3 pairs, Inception's
four branches), that copy reads ``A`` once more and writes it again: SqueezeNet 1.0 spent 0.29 of its 5.4 ms in
such copies (one thread, a 2-core Xeon of family 6, model 167; bench/RESULTS.md session 18).

When ``A`` has one writer, that writer writes the whole of it, and the piece's copy is its only reader, ``A``
becomes a view of the concatenation's bytes (:class:`cuvil.kernels.texpr.Buf` ``root`` / ``shift``, row-major
like any buffer): its producer's kernel, whatever kind it is (a GEMM, a Winograd output transform, a generic
loop), writes where the copy would have, and the copy stage is dropped. That needs the slice to be contiguous:
every dim before the concatenation's axis is 1 (batch 1 for a channel Concat in NCHW), all dims static, and the
slice's first byte 64-byte aligned like every arena buffer, so no kernel sees a less aligned buffer than before.

Values are bit for bit those of the copy (the producer stores what the copy would have read, same dtype), and
the memory plan keeps the concatenation's bytes live from its first producer's write to its last reader (the
view's root is the concatenation: :func:`cuvil.kernels.schedule._plan_arena` plans roots).
"""
from __future__ import annotations

import math
from typing import List, Optional

from ..ir.dtype import DType
from .texpr import Buf, is_var_minus, users_by_storage


def write_concats_in_place(stages: List, arena_base: int, align: int) -> List[str]:
    """Turns every eligible (producer, concatenation piece) pair of ``stages`` (reads already set) in place:
    the producer's buffer becomes a view of the piece's slice and the piece is removed from ``stages``.
    ``align``: the arena plan's alignment of a buffer (bytes); a slice starting elsewhere is left copied.
    Returns the names of the values written in place (the manifest's ``concats_in_place``)."""
    writers, readers = users_by_storage(stages)
    done, dropped = [], set()
    for piece in stages:
        src, shift = _copied_slice(piece, align)
        if src is None or src.base != arena_base or src.root is not None:
            continue
        ws, rs = writers.get(id(src), []), readers.get(id(src), [])
        if len(ws) != 1 or ws[0] is piece or any(r is not piece for r in rs):
            continue
        producer = ws[0]
        if producer.buf is not src or producer.region is not None or producer.guard is not None:
            continue
        dst = piece.buf
        if dst.base != arena_base or dst.root is not None or dst.pitch is not None:
            continue
        src.root, src.shift = dst, shift
        dropped.add(id(piece))
        done.append(src.name)
    if dropped:
        stages[:] = [st for st in stages if id(st) not in dropped]
    return done


def _copied_slice(piece, align: int) -> "tuple[Optional[Buf], int]":
    """(the buffer a concatenation piece copies whole into a contiguous, aligned slice of its own buffer, the
    slice's first byte), or (None, 0). The piece is exactly ``dst[..., i, ...] = src[..., i - lo, ...]`` over
    ``lo <= i < hi`` of one axis (its region), ``src`` the shape of that slice."""
    e, dst = piece.expr, piece.buf
    if (e.op == "cast" and e.dtype == DType.FLOAT and e.args and e.args[0].op == "load"
            and isinstance(e.args[0].attr, Buf) and e.args[0].attr.dtype == dst.dtype
            and dst.dtype in (DType.BFLOAT16, DType.FLOAT16)):
        e = e.args[0]        # (a 16-bit float widened exactly, stored back in its own format: a copy)
    if piece.region is None or piece.guard is not None or e.op != "load" or not isinstance(e.attr, Buf):
        return None, 0
    src: Buf = e.attr
    axis, lo, hi = piece.region
    shape = tuple(dst.shape)
    if not all(isinstance(d, int) for d in shape + tuple(src.shape) + (lo, hi)):
        return None, 0      # symbolic extents
    if src.dtype != dst.dtype or src.pitch is not None or len(src.shape) != len(shape) or len(e.args) != len(shape):
        return None, 0
    if tuple(src.shape) != shape[:axis] + (hi - lo,) + shape[axis + 1:]:
        return None, 0
    if any(d != 1 for d in shape[:axis]):
        return None, 0      # the slice is not contiguous
    names = [v.attr for v in piece.vars]
    for k, (a, n) in enumerate(zip(e.args, names)):
        if not (is_var_minus(a, n, lo) if k == axis else a.op == "var" and a.attr == n):
            return None, 0
    shift = lo * math.prod(shape[axis + 1:]) * dst.dtype.itemsize
    if shift % align:
        return None, 0
    return src, shift
