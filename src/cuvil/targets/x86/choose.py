"""The x86 cost model for algorithm choices (``on x86`` rules, see :data:`cuvil.dsl.ast.PHASES`).

A rule says a rewrite is *legal* (its proof); this module says where it *pays*. For a stride-1 3x3
convolution it estimates the time of the direct packed GEMM (:mod:`cuvil.targets.x86.gemm`) and of
Winograd F(2x2) and F(4x4) (:mod:`cuvil.targets.x86.winograd`) in one unit, multiply-adds of a full register
tile, and a Winograd rule is accepted only when its tile size is the cheapest of the three:

* GEMM work is counted on padded extents: output channels in panels of MR, positions (direct: output
  pixels; Winograd: tiles) in panels of ``cols``, the target's micro-kernel width (16 with AVX2, 64 with
  AVX-512): a 7x7 map has 4 tiles of 4x4 in one panel, mostly empty, which is why small maps take F(2x2)
  with AVX2 and stay direct with AVX-512's wider panels.
* The transforms are memory-bound passes; their cost per element read or written, in multiply-add units,
  is :data:`TRANSFORM_COST`: an estimate, checked (not fitted) against ``python3 bench/winograd_layers.py``,
  where on a 2-core Zen 3 (AVX2) the model picked the fastest of the three on each of the 12 layer shapes
  measured, and on a 2-core Zen 5 (AVX-512) on 10 of the 12 (the two misses, Inception-v1's 7x7 layers,
  stay direct where F(2x2) measured 12-27% faster).
"""
from __future__ import annotations

from typing import Optional

from ...dsl.ast import Num, OpCall, Rule
from ..gemm import MR

COLS = 16                 # B panel width of the AVX2 micro-kernels (tile_cols(256)), the default
TRANSFORM_COST = 4.0      # multiply-add units per transformed element (input tile element or output)
MIN_CHANNELS = 8          # fewer input or output channels: the GEMMs are too thin to gain


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def direct_cost(c: int, k: int, oh: int, ow: int, cols: int = COLS) -> float:
    return 9 * c * _pad(k, MR) * _pad(oh * ow, cols)


def winograd_cost(c: int, k: int, oh: int, ow: int, m: int, cols: int = COLS) -> float:
    tiles = (-(-oh // m)) * (-(-ow // m))
    e = (m + 2) ** 2
    gemm = e * c * _pad(k, MR) * _pad(tiles, cols)
    transforms = TRANSFORM_COST * (e * c * tiles + e * k * tiles + k * oh * ow)
    return gemm + transforms


def best_tile(c: int, k: int, oh: int, ow: int, cols: int = COLS) -> Optional[int]:
    """The Winograd tile (2 or 4) expected to beat the direct convolution, or None, for micro-kernels
    ``cols`` positions wide."""
    if min(c, k) < MIN_CHANNELS:
        return None
    costs = {None: direct_cost(c, k, oh, ow, cols), 2: winograd_cost(c, k, oh, ow, 2, cols),
             4: winograd_cost(c, k, oh, ow, 4, cols)}
    return min(costs, key=costs.get)


def _rhs_tile(rule: Rule) -> Optional[int]:
    rhs = rule.rhs
    if isinstance(rhs, OpCall) and rhs.op == "WinogradConv":
        for name, v in rhs.attrs:
            if name == "tile" and isinstance(v, Num):
                return int(v.value)
    return None


def accepter(cols: int = COLS):
    """The ``accept`` of a target whose micro-kernels are ``cols`` positions wide."""
    return lambda rule, b: accept(rule, b, cols)


def accept(rule: Rule, b, cols: int = COLS) -> bool:
    """Whether the x86 target (micro-kernels ``cols`` wide) wants this match of an ``on x86`` rule."""
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
    return best_tile(c, k, oh, ow, cols) == tile
