"""Convolution as a packed GEMM: the contraction node that GEMM micro-kernels implement.

A float32 convolution with ``G`` groups is, per image ``n`` and group ``g``, the matrix product
``out[n, g*Mg + m, p] = sum_k A[g, m, k] * B[n, g, k, p]`` with ``k`` running over (input channel, kernel
offsets) and ``p`` over output positions; ``B`` is the input seen through the window (im2col). ``A`` is the
weight tensor, packed at compile time into panels of ``mr`` output channels
(``Ap[g, m // mr, k, m % mr]``, zero rows past ``Mg``) so a micro-kernel reads one contiguous ``mr``-vector
per ``k``. The register tile, ``mr`` channels x ``cols`` positions, is chosen per convolution among the
target's shapes (:func:`choose_tile`). ``B`` is never materialised whole: a kernel packs panels of ``cols`` positions from the stored
(already zero-padded) input into per-thread scratch, just before the micro-kernels read them. The GPU's
lowering also emits float16 contractions (``half_contractions``) and ones over the unpadded input
(``Contraction.pads``: its kernels test the bounds; the x86 micro-kernels take neither form).

The lowering emits ``E("contract", [n, m, *o, reduce], attr=Contraction)``: every backend may evaluate it
as its last argument (the same sum over ``k``, reading the packed weights and the input), and the x86
backend replaces it by micro-kernels when the node is the stage's own output element.
"""
from __future__ import annotations

from typing import Optional, Tuple

import attrs
import numpy as np

from ..ir.dim import product
from ..ir.dtype import DType
from .texpr import Buf, E, nodes

MR = 6   # output channels per weight panel (rows of the micro-kernel's register tile) by default

#: In a target's ``narrow_formats``: its bf16 contractions run on AMX tiles (x86 ``tdpbf16ps``), whose
#: operands need the weights in the tile layouts below (:func:`pack_weights_amx`, :func:`pack_columns_bf16`
#: with ``k_multiple``) and a ``AMX_TILE``-square register tile. Never a Node.precision.
AMX_TILES = "amx_bf16"
AMX_TILE = 16            # rows (channels, positions, pairs of k) of an AMX tile
AMX_K = 32               # k per AMX tile step (16 pairs): the tile layouts pad K to a multiple of it


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


# A register tile is ``(rows, cols[, lanes])``: ``rows`` output channels broadcast as scalars against
# vectors of ``lanes`` positions (``cols`` in all); or ``(rows, cols, CHANNEL_LANES)``: vectors along the
# ``rows`` channels, positions broadcast (Contraction.channel_lanes), which lets ``cols`` be any count (7: a
# 7x7 map's row) where position vectors would leave lanes empty (49 positions in 64 lanes). Such a tile's
# epilogue transposes it in registers, so its work is weighted by the target's ``channel_tile_cost`` against
# the other form's (x86: cuvil.targets.x86.tuning.X86Tuning.channel_tile_cost).
CHANNEL_LANES = "c"
# ... and is weighted so from this reduction length on: its per-tile transpose and the weight vectors it
# re-reads per position panel are amortised over K (2-core Zen 5: K = 256, a 1x1 256->1024 14x14 layer, 214 ->
# 240 GFLOP/s; 2-core Zen 4, K = 128: ResNet-50's 28x28 F(4x4) GEMMs 0.74-0.78 -> 0.59-0.60 ms on 32 x 7 instead
# of 12 x 32, whole libraries in kernels: DenseNet-121 0.979x, Inception-v1 0.961x, ShuffleNet 0.971x at 1
# thread, the same bits; bench/RESULTS.md, session 35)
CHANNEL_MIN_K = 128
# Below it the weight grows as (1 + CHANNEL_SHORT_K / K) / (1 + CHANNEL_SHORT_K / CHANNEL_MIN_K): a fixed cost
# per tile of about CHANNEL_SHORT_K k-steps. Fitted on a 2-core Zen 4 (session 36) to SqueezeNet's layers, each
# forced both ways: channel lanes pay where position vectors leave lanes empty (49 positions in 64 lanes, the
# Winograd GEMMs of its 27x27 and 13x13 maps at K = 32 and 64: 0.193 -> 0.164 and 0.314 -> 0.254 ms) and not
# where they fill 88% of them (169 positions at K = 48 and 64: 0.033 -> 0.036 ms, 0.019 -> 0.027 at 2 threads);
# it also keeps the Zen 5 measurement above (K = 64, 196 positions of a 55x55 F(4x4) layer, 192 channels:
# 24% slower on channel lanes) on position lanes.
CHANNEL_SHORT_K = 8
# ... and below this they are not offered at all (the property fuzz draws reductions from here,
# tests/property/test_channel_lane_property.py; the weight above already prices them out below K = 24-32 on the
# shapes measured: 512 channels on 49 positions cross over at about 30)
CHANNEL_FLOOR_K = 16


# A position-lane tile with vectors dropped (see tile_cost) ran 25% below full tiles: a 12x32 tile on 16
# positions, the GEMMs of F(2x2) on 7x7 maps, 180 GFLOP/s against ~240 (2-core Zen 5); with the load-bound
# factor (13/12 there) this weight makes it 1.33. With the Winograd choice's weight cost (x86/choose.py) it
# was set by the layers of `python3 bench/winograd_layers.py --layers ...`: the cost model then picks the
# fastest of direct / F(2x2) / F(4x4) on 9 of 11 (misses: 160->320 6x6, direct for F(2x2)'s 0.117 vs 0.156 ms; 144->288 13x13,
# F(2x2) for F(4x4)'s 0.329 vs 0.352 ms); without it F(4x4) took 13x13 maps, where F(2x2) measured 10-50%
# faster.
PARTIAL_TILE_COST = 1.23


def channel_lanes(tile) -> bool:
    return len(tile) > 2 and tile[2] == CHANNEL_LANES


def short_k_weight(k: Optional[int]) -> float:
    """A channel-lane tile's extra weight at reduction length ``k`` (1 from CHANNEL_MIN_K on, or unknown)."""
    if k is None or k >= CHANNEL_MIN_K:
        return 1.0
    return (1.0 + CHANNEL_SHORT_K / k) / (1.0 + CHANNEL_SHORT_K / CHANNEL_MIN_K)


def tile_cost(m: int, p: int, tile, k: Optional[int] = None, channel_tile_cost: Optional[float] = None,
              min_k: int = CHANNEL_FLOOR_K) -> float:
    """Padded work of ``tile`` on ``m`` output channels x ``p`` positions (see :func:`choose_tile`). A
    position-lane tile whose one panel holds every position computes only the vectors that hold some (the
    x86 kernels' stores past ``p`` are masked off at compile time there, and LLVM drops their FMAs); a k-step
    then issues ``rows * live`` FMAs beside ``rows + live`` loads: its work is weighted PARTIAL_TILE_COST, or
    as load-bound where it has fewer FMAs than loads. ``k``: the reduction length,
    when known (channel-lane tiles need ``min_k``, default CHANNEL_FLOOR_K, and below CHANNEL_MIN_K weigh
    :func:`short_k_weight` more). ``channel_tile_cost``: the weight of a channel-lane tile's work, given by the
    target that offers such tiles."""
    rows, cols = tile[:2]
    if channel_lanes(tile):
        if k is not None and k < min_k:
            return float("inf")
        if channel_tile_cost is None:
            raise ValueError("a channel-lane tile needs the target's channel_tile_cost")
        return _pad(m, rows) * _pad(p, cols) * channel_tile_cost * short_k_weight(k)
    if len(tile) < 3 or p > cols:     # no lanes given (the GPU's tiles): plain padded work
        return _pad(m, rows) * _pad(p, cols)
    lanes = tile[2]
    live = -(-p // lanes)
    if live * lanes >= cols:
        return _pad(m, rows) * cols
    return _pad(m, rows) * live * lanes * PARTIAL_TILE_COST * max(1.0, (rows + live) / (rows * live))


def choose_tile(m: int, p, tiles, k: Optional[int] = None, channel_tile_cost: Optional[float] = None,
                min_k: int = CHANNEL_FLOOR_K, one_vector_exact: bool = False) -> tuple:
    """The register tile among the target's ``tiles`` with the least padded work (:func:`tile_cost`, about
    ``pad(m, rows) * pad(p, cols)``; channel-lane tiles weighted by ``channel_tile_cost``) for ``m``
    output channels and ``p`` positions (ties: the earlier one); the last position-lane tile when ``p`` is
    symbolic. With AVX-512's position-lane tiles (``((12, 32), (8, 48), (6, 64))``) a 14x14 map takes
    32-wide panels (224 of 196 positions computed, 256 with 64-wide ones), a 28x28 map 48-wide ones; on a
    2-core Zen 5, with each shape forced in turn, the least padded work picked the fastest of the three on
    the 3x3 layers of `python3 bench/x86_layers.py --only conv3x3` (1.23 -> 1.05 ms at 14x14 256 channels,
    1.02 -> 0.93 ms at 56x56 64 channels). Channel-lane tiles (48 x 7, 64 x 6, 32 x 7, 32 x 8) take 7x7 and
    14x14 maps, and 16 positions (a 7x7 map's Winograd F(2x2) GEMMs), which one position-lane panel would hold
    in a single live vector. ``min_k`` and ``one_vector_exact`` (such a panel counted as exact, keeping position
    lanes) give the x86 algorithm choice its own, earlier view (:func:`cuvil.targets.x86.choose.choice_tile`)."""
    positional = [t for t in tiles if not channel_lanes(t)]
    if not isinstance(p, int):
        return tuple(positional[-1])
    if any(len(t) > 2 and p <= t[1] and p % t[2] == 0 and (one_vector_exact or p > t[2]) for t in positional):
        tiles = positional     # one panel whose live vectors hold exactly the positions: nothing to remove
    # (one live vector is not such a tile: a k-step then loads a weight per FMA, and tile_cost weighs it)
    return tuple(min(tiles, key=lambda t: tile_cost(m, p, t, k, channel_tile_cost, min_k)))


@attrs.define(eq=False)
class Contraction:
    a: Buf              # packed weights [G, Mb, K, MR]
    x: Buf              # input [N, G*Cg, *spatial]: zero-padded (every window position inside it), or see pads
    n: int
    groups: int
    m: int              # output channels per group
    cin: int            # input channels per group
    kernel: tuple
    strides: tuple
    dilations: tuple
    out_spatial: tuple
    cols: int           # positions per micro-kernel tile (the register tile's width)
    mr: int = MR        # output channels per weight panel (the register tile's rows)
    pads: tuple = ()    # begin pads when ``x`` is the unpadded input (the GPU's kernels test bounds); () padded
    channel_lanes: bool = False   # the register tile's vectors run along its mr channels (see choose_tile)
    # input channel c of group g is x's channel c*groups + g (Winograd's V, see WinogradInput), not g*cin + c
    interleaved: bool = False
    # "bf16": the node computes in bfloat16 (Node.precision): ``a`` holds the weights rounded to bfloat16 in
    # pairs along K (:func:`pack_weights_bf16`, ``[G, Mb, ceil(K/2), mr, 2]``), the input is rounded to bfloat16
    # as it is packed, the products accumulate in float32; "" float32
    precision: str = ""
    # bf16 on AMX tiles (AMX_TILES): ``a`` is ``[G, Mb, S, mr, AMX_K / 2, 2]`` (:func:`pack_weights_amx`: per
    # tile step of AMX_K k, rows of channels; K in pairs padded with zeros to S whole steps), mr and cols
    # multiples of 16
    amx: bool = False

    @property
    def k(self) -> int:
        return self.cin * int(np.prod(self.kernel))

    @property
    def p(self):
        return product(self.out_spatial)

    @property
    def m_blocks(self) -> int:
        return -(-self.m // self.mr)

    @property
    def p_blocks(self):
        return (self.p + self.cols - 1) // self.cols

    @property
    def pair_rows(self) -> int:
        """Rows (pairs of k) of a bf16 operand along K: ceil(K/2), on AMX tiles rounded up to whole tile steps
        (AMX_TILE pairs; the rows past ceil(K/2) zero in the weights and the pair panels alike)."""
        k2 = (self.k + 1) // 2
        return -(-k2 // AMX_TILE) * AMX_TILE if self.amx else k2

    @property
    def flops(self) -> int:
        return 2 * self.n * self.groups * self.m * self.k * self.p


def pack_weights(w: np.ndarray, groups: int, mr: int = MR, dtype=np.float32) -> np.ndarray:
    """``w[M, C/G, *kernel]`` -> ``[G, Mb, K, mr]`` with K = C/G * prod(kernel), zero rows past M/G."""
    m_total = w.shape[0]
    mg = m_total // groups
    k = int(np.prod(w.shape[1:]))
    mb = -(-mg // mr)
    a = np.zeros((groups, mb * mr, k), dtype=dtype)
    a[:, :mg, :] = w.reshape(groups, mg, k)
    return np.ascontiguousarray(a.reshape(groups, mb, mr, k).transpose(0, 1, 3, 2))


def bf16_pairs(a: np.ndarray, axis: int) -> np.ndarray:
    """``a`` rounded to bfloat16 (nearest even), with its ``axis`` (K) padded with a zero to an even length and
    split into pairs moved last: ``[..., K, ...]`` -> ``[..., ceil(K/2), ..., 2]``, the layout of the x86
    ``vdpbf16ps`` operands (each 32-bit lane holds two consecutive k)."""
    import ml_dtypes
    k = a.shape[axis]
    if k % 2:
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, 1)
        a = np.pad(a, pad)
    shape = a.shape[:axis] + ((k + 1) // 2, 2) + a.shape[axis + 1:]
    a = a.reshape(shape)
    return np.ascontiguousarray(np.moveaxis(a, axis + 1, -1).astype(np.float32).astype(ml_dtypes.bfloat16))


def bf16_values(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bfloat16 (nearest even), as float32."""
    return narrow_values(a, "bf16")


#: the element types of the formats a contraction's operands are rounded to (Node.precision spellings)
NARROW_DTYPES = {"bf16": DType.BFLOAT16, "fp16": DType.FLOAT16}


def narrow_values(a: np.ndarray, fmt: str) -> np.ndarray:
    """``a`` rounded to ``fmt`` ("bf16" or "fp16", nearest even), as float32."""
    return np.ascontiguousarray(np.asarray(a, np.float32).astype(NARROW_DTYPES[fmt].numpy).astype(np.float32))


def pack_weights_bf16(w: np.ndarray, groups: int, mr: int = MR) -> np.ndarray:
    """:func:`pack_weights` rounded to bfloat16 in pairs along K: ``[G, Mb, ceil(K/2), mr, 2]``."""
    return bf16_pairs(pack_weights(w, groups, mr), 2)


def pack_weights_amx(w: np.ndarray, groups: int, mr: int) -> np.ndarray:
    """The AMX A-tile layout, step-major: :func:`pack_weights`' panels as rows of channels (``[G, Mb, mr, K]``), K
    padded with zeros to a multiple of AMX_K, rounded to bfloat16 in pairs and cut into tile steps of AMX_K / 2
    pairs: ``[G, Mb, S, mr, AMX_K / 2, 2]`` (S = K2p / 16). One step's A tiles (16 rows of 32 bfloat16, 64 bytes
    apart) are then one contiguous run of ``mr * 64`` bytes, and a weight block's steps follow each other: the
    kernel reads its weights as one sequential stream. (Rows of channels, ``[G, Mb, mr, K2p, 2]``, made each tile
    16 rows K2p pairs apart: 32 concurrent streams. On a Xeon with AMX, family 6 model 207, ResNet-50's 1x1
    layers with K = 128 to 1024 then ran 1.03-1.08x this layout's in-kernel time (K = 64 and 2048 within 2%),
    the whole model 1.03-1.04x; the same bits.
    bench/PRECISION.md, session 27.)"""
    a = pack_weights(w, groups, mr).transpose(0, 1, 3, 2)
    k = a.shape[-1]
    a = np.pad(a, [(0, 0)] * 3 + [(0, -(-k // AMX_K) * AMX_K - k)])
    p = bf16_pairs(a, 3)                                   # [G, Mb, mr, K2p, 2]
    g, mb, _, k2p, _ = p.shape
    return np.ascontiguousarray(p.reshape(g, mb, mr, k2p // AMX_TILE, AMX_TILE, 2).transpose(0, 1, 3, 2, 4, 5))


@attrs.define(eq=False)
class DepthwiseWindow:
    """A 2-D per-channel window over a stored input whose every window position is inside it (padded): a
    depthwise convolution (one output channel per input channel) or a max pool.
    ``E("window", [n, c, oh, ow, reduce], attr=self)``; the x86 backend computes whole output rows in vector
    registers (see :mod:`cuvil.targets.x86.depthwise`)."""
    w: Optional[Buf]    # weights [C, 1, KH, KW] ("conv"); None for "max"
    x: Buf              # input [N, C, H, W]
    kernel: tuple
    strides: tuple
    dilations: tuple
    out_spatial: tuple
    kind: str = "conv"  # "conv": sum of w * x; "max": fmax of x (MaxPool: NaN skipped, as in the reference);
    # "sum": a plain sum of x (w None; a mean over the whole map of a channels-last value, lower.pool)
    # "conv": zero padding (top, left) the kernel reads as zeros (masked loads, rows outside skipped)
    # instead of a stored padded copy; a "max" window's input is padded (pads (0, 0))
    pads: tuple = (0, 0)

    @property
    def flops(self) -> int:
        if self.kind != "conv":
            return 0
        n, c = self.x.shape[:2]
        return 2 * n * c * product(self.out_spatial) * int(np.prod(self.kernel))


@attrs.define(eq=False)
class MatContraction:
    """A float32 product with constant weights, ``out[p, m] = sum_k A[p, k] * W[k, m]`` (MatMul with a
    constant 2-D right operand, Gemm with constant B): ``A`` is stored row-major (rows of ``k``; its leading
    dims flattened into ``rows``, which may be symbolic), ``W`` packed at compile time into panels of
    ``cols`` output columns (``Wp[m // cols, k, m % cols]``, zero columns past ``m``). The output's last dim
    is ``m``. ``E("contract", [*out_index, reduce], attr=self)``; every backend may evaluate it as its sum,
    the x86 backend runs register tiles of MR rows x ``cols`` columns that read A directly (no packing)."""
    w: Buf              # packed weights [Mb, K, cols]
    a: Buf              # A, row-major, rows of k
    rows: object        # rows of A (int or SymExpr)
    m: int
    k: int
    cols: int
    # "bf16": ``w`` holds the weights rounded to bfloat16 in pairs along K (:func:`pack_columns_bf16`,
    # ``[Mb, ceil(K/2), cols, 2]``), A is rounded to bfloat16, the products accumulate in float32; "" float32
    precision: str = ""
    # bf16 on AMX tiles (AMX_TILES): ``w``'s K is padded to a multiple of AMX_K (pack_columns_bf16)
    amx: bool = False
    mr: int = MR        # rows of A per register tile (x86: MR x cols accumulators)

    @property
    def m_blocks(self) -> int:
        return -(-self.m // self.cols)

    @property
    def flops(self):
        return 2 * self.rows * self.m * self.k


def pack_columns(w: np.ndarray, cols: int) -> np.ndarray:
    """``w[K, M]`` -> ``[ceil(M / cols), K, cols]`` panels of consecutive output columns, zero past M."""
    k, m = w.shape
    mb = -(-m // cols)
    out = np.zeros((k, mb * cols), dtype=np.float32)
    out[:, :m] = w
    return np.ascontiguousarray(out.reshape(k, mb, cols).transpose(1, 0, 2))


def pack_columns_fp16(w: np.ndarray, cols: int) -> np.ndarray:
    """:func:`pack_columns` rounded to float16 (nearest even): ``[Mb, K, cols]`` halves
    (:mod:`cuvil.targets.x86.gemm_fp16`)."""
    return pack_columns(np.asarray(w, np.float32), cols).astype(np.float16)


def pack_columns_bf16(w: np.ndarray, cols: int, k_multiple: int = 2) -> np.ndarray:
    """:func:`pack_columns` rounded to bfloat16 in pairs along K: ``[Mb, ceil(K/2), cols, 2]``; with
    ``k_multiple`` (AMX_K for AMX tiles) K is padded with zero rows to a multiple of it first (16 pairs of a
    panel are then one B tile: rows of cols pairs, 16 columns per tile)."""
    p = pack_columns(w, cols)
    k = p.shape[1]
    p = np.pad(p, [(0, 0), (0, -(-k // k_multiple) * k_multiple - k), (0, 0)])
    return bf16_pairs(p, 1)


@attrs.define(eq=False)
class PadWindow:
    """A padded copy ``y[n, c, *p] = x[n, c, *(p - begin)]`` where every ``0 <= p - begin < sizes``, else
    ``fill``: ``E("padwin", [safe], attr=self)``, where ``safe`` is that select with the reads clamped into
    ``x`` (every backend may evaluate it); ``interior()`` builds the unclamped read, valid inside only,
    which the x86 backend evaluates over each row's interior run (:mod:`cuvil.targets.x86.pad`)."""
    begin: tuple        # leading pad per spatial axis
    sizes: tuple        # the input's spatial extents
    fill: float
    interior: object    # () -> E over the stage's variables
    # the interior is written in place by the input's producer (cuvil.kernels.pad_in_place): the x86 kernel
    # writes only the border (the plain expression copies each interior element onto itself); out of the repr,
    # which the process-replay snapshots print (the pitched producer's stage shows it: cuvil.testing.replay)
    in_place: bool = attrs.field(default=False, repr=False)


@attrs.define(eq=False)
class WinogradInput:
    """The input transform of a Winograd convolution (:mod:`cuvil.ir.ops.winograd`):
    ``V[n, e*C + c, t] = (Bt d B)[e]`` (E = (m+2)^2) for the (m+2) x (m+2) tile ``d`` of channel ``c`` at tile
    ``t = th*TW + tw``, whose element (p, q) is ``x[n, c, th*m + p - pads[0], tw*m + q - pads[1]]`` of the
    unpadded input ``x[N, C, H, W]``, zero outside it (the padding, and the last tiles' overhang).
    ``E("wino_in", [n, ec, t, sum], attr=self)``; the x86 backend transforms rows of tiles in vector
    registers, its loads masked to the input (:mod:`cuvil.targets.x86.winograd`): no padded copy is stored.
    V feeds a grouped 1x1 :class:`Contraction` (one group per tile element e), or with ``interleaved``
    ``V[n, c*E + e, t]`` and an interleaved contraction, where :func:`winograd_interleaved` says so."""

    x: Buf
    tile: int
    channels: int
    tiles: tuple        # (TH, TW)
    pads: tuple = (0, 0)   # (top, left)
    interleaved: bool = False   # V[n, c*E + e, t] (see winograd_interleaved); else V[n, e*C + c, t]

    @property
    def flops(self) -> int:
        a = self.tile + 2
        return 2 * 2 * a ** 3 * self.x.shape[0] * self.channels * self.tiles[0] * self.tiles[1]


# L1 data cache geometry of the x86 cores targeted (Zen 4/5 and recent Intel: 48 KiB, 64 sets x 12 ways)
L1_SETS, L1_WAYS, LINE = 64, 12, 64


def planes_alias(planes: int, stride_bytes: int) -> bool:
    """Whether ``planes`` streams ``stride_bytes`` apart put more of their lines in one L1 set than it has ways
    (a stride that is not whole lines drifts across the sets: never)."""
    if stride_bytes % LINE:
        return False
    step = (stride_bytes // LINE) % L1_SETS
    sets = L1_SETS // np.gcd(step, L1_SETS) if step else 1
    return -(-planes // sets) > L1_WAYS


def winograd_interleaved(channels: int, tiles: int, tile: int) -> bool:
    """Whether V is stored channel-major (``V[n, c*E + e, t]``): when e-major storage would put more of a
    transform unit's E = (tile+2)^2 stores, ``channels * tiles`` floats apart, in one L1 set than it has
    ways. With 128 channels and 16 tiles that stride is 8 KiB and all 36 stores of F(4x4) share a set:
    DenseNet-121's 14x14 input transforms ran 3.3x slower than channel-major (0.080 -> 0.024 ms), ResNet-50's
    F(2x2) 7x7 ones 4x (0.135 -> 0.034 ms). Channel-major costs the GEMM's panel packing strided reads
    (C rows E*T floats apart), ~5% of the GEMM where nothing aliased (`python3 bench/winograd_layers.py`)."""
    return planes_alias((tile + 2) ** 2, channels * tiles * 4)


def winograd_m_row(channels: int, tiles: int, tile: int) -> int:
    """Floats from one row of M (a channel's ``tiles`` values of one tile element) to the next: ``tiles``, or
    more where the output transform's E = (tile+2)^2 loads of a vector block, ``channels * tiles`` floats apart,
    would alias in L1 (:func:`planes_alias`, as for V's stores in :func:`winograd_interleaved`). A row of
    ``tiles`` rounded up to whole 16-byte steps until they spread, at most max(4, tiles / 8) floats longer (else
    ``tiles``: with 128 or more channels a 16-byte step moves a plane by whole lines in multiples of 8 sets or
    more, and few rows spread); the rows' tails are written by no one and read by no one. ResNet-50's 56x56
    layers in bf16 (F(2x2), 64 channels, 784 tiles: 16 planes 49 x 4 KiB apart, all in one set): the output
    transform 0.160 ms, against 0.079 / 0.083 at 54x54 / 58x58 (a 64 -> 64 3x3 layer alone, 2-core Zen 4); with
    rows of 788, 0.081-0.084 (`python3 bench/winograd_alias.py --precision bf16`, bench/RESULTS.md session 37)."""
    e = (tile + 2) ** 2
    for row in [tiles] + list(range((tiles // 4 + 1) * 4, tiles + max(4, tiles // 8) + 1, 4)):
        if not planes_alias(e, channels * row * 4):
            return row
    return tiles


@attrs.define(eq=False)
class WinogradOutput:
    """The output transform: ``Y[n, k, th*m + r, tw*m + q] = (At M A)[r, q]`` for the (m+2) x (m+2) values
    ``M[n, e*K + k, t]`` of the GEMM stage, cropped to ``out_spatial``. ``E("wino_out", [n, k, h, w, direct,
    sum], attr=self)``: ``direct`` is the direct convolution at that output, which the x86 kernel computes
    for tiles whose Winograd values are not finite."""
    m: Buf              # [N, E*K, T]
    tile: int
    channels: int       # K
    tiles: tuple        # (TH, TW)
    out_spatial: tuple  # (OH, OW)

    @property
    def flops(self) -> int:
        a, t = self.tile + 2, self.tiles[0] * self.tiles[1]
        return 2 * (a * a * self.tile + self.tile * self.tile * a) * self.m.shape[0] * self.channels * t


def fallback_weights(node: E) -> Optional[Tuple[E, E, Tuple[int, ...]]]:
    """The parts of a ``wino_out`` node's direct convolution ``sum over (c, p, q) of W[k, c, p, q] * x``
    (x86/winograd.py rebuilds one output channel's W into per-thread scratch once, then sums from it):
    ``(w, x, (C, kh, kw))`` with ``w`` the reconstruction of one W element from U's panels, which may read
    only the reduction's variables and the output channel ``node.args[1]``; None for any other form (the
    kernel then evaluates the direct expression as it stands)."""
    if len(node.args) != 6:
        return None
    direct = node.args[-2]
    if direct.op != "reduce" or direct.attr[0] != "sum" or direct.args[0].op != "mul":
        return None
    w, x = direct.args[0].args
    extents = direct.attr[2]
    if w.op != "reduce" or node.args[1].op != "var" or not all(isinstance(d, int) for d in extents):
        return None
    inner = {v.attr for e in nodes(w) if e.op == "reduce" for v in e.attr[1]}
    allowed = inner | {v.attr for v in direct.attr[1]} | {node.args[1].attr}
    if any(e.op == "var" and e.attr not in allowed for e in nodes(w)):
        return None
    return w, x, tuple(extents)
