"""Winograd convolution: Cuvil's own ops (domain ``ai.cuvil``), introduced by the proved ``on x86`` rules of
``rules/winograd.rule`` for stride-1 3x3 convolutions.

F(m x m, 3x3) computes an m x m tile of outputs from an (m+2) x (m+2) tile ``d`` of the (zero-padded) input
with ``(m+2)^2`` multiplications per (input, output) channel pair instead of ``9 m^2`` (Lavin & Gray 2016):

    Y = At [ (G g Gt) * (Bt d B) ] A          (``*`` elementwise, summed over input channels)

* ``WinogradKernel(W, tile=m)``: ``W[M, C, 3, 3]`` -> ``U[(m+2)^2, M, C]`` with
  ``U[i*(m+2)+j, k, c] = (G W[k, c] Gt)[i, j]`` (constant weights: folded at compile time);
* ``WinogradConv(X, U, B?, tile=m, pads=[t, l, b, r])``: the convolution of ``X[N, C, H, W]`` (zero padding
  ``pads``) with the kernel ``U`` stands for, plus the bias; ``Y[N, M, H+t+b-2, W+l+r-2]``. Tiles past the
  output's edge read zeros and are cropped.

The matrices (exact rationals) live here once; the reference implementation, the Z3 semantics, the lowering
and the x86 kernels read them from :data:`MATRICES`. F(2x2) uses the points (0, 1, -1), F(4x4) (0, +-1, +-2);
the larger tile saves more multiplications and rounds more (its constants reach 8 and 1/24).
"""
from __future__ import annotations

from fractions import Fraction as Fr
from typing import Dict, Tuple

import numpy as np
import onnx
import onnx.defs
from onnx import helper

from ..dim import Dim
from ..registry import CUSTOM_DOMAIN, InferCtx, op, register_custom_schema
from ..types import TensorType

TILES = (2, 4)


def _fr(rows):
    return tuple(tuple(Fr(v) for v in r) for r in rows)


# tile m -> (Bt [(m+2) x (m+2)], G [(m+2) x 3], At [m x (m+2)])
MATRICES: Dict[int, Tuple[tuple, tuple, tuple]] = {
    2: (_fr([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]]),
        _fr([[1, 0, 0], ["1/2", "1/2", "1/2"], ["1/2", "-1/2", "1/2"], [0, 0, 1]]),
        _fr([[1, 1, 1, 0], [0, 1, -1, -1]])),
    4: (_fr([[4, 0, -5, 0, 1, 0], [0, -4, -4, 1, 1, 0], [0, 4, -4, -1, 1, 0], [0, -2, -1, 2, 1, 0],
             [0, 2, -1, -2, 1, 0], [0, 4, 0, -5, 0, 1]]),
        _fr([["1/4", 0, 0], ["-1/6", "-1/6", "-1/6"], ["-1/6", "1/6", "-1/6"], ["1/24", "1/12", "1/6"],
             ["1/24", "-1/12", "1/6"], [0, 0, 1]]),
        _fr([[1, 1, 1, 1, 1, 0], [0, 1, -1, 2, -2, 0], [0, 1, 1, 4, 4, 0], [0, 1, -1, 8, -8, 1]])),
}


def matrices_f64(m: int):
    """(Bt, G, At) as float64 arrays."""
    return tuple(np.array([[float(v) for v in r] for r in mat]) for mat in MATRICES[m])


def tiles_of(out: int, m: int):
    """Tiles of m outputs covering ``out`` (int or symbolic)."""
    return (out + m - 1) // m


def check_tile(ctx: InferCtx) -> int:
    m = ctx.attr("tile", 4)
    if m not in TILES:
        ctx.fail(f"tile must be one of {TILES}, got {m}")
    return m


def _schemas():
    S = onnx.defs.OpSchema
    FP = S.FormalParameter
    opt = S.FormalParameterOption.Optional
    T = [("T", ["tensor(float)"], "float32")]
    tile = S.Attribute("tile", helper.make_attribute("tile", 4), "outputs per tile side: 2 or 4")
    yield S("WinogradKernel", CUSTOM_DOMAIN, 1, "W[M, C, 3, 3] -> U[(tile+2)^2, M, C] = G W Gt",
            inputs=[FP("W", "T")], outputs=[FP("U", "T")], type_constraints=T, attributes=[tile])
    yield S("WinogradConv", CUSTOM_DOMAIN, 1, "3x3 stride-1 convolution with the Winograd kernel U",
            inputs=[FP("X", "T"), FP("U", "T"), FP("B", "T", param_option=opt)], outputs=[FP("Y", "T")],
            type_constraints=T,
            attributes=[tile, S.Attribute("pads", helper.make_attribute("pads", [0, 0, 0, 0]),
                                          "zero padding [top, left, bottom, right]")])


for _s in _schemas():
    register_custom_schema(_s)


@op("WinogradKernel", domain=CUSTOM_DOMAIN)
def winograd_kernel(ctx: InferCtx):
    m = check_tile(ctx)
    w = ctx.shape(0)
    if len(w) != 4 or any(isinstance(k, int) and k != 3 for k in w[2:]):
        ctx.fail(f"weight shape {list(w)} must be [M, C, 3, 3]")
    return TensorType(ctx.dtype(0), ((m + 2) ** 2, w[0], w[1]))


@op("WinogradConv", domain=CUSTOM_DOMAIN)
def winograd_conv(ctx: InferCtx):
    m = check_tile(ctx)
    x, u = ctx.shape(0), ctx.shape(1)
    if len(x) != 4:
        ctx.fail(f"input must be [N, C, H, W], got shape {list(x)}")
    if len(u) != 3 or (isinstance(u[0], int) and u[0] != (m + 2) ** 2):
        ctx.fail(f"kernel shape {list(u)} must be [{(m + 2) ** 2}, M, C] for tile {m}")
    ctx.unify(x[1], u[2], "input channels of the input and the kernel")
    pads = [int(p) for p in ctx.attr("pads", [0, 0, 0, 0])]
    if len(pads) != 4 or any(p < 0 for p in pads):
        ctx.fail(f"pads must be 4 non-negative values, got {pads}")
    out: Tuple[Dim, ...] = (x[2] + pads[0] + pads[2] - 2, x[3] + pads[1] + pads[3] - 2)
    for i, o in enumerate(out):
        ctx.require("ge", o, 1, f"the 3x3 window does not fit spatial axis {i} with pads {pads}")
    if ctx.has_input(2):
        b = ctx.shape(2)
        if len(b) != 1 or (isinstance(b[0], int) and isinstance(u[1], int) and b[0] != u[1]):
            ctx.fail(f"bias shape {list(b)} must be [{u[1]}]")
    return TensorType(ctx.dtype(0), (x[0], u[1]) + out)


def kernel_transform(w: np.ndarray, m: int) -> np.ndarray:
    """``U = G W Gt`` per (M, C), laid out [(m+2)^2, M, C]; computed in float64, rounded once.

    The sums run term by term in a fixed order with elementwise float64 operations (each one IEEE-rounded),
    never through ``einsum``/BLAS, whose summation order depends on the CPU's SIMD dispatch: the packed weights,
    and so the library's bytes and its golden replay hash, are the same on every CPU."""
    _, g, _ = matrices_f64(m)
    w64 = np.asarray(w, dtype=np.float64)
    a = m + 2
    u = np.zeros((a, a) + w.shape[:2], dtype=np.float64)
    for i in range(a):
        for j in range(a):
            for p in range(3):
                for q in range(3):
                    if g[i, p] != 0.0 and g[j, q] != 0.0:
                        u[i, j] += (g[i, p] * g[j, q]) * w64[:, :, p, q]
    return u.reshape(a * a, w.shape[0], w.shape[1]).astype(np.float32)


def winograd_conv_reference(x: np.ndarray, u: np.ndarray, b, m: int, pads) -> np.ndarray:
    """The algorithm as written (float64 transforms, one rounding to float32 at the end)."""
    bt, _, at = matrices_f64(m)
    a = m + 2
    n, c, h, w = x.shape
    k = u.shape[1]
    oh, ow = h + pads[0] + pads[2] - 2, w + pads[1] + pads[3] - 2
    th, tw = tiles_of(oh, m), tiles_of(ow, m)
    xp = np.zeros((n, c, th * m + 2, tw * m + 2))
    xp[:, :, pads[0]:pads[0] + h, pads[1]:pads[1] + w] = x
    # d[n, c, th, tw, a, a]: the overlapping input tiles
    idx_h = (np.arange(th)[:, None] * m + np.arange(a)[None, :])
    idx_w = (np.arange(tw)[:, None] * m + np.arange(a)[None, :])
    d = xp[:, :, idx_h[:, None, :, None], idx_w[None, :, None, :]]
    v = np.einsum("ia,nctsab,jb->nctsij", bt, d, bt).reshape(n, c, th, tw, a * a)
    mm = np.einsum("ekc,nctse->nktse", u.astype(np.float64), v).reshape(n, k, th, tw, a, a)
    y = np.einsum("ri,nktsij,qj->nktrsq", at, mm, at).reshape(n, k, th * m, tw * m)[:, :, :oh, :ow]
    if b is not None:
        y = y + np.asarray(b, dtype=np.float64)[None, :, None, None]
    return y.astype(np.float32)
