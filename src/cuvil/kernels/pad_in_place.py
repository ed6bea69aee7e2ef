"""Producers that write into their reader's padded buffer: no padded copy of a bf16 convolution's output.

A padded convolution reads a zero-bordered copy of its input (``padwin`` stages,
:func:`cuvil.kernels.lower.windows.padded_window_input`): a pass that reads the producer's output and writes
it again, one pixel further in. On ResNet-50 bf16 on AMX the copies cost 1.8-2.0 ms of ~10 (one thread,
bench/amx_layer_profile.py). Where the copied tensor ``A`` has one writer, a bf16 convolution (its epilogue
the AMX / AVX512_BF16 one), and no reader but the copy, ``A`` becomes a *pitched view* of the padded buffer's
interior (:class:`cuvil.kernels.texpr.Buf` ``pitch`` / ``shift``): the convolution's epilogue stores its
rows ``W + pads`` elements apart (:func:`cuvil.targets.x86.gemm.vector_epilogue`), and the copy stage is left
writing only the border (``PadWindow.in_place``: :mod:`cuvil.targets.x86.pad` skips the interior; a backend
that evaluates the stage's plain expression copies each interior element onto itself, which is correct).

The border must be zero (the fill) when the reader runs, and the arena is reused: other buffers live in the
padded buffer's bytes before the producer runs. The border is therefore written at every run, by the copy
stage that now writes only it (a ring of ``2 (H + W) + 4`` pixels a channel: 0.9% of a 56x56 map's copy),
rather than keeping the padded buffer out of the arena's reuse, which would cost its whole size in every
plan (ResNet-50: ~4 MB an image for 16 padded inputs) to save a pass that costs almost nothing.

Values are bit for bit those of the copy: the producer stores what the copy would have read (same dtype, the
same rounding), and the border holds the same fill.

Opt-in (``schedule(pad_in_place=True)``; x86: ``X86Tuning(pad_in_place=True)``): measured on ResNet-50 bf16 on
a 2-core Xeon with AMX, the copies' time went and the 3x3 readers slowed by about as much, the copy pass having
left their input fresh in L2 (bench/PRECISION.md, 2026-12-03 session 15).
"""
from __future__ import annotations

from typing import List

from ..ir.dim import SymExpr
from ..ir.dtype import DType
from .contraction import Contraction, PadWindow
from .contraction_nhwc import ChannelsLastContraction, ChannelsLastRows, is_channels_last
from .texpr import Buf, is_var_minus, top_level, users_by_storage


def write_pads_in_place(stages: List, arena_base: int) -> List[str]:
    """Turns every eligible (producer, padded copy) pair of ``stages`` (reads already set) in place: the
    producer's buffer becomes a pitched view of the copy's, the copy writes only the border. Returns the names
    of the values written in place (the manifest's ``pads_in_place``)."""
    writers, readers = users_by_storage(stages)
    done = []
    for pad in stages:
        src = _copied_buffer(pad)
        if src is None or src.base != arena_base or src.root is not None or src.dtype != pad.buf.dtype:
            continue
        ws, rs = writers.get(id(src), []), readers.get(id(src), [])
        if len(ws) != 1 or any(r is not pad for r in rs) or not _bf16_convolution(ws[0], src):
            continue
        spec: PadWindow = pad.expr.attr
        dst = pad.buf
        if dst.root is not None or dst.pitch is not None or dst.base != arena_base:
            continue
        strides = dst.strides
        src.root, src.pitch = dst, tuple(strides)
        src.shift = sum(b0 * s for b0, s in zip(spec.begin, strides[2:])) * dst.dtype.itemsize
        spec.in_place = True
        done.append(src.name)
    return done


def _copied_buffer(pad) -> "Buf | None":
    """The buffer a 2-D zero-padded copy stage copies (its interior exactly ``src[n, c, h - b0, w - b1]``),
    or None."""
    e = pad.expr
    if pad.region is not None or pad.guard is not None or e.op != "padwin" or not isinstance(e.attr, PadWindow):
        return None
    spec: PadWindow = e.attr
    if spec.in_place or len(spec.begin) != 2 or len(pad.buf.shape) != 4 or spec.fill != 0:
        return None
    inner = spec.interior()
    if inner.op == "cast" and inner.args[0].op == "load":     # a bfloat16 input as its float32 readers see it
        inner = inner.args[0]
    if inner.op != "load" or not isinstance(inner.attr, Buf):
        return None
    src = inner.attr
    names = [v.attr for v in pad.vars]
    if len(inner.args) != 4 or any(a.op != "var" or a.attr != n for a, n in zip(inner.args[:2], names)):
        return None
    for a, n, b0 in zip(inner.args[2:], names[2:], spec.begin):
        if not is_var_minus(a, n, b0):
            return None
    if tuple(src.shape[2:]) != tuple(spec.sizes) or any(isinstance(d, SymExpr) for d in src.shape[1:]) \
            or tuple(src.shape[:2]) != tuple(pad.buf.shape[:2]) or src.pitch is not None:
        return None
    return src



def _bf16_convolution(st, buf: Buf) -> bool:
    """``st`` writes the whole of ``buf`` (no region, no guard) with one bf16 convolution contraction at its top
    level (its epilogue the vector one of the bf16 kernels)."""
    if st.buf is not buf or st.region is not None or st.guard is not None:
        return False
    found, reductions = top_level(st.expr, "contract")
    return (len(found) == 1 and not reductions and isinstance(found[0].attr, Contraction)
            and found[0].attr.precision == "bf16" and not found[0].attr.pads)


def write_rows_in_place(stages: List, arena_base: int) -> List[str]:
    """The same for the channels-last rows of a stride-1 window (:class:`cuvil.kernels.contraction_nhwc.ChannelsLastRows`
    of one phase: a 3x3 convolution's zero-bordered input): where the copied value is channels-last bfloat16 with
    whole blocks of 32 channels, written whole by one channels-last convolution and read by the copy alone, it
    becomes a view of the rows' interior (its positions ``Wq * C`` apart a row, ``Hq * Wq * C`` an image), its
    producer's epilogue stores there, and the copy writes only the zeros around it (``ChannelsLastRows.in_place``).
    Returns the names of the values written in place."""
    writers, readers = users_by_storage(stages)
    done = []
    for rows in stages:
        e = rows.expr
        if rows.region is not None or rows.guard is not None or e.op != "nhwc_rows" \
                or not isinstance(e.attr, ChannelsLastRows):
            continue
        spec: ChannelsLastRows = e.attr
        src, dst = spec.x, rows.buf
        if (spec.in_place or tuple(spec.phases) != (1, 1) or tuple(spec.strides) != (1, 1) or not is_channels_last(src)
                or src.dtype != DType.BFLOAT16 or src.root is not None or src.base != arena_base
                or dst.dtype != DType.BFLOAT16 or dst.root is not None or dst.pitch is not None or dst.base != arena_base
                or len(dst.shape) != 4 or dst.shape[1] != 1 or dst.shape[3] != spec.channels):
            continue
        (hq, wq), (t, l), (h, w) = spec.grid, spec.begin, spec.in_hw
        if t < 0 or l < 0 or t + h > hq or l + w > wq or not all(isinstance(d, int) for d in src.shape[1:]):
            continue
        ws, rs = writers.get(id(src), []), readers.get(id(src), [])
        if len(ws) != 1 or any(r is not rows for r in rs) or not _channels_last_convolution(ws[0], src):
            continue
        c = spec.channels
        src.root, src.pitch = dst, (hq * wq * c, 1, wq * c, c)
        src.shift = (t * wq + l) * c * dst.dtype.itemsize
        spec.in_place = True
        done.append(src.name)
    return done


def _channels_last_convolution(st, buf: Buf) -> bool:
    """``st`` writes the whole of ``buf`` (no region, no guard) with one channels-last convolution."""
    if st.buf is not buf or st.region is not None or st.guard is not None:
        return False
    found, reductions = top_level(st.expr, "contract")
    return len(found) == 1 and not reductions and isinstance(found[0].attr, ChannelsLastContraction)
