"""Phase planes: a 2-D sliding window (any kernel size, stride, dilation and padding) read as constant shifts
of a flat grid, so that a convolution's micro-kernel loads its operand tiles straight from the stored input
instead of an im2col copy. The int8 (:mod:`cuvil.kernels.contraction_int8`) and bf16
(:mod:`cuvil.kernels.contraction_planes`) AMX / VNNI kernels share this geometry.

The padded input is split by stride phase: phase ``f = (rh, rw)`` holds the rows ``a sh + rh`` and columns
``b sw + rw`` of the padded input, a ``Hq x Wq`` grid. Output position ``(oh, ow)`` reads, for tap ``(kh,
kw)``, phase ``((kh dh) % sh, (kw dw) % sw)`` at grid position ``q = oh Wq + ow + off``, ``off = ((kh dh) //
sh) Wq + (kw dw) // sw``: the same shift for every output position. A kernel therefore runs over *wide
positions* ``p' = oh Wq + ow`` (``ow < Wq``; the columns ``ow >= OW`` are computed and dropped), and any run
of consecutive wide positions is a contiguous run of the plane at ``p' + off``, whatever the window.
"""
from __future__ import annotations

from typing import Optional, Tuple

import attrs

from .texpr import I64, E, all_of, cmp, const, in_range


def phase_count(kernel: int, dil: int, stride: int) -> Optional[int]:
    """How many stride phases the window's taps read along one axis (they must be 0 .. n - 1), or None."""
    used = {(k * dil) % stride for k in range(kernel)}
    return len(used) if used == set(range(len(used))) else None


@attrs.frozen
class PlaneGeometry:
    phases: Tuple[int, int]     # (rows, cols): the row and column phases read
    grid: Tuple[int, int]       # (Hq, Wq)
    taps: tuple                 # per tap t = kh * KW + kw: (phase index f, shift off in grid positions)

    @property
    def num_phases(self) -> int:
        return self.phases[0] * self.phases[1]

    @property
    def max_shift(self) -> int:
        return max(off for _, off in self.taps)


def plane_geometry(kernel: Tuple[int, int], strides: Tuple[int, int], dilations: Tuple[int, int],
                   out_hw: Tuple[int, int]) -> Optional[PlaneGeometry]:
    """The phase planes of a 2-D window (``kernel`` (KH, KW), its strides, dilations and output extents), or None
    where its taps skip a phase (a dilation that is a multiple of the stride, say: those planes would hold
    pixels nothing reads)."""
    (kh_, kw_), (sh, sw), (dh, dw) = kernel, strides, dilations
    rows, cols = phase_count(kh_, dh, sh), phase_count(kw_, dw, sw)
    if rows is None or cols is None:
        return None
    grid = (out_hw[0] + ((kh_ - 1) * dh) // sh, out_hw[1] + ((kw_ - 1) * dw) // sw)
    taps = tuple((((kh * dh) % sh) * cols + (kw * dw) % sw, ((kh * dh) // sh) * grid[1] + (kw * dw) // sw)
                 for kh in range(kh_) for kw in range(kw_))
    return PlaneGeometry((rows, cols), grid, taps)


def plane_length(grid: Tuple[int, int], out_h: int, max_shift: int, max_nr: int) -> int:
    """Positions per stored plane: the grid, and every position a panel of ``max_nr`` wide positions from the
    last panel's start reads (the panels run past the last wide position), a multiple of 16."""
    need = max(grid[0] * grid[1], out_h * grid[1] + max_nr + max_shift)
    return -(-need // 16) * 16


def plane_source(idx, per_group: int, channels: int, in_hw, begin, strides, cols: int, grid) -> Tuple[E, E, E, E]:
    """For the plane element ``idx = (n, g, f, q, i)`` (channel ``i`` of group ``g``, phase ``f``, grid position
    ``q``) of planes with ``per_group`` channels a group: (channel, input row, input column, inside), ``inside``
    false for padding, a channel past the last and a position past the grid (the plane holds the fill there)."""
    n, g, f, q, i = idx
    a, b = q // grid[1], q % grid[1]
    ih = a * strides[0] + f // cols - begin[0]
    iw = b * strides[1] + f % cols - begin[1]
    c = g * per_group + i
    inside = all_of([cmp("lt", c, const(channels, I64)), cmp("lt", q, const(grid[0] * grid[1], I64)),
                     in_range(ih, 0, in_hw[0]), in_range(iw, 0, in_hw[1])])
    return c, ih, iw, inside
