"""Signal processing: DFT, STFT, the Hann/Hamming/Blackman windows and MelWeightMatrix.

Their sizes (DFT's length and axis, STFT's step and frame length, a window's size, every MelWeightMatrix
input) are values that decide output shapes: they must be constants (the ONNX backend compiles graph inputs
that hold them in as constants).
"""
from __future__ import annotations

from typing import Optional

from ..dtype import DType
from ..registry import InferCtx, op
from ..types import TensorType


def scalar_value(ctx: InferCtx, name: str, i: int, what: str, required: bool = False) -> Optional[int]:
    """An integer that decides the output's shape: a lifted attribute or a constant scalar input."""
    v = ctx.attr_or_input(name, i) if name else None
    if v is None and not name and ctx.has_input(i):
        c = ctx.const(i)
        v = None if c is None else c.tolist()
    if isinstance(v, list):
        if len(v) != 1:
            ctx.fail(f"{what} must be a scalar, got {v}")
        v = v[0]
    if v is None:
        if required or ctx.has_input(i):
            ctx.fail(f"{what} must be a constant (it decides the output's shape)")
        return None
    return int(v)


def dft_geometry(ctx: InferCtx):
    """(axis, signal length L, DFT length N, output length along the axis) of a DFT node."""
    s = ctx.shape(0)
    r = len(s)
    if r < 2 or s[-1] not in (1, 2):
        ctx.fail(f"input must be [..., signal, 1 or 2] (real or complex), got {list(s)}")
    axis = scalar_value(ctx, "axis", 2, "axis")
    axis = ctx.axis(-2 if axis is None else axis, r)
    if axis == r - 1:
        ctx.fail("axis must not be the last (real/imaginary) dimension")
    length = s[axis]
    if not isinstance(length, int):
        ctx.fail(f"the transformed axis must have a static size, got {length}")
    inverse, onesided = bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0))
    n = scalar_value(ctx, "dft_length", 1, "dft_length")
    if n is None:
        n = 2 * (length - 1) if inverse and onesided else length
    if n < 1:
        ctx.fail(f"dft_length must be positive, got {n}")
    if inverse and onesided:
        out_len = n
    elif onesided:
        out_len = n // 2 + 1
    else:
        out_len = n
    return axis, length, n, out_len


@op("DFT", lifted=(("dft_length", 1, "i64"), ("axis", 2, "i64")))
def dft(ctx: InferCtx):
    axis, _, _, out_len = dft_geometry(ctx)
    s = list(ctx.shape(0))
    s[axis] = out_len
    inverse, onesided = bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0))
    if onesided and not inverse and s[-1] == 2:
        ctx.fail("onesided needs a real input (last dimension 1)")
    s[-1] = 1 if inverse and onesided else 2
    return TensorType(ctx.dtype(0), tuple(s))


def stft_geometry(ctx: InferCtx):
    """(frame step, frame length, number of frames, number of frequencies) of an STFT node."""
    s = ctx.shape(0)
    if len(s) != 3 or s[2] not in (1, 2) or not isinstance(s[1], int):
        ctx.fail(f"signal must be [batch, length (static), 1 or 2], got {list(s)}")
    step = scalar_value(ctx, "frame_step", 1, "frame_step", required=True)
    flen = scalar_value(ctx, "frame_length", 3, "frame_length")
    if ctx.has_input(2):
        w = ctx.shape(2)
        if len(w) != 1 or not isinstance(w[0], int):
            ctx.fail(f"window must be 1-D with a static length, got {list(w)}")
        if flen is not None and flen != w[0]:
            ctx.fail(f"frame_length {flen} differs from the window's length {w[0]}")
        flen = w[0]
    if flen is None:
        ctx.fail("STFT needs a window or a frame_length")
    if step < 1 or flen < 1 or flen > s[1]:
        ctx.fail(f"frame_step {step} and frame_length {flen} do not fit a signal of length {s[1]}")
    frames = (s[1] - flen) // step + 1
    onesided = bool(ctx.attr("onesided", 1))
    if onesided and s[2] == 2:
        ctx.fail("onesided needs a real signal (last dimension 1)")
    return step, flen, frames, flen // 2 + 1 if onesided else flen


@op("STFT", lifted=(("frame_step", 1, "i64"), ("frame_length", 3, "i64")))
def stft(ctx: InferCtx):
    _, _, frames, freqs = stft_geometry(ctx)
    return TensorType(ctx.dtype(0), (ctx.shape(0)[0], frames, freqs, 2))


def _output_dtype(ctx: InferCtx) -> DType:
    code = ctx.attr("output_datatype", 1)
    try:
        dt = DType(code)
    except ValueError:
        ctx.fail(f"output_datatype {code} is not supported")
    if not (dt.is_float or dt.is_int) or dt.narrow_bits:
        ctx.fail(f"output_datatype must be a float or integer type, got {dt.name}")
    return dt


@op("HannWindow", "HammingWindow", "BlackmanWindow", lifted=(("size", 0, "i64"),))
def window(ctx: InferCtx):
    size = scalar_value(ctx, "size", 0, "size", required=True)
    if size < 0:
        ctx.fail(f"size must not be negative, got {size}")
    return TensorType(_output_dtype(ctx), (size,))


@op("MelWeightMatrix")
def mel_weight_matrix(ctx: InferCtx):
    bins = scalar_value(ctx, "", 0, "num_mel_bins", required=True)
    n = scalar_value(ctx, "", 1, "dft_length", required=True)
    if bins < 1 or n < 1:
        ctx.fail(f"num_mel_bins {bins} and dft_length {n} must be positive")
    return TensorType(_output_dtype(ctx), (n // 2 + 1, bins))
