"""Lowerings of DFT, STFT and the window functions: direct sums (O(N) per output element) with twiddle
factors computed in float64 from the exact integer phase ``(k * n) mod N``, accumulated in float64 and
rounded once, so structural zeros (the imaginary part of the DC and Nyquist bins) stay below 1e-13 of the
input's scale. No FFT: the cost is N^2 per transformed row, right for the short transforms of audio
front ends, not for long signals."""
from __future__ import annotations

import math

from ...ir.dtype import DType
from ..texpr import I64, binop, call, cast, cmp, const, logic, reduce, select
from .core import TensorFn, lowering

F64 = DType.DOUBLE


def _phase(k, n, length: int):
    """2 pi ((k * n) mod length) / length, in float64."""
    return binop("mul", cast((k * n) % length, F64), const(2 * math.pi / length, F64))


def _scalar_attr(ctx, name, default=None):
    v = ctx.node.attrs.get(name, default)
    return v[0] if isinstance(v, (list, tuple)) else v


@lowering("DFT")
def _dft(ctx):
    x = ctx.input(0)
    rank = len(x.shape)
    axis = int(_scalar_attr(ctx, "axis", -2)) % rank
    length = x.shape[axis]
    inverse, onesided = bool(ctx.attr("inverse", 0)), bool(ctx.attr("onesided", 0))
    n_dft = _scalar_attr(ctx, "dft_length")
    n_dft = int(n_dft) if n_dft is not None else (2 * (length - 1) if inverse and onesided else length)
    complex_in = x.shape[-1] == 2
    out_shape, dt = ctx.out_shape(), ctx.out_dtype()
    # input elements that contribute: the signal truncated or zero-padded to the DFT length (an inverse
    # one-sided transform reads the N/2 + 1 non-redundant bins)
    terms = min(length, n_dft // 2 + 1 if inverse and onesided else n_dft)
    scale = 1.0 / n_dft if inverse else 1.0

    def parts(idx, n):
        src = list(idx)
        src[axis] = n
        xr = cast(x(src[:-1] + [const(0, I64)]), F64)
        xi = cast(x(src[:-1] + [const(1, I64)]), F64) if complex_in else None
        theta = _phase(idx[axis], n, n_dft)
        return xr, xi, call("cos", theta), call("sin", theta)

    def real_part(idx):
        def term(n):
            xr, xi, c, s = parts(idx, n)
            if not inverse:                                    # Re(x e^{-i theta})
                v = binop("mul", xr, c)
                return v if xi is None else binop("add", v, binop("mul", xi, s))
            v = binop("mul", xr, c)                            # Re(x e^{+i theta})
            v = v if xi is None else binop("sub", v, binop("mul", xi, s))
            if onesided:   # the bins a Hermitian spectrum holds twice: all but DC and (even N) Nyquist
                once = cmp("eq", n, const(0, I64))
                if n_dft % 2 == 0:
                    once = logic("or", once, cmp("eq", n, const(n_dft // 2, I64)))
                v = binop("mul", v, select(once, const(1.0, F64), const(2.0, F64)))
            return v
        return reduce("sum", [terms], term, F64)

    def imag_part(idx):
        def term(n):
            xr, xi, c, s = parts(idx, n)
            sign = 1.0 if inverse else -1.0                    # Im(x e^{-+i theta})
            v = binop("mul", const(sign, F64), binop("mul", xr, s))
            return v if xi is None else binop("add", v, binop("mul", xi, c))
        return reduce("sum", [terms], term, F64)

    def f(idx):
        re = real_part(idx)
        v = re if out_shape[-1] == 1 else select(cmp("eq", idx[-1], const(0, I64)), re, imag_part(idx))
        return cast(binop("mul", v, const(scale, F64)) if scale != 1.0 else v, dt)
    return [TensorFn(out_shape, dt, f, "complex")]


@lowering("STFT")
def _stft(ctx):
    x, window = ctx.input(0), ctx.input(2)
    step = int(_scalar_attr(ctx, "frame_step"))
    flen = window.shape[0] if window is not None else int(_scalar_attr(ctx, "frame_length"))
    complex_in = x.shape[-1] == 2
    out_shape, dt = ctx.out_shape(), ctx.out_dtype()

    def component(idx, imag: bool):
        b, t, k = idx[0], idx[1], idx[2]

        def term(n):
            pos = t * step + n
            xr = cast(x([b, pos, const(0, I64)]), F64)
            xi = cast(x([b, pos, const(1, I64)]), F64) if complex_in else None
            if window is not None:
                w = cast(window([n]), F64)
                xr = binop("mul", xr, w)
                xi = binop("mul", xi, w) if xi is not None else None
            theta = _phase(k, n, flen)
            c, s = call("cos", theta), call("sin", theta)
            if not imag:                                         # Re(x e^{-i theta})
                v = binop("mul", xr, c)
                return v if xi is None else binop("add", v, binop("mul", xi, s))
            v = binop("mul", const(-1.0, F64), binop("mul", xr, s))
            return v if xi is None else binop("add", v, binop("mul", xi, c))
        return reduce("sum", [flen], term, F64)

    def f(idx):
        return cast(select(cmp("eq", idx[3], const(0, I64)), component(idx, False), component(idx, True)), dt)
    return [TensorFn(out_shape, dt, f, "complex")]


# a0 - a1 cos(theta) + a2 cos(2 theta), ONNX's coefficients
_WINDOWS = {"HannWindow": (0.5, 0.5, 0.0), "HammingWindow": (25 / 46, 21 / 46, 0.0),
            "BlackmanWindow": (0.42, 0.5, 0.08)}


@lowering("HannWindow", "HammingWindow", "BlackmanWindow")
def _window(ctx):
    (size,) = ctx.out_shape()
    a0, a1, a2 = _WINDOWS[ctx.node.op]
    period = size if ctx.attr("periodic", 1) else size - 1
    step = 2 * math.pi / period if period else math.nan   # a symmetric window of size 1: 0/0, as ONNX's body
    dt = ctx.out_dtype()

    def f(idx):
        theta = binop("mul", cast(idx[0], F64), const(step, F64))
        v = binop("sub", const(a0, F64), binop("mul", const(a1, F64), call("cos", theta)))
        if a2:
            v = binop("add", v, binop("mul", const(a2, F64), call("cos", binop("mul", theta, const(2.0, F64)))))
        return cast(v, dt)
    return [TensorFn((size,), dt, f, "elementwise")]

