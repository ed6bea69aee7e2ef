"""Quantized convolutions as int8 GEMMs: the contraction node the x86 ``vpdpbusd`` micro-kernels implement.

A ``QLinearConv`` with constant int8 weights (zero point 0, as onnxruntime's quantizer writes them), constant
per-tensor input/output scales and zero points and per-tensor or per-channel weight scales computes, per image
``n``, output channel ``m`` and position ``p``::

    y[n, m, p] = sat(rint(float(acc + comp[m]) * mult[m]) + yzp)
    acc        = sum_k B[n, p, k] * W[m, k]       (u8 x s8 products, int32 sum)
    comp[m]    = bias[m] - zx * sum_k W[m, k]     (so acc + comp = bias + sum (x - zx) w, exactly)
    mult[m]    = float32(float32(xs * ws[m]) / ys)

``B`` is the im2col of the (zero-point padded) input as unsigned bytes: uint8 activations as they are, int8
ones shifted by +128 (``x ^ 0x80``), with ``zx`` shifted alike, so the sum is the same integer. ``vpdpbusd``
multiplies four unsigned bytes by four signed ones and adds the four products to an int32 lane, so ``k`` runs
in groups of four: ``B`` is stored ``[N, PB, KG, NR, 4]`` (``PB`` panels of ``NR`` positions, ``KG = ceil(K /
4)`` groups, the four bytes of a group adjacent: one 16-lane vector holds 16 positions x 4 k's) and the
weights are packed at compile time as ``W[MB, KG, MR, 4]`` (``MR`` channels per panel, zero past ``M`` and
``K``), each channel's four bytes one 32-bit broadcast. The requantisation is that of the reference lowering
(cuvil.kernels.lower.quant: the same float32 operations in the same order), so every backend's value of the
node, its last argument, and the micro-kernel's are the same bits.

The lowering emits ``E("qgemm", [n, m, *o, value], attr=Int8Contraction)``; the x86 backend replaces it by
micro-kernels where the CPU has AVX512-VNNI (:mod:`cuvil.targets.x86.gemm_int8`), else computes ``value``.
"""
from __future__ import annotations

from typing import Tuple

import attrs
import numpy as np

from ..ir.dtype import DType
from .texpr import Buf

MR_I8 = 8          # output channels per weight panel (rows of the register tile)
LANES_I8 = 16      # int32 lanes of a 512-bit vector: positions per vector
NV_I8 = 3          # vectors of positions per register tile: 8 x 3 accumulators


@attrs.define(eq=False)
class Int8Pack:
    """The im2col panels ``B[n, pb, kg, j, i]`` of a 2-D convolution's stored (zero-point padded) input ``x``:
    ``x[n, c, oh*sh + kh*dh, ow*sw + kw*dw]`` for ``k = kg*4 + i = (c, kh, kw)`` and position ``p = pb*nr + j =
    (oh, ow)``, both clamped to their last (a k past K meets a zero weight; a position past P is never
    stored), ``^ 0x80`` for int8 activations. ``E("qpack", [n, pb, kg, j, i, value], attr=self)``; the x86
    backend packs four k's of a position per 32-bit store (:func:`cuvil.targets.x86.gemm_int8.emit_qpack_stage`)."""
    x: Buf              # [N, C, Hp, Wp] uint8 / int8
    k: int
    kernel: tuple
    strides: tuple
    dilations: tuple
    out_spatial: tuple
    nr: int
    shift: bool         # int8 activations: stored + 128

    @property
    def kg(self) -> int:
        return -(-self.k // 4)

    @property
    def p(self) -> int:
        return int(np.prod(self.out_spatial))

    @property
    def p_blocks(self) -> int:
        return -(-self.p // self.nr)


@attrs.define(eq=False)
class Int8Contraction:
    b: Buf              # im2col panels [N, PB, KG, NR, 4] uint8
    w: Buf              # packed weights [MB, KG, MR, 4] int8
    comp: Buf           # int32 [MB * MR]: bias - zx * sum_k w
    mult: Buf           # float32 [MB * MR]: xs * ws / ys
    n: int
    m: int              # output channels
    p: int              # output positions (product of the output's spatial dims)
    k: int              # reduction length before padding to groups of four
    nr: int             # positions per panel (LANES_I8 * vectors)
    mr: int             # channels per weight panel
    y_zero_point: int
    out_dtype: DType    # UINT8 or INT8

    @property
    def kg(self) -> int:
        return -(-self.k // 4)

    @property
    def p_blocks(self) -> int:
        return -(-self.p // self.nr)

    @property
    def m_blocks(self) -> int:
        return -(-self.m // self.mr)

    @property
    def flops(self) -> int:
        return 2 * self.n * self.m * self.k * self.p


# Work weight of a panel of 1 / 2 / 3 vectors: fewer accumulators (8 / 16 / 24) hide less of vpdpbusd's latency.
_NV_COST = {1: 1.3, 2: 1.05, 3: 1.0}


def panel_positions(p: int) -> int:
    """Positions per B panel (16, 32 or 48): the least padded work ``pad(p, nr)``, weighted by _NV_COST (a
    7x7 map takes 32: 64 computed, 96 with 48; 14x14 32, 56x56 48)."""
    return min((LANES_I8 * v for v in (3, 2, 1)), key=lambda nr: -(-p // nr) * nr * _NV_COST[nr // LANES_I8])


def pack_int8_weights(w: np.ndarray, mr: int = MR_I8) -> np.ndarray:
    """``w[M, ...]`` (int8) -> ``[MB, KG, mr, 4]``: K = prod(w.shape[1:]) padded to groups of four, zero rows
    past M."""
    m = w.shape[0]
    k = int(np.prod(w.shape[1:]))
    kg, mb = -(-k // 4), -(-m // mr)
    a = np.zeros((mb * mr, kg * 4), np.int8)
    a[:m, :k] = w.reshape(m, k)
    return np.ascontiguousarray(a.reshape(mb, mr, kg, 4).transpose(0, 2, 1, 3))


def requant_constants(w: np.ndarray, bias, zx: int, xs, ws: np.ndarray, ys, mr: int = MR_I8) -> Tuple[np.ndarray, np.ndarray]:
    """(comp, mult) per output channel, padded to whole panels (see the module docstring); ``zx`` already
    shifted for int8 activations."""
    m = w.shape[0]
    mb = -(-m // mr)
    sums = w.reshape(m, -1).astype(np.int64).sum(axis=1)
    comp = np.zeros(mb * mr, np.int64)
    comp[:m] = (np.asarray(bias, np.int64).reshape(-1) if bias is not None else 0) - int(zx) * sums
    mult = np.zeros(mb * mr, np.float32)
    f32 = np.float32
    mult[:m] = (f32(np.asarray(xs).reshape(())) * np.asarray(ws, f32).reshape(-1)) / f32(np.asarray(ys).reshape(()))
    return comp, mult
