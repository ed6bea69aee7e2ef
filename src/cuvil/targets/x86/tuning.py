"""The x86 backend's cost-model and register-tile settings that benchmarks vary (``bench/channel_tiles.py``,
``bench/winograd_layers.py``): one immutable object carried by :class:`cuvil.targets.x86.target.X86Options`
and passed to the Winograd choice (:mod:`cuvil.targets.x86.choose`), the scheduler's tile choice
(:func:`cuvil.kernels.contraction.choose_tile`, which takes the plain ``channel_tile_cost``) and the register
tiles offered (:func:`cuvil.targets.x86.gemm.tile_shapes`), never module state. The defaults are the shipped
choices, measured on a 2-core Zen 5 (the figures are in the comments below and in those modules); the 32 x 8
channel-lane tile and channel-lane tiles at ``channel_tile_cost`` from K = 128
(:data:`cuvil.kernels.contraction.CHANNEL_MIN_K`) on a 2-core Zen 4 only (session 35), and from K = 16 with more
weight below 128 (:func:`cuvil.kernels.contraction.short_k_weight`, session 36)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import attrs


def _channel_tiles(value) -> Tuple[Tuple[int, int], ...]:
    return tuple((int(n), int(c)) for n, c in value)


def _positive_pairs(inst, attribute, value) -> None:
    if not all(n > 0 and c > 0 for n, c in value):
        raise ValueError(f"{attribute.name}: (channel vectors, positions) pairs of positive ints, got {value!r}")


def _matmul_tile(value) -> Optional[Tuple[int, int]]:
    return None if value is None else (int(value[0]), int(value[1]))


def _tile_pair(inst, attribute, value) -> None:
    if value is not None and not (value[0] > 0 and value[1] > 0):
        raise ValueError(f"{attribute.name}: None or (rows, cols), positive ints, got {value!r}")


def _tile(value) -> tuple:
    """A register tile (rows, cols[, lanes]): ints, or the channel-lane marker "c" as its lanes."""
    return tuple(v if isinstance(v, str) else int(v) for v in value)


def _layer_winograd(value) -> Tuple[Tuple[Tuple[int, ...], int], ...]:
    return tuple(sorted((tuple(int(d) for d in key), int(tile)) for key, tile in value))


def _layer_tiles(value) -> Tuple[Tuple[Tuple[int, ...], tuple], ...]:
    return tuple(sorted(((tuple(int(d) for d in key), _tile(tile)) for key, tile in value), key=repr))


def _winograd_entries(inst, attribute, value) -> None:
    if not all(len(key) == 4 and tile in (0, 2, 4) for key, tile in value):
        raise ValueError(f"{attribute.name}: ((c, k, oh, ow), 0, 2 or 4) pairs, got {value!r}")


def _tile_entries(inst, attribute, value) -> None:
    if not all(len(key) == 3 and len(tile) == 3 and tile[0] > 0 and tile[1] > 0 for key, tile in value):
        raise ValueError(f"{attribute.name}: ((m, positions, k), (rows, cols, lanes)) pairs, got {value!r}")


def _non_negative(inst, attribute, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name}: a number >= 0, got {value!r}")


@attrs.frozen
class X86Tuning:
    """Cost-model weights and register tiles of the x86 backend (defaults: the shipped, measured ones)."""
    # AVX-512's channel-lane register tiles (cuvil.kernels.contraction.choose_tile), as (channel vectors,
    # positions): 7x3, 6x4, 7x2 or 8x2 accumulator vectors of channels beside the weight vectors and a broadcast
    # (7x4 spilled: 28 accumulators + 4 + a broadcast). 8x2 takes 16 positions (a 7x7 map's Winograd F(2x2)
    # GEMMs, which a 12 x 32 tile ran with one live vector: a weight broadcast per FMA) and 6x6 maps: on a
    # Zen 4, ResNet-50's two such GEMMs 0.88-0.92x in float32 and 0.83-0.86x in bf16, Inception-v1's 6x6 layers
    # 0.92-0.94x, the same bits (bench/RESULTS.md, session 35). Empty: position-lane tiles only
    channel_tiles: Tuple[Tuple[int, int], ...] = attrs.field(default=((3, 7), (4, 6), (2, 7), (2, 8)),
                                                             converter=_channel_tiles, validator=_positive_pairs)
    # A channel-lane tile's epilogue transposes it in registers, so its padded work is weighted this much
    # against a position-lane tile's (cuvil.kernels.contraction.tile_cost)
    channel_tile_cost: float = attrs.field(default=1.10, validator=_non_negative)
    # multiply-add units per weight float in the Winograd choice (cuvil.targets.x86.choose): a whole model's
    # weights stream from memory once per inference (~30 GB/s here against ~136 G multiply-adds/s per core),
    # and Winograd multiplies them by (m+2)^2 / 9. Without this term F(4x4) won on 7x7 512-channel layers
    # (4 tiles: 38 MB of transformed weights) once channel-lane tiles made its 4-position GEMM cheap on paper;
    # measured 1.15 ms against F(2x2)'s 0.69 ms (`python3 bench/x86_layers.py --only conv3x3`)
    weight_cost: float = attrs.field(default=16.0, validator=_non_negative)
    # 2 or 4: every stride-1 3x3 convolution an `on x86` Winograd rule matches takes that tile, whatever the
    # cost model says (the A/B measurements the model is fitted on: bench/winograd_layers.py,
    # bench/winograd_fallback.py); None: the cost model chooses
    winograd_tile: Optional[int] = attrs.field(default=None, validator=attrs.validators.in_((None, 2, 4)))
    # bf16 contractions on AMX tiles (tdpbf16ps, cuvil.targets.x86.amx) where the CPU has AMX-BF16; False:
    # AVX512_BF16's vdpbf16ps kernels even there (the side-by-side benchmark, the tests of that path)
    amx: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    # a bf16 2-D convolution reads its operand tiles straight from its input stored once as phase planes of
    # channel pairs (cuvil.kernels.contraction_planes, gemm_planes.py) instead of packing im2col pair panels.
    # None (the default): on AMX tiles only, where it was measured (ResNet-50 0.91-0.93x of the packed build on a
    # Xeon with AMX); the vdpbf16ps kernel over planes is written and tested but was measured only on that Xeon,
    # whose vdpbf16ps is slow (its planes layers 1.05x the packed ones there), not on the AVX512_BF16 CPUs without
    # AMX it is for (AMD Zen 4/5). True: both paths; False: the packed panels (bench/amx_resnet_ab.py --no-planes)
    bf16_planes: Optional[bool] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    # a bf16 stride-1 3x3 convolution on vdpbf16ps kernels (no AMX) as Winograd F(2x2): the input transform in
    # float32, its values and the transformed weights rounded to bfloat16 into the 16 GEMMs, the output transform
    # in float32 (docs/precision.md, "Winograd in bf16"). None (the default): where the cost model (choose.py,
    # GEMMs and weights at half their float32 cost) expects it to pay; False: the direct bf16 kernels; True: every
    # such convolution with 4 or more input and output channels (fewer: no GEMM takes it). On a Zen 4 ResNet-50
    # bf16 ran 0.936x (median) the direct build's steps (bench/PRECISION.md, session 33)
    bf16_winograd: Optional[bool] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    # bf16 2-D convolutions on AMX tiles take the activations' channels-last rows as their A tiles (their input
    # stored once as channels-last phase planes; cuvil.kernels.contraction_nhwc, gemm_nhwc.py), and a value whose
    # producer is such a convolution and whose every reader takes it so (or is a skip Add) is stored
    # channels-last, read in place by a 1x1 reader. Only where the CPU has AMX. On a 2-core Xeon with AMX
    # (family 6, model 207) ResNet-50 bf16 ran 0.84-0.87x the channel-planar build's p50 (bench/PRECISION.md,
    # session 29). False: the channel-planar forms (pair planes, packed panels; bench/amx_resnet_ab.py without
    # --channels-last)
    channels_last: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    # with channels_last: a sum of two bf16 1x1 convolutions (a bottleneck's last one and its projection
    # shortcut) runs as one over the concatenation of their inputs' channels (rules/conv_sum.rule), each piece
    # read where it lies, the first product's float32 output never stored. ResNet-50 bf16 on a Xeon with AMX
    # (family 6, model 207): 0.92-0.99x the unfused build's p50 (bench/PRECISION.md, session 30). False: two
    # convolutions (bench/amx_resnet_ab.py --no-conv-sum)
    conv_sum: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    # with channels_last: a channels-last convolution whose output only a stride-1 window's rows copy reads (a 3x3
    # layer's zero-bordered input) writes into the rows' interior, and the copy writes only the zeros around it
    # (cuvil.kernels.pad_in_place.write_rows_in_place; the same bits). Opt-in: on a Xeon with AMX (family 6,
    # model 207) ResNet-50 bf16's 13 such copies went (rows 0.73-0.74x) and its convolutions slowed by as much
    # (all steps 0.990x by median, 1.018x by min, bench/PRECISION.md session 30), as the channel-planar form's
    # pad_in_place did in session 15 (bench/amx_resnet_ab.py --rows-in-place)
    rows_in_place: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    # a float32 activation read only by bf16 convolutions (which round it to bfloat16 anyway) is stored as
    # bfloat16, and so are their zero-padded input copies (cuvil.kernels.schedule's bf16_storage): half the
    # bytes written and read, pair panels packed without rounding. False: float32 activations (the A/B)
    bf16_storage: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    # with bf16_storage: a value read by bf16 convolutions and by residual Adds (a ResNet block's output) stored
    # as bfloat16 too, as OpenVINO's bf16 does: a new rounding of the skip path (2^-8 relative). None (the
    # default): where the precision policy decided so (an explicit --precision bf16, the value's range
    # certified finite in bf16: Value.storage, cuvil.precision.policy.residual_storage). False: never (the
    # opt-out: the skip path float32 whatever the plan says). True: every such value, planned or not (nodes
    # narrowed by hand, bench/amx_resnet_ab.py --bf16-residual)
    bf16_residual: Optional[bool] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(bool)))
    # an AMX convolution prefetches the lines of its next position panel one panel ahead: the input rows a 1x1
    # reader packs, and in its vector epilogue (panel order: every weight block of one panel, then the next)
    # the residual it reads and the output it writes, for the tile that comes back to the same channels
    # there. Without it a 1x1 convolution at 56x56 waits on those lines (channel rows 12.5 KB apart: too many
    # streams for the hardware prefetcher). False: the A/B (bench/amx_resnet_ab.py --no-next-panel-prefetch);
    # the outputs are the same bits either way
    next_panel_prefetch: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    # a large AMX 1x1 convolution (bf16 output of 1 MB or more, its pair panels within 512 KB: ResNet-50's
    # 64 -> 256 convolutions at 56x56) sweeps all positions with one block of 32 output channels before the
    # next, so its epilogue streams 32 output and residual rows front to back instead of touching every channel
    # row at each 32-position panel (gemm.channel_sweep). On this session's 2-core Xeon (family 6, model 167,
    # AMX) those four layers went from 2.75 to 1.28 ms of in-kernel time (best of 31 rounds). False: the
    # A/B (bench/amx_resnet_ab.py --no-channel-sweep); the outputs are the same bits either way
    channel_sweep: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    # True: a bf16 convolution whose output only a padded copy reads (a 1x1 before a 3x3) stores its rows into
    # the copy's interior, and the copy writes only the zero border (cuvil.kernels.pad_in_place); the same bits
    # either way. Off by default: on this session's 2-core Xeon (family 6, model 167, AMX) ResNet-50's 3x3 pad
    # passes went (0.43 ms of in-kernel time, best of 30 rounds) but the 3x3 readers ran slower by as much (a
    # 1x1 -> 3x3 -> 1x1 block at 56x56: 3x3 +76..131 us, the copy had left its input fresh in L2; the producer
    # also streams its 1.6 MB input there) and whole-model thread CPU came out 0.8-1.7x (median ~1.05) of the
    # copies' on the loaded VM: no gain to pay for yet (bench/amx_resnet_ab.py --pad-in-place, bench/PRECISION.md).
    # (The channel-planar kernels' copies: the channels-last convolutions, the default on AMX, take their
    # windows first and have no such copy; with channels_last=False it applies there too.)
    pad_in_place: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    # True: a stored value that only a concatenation piece copies (SqueezeNet's expand pairs, Inception's
    # branches: a Concat read by a convolution or a pool) is written into its slice of the concatenation by its
    # producer, and the copy pass goes (cuvil.kernels.concat_in_place); the same bits either way. False: the A/B
    # (bench/concat_ab.py)
    concat_in_place: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))

    @property
    def bf16_storage_mode(self) -> str:
        """The scheduler's ``bf16_storage``: "residual", "plan", "convs" or "" (off)."""
        if not self.bf16_storage:
            return ""
        return {True: "residual", None: "plan", False: "convs"}[self.bf16_residual]
    # AVX-512's position-lane convolution register tiles offered to choose_tile, as (rows, position vectors):
    # None: 12x2, 8x3 and 6x4 (12 x 32, 8 x 48, 6 x 64 floats; cuvil.targets.x86.gemm.tile_shapes). One pair
    # forces that tile wherever a position-lane tile is taken (bench/conv_tiles.py)
    conv_tiles: Optional[Tuple[Tuple[int, int], ...]] = attrs.field(
        default=None, converter=attrs.converters.optional(_channel_tiles),
        validator=attrs.validators.optional(_positive_pairs))
    # The register tile (rows of A, weight-panel columns) of float32 MatMuls/Gemms with constant weights
    # (cuvil.targets.x86.matmul); None: chosen for the CPU (cuvil.targets.x86.gemm.matmul_tile). cols must
    # be a multiple of the vector width, and rows x cols / width accumulators + cols / width + 1 registers
    # fit the register file, else the product takes the generic loop nest
    matmul_tile: Optional[Tuple[int, int]] = attrs.field(default=None, converter=_matmul_tile,
                                                         validator=_tile_pair)
    # Per-layer choices measured on the host by `--tune` (cuvil.targets.x86.tune), each overriding the cost
    # model for one layer shape. ((c, k, oh, ow), tile): a stride-1 3x3 convolution of c -> k channels with an
    # oh x ow output takes Winograd F(tile x tile), or stays direct (0), whatever the costs say
    layer_winograd: Tuple[Tuple[Tuple[int, ...], int], ...] = attrs.field(
        default=(), converter=_layer_winograd, validator=_winograd_entries)
    # ((m, positions, k), tile): the register tile (rows, cols, lanes) of a direct convolution's contraction
    # with m output channels per group, that many output positions and a reduction of k terms, instead of
    # cuvil.kernels.contraction.choose_tile's least padded work
    layer_tiles: Tuple[Tuple[Tuple[int, ...], tuple], ...] = attrs.field(
        default=(), converter=_layer_tiles, validator=_tile_entries)

    @property
    def tile_choices(self) -> dict:
        """``layer_tiles`` as the scheduler's ``tile_choices``: {(m, positions, k): tile}."""
        return dict(self.layer_tiles)


DEFAULT_TUNING = X86Tuning()


#: Cost-model settings fitted per microarchitecture, keyed by cpuid (vendor, family, model): an untuned build
#: for the host takes its CPU's entry instead of DEFAULT_TUNING (fitted by bench/calibrate_tuning.py on the
#: per-layer measurements `--tune` caches; the figures are in bench/RESULTS.md). A CPU without an entry, or
#: one named with --cpu (no cpuid), keeps the shipped defaults; an explicit ``tuning=`` is taken as given.
CALIBRATED: Dict[Tuple[str, int, int], X86Tuning] = {
    # No entry yet. Intel Xeon with AMX (cpuid GenuineIntel 6/167, a VM), 2026-12-03: on the 41 ResNet-50 /
    # SqueezeNet layers `--tune` measured (one thread, thread CPU time) the best fit was channel_tile_cost 1.20
    # (Zen 5: 1.10; 2.39 ms lost against the fastest candidates instead of 2.72, 22 of 41 picked right instead
    # of 21), but whole models measured level with the shipped weights (ResNet-50 1.14 vs 1.13x onnxruntime,
    # SqueezeNet 1.17 vs 1.18, bench/RESULTS.md), so it is not taken: a calibrated entry has to beat the
    # shipped one on whole models, not only on layers alone.
}


def calibrated_tuning(cpu) -> X86Tuning:
    """The settings of ``cpu``'s microarchitecture (a :class:`cuvil.targets.x86.cpu.CpuDescription`) in
    :data:`CALIBRATED`, else :data:`DEFAULT_TUNING`."""
    if not cpu.is_host or cpu.family is None or cpu.model is None:
        return DEFAULT_TUNING
    return CALIBRATED.get((cpu.vendor, cpu.family, cpu.model), DEFAULT_TUNING)
