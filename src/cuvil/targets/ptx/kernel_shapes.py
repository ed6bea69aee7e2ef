"""Which kernel shape a PTX stage gets (:meth:`~cuvil.targets.ptx.codegen.PtxKernelModule.add_stage`): a
stage with one float sum and few outputs splits the sum over lanes (:func:`split_lanes`), the largest
stages whose sum is ``weights x input`` load both into shared-memory tiles (:func:`tile_factors`,
:func:`tile_shape`), large ones compute several output channels per thread (:func:`coarsen_factor`).
Thresholds measured on an H200 (``bench/gpu/RESULTS.md``); those benchmarks vary are PtxTuning's."""
from __future__ import annotations

from typing import Optional

from ...ir.dtype import DType
from ...kernels.schedule import Stage
from ...kernels.texpr import E, nodes, top_level
from .tuning import DEFAULT_TUNING, PtxTuning

WARP = 32
# a stage whose float sum has at least this many terms may split it over lanes (:func:`split_lanes`; the
# other thresholds are PtxTuning's)
WARP_MIN_TERMS = 128


def split_lanes(outputs: int, terms: int, outer: int = 0, tuning: PtxTuning = DEFAULT_TUNING) -> int:
    """Threads per output element: the smallest power of two that brings the stage to
    ``tuning.split_target_threads`` (half that when the reduction has inner taps), at most a warp, each lane
    keeping ``tuning.split_min_terms_per_lane`` terms (and, splitting the outermost reduction index, at least
    one value of it)."""
    lanes = 1
    target = tuning.split_target_threads if outer in (0, terms) else tuning.split_target_threads // 2
    while (lanes < WARP and outputs * lanes < target
           and terms // (2 * lanes) >= tuning.split_min_terms_per_lane
           and (tuning.split_mode != "outer" or 2 * lanes <= outer)):
        lanes *= 2
    return lanes


def single_sum(st: Stage) -> Optional[E]:
    """The stage's one top-level float32 ``sum`` / ``fma`` reduction (none nested in it, no argmax scans, no
    other reduction in the stage), static shapes, no region; else None."""
    _, reductions = top_level(st.expr, "__none__")
    if len(reductions) != 1 or st.region is not None:
        return None
    red = reductions[0]
    if red.op != "reduce" or red.attr[0] not in ("sum", "fma") or red.dtype != DType.FLOAT:
        return None
    if not all(isinstance(d, int) for d in st.buf.shape) or not all(isinstance(x, int) for x in red.attr[2]):
        return None
    for a in red.args:   # no reduction inside the reduction's body
        if any(x.op in ("reduce", "argscan") for x in nodes(a)):
            return None
    return red


TILE_M, TILE_P, TILE_K = 64, 64, 16   # the largest tile; smaller ones (32) when it would leave SMs idle
TILE_MIN_BLOCKS = 264                  # blocks a tiled stage should launch (2 per SM of an H200)


def tile_shape(m: int, p: int):
    """(TM, TP): the largest of 64 x 64, 64 x 32, 32 x 64, 32 x 32 giving TILE_MIN_BLOCKS blocks, else 32 x 32."""
    for tm, tp in ((TILE_M, TILE_P), (TILE_M, TILE_P // 2), (TILE_M // 2, TILE_P), (TILE_M // 2, TILE_P // 2)):
        if -(-m // tm) * -(-p // tp) >= TILE_MIN_BLOCKS:
            return tm, tp
    return TILE_M // 2, TILE_P // 2


TILE_MIN_TERMS = 64   # a tiled stage's reduction has at least this many terms (its outputs: PtxTuning.tile_min_outputs)


def _vars_of(e: E) -> set:
    return {x.attr for x in nodes(e) if x.op == "var"}


def tile_factors(st: Stage, red: E, tuning: PtxTuning = DEFAULT_TUNING):
    """(weight factor, input factor) of a reduction ``sum(w * x)`` / ``fma(w, x)`` whose output is (n, m,
    rest...) with ``w`` independent of every output index but the channel (dim 1) and ``x`` independent of
    the channel: what a tiled kernel loads into shared memory. None when the stage does not have that form
    or is small (fewer than ``tuning.tile_min_outputs`` outputs)."""
    shape = st.buf.shape
    if len(shape) < 3 or not all(isinstance(d, int) for d in shape):
        return None
    outputs = 1
    for d in shape:
        outputs *= d
    terms = 1
    for x in red.attr[2]:
        terms *= int(x)
    if outputs < tuning.tile_min_outputs or terms < TILE_MIN_TERMS or shape[1] < 16 or max(outputs, terms) >= 2 ** 31:
        return None
    kind = red.attr[0]
    if kind == "fma":
        f1, f2 = red.args[0], red.args[1]
    else:
        body = red.args[0]
        if body.op != "mul" or len(body.args) != 2:
            return None
        f1, f2 = body.args
    if f1.dtype != DType.FLOAT or f2.dtype != DType.FLOAT:
        return None
    chan = st.vars[1].attr
    others = {v.attr for k, v in enumerate(st.vars) if k != 1}
    for w, x in ((f1, f2), (f2, f1)):
        vw, vx = _vars_of(w), _vars_of(x)
        if chan in vw and not (vw & others) and chan not in vx:
            return w, x
    return None


COARSEN_MIN = 196608   # outputs from which a reduction with kernel taps is coarsened (x2)...
COARSEN_MIN_1X1 = 401408   # ... and a single-index one (1x1 convolution); from 802,816 outputs x4


def coarsen_factor(st: Stage, red: E, tuning: PtxTuning = DEFAULT_TUNING) -> int:
    """Output channels (dim 1) one thread computes together, sharing every load that does not depend on
    the channel (a convolution's input window). Only stages with many outputs gain (fewer threads still fill
    the GPU): on an H200, ResNet-50's 3x3 convolutions of 200,704 outputs ran 1.3-1.5x faster with 2
    channels per thread, 1x1 ones 0.8x (they gain from 401,408 outputs), the 7x7 stem (802,816) 1.75x with 4
    (bench/gpu/RESULTS.md); at most ``tuning.coarsen``. 1 when dim 1 does not divide or the reduction does not
    read the channel."""
    outputs = 1
    for d in st.buf.shape:
        outputs *= int(d)
    taps = 1
    for x in red.attr[2][1:]:
        taps *= int(x)
    co = 4 if outputs >= 802816 else 2 if outputs >= (COARSEN_MIN if taps > 1 else COARSEN_MIN_1X1) else 1
    co = min(co, tuning.coarsen)
    if co <= 1 or len(st.buf.shape) < 3 or st.buf.shape[1] % co:
        return 1
    chan = st.vars[1].attr
    if not any(x.op == "var" and x.attr == chan for a in red.args for x in nodes(a)):
        return 1
    return co
