"""Quantized convolutions as int8 GEMMs read in place: the contraction node the x86 ``vpdpbusd`` (AVX512-VNNI)
and ``tdpbusd`` (AMX-INT8) micro-kernels implement.

A ``QLinearConv`` with constant int8 weights (zero point 0, as onnxruntime's quantizer writes them), constant
per-tensor input/output scales and zero points and per-tensor or per-channel weight scales computes, per image
``n``, output channel ``m`` and position ``p``::

    y[n, m, p] = sat(rint(float(acc + comp[m]) * mult[m]) + yzp)
    acc        = sum_k B[n, p, k] * W[m, k]       (u8 x s8 products, int32 sum)
    comp[m]    = bias[m] - zx * sum_k W[m, k]     (so acc + comp = bias + sum (x - zx) w, exactly)
    mult[m]    = float32(float32(xs * ws[m]) / ys)

``B`` is the (zero-point padded) input as unsigned bytes: uint8 activations as they are, int8 ones shifted by
+128 (``x ^ 0x80``), with ``zx`` shifted alike, so the sum is the same integer. Both instructions multiply four
unsigned bytes by four signed ones and add the four products to one int32, so ``k`` runs in groups of four
channels of one tap: ``k = (tap, g, i)``, channel ``c = 4 g + i``.

No im2col: the input is stored once as *phase planes* (:class:`Int8Planes`), ``[N, G, F, PL, 4]``: for each
group of four channels, each stride phase ``f = (rh, rw)`` of the padded input (the rows ``a sh + rh`` and
columns ``b sw + rw``), its ``Hq x Wq`` grid of pixels, each pixel's four channel bytes adjacent. In a phase
plane every tap of a strided, dilated, padded window is a constant shift: output position ``(oh, ow)`` reads,
for tap ``(kh, kw)``, plane ``f = ((kh dh) % sh, (kw dw) % sw)`` at ``q = oh Wq + ow + off``, ``off = ((kh dh)
// sh) Wq + (kw dw) // sw``. So the kernels run over *wide positions* ``p' = oh Wq + ow`` (``ow < Wq``, the
columns ``ow >= OW`` computed and dropped): sixteen consecutive wide positions of one group are 64 contiguous
bytes at ``q = p' + off`` (one vector of ``vpdpbusd``, one row of an AMX B tile), whatever the kernel size,
stride or padding. The planes are as large as the input (for a 3x3 window nine times smaller than an im2col),
and their packing is a vectorised byte interleave (x86: :func:`cuvil.targets.x86.gemm_int8.emit_planes_stage`).

The weights are packed once, at compile time, in the AMX A-tile layout ``[MB, T, GB, MR, gb * 4]`` (``MR`` =
32 channels per block, ``T`` taps, ``GB`` blocks of ``gb`` groups: each block one tile's K of ``gb * 4`` bytes
per channel row), which the VNNI kernel reads too (it broadcasts a channel's four bytes of one group).

The requantisation is that of the reference lowering (cuvil.kernels.lower.quant: the same float32 operations in
the same order), so every backend's value of the node, its last argument, and the micro-kernels' are the same
bits. The lowering emits ``E("qgemm", [n, m, *o, value], attr=Int8Contraction)``; the x86 backend replaces it
by micro-kernels where the CPU has AVX512-VNNI or AMX-INT8 (:mod:`cuvil.targets.x86.gemm_int8`), else
computes ``value``.
"""
from __future__ import annotations

from typing import Tuple

import attrs
import numpy as np

from ..ir.dtype import DType
from .phase_planes import plane_length
from .texpr import Buf

#: In a target's ``narrow_formats``: its int8 convolutions run on AMX tiles (x86 ``tdpbsud``); never a
#: Node.precision. Without it they run the VNNI kernels (the weights' layout is the same).
AMX_INT8_TILES = "amx_int8"
MR_I8 = 32         # output channels per weight block (two AMX A tiles; four VNNI register panels of 8)
LANES_I8 = 16      # int32 lanes of a 512-bit vector, columns of an AMX C tile: positions per vector
MAX_GB = 16        # groups of four k's per AMX tile (64 bytes of K)
#: the widest position panel a kernel takes (VNNI: 48 = 3 vectors; AMX: 32 = 2 tiles); the planes hold
#: enough positions past the last wide position for it
MAX_NR = 48


def group_block(groups: int) -> Tuple[int, int]:
    """(gb, padded group count): the K of one AMX tile in groups of four channels, and the groups padded to a
    multiple of it. All of them up to 16; else a divisor of the count between 8 and 16; else 16, padded."""
    if groups <= MAX_GB:
        return groups, groups
    for gb in range(MAX_GB, 7, -1):
        if groups % gb == 0:
            return gb, groups
    return MAX_GB, -(-groups // MAX_GB) * MAX_GB


@attrs.define(eq=False)
class Int8Planes:
    """The phase planes ``B[n, g, f, q, i]`` of a 2-D convolution's input ``x`` (see the module docstring):
    ``x[n, 4g + i, a sh + rh - ph0, b sw + rw - pw0]`` for ``f = rh * len(cols) + rw`` (``rh < rows``, ``rw <
    cols``), ``q = a Wq + b < Hq Wq``; ``fill`` (the input's zero point as a stored byte) where that pixel is
    padding, past the last channel or past the grid; ``^ 0x80`` for int8 activations.
    ``E("qplanes", [n, g, f, q, i, value], attr=self)``; the x86 backend interleaves four channel rows per
    vector (:func:`cuvil.targets.x86.gemm_int8.emit_planes_stage`)."""
    x: Buf              # [N, C, H, W] uint8 / int8 (a 1-D convolution's [N, C, W] as H = 1)
    channels: int
    groups: int         # G: channel groups of four (padded to a multiple of the tile's group block)
    in_hw: tuple        # (H, W)
    begin: tuple        # (ph0, pw0): the begin pads
    strides: tuple      # (sh, sw)
    phases: tuple       # (rows, cols): the row and column phases read (0 .. rows - 1, 0 .. cols - 1)
    grid: tuple         # (Hq, Wq)
    plane: int          # PL: positions per plane, >= Hq * Wq
    fill: int           # stored byte of padding (0..255)
    shift: bool         # int8 activations: stored + 128

    @property
    def num_phases(self) -> int:
        return self.phases[0] * self.phases[1]


@attrs.define(eq=False)
class Int8Contraction:
    b: Buf              # phase planes [N, G, F, PL, 4] uint8 (Int8Planes)
    w: Buf              # packed weights [MB, T, GB, MR, gb * 4] int8
    comp: Buf           # int32 [MB * MR]: bias - zx * sum_k w
    mult: Buf           # float32 [MB * MR]: xs * ws / ys
    n: int
    m: int              # output channels
    k: int              # reduction length (C * taps, before padding to groups of four)
    taps: tuple         # per tap (t-major, as packed): (phase index f, shift off in positions)
    groups: int         # G
    gb: int             # groups per K block (an AMX tile's K is gb * 4 bytes)
    wq: int             # the planes' row length: wide position p' = oh * wq + ow
    out_hw: tuple       # (OH, OW)
    plane: int          # PL
    num_phases: int     # F
    y_zero_point: int
    out_dtype: DType    # UINT8 or INT8
    amx: bool = False   # the target runs int8 tiles (AMX_INT8_TILES in its narrow formats)
    mr: int = MR_I8

    @property
    def p(self) -> int:
        """Output positions."""
        return self.out_hw[0] * self.out_hw[1]

    @property
    def wide(self) -> int:
        """Wide positions (``OH * Wq``; those of a column ``>= OW`` are dropped)."""
        return self.out_hw[0] * self.wq

    @property
    def g_blocks(self) -> int:
        return self.groups // self.gb

    @property
    def m_blocks(self) -> int:
        return -(-self.m // self.mr)

    @property
    def max_shift(self) -> int:
        return max(off for _, off in self.taps)

    @property
    def flops(self) -> int:
        return 2 * self.n * self.m * self.k * self.p


def p_blocks(wide: int, nr: int) -> int:
    return -(-wide // nr)


# Work weight of a VNNI panel of 1 / 2 / 3 vectors: fewer accumulators (8 / 16 / 24) hide less of vpdpbusd's
# latency.
_NV_COST = {1: 1.3, 2: 1.05, 3: 1.0}


def panel_positions(p: int) -> int:
    """Wide positions per VNNI panel (16, 32 or 48): the least padded work ``pad(p, nr)``, weighted by
    _NV_COST (63 positions take 32: 64 computed, 96 with 48; 16 x 14 = 224 take 32, 56 x 58 48)."""
    return min((LANES_I8 * v for v in (3, 2, 1)), key=lambda nr: -(-p // nr) * nr * _NV_COST[nr // LANES_I8])


def plane_positions(grid: Tuple[int, int], out_h: int, max_shift: int) -> int:
    """PL: the grid, and every position a panel of the last wide positions reads (``MAX_NR`` past them), a
    multiple of 16."""
    return plane_length(grid, out_h, max_shift, MAX_NR)


def pack_int8_weights(w: np.ndarray, groups: int, gb: int, mr: int = MR_I8) -> np.ndarray:
    """``w[M, C, KH, KW]`` (int8) -> ``[MB, T, G / gb, mr, gb * 4]``: channels padded to ``4 G``, zero rows
    past M; tap ``t = kh * KW + kw``."""
    m, c = w.shape[:2]
    taps = int(np.prod(w.shape[2:]))
    mb = -(-m // mr)
    a = np.zeros((mb * mr, groups * 4, taps), np.int8)
    a[:m, :c] = w.reshape(m, c, taps)
    # [MB, mr, GB, gb, 4, T] -> [MB, T, GB, mr, gb, 4]
    a = a.reshape(mb, mr, groups // gb, gb, 4, taps).transpose(0, 5, 2, 1, 3, 4)
    return np.ascontiguousarray(a.reshape(mb, taps, groups // gb, mr, gb * 4))


def requant_constants(w: np.ndarray, bias, zx: int, xs, ws: np.ndarray, ys, mr: int = MR_I8) -> Tuple[np.ndarray, np.ndarray]:
    """(comp, mult) per output channel, padded to whole blocks (see the module docstring); ``zx`` already
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
