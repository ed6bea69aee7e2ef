"""bf16 convolutions on AMX tiles read in place from *pair planes*: the contraction node the x86 ``tdpbf16ps``
micro-kernel (:mod:`cuvil.targets.x86.gemm_planes`) implements, with no im2col.

The packed-panel form (:class:`cuvil.kernels.contraction.Contraction` with ``amx``) gathers, for every panel
of 32 output positions, the ``K = C * KH * KW`` input values of each position into a pair panel: for a 3x3
layer nine times the input, rounded and interleaved in the kernel's inner loop (measured on ResNet-50: about
1.6 ms of 14 ms of AMX kernel time, bench/results/xeon-session21/amx-no-packing.txt). Here the input is
stored once, rounded to bfloat16, as phase planes (:mod:`cuvil.kernels.phase_planes`) whose elements are
*pairs of channels*: ``B[n, g, f, q, i] = x[n, 2 g + i, a sh + rh - ph0, b sw + rw - pw0]`` (``f`` the
phase ``(rh, rw)``, ``q = a Wq + b``), zero for padding, past the last channel and past the grid. A B tile
of ``tdpbf16ps`` is 16 rows of pairs of k by 16 columns: here 16 channel pairs (rows ``F * PL`` words
apart) by 16 consecutive wide positions, 64 contiguous bytes of a plane at ``p' + off`` for tap ``t``. So
per tap and block of 32 channels the kernel loads its B tiles straight from the planes, whatever the
kernel size, stride, dilation or padding.

The weights are packed at compile time as A tiles, ``[MB, KB, T, 32, 16, 2]``: per block of 32 output
channels, block of 32 input channels and tap, 32 rows of 16 channel pairs (two 16 x 32 A tiles); channels
past C are zero (the planes' too, so they add nothing). Channel block outer, taps inner: the AMX kernel's steps
take that order, so a block's position tiles (16 channel pairs, a few lines per pair whatever the tap's shift)
stay in L1 over its taps while the weights stream in order (ResNet-50's 3x3 layers at 14x14 and 28x28 0.88-0.89x
of tap-major's in-kernel time on a Xeon with AMX, family 6 model 207: bench/PRECISION.md, session 26).

What is computed is what the packed form computes: each product of two bfloat16 values is exact in float32
and the sums are float32 (``tdpbf16ps``), the same certificate (:mod:`cuvil.precision`); only the order of
the sum differs (per channel block over the taps here, over channels per tap there), which the format's
certificates do not fix.

The lowering (:func:`cuvil.kernels.lower.conv.conv_as_gemm`) emits ``E("pplanes", [n, g, f, q, i, value])``
for the planes' stage and ``E("contract", [n, m, oh, ow, reduce], attr=PlaneContraction)`` for the
convolution; every backend may evaluate both as their plain values.
"""
from __future__ import annotations

import attrs
import numpy as np

from .contraction import AMX_K, AMX_TILE, bf16_pairs
from .texpr import Buf

#: In a target's ``narrow_formats``: its bf16 convolutions read pair planes (this module) instead of packing
#: im2col panels, on AMX tiles where AMX_TILES is there too, else with ``vdpbf16ps``; never a Node.precision
#: (``X86Tuning.bf16_planes``).
BF16_PLANES = "bf16_planes"
PLANE_MR = 2 * AMX_TILE      # output channels per weight block: two A tiles
PLANE_NR = 2 * AMX_TILE      # wide positions per AMX unit: two B tiles
MAX_PLANE_NR = 48            # the widest panel a kernel takes (vdpbf16ps: 3 vectors); the planes hold that many
CHANNEL_BLOCK = AMX_K        # input channels per tile step (16 pairs)


@attrs.define(eq=False)
class PairPlanes:
    """The pair planes ``B[n, g, f, q, i]`` of a 2-D convolution's input ``x`` (see the module docstring).
    ``E("pplanes", [n, g, f, q, i, value], attr=self)``; the x86 backend interleaves two channel rows per
    vector (:func:`cuvil.targets.x86.gemm_planes.emit_pair_planes_stage`)."""
    x: Buf              # [N, C, H, W] float32, or bfloat16 (a bf16-stored activation)
    channels: int
    groups: int         # channel pairs, padded to whole channel blocks (CHANNEL_BLOCK / 2 pairs each)
    in_hw: tuple        # (H, W)
    begin: tuple        # (ph0, pw0): the begin pads
    strides: tuple      # (sh, sw)
    phases: tuple       # (rows, cols)
    grid: tuple         # (Hq, Wq)
    plane: int          # PL: positions per plane
    amx: bool = True    # read by AMX tiles (else by vdpbf16ps): the manifest's path

    @property
    def num_phases(self) -> int:
        return self.phases[0] * self.phases[1]


@attrs.define(eq=False)
class PlaneContraction:
    b: Buf              # pair planes [N, G, F, PL, 2] bfloat16 (PairPlanes)
    w: Buf              # packed weights [MB, KB, T, PLANE_MR, 16, 2] bfloat16
    n: int
    m: int              # output channels
    cin: int            # input channels
    taps: tuple         # per tap (t = kh * KW + kw): (phase index f, shift off in positions)
    groups: int         # G: channel pairs of the planes
    wq: int             # the planes' row length: wide position p' = oh * wq + ow
    out_hw: tuple       # (OH, OW)
    plane: int          # PL
    num_phases: int     # F
    amx: bool = True    # AMX tiles (else vdpbf16ps: x86/gemm_planes.py)
    nr: int = PLANE_NR  # wide positions per panel (AMX: PLANE_NR; vdpbf16ps: 16, 32 or 48)
    mr: int = PLANE_MR

    @property
    def k(self) -> int:
        return self.cin * len(self.taps)

    @property
    def p(self) -> int:
        return self.out_hw[0] * self.out_hw[1]

    @property
    def wide(self) -> int:
        """Wide positions computed (``(OH - 1) * Wq + OW``: a last row's dropped columns are not)."""
        return (self.out_hw[0] - 1) * self.wq + self.out_hw[1]

    @property
    def max_shift(self) -> int:
        return max(off for _, off in self.taps)

    @property
    def k_blocks(self) -> int:
        return self.groups * 2 // CHANNEL_BLOCK

    @property
    def m_blocks(self) -> int:
        return -(-self.m // self.mr)

    @property
    def p_blocks(self) -> int:
        return -(-self.wide // self.nr)

    @property
    def flops(self) -> int:
        return 2 * self.n * self.m * self.k * self.p


def pair_groups(channels: int) -> int:
    """Channel pairs of the planes: ``channels`` padded to whole blocks of CHANNEL_BLOCK, halved."""
    return -(-channels // CHANNEL_BLOCK) * CHANNEL_BLOCK // 2


def pack_plane_weights(w: np.ndarray, mr: int = PLANE_MR) -> np.ndarray:
    """``w[M, C, KH, KW]`` (float32) -> ``[MB, KB, T, mr, CHANNEL_BLOCK / 2, 2]`` bfloat16 (nearest even):
    channels padded to whole blocks, zero rows past M; tap ``t = kh * KW + kw``."""
    m, c = w.shape[:2]
    taps = int(np.prod(w.shape[2:]))
    mb, kb = -(-m // mr), pair_groups(c) * 2 // CHANNEL_BLOCK
    a = np.zeros((mb * mr, kb * CHANNEL_BLOCK, taps), np.float32)
    a[:m, :c] = w.reshape(m, c, taps)
    # [MB, mr, KB, CB, T] -> [MB, KB, T, mr, CB]; then the CB channels in pairs
    a = a.reshape(mb, mr, kb, CHANNEL_BLOCK, taps).transpose(0, 2, 4, 1, 3)
    return bf16_pairs(np.ascontiguousarray(a), 4)
