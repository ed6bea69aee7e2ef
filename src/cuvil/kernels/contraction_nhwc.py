"""bf16 convolutions on AMX tiles over *channels-last rows*: the activations are the A tiles, loaded in place.

The channel-planar forms (:mod:`cuvil.kernels.contraction`, :mod:`cuvil.kernels.contraction_planes`) take the
weights as A tiles and the input as B tiles of channel pairs by positions: a position panel reads one line per
channel pair, and a 1x1 layer reading a wide map (ResNet-50's 256 -> 64 at 56x56) waits on 128 row streams
(bench/results/xeon-session28/amx-nhwc-1x1.txt: the same layer channels-last in 0.46-0.50x the time). Here the
input is stored *channels-last*: rows of ``Cp`` bfloat16 channels (``C`` padded to whole blocks of 32, zeros
past ``C``), one row per position of a flat grid, ``A[n, q, c]``. A tile of 16 rows by 32 channels is then 16
runs of 64 bytes, ``Cp * 2`` bytes apart: one sequential stream per tile, whatever the channel count.

A 2-D window (any kernel size, stride, dilation and zero padding) reads its input as constant shifts of the
flat grids of its *phase planes* (:mod:`cuvil.kernels.phase_planes`): output ``(oh, ow)`` is the *wide position*
``p = oh * Wq + ow`` (``Wq`` the grid's row length; the columns ``ow >= OW`` are computed and dropped), and tap
``t`` reads row ``p + off_t`` of plane ``f_t``. The planes are stored as channels-last rows ``A[n, f, q, c]``
(zeros for padding and past ``C``), a copy made once per convolution; a stride-1 1x1 convolution reads the
stored value itself where it is channels-last already with whole blocks of 32 channels (its producer wrote it so:
the scheduler's layout choice, ``kernels.schedule``), the one phase's grid being the input.

The weights are B tiles in pairs of input channels, ``[MB, T, S, 16, 32, 2]``: per block of 32 output channels,
tap and step of 32 input channels, 16 rows of pairs by 32 output channels (two B tiles). ``out[n, m, oh, ow]``
is then ``sum over (t, c) of W[m, c, t] * A[n, p + off_t, c]``: each product of two bfloat16 values exact in
float32, float32 sums (``tdpbf16ps``), the certificate of every bf16 contraction (:mod:`cuvil.precision`); only
the order of the sum differs from the other forms'.

The lowering (:func:`cuvil.kernels.lower.conv.channels_last_conv`) emits
``E("contract", [n, m, oh, ow, reduce], attr=ChannelsLastContraction)``; every backend may evaluate it as its
plain value, and the x86 backend runs it on AMX tiles (:mod:`cuvil.targets.x86.gemm_nhwc`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import attrs
import numpy as np

from .contraction import AMX_K, AMX_TILE, bf16_pairs
from .phase_planes import plane_geometry
from .texpr import Buf

#: In a target's ``narrow_formats``: its bf16 2-D convolutions on AMX tiles take this form where they
#: apply (``X86Tuning.channels_last``); never a Node.precision.
BF16_CHANNELS_LAST = "bf16_channels_last"
NHWC_MR = 2 * AMX_TILE      # output channels per weight block: two B tiles
NHWC_NR = 2 * AMX_TILE      # wide positions per unit: two A tiles
CHANNEL_STEP = AMX_K        # input channels per tile step


def channels_last_pitch(shape) -> Tuple[int, ...]:
    """Element strides of a ``[N, C, H, W]`` tensor stored channels-last (``[N, H, W, C]`` in memory)."""
    _, c, h, w = shape
    return (h * w * c, 1, w * c, c)


def is_channels_last(buf: Buf) -> bool:
    """Whether ``buf`` is a 4-D tensor stored channels-last (:func:`channels_last_pitch`; no other view)."""
    return (buf.pitch is not None and len(buf.shape) == 4 and buf.shift == 0
            and tuple(buf.pitch) == channels_last_pitch(buf.shape))


def channels_last_view(buf: Buf) -> bool:
    """Whether ``buf`` is a 4-D tensor whose elements lie channels-last: ``C`` consecutive channels a position,
    positions of a row ``C`` apart, rows and images further apart (:func:`is_channels_last`, or such a view of
    a larger buffer's interior: a padded rows buffer its producer writes in place)."""
    if buf.pitch is None or len(buf.shape) != 4 or not all(isinstance(d, int) for d in buf.shape[1:]):
        return False
    sn, sc, sh, sw = buf.pitch
    _, c, h, w = buf.shape
    return sc == 1 and sw == c and sh >= w * c and sh % c == 0 and (not isinstance(sn, int) or sn >= h * sh)


def padded_channels(c: int) -> int:
    return -(-c // CHANNEL_STEP) * CHANNEL_STEP


def channels_last_window(x_shape, w_shape, out_shape, strides, dil, begin, group: int) -> Optional[str]:
    """Why a 2-D convolution cannot take the channels-last form, or None when it can: fixed sizes but the batch
    (a symbolic batch counts its units at run time), one group,
    non-negative pads, taps that read every stride phase they span (:func:`cuvil.kernels.phase_planes.plane_geometry`),
    enough wide positions for one unit and channel counts that fill the tiles
    (at least half of the last block of 32 input channels used: a 3-channel stem stays in the packed form)."""
    if len(x_shape) != 4 or len(w_shape) != 4 or group != 1:
        return "not a one-group 2-D convolution"
    if not all(isinstance(d, int) for d in list(x_shape[1:]) + list(out_shape[1:])):
        return "symbolic sizes other than the batch"
    if any(b < 0 for b in begin):
        return "a negative pad"
    geo = plane_geometry(tuple(w_shape[2:]), tuple(strides), tuple(dil), tuple(out_shape[2:]))
    if geo is None:
        return "taps that skip a stride phase"
    cin, m = x_shape[1], w_shape[0]
    if 2 * padded_channels(cin) > 3 * cin or m < 16:
        return "too few channels to fill the tiles"
    if (out_shape[2] - 1) * geo.grid[1] + out_shape[3] < NHWC_NR:
        return "fewer wide positions than one unit"
    return None


def channels_last_reader(node, v) -> bool:
    """Whether graph node ``node`` is a bf16 convolution that would take the channels-last form reading ``v`` as
    its input (and only so): the scheduler's layout choice asks it of each reader (the lowering decides for good;
    a reader that does not take the form reads a channels-last value through its strides)."""
    if node.op != "Conv" or node.precision != "bf16" or node.inputs[0] is not v or any(x is v for x in node.inputs[1:]):
        return False
    w, out = node.inputs[1], node.outputs[0]
    if not w.is_const or w.shape is None or len(w.shape) != 4 or out.shape is None:
        return False
    at = node.attrs
    pads = at.get("pads") or [0] * 4
    if at.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID") and any(k > 1 for k in w.shape[2:]):
        pads = [0] * 4       # (SAME pads are non-negative)
    return channels_last_window(tuple(v.shape), tuple(w.shape), tuple(out.shape), at.get("strides") or (1, 1),
                                at.get("dilations") or (1, 1), pads[:2], at.get("group", 1)) is None


def channels_last_piece(node, v) -> bool:
    """Whether graph node ``node`` reading ``v`` is a piece of a channels-last convolution's input that the
    convolution reads where ``v`` lies (:func:`cuvil.kernels.lower.conv.channels_last_conv`): a Concat of
    channels (``rules/conv_sum.rule``) whose one reader is a bf16 1x1 convolution without stride or pads taking
    the channels-last form, ``v`` whole steps of 32 channels; or a Slice of ``v`` from its first element with
    steps on its spatial dims only, read by such a Concat (a projection's stride: ``v`` copied once into rows)."""
    if node.op == "Slice":
        st = node.attrs
        if (node.inputs[0] is not v or any(x is v for x in node.inputs[1:]) or list(st.get("axes") or []) != [2, 3]
                or any(s != 0 for s in st.get("starts") or [1])):
            return False
        out = node.outputs[0]
        return len(out.uses) == 1 and channels_last_piece(out.uses[0][0], out)
    if node.op != "Concat" or node.attrs.get("axis") not in (1, -3) or v.shape is None or len(v.shape) != 4 \
            or not isinstance(v.shape[1], int) or v.shape[1] % CHANNEL_STEP:
        return False
    out = node.outputs[0]
    if len(out.uses) != 1:
        return False
    conv = out.uses[0][0]
    at = conv.attrs
    return (conv.op == "Conv" and conv.inputs[1] is not None and conv.inputs[1].shape is not None
            and tuple(conv.inputs[1].shape[2:]) == (1, 1) and not any(at.get("pads") or [0])
            and tuple(at.get("strides") or (1, 1)) == (1, 1) and channels_last_reader(conv, out))


@attrs.define(eq=False)
class ChannelsLastRows:
    """The channels-last phase planes ``A[n, f, q, c]`` of a convolution's input ``x`` (element ``c`` of grid
    position ``q`` of phase ``f``, as :func:`cuvil.kernels.phase_planes.plane_source` places it; zero for padding
    and past the channels). ``E("nhwc_rows", [n, f, q, c, value], attr=self)``; the x86 backend copies whole rows
    of channels where ``x`` is stored channels-last (:func:`cuvil.targets.x86.gemm_nhwc.emit_rows_stage`)."""
    x: Buf              # [N, C, H, W]: float32 or bfloat16, channel-planar or channels-last
    channels: int
    in_hw: tuple        # (H, W)
    begin: tuple        # (ph0, pw0)
    strides: tuple      # (sh, sw)
    phases: tuple       # (rows, cols)
    grid: tuple         # (Hq, Wq)
    # the input is a view of the rows' own interior, written there by its producer
    # (:func:`cuvil.kernels.pad_in_place.write_rows_in_place`): the copy writes only the zeros around it
    in_place: bool = False


@attrs.define(eq=False)
class ChannelsLastPart:
    """A further operand of a 1x1 :class:`ChannelsLastContraction` over the concatenation of its inputs' channels
    (a bottleneck's last convolution and its projection shortcut summed, ``rules/conv_sum.rule``): its own rows
    over the same wide grid (a ``[N, 1, PL, C]`` copy, or a value stored channels-last), ``C`` whole steps of 32
    channels; the packed weights' steps go on through it."""
    a: Buf
    cin: int
    image: int          # elements from one image's rows to the next
    row: int            # elements from one position's row to the next (its C, or the value's channel count)


@attrs.define(eq=False)
class ChannelsLastContraction:
    a: Buf              # channels-last rows: [N, F, PL, Cp] bfloat16, or a [N, C, H, W] value stored channels-last
    w: Buf              # packed weights [MB, T, S, 16, NHWC_MR, 2] bfloat16 (pack_nhwc_weights)
    n: int
    m: int              # output channels
    cin: int            # input channels (C; the rows hold Cp = padded_channels(C))
    taps: tuple         # per tap t = kh * KW + kw: (phase f, shift in rows of its plane)
    wq: int             # the grid's row length: wide position p = oh * wq + ow
    out_hw: tuple       # (OH, OW)
    plane: int          # PL: rows per phase plane (the grid, Hq * Wq)
    image: int          # elements from one image's rows to the next (F * PL * Cp)
    row: int            # elements from one row (position) to the next: Cp
    parts: tuple = ()   # further operands (ChannelsLastPart) of a 1x1 window whose C fills whole steps

    def shift(self, t: int) -> int:
        """Rows from an image's first row to tap ``t``'s row for wide position 0."""
        f, off = self.taps[t]
        return f * self.plane + off

    @property
    def steps(self) -> int:
        """Tile steps of 32 input channels per tap."""
        return padded_channels(self.cin) // CHANNEL_STEP

    @property
    def all_steps(self) -> int:
        """Tile steps of one weight block: every tap's, then every further part's."""
        return len(self.taps) * self.steps + sum(p.cin // CHANNEL_STEP for p in self.parts)

    @property
    def wide(self) -> int:
        """Wide positions computed (``(OH - 1) * wq + OW``: a last row's dropped columns are not)."""
        return (self.out_hw[0] - 1) * self.wq + self.out_hw[1]

    @property
    def m_blocks(self) -> int:
        return -(-self.m // NHWC_MR)

    @property
    def p_blocks(self) -> int:
        return -(-self.wide // NHWC_NR)

    @property
    def flops(self) -> int:
        cin = self.cin * len(self.taps) + sum(p.cin for p in self.parts)
        return 2 * self.n * self.m * cin * self.out_hw[0] * self.out_hw[1]


def pack_nhwc_weights(w: np.ndarray) -> np.ndarray:
    """``w[M, C, KH, KW]`` (float32) -> ``[MB, T, S, 16, NHWC_MR, 2]`` bfloat16 (nearest even): per block of
    NHWC_MR output channels, tap ``t = kh * KW + kw`` and step of CHANNEL_STEP input channels, the B tiles' rows
    of channel pairs; zero past M and past C."""
    m, c = w.shape[:2]
    taps = int(np.prod(w.shape[2:]))
    mb, cp = -(-m // NHWC_MR), padded_channels(c)
    a = np.zeros((taps, cp, mb * NHWC_MR), np.float32)       # [T, Cp, Mp]
    a[:, :c, :m] = w.reshape(m, c, taps).transpose(2, 1, 0)
    # [T, S, CS, MB, MR] -> [MB, T, S, CS, MR], then the CS channels in pairs (moved last)
    a = a.reshape(taps, cp // CHANNEL_STEP, CHANNEL_STEP, mb, NHWC_MR).transpose(3, 0, 1, 2, 4)
    return bf16_pairs(np.ascontiguousarray(a), 3)
