"""The x86 cost model for algorithm choices (``on x86`` rules, see :data:`cuvil.dsl.ast.PHASES`).

A rule says a rewrite is *legal* (its proof); this module says where it *pays*. For a stride-1 3x3
convolution it estimates the time of the direct packed GEMM (:mod:`cuvil.targets.x86.gemm`) and of
Winograd F(2x2) and F(4x4) (:mod:`cuvil.targets.x86.winograd`) in one unit, multiply-adds of a full register
tile, and a Winograd rule is accepted only when its tile size is the cheapest of the three:

* GEMM work is counted on padded extents: output channels in panels of the register tile's rows,
  positions (direct: output pixels; Winograd: tiles) in panels of its columns, for the tile the lowering
  chose among the target's when this model was fitted (:func:`choice_tile`; AVX2: 6x16; AVX-512: 12x32, 8x48 or
  6x64, or the channel-lane 32x7, 48x7 or 64x6 for reductions of 256 or more; the lowering has more since): a
  7x7 map has 4 tiles of 4x4 in one panel, mostly empty, which is why small maps take F(2x2) or stay direct.
* Weights stream from memory once per inference, Winograd's (m+2)^2/9 times as many:
  :attr:`X86Tuning.weight_cost <cuvil.targets.x86.tuning.X86Tuning.weight_cost>` per weight float. Each
  GEMM packs its B panels, :data:`PACK_COST` per packed float, except a 1x1 GEMM in
  panel order (Winograd's, where output channels <= tiles), which reads them in place.
* The transforms: :data:`TRANSFORM_OP_COST` per scalar operation (the matrices' non-zeros, counted over
  whole vectors of tiles: F(4x4) does 7.3 operations per transformed input element to F(2x2)'s 4, and a
  7-tile row fills 7 of 16 lanes), plus :data:`TRANSFORM_COST` per element stored or loaded.
* Fitted on the 16 layers of `python3 bench/winograd_layers.py` (2-core Zen 5, AVX-512, in-place panels,
  V channel-major where it aliases: :func:`cuvil.kernels.contraction.winograd_interleaved`), with the weight cost held
  at 16 (:data:`cuvil.kernels.contraction.PARTIAL_TILE_COST` and it were first set on 11 of them). The model picks
  the fastest of direct / F(2x2) / F(4x4) on 11 of 16. It takes F(4x4) for DenseNet-121's 128 -> 32 at
  56x56 (18% slower than F(2x2) there), F(2x2) at 14x14 (direct was 9% faster), and F(2x2) for three 13x13 /
  14x14 Inception-v1 layers, where F(4x4) ran 17-30% faster alone. Those three are the weight term: a layer
  run alone keeps its weights in L3, a model streams them. With a weight cost of 12 the model took them, and whole
  models measured Inception-v1 1.5% faster and SqueezeNet 1.5-2% slower, with libraries 36% and 54% larger
  (F(4x4) stores 4x the weights). The per-element transform cost alone (4.0, the first model) had taken
  F(4x4) for DenseNet's 28x28 layers as well (23% slower). AVX2's choices on these 16 layers are the same
  as that first model's, which picked the fastest of the three on each of 12 layer shapes measured on a
  2-core Zen 3.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ...dsl.ast import Num, OpCall, Rule
from ...ir.dtype import DType
from ...ir.ops.winograd import MATRICES
from ...kernels.contraction import channel_lanes, choose_tile, tile_cost
from .gemm import tile_shapes
from .tuning import DEFAULT_TUNING, X86Tuning
from .winograd import transform_lanes

AVX2_TILES = tile_shapes(256)   # the default target's register tiles
TRANSFORM_COST = 2.0      # multiply-add units per transformed element stored or loaded (V, M, the output)
# per scalar operation of the transforms (the matrices' non-zeros, see _transform_ops), counted over whole
# vectors of tiles: F(4x4) takes 7.3 operations per transformed input element where F(2x2) takes 4, and
# a 7-tile row fills 7 of 16 lanes
TRANSFORM_OP_COST = 2.0
# multiply-add units per float of a packed B panel (K x padded positions per GEMM): the packing copy (a
# gather where positions are not consecutive) costs about what a k-step of a 4-vector tile row does, and
# small GEMMs pay it on every panel. Without it the model took F(4x4) for DenseNet-121's 128 -> 32 growth
# convolutions at 14x14 (36 GEMMs of 32 x 128 x 16: 0.106 ms against F(2x2)'s 0.073).
PACK_COST = 8.0
MIN_CHANNELS = 8          # fewer input or output channels: the GEMMs are too thin to gain
GEMM_MIN_CHANNELS = 4     # fewer: no GEMM micro-kernel takes the Winograd GEMMs at all (lower/conv.py's conv_as_gemm)
#: The bound of a bf16 Winograd F(2x2) convolution's rounding, as the unit roundoff of its inputs the precision
#: policy widens its ranges by (2.01 times it times sum |w||x|: cuvil.precision.ranges._summed). V = Bt d B and
#: U = G g Gt are each off by at most e = 2^-8 + 2^-22 of |Bt||d||B| and |G||g||Gt| (bf16's half ulp after float32's
#: own error of a sum of at most 4 terms), so a product by (2e + e^2) of their magnitudes; with |V| <= 4 max|x|
#: and |At||G| at most 2 in any entry, At (sum over c of Uabs Vabs) A <= 16 max|x| sum|w|: the output is off by at
#: most 16 (2e + e^2) max|x| sum|w|, which this unit covers (2.01 u >= 16 (2e + e^2)). The non-finite-tile
#: fallback (W rebuilt from the rounded U: within 6.25 * 2^-8 of sum |w|) stays inside it too. float32's own sums
#: over the transformed magnitudes (up to (8C + 32) 2^-23 of them) are covered by the interval rule's (9C + 1) 2^-23
#: for C >= 31 and by the slack between 2.01 u and 16 (2e + e^2) below that.
_E = 2.0 ** -8 + 2.0 ** -22
BF16_WINOGRAD_UNIT = 8 * ((1 + _E) ** 2 - 1)


# The algorithm choice (Winograd or direct, F(2x2) or F(4x4)) prices each GEMM on the tile the lowering took when
# the choice was fitted (bench/winograd_layers.py; sessions 11-33), not on the lowering's later tiles (session 35:
# channel-lane tiles from K = 128, the 32 x 8 tile, one live vector no longer counted as an exact panel). Pricing
# those too moved Winograd choices the model was never measured on: DenseNet-121's 3x3 growth layers (K = 128) to
# F(4x4) and to Winograd at 7x7, its weights 42.6 -> 55.5 MB (+30%) for 1.3% more in kernels on a Zen 4 than the
# tiles alone gave; and 45 of 200 sampled geometries with 256 or more input channels (F(2x2) -> F(4x4), direct ->
# F(2x2) in bf16). The cost model has no term for a library's size, so the choice stays where it was measured.
#: the reduction length from which the choice prices channel-lane tiles (the lowering: from CHANNEL_FLOOR_K,
#: weighted more below CHANNEL_MIN_K, session 36)
CHOICE_CHANNEL_MIN_K = 256
#: the channel-lane tiles' position counts the choice prices (the lowering also has 32 x 8)
CHOICE_CHANNEL_COLS = (6, 7)


def choice_tile(m: int, p: int, k: int, shapes, tuning: X86Tuning = DEFAULT_TUNING) -> tuple:
    """The register tile the algorithm choice prices an m x p GEMM over k terms on (see above)."""
    shapes = [t for t in shapes if not channel_lanes(t) or t[1] in CHOICE_CHANNEL_COLS]
    return tuple(choose_tile(m, p, shapes, k, tuning.channel_tile_cost, CHOICE_CHANNEL_MIN_K, one_vector_exact=True))


def _gemm_work(m: int, p: int, k: int, shapes, in_place: bool = False, tuning: X86Tuning = DEFAULT_TUNING) -> float:
    """Cost per reduction element of an m x p GEMM: the chosen tile's padded work and its panel packing;
    ``in_place``: a 1x1 GEMM whose full panels are read where they are when it runs in panel order with a
    position-lane tile (m <= p, see :mod:`cuvil.targets.x86.gemm`); its partial last panel is packed."""
    tile = choice_tile(m, p, k, shapes, tuning)
    cols = tile[1]
    if in_place and m <= p and not channel_lanes(tile):    # only a partial last panel is packed
        packed = cols if p % cols else 0
    else:
        packed = -(-p // cols) * cols
    return tile_cost(m, p, tile, k, tuning.channel_tile_cost, CHOICE_CHANNEL_MIN_K) + PACK_COST * packed


def direct_cost(c: int, k: int, oh: int, ow: int, shapes=AVX2_TILES, tuning: X86Tuning = DEFAULT_TUNING,
                narrow: float = 1.0) -> float:
    """``narrow``: the GEMM's and the weights' share of the cost (0.5 for bf16: vdpbf16ps does two products per
    lane where an FMA does one, and a weight is two bytes)."""
    return narrow * (9 * c * _gemm_work(k, oh * ow, 9 * c, shapes, tuning=tuning) + tuning.weight_cost * 9 * c * k)


def _transform_ops(m: int) -> tuple:
    """Scalar adds / multiply-adds of one tile's input transform (Bt d B: two passes of Bt's non-zeros over
    the (m+2)^2 tile) and output transform (At M A)."""
    bt, _, at = MATRICES[m]
    nnz = lambda mat: sum(1 for row in mat for x in row if x != 0)    # noqa: E731
    return 2 * (m + 2) * nnz(bt), (2 * m + 2) * nnz(at)


def winograd_cost(c: int, k: int, oh: int, ow: int, m: int, shapes=AVX2_TILES,
                  tuning: X86Tuning = DEFAULT_TUNING, narrow: float = 1.0) -> float:
    """``narrow``: as :func:`direct_cost`'s, for the GEMMs and the weights (the transforms stay float32)."""
    th, tw = -(-oh // m), -(-ow // m)
    tiles = th * tw
    e = (m + 2) ** 2
    gemm = e * c * _gemm_work(k, tiles, c, shapes, in_place=True, tuning=tuning)
    # the transform kernels run VW neighbouring tiles of a tile row per vector (4 for rows of <= 4 tiles)
    vw = transform_lanes(16 if any(len(t) > 2 and t[2] == 16 for t in shapes) else 8, tw)
    slots = th * -(-tw // vw) * vw
    ops_in, ops_out = _transform_ops(m)
    transforms = (TRANSFORM_OP_COST * (ops_in * c + ops_out * k) * slots
                  + TRANSFORM_COST * (e * c * tiles + e * k * tiles + k * oh * ow))
    return narrow * (gemm + tuning.weight_cost * e * c * k) + transforms


def best_tile(c: int, k: int, oh: int, ow: int, shapes=AVX2_TILES, tuning: X86Tuning = DEFAULT_TUNING) -> Optional[int]:
    """The Winograd tile (2 or 4) expected to beat the direct convolution, or None, for a target whose
    micro-kernels' register tiles are ``shapes`` (see :func:`cuvil.kernels.contraction.choose_tile`), with
    the cost model's weights ``tuning`` (its ``winograd_tile``, when set, is taken whatever the costs, and so
    is this layer's entry in its ``layer_winograd``)."""
    if tuning.winograd_tile is not None:
        return tuning.winograd_tile
    measured = dict(tuning.layer_winograd).get((c, k, oh, ow))
    if measured is not None:       # chosen by `--tune` on this CPU (cuvil.targets.x86.tune)
        return measured or None
    if min(c, k) < MIN_CHANNELS:
        return None
    costs = {None: direct_cost(c, k, oh, ow, shapes, tuning), 2: winograd_cost(c, k, oh, ow, 2, shapes, tuning),
             4: winograd_cost(c, k, oh, ow, 4, shapes, tuning)}
    return min(costs, key=costs.get)


def winograd_geometry(n) -> Optional[Tuple[int, int, int, int]]:
    """(input channels, output channels, output height, width) of a Conv node rules/winograd.rule may rewrite (a
    3x3 stride-1 undilated ungrouped convolution with constant weights and static float32 maps), else None."""
    if n.op != "Conv" or len(n.inputs) < 2 or n.inputs[1] is None or not n.inputs[1].is_const:
        return None
    x, w = n.inputs[0], n.inputs[1].const
    a = n.attrs
    auto = a.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if (w.ndim != 4 or tuple(w.shape[2:]) != (3, 3) or int(a.get("group", 1)) != 1 or auto != "NOTSET"
            or any(int(v) != 1 for v in (a.get("strides") or ())) or any(int(v) != 1 for v in (a.get("dilations") or ()))):
        return None
    shape = x.shape if x is not None else None
    pads = list(a.get("pads") or [0, 0, 0, 0])
    if shape is None or len(shape) != 4 or x.dtype != DType.FLOAT or not all(isinstance(d, int) for d in shape[2:]):
        return None
    return int(w.shape[1]), int(w.shape[0]), shape[2] + pads[0] + pads[2] - 2, shape[3] + pads[1] + pads[3] - 2


def bf16_winograd_pays(c: int, k: int, oh: int, ow: int, shapes, tuning: X86Tuning) -> bool:
    """Whether a bf16 convolution of this geometry takes Winograd F(2x2) (the accepter's and the precision
    policy's view alike: ``X86Target.transformed_rounding``)."""
    return min(c, k) >= GEMM_MIN_CHANNELS and best_bf16_tile(c, k, oh, ow, shapes, tuning) == 2


def best_bf16_tile(c: int, k: int, oh: int, ow: int, shapes, tuning: X86Tuning) -> Optional[int]:
    """:func:`best_tile` for a convolution narrowed to bf16 (vdpbf16ps GEMMs): F(2x2) or direct, by the same
    costs with the GEMMs and weights at half their float32 cost."""
    if tuning.bf16_winograd is not None:
        return 2 if tuning.bf16_winograd else None
    if min(c, k) < MIN_CHANNELS:
        return None
    costs = {None: direct_cost(c, k, oh, ow, shapes, tuning, 0.5), 2: winograd_cost(c, k, oh, ow, 2, shapes, tuning, 0.5)}
    return min(costs, key=costs.get)


def _rhs_tile(rule: Rule) -> Optional[int]:
    rhs = rule.rhs
    if isinstance(rhs, OpCall) and rhs.op == "WinogradConv":
        for name, v in rhs.attrs:
            if name == "tile" and isinstance(v, Num):
                return int(v.value)
    return None


def conv_sum_rule(rule: Rule) -> bool:
    """Whether ``rule`` is one of rules/conv_sum.rule's: its replacement a Conv over a Concat."""
    rhs = rule.rhs
    return (isinstance(rhs, OpCall) and rhs.op == "Conv" and bool(rhs.args) and isinstance(rhs.args[0], OpCall)
            and rhs.args[0].op == "Concat")


def accepter(shapes=AVX2_TILES, tuning: X86Tuning = DEFAULT_TUNING, channels_last: bool = False,
             bf16_winograd: bool = False):
    """The ``accept`` of a target whose micro-kernels' register tiles are ``shapes``, cost model ``tuning``;
    ``channels_last``: its bf16 convolutions take the channels-last AMX form; ``bf16_winograd``: its bf16
    convolutions may take Winograd F(2x2) with vdpbf16ps GEMMs."""
    return lambda rule, b: accept(rule, b, shapes, tuning, channels_last, bf16_winograd)


def accept(rule: Rule, b, shapes=AVX2_TILES, tuning: X86Tuning = DEFAULT_TUNING, channels_last: bool = False,
           bf16_winograd: bool = False) -> bool:
    """Whether the x86 target (register tiles ``shapes``, cost model ``tuning``) wants this match of an
    ``on x86`` rule."""
    if conv_sum_rule(rule):
        return channels_last and conv_sum_pays(b)
    if isinstance(rule.rhs, OpCall) and rule.rhs.op == "FusedAttention":
        # the x86 kernel computes in float32 (a float16 / bfloat16 model's operands widened into it); a double
        # model's attention stays unfused
        return all(getattr(v, "dtype", DType.FLOAT) != DType.DOUBLE for v in b.values.values() if v is not None)
    tile = _rhs_tile(rule)
    if tile is None:
        return True
    conv = next((n for n in b.nodes if n.op == "Conv"), None)
    geo = winograd_geometry(conv) if conv is not None else None
    if geo is None:
        return False      # symbolic maps (the transform kernels need static geometry), a float16 model's input
    c, k, oh, ow = geo
    if min(c, k) < GEMM_MIN_CHANNELS:
        return False      # the Winograd GEMMs would have no micro-kernel (whatever the tuning forces)
    if conv.precision:    # narrowed by the precision policy: the direct kernel, or with vdpbf16ps F(2x2)
        return (conv.precision == "bf16" and bf16_winograd and tile == 2
                and bf16_winograd_pays(c, k, oh, ow, shapes, tuning))
    return best_tile(c, k, oh, ow, shapes, tuning) == tile


def conv_sum_pays(b) -> bool:
    """A sum of two 1x1 convolutions (rules/conv_sum.rule) runs as one where both are narrowed to bf16 and the
    channels-last AMX kernel takes the sum: it then reads each input where it lies and accumulates both products
    in one tile, and the first product's float32 output is never stored and read back (ResNet-50 bf16, a Xeon
    with AMX: bench/PRECISION.md, "Projection shortcuts in one accumulation"). Each input must fill whole steps
    of 32 channels; anywhere else the concatenation would be stored first, which is not measured to pay."""
    from ...kernels.contraction_nhwc import CHANNEL_STEP, channels_last_window
    x, y, w1, w2 = (b.values.get(k) for k in ("x", "y", "w1", "w2"))
    if any(v is None or v.shape is None or len(v.shape) != 4 for v in (x, y, w1, w2)):
        return False
    convs = [n for n in b.nodes if n.op == "Conv"]
    if len(convs) != 2 or any(n.precision != "bf16" for n in convs):
        return False
    dims = list(x.shape[1:]) + list(y.shape[1:])
    if not all(isinstance(d, int) for d in dims) or x.shape[1] % CHANNEL_STEP or y.shape[1] % CHANNEL_STEP:
        return False
    m, c = w1.shape[0], x.shape[1] + y.shape[1]
    out = (x.shape[0], m) + tuple(x.shape[2:])
    return channels_last_window((x.shape[0], c) + tuple(x.shape[2:]), (m, c, 1, 1), out, (1, 1), (1, 1), (0, 0), 1) is None
