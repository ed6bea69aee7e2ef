"""The x86 cost model for algorithm choices (``on x86`` rules, see :data:`cuvil.dsl.ast.PHASES`).

A rule says a rewrite is *legal* (its proof); this module says where it *pays*. For a stride-1 3x3
convolution it estimates the time of the direct packed GEMM (:mod:`cuvil.targets.x86.gemm`) and of
Winograd F(2x2) and F(4x4) (:mod:`cuvil.targets.x86.winograd`) in one unit, multiply-adds of a full register
tile, and a Winograd rule is accepted only when its tile size is the cheapest of the three:

* GEMM work is counted on padded extents: output channels in panels of the register tile's rows,
  positions (direct: output pixels; Winograd: tiles) in panels of its columns, for the tile the lowering
  will choose among the target's (:func:`cuvil.targets.gemm.choose_tile` / ``tile_cost``; AVX2: 6x16;
  AVX-512: 12x32, 8x48 or 6x64, or the channel-lane 32x7, 48x7 or 64x6 for reductions of 256 or more): a
  7x7 map has 4 tiles of 4x4 in one panel, mostly empty, which is why small maps take F(2x2) or stay direct.
* Weights stream from memory once per inference, Winograd's (m+2)^2/9 times as many: :data:`WEIGHT_COST`
  per weight float; each GEMM packs its B panels: :data:`PACK_COST` per packed float.
  :data:`cuvil.targets.gemm.PARTIAL_TILE_COST` and WEIGHT_COST were set on 11 layers (ResNet-50's 7x7 and
  14x14, the light Inception-v1's and SqueezeNet's 13x13 and 6x6, 27x27), PACK_COST on the 16 layers of
  `python3 bench/winograd_layers.py` with V's channel-major layout (:func:`cuvil.targets.gemm.
  winograd_interleaved`; 2-core Zen 5, AVX-512). There the model picks the fastest of direct / F(2x2) /
  F(4x4) on 11 of 16: F(4x4) for DenseNet-121's 128 -> 32 at 56x56 and 28x28 (3% and 7% slower than
  F(2x2)), and F(2x2) for three 13x13 / 14x14 Inception-v1 layers, where F(4x4) ran 17-30% faster alone.
  That is the weight term: a layer run alone keeps its weights in L3, a model streams them. With
  WEIGHT_COST 12 the model took those three (13 of 16), and whole models measured: Inception-v1 1.5%
  faster, SqueezeNet 1.5-2% slower, their libraries 36% and 54% larger (F(4x4) stores 4x the weights).
* The transforms are memory-bound passes; their cost per element read or written, in multiply-add units,
  is :data:`TRANSFORM_COST`: an estimate, checked (not fitted) against ``python3 bench/winograd_layers.py``,
  where on a 2-core Zen 3 (AVX2) the model picked the fastest of the three on each of the 12 layer shapes
  measured (the Zen 5 figures are in bench/winograd_layers.py's output and the commit that set them).
"""
from __future__ import annotations

from typing import Optional

from ...dsl.ast import Num, OpCall, Rule
from ..gemm import choose_tile, tile_cost
from .gemm import tile_shapes

AVX2_TILES = tile_shapes(256)   # the default target's register tiles
TRANSFORM_COST = 4.0      # multiply-add units per transformed element (input tile element or output)
# multiply-add units per weight float: a whole model's weights stream from memory once per inference
# (~30 GB/s here against ~136 G multiply-adds/s per core), and Winograd multiplies them by (m+2)^2 / 9.
# Without this term F(4x4) won on 7x7 512-channel layers (4 tiles: 38 MB of transformed weights) once
# channel-lane tiles made its 4-position GEMM cheap on paper; measured 1.15 ms against F(2x2)'s 0.69 ms
# (`python3 bench/x86_layers.py --only conv3x3`).
WEIGHT_COST = 16.0
# multiply-add units per float of a packed B panel (K x padded positions per GEMM): the packing copy (a
# gather where positions are not consecutive) costs about what a k-step of a 4-vector tile row does, and
# small GEMMs pay it on every panel. Without it the model took F(4x4) for DenseNet-121's 128 -> 32 growth
# convolutions at 14x14 (36 GEMMs of 32 x 128 x 16: 0.106 ms against F(2x2)'s 0.073).
PACK_COST = 8.0
MIN_CHANNELS = 8          # fewer input or output channels: the GEMMs are too thin to gain


def _gemm_work(m: int, p: int, k: int, shapes) -> float:
    """Cost per reduction element of an m x p GEMM: the chosen tile's padded work and its panel packing."""
    tile = choose_tile(m, p, shapes, k)
    return tile_cost(m, p, tile, k) + PACK_COST * -(-p // tile[1]) * tile[1]


def direct_cost(c: int, k: int, oh: int, ow: int, shapes=AVX2_TILES) -> float:
    return 9 * c * _gemm_work(k, oh * ow, 9 * c, shapes) + WEIGHT_COST * 9 * c * k


def winograd_cost(c: int, k: int, oh: int, ow: int, m: int, shapes=AVX2_TILES) -> float:
    tiles = (-(-oh // m)) * (-(-ow // m))
    e = (m + 2) ** 2
    gemm = e * c * _gemm_work(k, tiles, c, shapes)
    transforms = TRANSFORM_COST * (e * c * tiles + e * k * tiles + k * oh * ow)
    return gemm + transforms + WEIGHT_COST * e * c * k


def best_tile(c: int, k: int, oh: int, ow: int, shapes=AVX2_TILES) -> Optional[int]:
    """The Winograd tile (2 or 4) expected to beat the direct convolution, or None, for a target whose
    micro-kernels' register tiles are ``shapes`` (see :func:`cuvil.targets.gemm.choose_tile`)."""
    if min(c, k) < MIN_CHANNELS:
        return None
    costs = {None: direct_cost(c, k, oh, ow, shapes), 2: winograd_cost(c, k, oh, ow, 2, shapes),
             4: winograd_cost(c, k, oh, ow, 4, shapes)}
    return min(costs, key=costs.get)


def _rhs_tile(rule: Rule) -> Optional[int]:
    rhs = rule.rhs
    if isinstance(rhs, OpCall) and rhs.op == "WinogradConv":
        for name, v in rhs.attrs:
            if name == "tile" and isinstance(v, Num):
                return int(v.value)
    return None


def accepter(shapes=AVX2_TILES):
    """The ``accept`` of a target whose micro-kernels' register tiles are ``shapes``."""
    return lambda rule, b: accept(rule, b, shapes)


def accept(rule: Rule, b, shapes=AVX2_TILES) -> bool:
    """Whether the x86 target (register tiles ``shapes``) wants this match of an ``on x86`` rule."""
    tile = _rhs_tile(rule)
    if tile is None:
        return True
    x, w = b.values.get("x"), b.values.get("w")
    if x is None or w is None or x.shape is None or w.shape is None:
        return False
    k, c = w.shape[:2]
    pads = [b.attrs.get(n, 0) for n in ("t", "l", "d", "r")]
    dims = list(x.shape[2:]) + list(w.shape[:2])
    if not all(isinstance(d, int) for d in dims + pads):
        return False      # symbolic maps: the transform kernels need static geometry
    oh, ow = x.shape[2] + pads[0] + pads[2] - 2, x.shape[3] + pads[1] + pads[3] - 2
    return best_tile(c, k, oh, ow, shapes) == tile
