"""Tensor-core MatMul / Gemm kernels for the GPU (``mma.sync``), in float16, bfloat16 or TF32 with float32
accumulation.

Which stages: a stage whose one float reduction (:func:`~cuvil.targets.ptx.kernel_shapes.single_sum`) runs
over one index ``k`` and multiplies two factors, ``A`` depending on the output's second-to-last index
(``m``) and ``k`` but not its last (``n``), ``B`` on ``k`` and ``n`` but not ``m`` (both may depend on the
leading, batch indices): ``out[..., m, n] = epilogue(sum_k A(..., m, k) * B(..., k, n))``. That is how the
GPU schedule lowers MatMul (batched, with either operand transposed, as BERT's and GPT-2's exports have them:
a ``Transpose`` folded into the load's indices) and Gemm; the bias, GELU and residual add the schedule fused
into the stage are its epilogue. The factors are evaluated through the stage's own expression (the
:class:`~cuvil.targets.ptx.emitter.PtxEmitter`) at in-range indices (rows and columns past the matrix are
clamped to the last one and never stored; terms past ``K`` select zero); the kernel's own chunk walk, its
vector loads and its split-K partial sums are stated to the bounds prover in
:mod:`cuvil.targets.ptx.bounds_patterns` (:meth:`~cuvil.targets.ptx.bounds_patterns.GpuPatterns.matmul_accesses`);
a product whose statement is refuted takes the plain kernels.

Which format (:func:`mma_format`): tensor cores only where contraction is allowed (the reduction is an
``fma`` one: an ``mma`` rounds its sum of products once, which no chain of separate roundings does), on sm_80
and later, and only when the stage's numbers may be narrowed: its node's ``precision`` (set by the precision
policy) is ``fp16`` or ``bf16``; or its factors are float16 already (``enable_fp16``); or ``allow_tf32``
(TF32: the factors rounded to a 10-bit mantissa with ``cvt.rna.tf32.f32``, products summed in float32).
Strict float32 (the default) never takes this kernel.

The kernel: a group of 128 threads (four warps, 2 x 2) computes a BM x BN output tile (64 or 32 each, the
largest that still gives about two blocks per SM, :func:`plan_matmul`), walking ``K`` in chunks of
:data:`TK` = 32 terms. Per chunk every thread loads its share of the BM x TK ``A`` tile and the TK x BN ``B``
tile from global memory (the thread-to-element mapping follows whichever index is contiguous in memory, so a
warp's loads coalesce for row-major and transposed operands alike), converts them to the format and stores
them in shared memory ``k``-contiguous (``sa[m][k]``, ``sb[n][k]``; rows padded by :data:`PAD` elements so
the fragment loads of a warp hit 32 different banks); then each warp computes its WM x WN sub-tile with
``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}`` (or ``m16n8k8 ... .tf32``). The next chunk's global
loads are issued into registers before this chunk's ``mma`` (software pipelining) and stored to shared
memory after the barrier. BERT's products have few output tiles (128 rows) and long sums, so one group's
chunks would run one global-load latency after another: a block holds ``ks`` (2 or 4) such groups, group
``g`` taking chunks g, g + ks, ... (:func:`chunk_of`) with its own tiles, so ``ks`` chunks are in flight at
once; at the end groups 1..ks-1 leave their sums in shared memory and group 0 adds them in group order
(deterministic) and runs the epilogue. With ``PtxTuning.mma_async`` (on: 3 stages) a float16 product whose
operands are both one 16-byte aligned float16 matrix (:func:`async_ok`) takes another main loop instead
(:func:`_async_main_loop`): each K group's chunks are copied by ``cp.async.cg`` (16 bytes, zero-filled past
the matrix or past K) into ``plan.stages`` shared stages, ``stages - 1`` chunks ahead of the ``mma``s, and the
fragments are read by ``ldmatrix.x4`` (``.trans`` for an operand stored ``[k][row]``, the one whose rows are
contiguous); no registers hold the next chunk.
Fragment layouts (:data:`FRAGMENTS`) are the PTX ISA's ("Matrix Fragments for
mma.m16n8k16 / m16n8k8"); tests/test_gpu_tensor_cores.py replays the kernel's shared-memory indexing and
fragment gathering in numpy against them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import attrs
import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.schedule import ARENA, Stage
from ...kernels.texpr import Buf, E, load, nodes, reduce, replace_node
from ..llvm.types import F16, F32, I32, I64
from .emitter import PtxEmitter, overlaps, set_contraction, shared_global
from .kernel_shapes import single_sum
from .tile_walk import bind_tile, clamp, fetch_chunk, load_slot_indices
from .tile_walk import divmod_c as tile_divmod

TK = 32            # reduction terms per chunk
THREADS = 128      # four warps, 2 x 2 over the block tile
MIN_BLOCKS = 264   # about two blocks per SM of an H200: the tile shrinks until the grid has this many
FORMATS = ("fp16", "bf16", "tf32", "fp8")
NARROW = ("fp16", "bf16", "fp8")     # the node precisions (the policy's) this kernel runs
# ops whose contraction the PTX target narrows to a node's fp16 / bf16 precision (the precision policy's hook)
NARROWED_OPS = ("MatMul", "Gemm")
# ops the GPU schedule folds into a product's operand loads (their input is what the product's stage reads)
_LAYOUT_OPS = ("Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten")


@attrs.frozen
class Fragments:
    """One ``mma`` shape's fragment layout, per lane ``(g, t) = (lane // 4, lane % 4)``.

    ``k``: terms per mma; ``per_reg``: elements per 32-bit register (2 halves, 1 tf32); ``a``: per A register
    its (row, column) offset from ``(g, per_reg * t)``; ``b``: per B register its (k) offset from
    ``per_reg * t`` at column ``g``; ``c``: per accumulator its (row, column) offset from ``(g, 2 * t)``.
    A register of a 16-bit format holds the element at that column and the next (k, k + 1)."""
    ptx: str
    k: int
    per_reg: int
    a: Tuple[Tuple[int, int], ...]
    b: Tuple[int, ...]
    c: Tuple[Tuple[int, int], ...] = ((0, 0), (0, 1), (8, 0), (8, 1))


FRAGMENTS: Dict[str, Fragments] = {
    "fp16": Fragments("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", 16, 2,
                      ((0, 0), (8, 0), (0, 8), (8, 8)), (0, 8)),
    "bf16": Fragments("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", 16, 2,
                      ((0, 0), (8, 0), (0, 8), (8, 8)), (0, 8)),
    "tf32": Fragments("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", 8, 1,
                      ((0, 0), (8, 0), (0, 4), (8, 4)), (0, 4)),
    # E4M3 (sm_89+, PTX ISA 8.4): four bytes per register, the same byte positions as a 16-bit format's k16
    "fp8": Fragments("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32", 32, 4,
                     ((0, 0), (8, 0), (0, 16), (8, 16)), (0, 16)),
}
# shared rows padded so that the 8 rows x 4 words of a fragment load fall in 32 banks: 16-bit rows of 40
# halves (20 words), tf32 rows of 36 words, fp8 rows of 48 bytes (12 words: 0, 12, 24, 4, ... mod 32)
PAD = {"fp16": 8, "bf16": 8, "tf32": 4, "fp8": 16}
ELEM_BYTES = {"fp16": 2, "bf16": 2, "tf32": 4, "fp8": 1}
MIN_SM = {"fp16": 80, "bf16": 80, "tf32": 80, "fp8": 89}


def row_stride(fmt: str) -> int:
    """Elements per shared row (``k`` contiguous)."""
    return TK + PAD[fmt]


@attrs.define
class MatmulPlan:
    fmt: str
    bm: int           # block tile rows (m)
    bn: int           # block tile columns (n)
    batch: Tuple[int, ...]
    m: int
    n: int
    k: int
    a_kfast: bool     # A's thread mapping: k varies fastest (A contiguous along k), else m does
    b_kfast: bool     # B's: k fastest (B transposed, contiguous along k), else n
    swapped: bool = False   # the reduction's first factor is B (depends on n)
    ks: int = 1             # K groups: groups of four warps that take every ks-th chunk (see chunk_of)
    splits: int = 1         # K slices across blocks (split-K): slice s writes its partial sums, a sum kernel adds them
    min_ctas: int = 1       # blocks per SM ptxas must leave registers for (1: no cap)
    a_vec: int = 1          # halves per global load of A (8, 4, 2: one vector load, :func:`vec_width`; 1: scalar)
    b_vec: int = 1
    stages: int = 1         # > 1: both operands copied by cp.async into this many shared stages per K group

    @property
    def threads(self) -> int:
        return THREADS * self.ks

    @property
    def chunks(self) -> int:
        return -(-self.k // TK)

    @property
    def slice_chunks(self) -> int:
        """Chunks per K slice (the slices divide the chunks evenly, :func:`plan_slices`)."""
        return self.chunks // self.splits

    @property
    def rounds(self) -> int:
        return -(-self.slice_chunks // self.ks)

    @property
    def wm(self) -> int:
        return self.bm // 2

    @property
    def wn(self) -> int:
        return self.bn // 2

    @property
    def tiles_m(self) -> int:
        return -(-self.m // self.bm)

    @property
    def tiles_n(self) -> int:
        return -(-self.n // self.bn)

    @property
    def batches(self) -> int:
        r = 1
        for d in self.batch:
            r *= d
        return r

    @property
    def tiles(self) -> int:
        return self.batches * self.tiles_m * self.tiles_n

    @property
    def blocks(self) -> int:
        return self.tiles * self.splits

    @property
    def scratch_floats(self) -> int:
        """The split-K partial sums, ``[splits, *batch, m, n]`` floats (0 without split-K)."""
        return self.splits * self.batches * self.m * self.n if self.splits > 1 else 0


# --- fragment indexing (shared by the emitter and the numpy replay in the tests) ---------------------------

def a_word(fmt: str, sk: int, row0, g, t, ks: int, reg: int):
    """Shared element index of A register ``reg`` of lane (g, t) for the 16-row tile starting at ``row0`` and
    the mma's terms ``ks ..``: ``sa[row][col]`` with ``row = row0 + g + dr``, ``col = ks + per_reg * t + dc``.
    Works on ints and on emitted values alike (``+``/``*`` only)."""
    f = FRAGMENTS[fmt]
    dr, dc = f.a[reg]
    return (row0 + g + dr) * sk + t * f.per_reg + (ks + dc)


def b_word(fmt: str, sk: int, col0, g, t, ks: int, reg: int):
    """Shared element index of B register ``reg`` of lane (g, t) for the 8-column tile at ``col0``
    (``sb[n][k]``, ``n = col0 + g``, ``k = ks + per_reg * t + dk``)."""
    f = FRAGMENTS[fmt]
    return (col0 + g) * sk + t * f.per_reg + (ks + f.b[reg])


def c_coords(fmt: str, row0, col0, g, t, reg: int):
    """(row, column) of accumulator ``reg`` of lane (g, t) in the 16 x 8 tile at (row0, col0)."""
    dr, dc = FRAGMENTS[fmt].c[reg]
    return row0 + g + dr, col0 + t * 2 + dc


def chunk_of(rnd, grp, ks: int):
    """The chunk K group ``grp`` of ``ks`` takes in round ``rnd`` (it skips the round when that is past the
    last chunk): the groups interleave, so the ks chunks of a round are in flight together."""
    return rnd * ks + grp


def smem_bytes(fmt: str, bm: int, bn: int, ks: int, stages: int = 1) -> int:
    """Static shared memory of the kernel: the ks groups' A and B tiles (``stages`` of them per group with
    cp.async); the groups' partial sums reuse it."""
    return stages * ks * (bm + bn) * row_stride(fmt) * ELEM_BYTES[fmt]


def reduction_bytes(bm: int, bn: int, ks: int) -> int:
    """Partial sums groups 1..ks-1 leave in shared memory for group 0 (float32)."""
    return (ks - 1) * bm * bn * 4


SMEM_LIMIT = 48 * 1024   # static shared memory per block


def warp_tiles(plan: MatmulPlan):
    """The (16-row, 8-column) mma tiles of one warp's WM x WN sub-tile, in accumulator order."""
    return [(i * 16, j * 8) for i in range(plan.wm // 16) for j in range(plan.wn // 8)]


def load_slots(plan: MatmulPlan, which: str):
    """Per thread, the tile elements it loads each chunk: for slot ``j`` the element ``e = tid + j * THREADS``
    is (row, k) = divmod(e, TK) when k varies fastest, else (e % rows, e // rows); rows = BM (A) or BN (B).
    With vector loads (``plan.a_vec`` / ``b_vec`` = V > 1) slot ``e`` is a vector of V elements along the
    contiguous index: (row, V * kv) = divmod(e, TK / V), else (V * rv, k) with (k, rv) = divmod(e, rows / V)."""
    rows = plan.bm if which == "a" else plan.bn
    kfast = plan.a_kfast if which == "a" else plan.b_kfast
    return rows * TK // THREADS, rows, kfast


def vec_slots(plan: MatmulPlan, which: str):
    """(vectors per thread per chunk, V, rows, kfast) of an operand's vector loads (see :func:`load_slots`)."""
    rows = plan.bm if which == "a" else plan.bn
    kfast = plan.a_kfast if which == "a" else plan.b_kfast
    v = plan.a_vec if which == "a" else plan.b_vec
    return rows * TK // (v * THREADS), v, rows, kfast


# --- recognising the stage ----------------------------------------------------------------------------------

def _vars_of(e: E) -> set:
    return {x.attr for x in nodes(e) if x.op == "var"}


def _coeff(e: E, name: str) -> Optional[int]:
    """The coefficient of variable ``name`` in the affine index expression ``e`` (None: not affine)."""
    if e.op == "var":
        return 1 if e.attr == name else 0
    if e.op == "const":
        return 0
    if e.op == "add":
        a, b = (_coeff(x, name) for x in e.args)
        return None if a is None or b is None else a + b
    if e.op == "mul":
        a, b = e.args
        if a.op == "const":
            cb = _coeff(b, name)
            return None if cb is None else a.attr * cb
        if b.op == "const":
            ca = _coeff(a, name)
            return None if ca is None else b.attr * ca
    return None if name in _vars_of(e) else 0


def _stride(factor: E, name: str) -> Optional[int]:
    """The element stride of the factor's one load along variable ``name`` (None: not one affine load)."""
    loads = [x for x in nodes(factor) if x.op == "load"]
    if len(loads) != 1:
        return None
    ld = loads[0]
    total = 0
    for idx, s in zip(ld.args, ld.attr.strides):
        c = _coeff(idx, name)
        if c is None:
            return None
        total += c * int(s)
    return total


def factors(red: E) -> Optional[Tuple[E, E]]:
    """The two factors of a reduction of products (``fma`` reductions carry them as arguments)."""
    if red.attr[0] == "fma" and len(red.args) == 2:
        return red.args[0], red.args[1]
    body = red.args[0]
    if red.attr[0] == "sum" and body.op == "mul":
        return body.args[0], body.args[1]
    return None


def matmul_parts(st: Stage):
    """(reduction, A, B, swapped) when ``st`` is a matrix product the tensor-core kernel computes (see the
    module docstring), else None."""
    if st.region is not None or st.guard is not None or len(st.buf.shape) < 2:
        return None
    if st.buf.dtype not in (DType.FLOAT, DType.FLOAT16):
        return None
    red = single_sum(st)
    if red is None or len(red.attr[1]) != 1:
        return None
    fs = factors(red)
    if fs is None:
        return None
    kv = red.attr[1][0].attr
    mv, nv = st.vars[-2].attr, st.vars[-1].attr
    batch = {v.attr for v in st.vars[:-2]}
    allowed = batch | {kv, mv, nv}
    a, b = fs
    va, vb = _vars_of(a), _vars_of(b)
    if not (va <= allowed and vb <= allowed):
        return None
    swapped = False
    if nv in va or mv in vb:
        a, b, va, vb, swapped = b, a, vb, va, True
    if nv in va or mv in vb or kv not in va or kv not in vb:
        return None
    for f in (a, b):       # plain operand reads (a load, maybe widened): no arithmetic per term
        if not all(x.op in ("load", "cast", "var", "const", "add", "mul") or x.dtype == DType.INT64
                   for x in nodes(f)):
            return None
        if f.dtype != DType.FLOAT:
            return None
    return red, a, b, swapped


def _is_half(f: E) -> bool:
    return f.op == "cast" and f.args[0].dtype == DType.FLOAT16


def _const_term(e: E) -> Optional[int]:
    """The value of the affine index expression ``e`` with every variable 0 (None: not affine)."""
    if e.op == "var":
        return 0
    if e.op == "const":
        return int(e.attr)
    if e.op in ("add", "mul"):
        a, b = (_const_term(x) for x in e.args)
        if a is None or b is None:
            return None
        return a + b if e.op == "add" else a * b
    return None


def vec_width(f: E, fmt: str, kfast: bool, kv: str, rv: str, bvars, k: int, rows: int, tile_rows: int) -> int:
    """Halves per global load of a factor (8, 4 or 2), or 1: a float16 factor that is one plain load, whose
    index along the direction the thread mapping follows (``k`` when ``kfast``, else its row variable
    ``rv``) has element stride 1, every other stride and the constant offset a multiple of the width, the
    buffer's byte offset aligned to the load, and no element of a vector clamped or past ``K``: ``k`` a
    multiple of :data:`TK` (either direction: vectors are never zeroed past K), and ``rows`` a multiple of the
    tile's rows when the rows are contiguous (before session 17 the row-contiguous case took vectors past K,
    which the bounds prover refuted: such products ran on the plain kernels)."""
    if fmt != "fp16" or not _is_half(f) or f.args[0].op != "load":
        return 1
    ld = f.args[0]
    if k % TK or not kfast and rows % tile_rows:
        return 1
    along = kv if kfast else rv
    if _stride(f, along) != 1:
        return 1
    others = [_stride(f, v) for v in [kv, rv] + list(bvars) if v != along]
    if any(x is None for x in others):
        return 1
    consts = [_const_term(i) for i in ld.args]
    if any(c is None for c in consts):
        return 1
    flat0 = sum(c * int(st_) for c, st_ in zip(consts, ld.attr.strides))
    for v in (8, 4, 2):
        if int(ld.attr.offset) % (2 * v) == 0 and flat0 % v == 0 and all(x % v == 0 for x in others):
            return v
    return 1


ASYNC_VEC = 8      # halves per cp.async piece (16 bytes: cp.async.cg)
ASYNC_PAD = 8      # halves of padding per shared row of a stage stored k-major (``[k][row]``)


def async_ok(f: E, fmt: str, kfast: bool, kv: str, rv: str, bvars, k: int, rows: int) -> bool:
    """Whether a factor's tile can be copied by 16-byte ``cp.async`` pieces of :data:`ASYNC_VEC` halves along
    its contiguous index (``k`` when ``kfast``, else its row variable ``rv``): the alignment rules of
    :func:`vec_width` for 8 halves, and pieces that lie wholly inside or wholly past the matrix (``k`` a
    multiple of 8 when kfast, else ``rows``), so that a ragged tile is zero-filled piece by piece
    (``cp.async``'s source size 0) instead of clamped: K and the rows need not be multiples of the tile."""
    if kfast and k % ASYNC_VEC or not kfast and rows % ASYNC_VEC:
        return False
    # (vec_width's ragged-tile rules do not apply: 0 chunks of 0 rows pass them)
    return vec_width(f, fmt, kfast, kv, rv, bvars, 0, 0, 1) == ASYNC_VEC


def async_pieces(rows: int, kfast: bool):
    """Per 16-byte piece ``e`` of one operand's chunk (``rows * TK / 8`` of them, thread ``e % THREADS`` copies
    it): (row, term) of its first element and its shared half offset within the stage's operand region:
    ``[row][k]`` rows of :func:`row_stride` halves when kfast, else ``[k][row]`` rows of ``rows + ASYNC_PAD``."""
    out = []
    for e in range(rows * TK // ASYNC_VEC):
        if kfast:
            r, kk = e // (TK // ASYNC_VEC), e % (TK // ASYNC_VEC) * ASYNC_VEC
            out.append((r, kk, r * (TK + PAD["fp16"]) + kk))
        else:
            kk, r = e // (rows // ASYNC_VEC), e % (rows // ASYNC_VEC) * ASYNC_VEC
            out.append((r, kk, kk * (rows + ASYNC_PAD) + r))
    return out


def async_region(rows: int, kfast: bool) -> int:
    """Halves of one operand's region in a cp.async stage."""
    return rows * (TK + PAD["fp16"]) if kfast else TK * (rows + ASYNC_PAD)


def ldsm_a_half(kfast: bool, bm: int, row, r, m2, d2, ks: int):
    """The half (within the A region) whose address a lane with ``ldmatrix`` digits (r, m2, d2) =
    (lane % 8, lane // 8 % 2, lane // 16) gives ``ldmatrix.x4`` (``.trans`` unless kfast) for the 16 x 16 A
    fragment at tile row ``row`` and terms ``ks ..``: matrix ``2 * d2 + m2`` is rows ``8 * m2 ..``, terms
    ``8 * d2 ..``, which is A register ``2 * d2 + m2`` (:data:`FRAGMENTS`). Ints or emitted values."""
    if kfast:
        return (row + r + 8 * m2) * (TK + PAD["fp16"]) + ks + 8 * d2
    return (r + 8 * d2 + ks) * (bm + ASYNC_PAD) + row + 8 * m2


def ldsm_b_half(kfast: bool, bn: int, col, r, m2, d2, ks: int):
    """... for the two 8-column B fragments at ``col`` and ``col + 8``: matrix ``2 * d2 + m2`` is columns
    ``col + 8 * d2 ..``, terms ``8 * m2 ..``: registers 0, 1 of the first tile, then 0, 1 of the second."""
    if kfast:
        return (col + r + 8 * d2) * (TK + PAD["fp16"]) + ks + 8 * m2
    return (r + 8 * m2 + ks) * (bn + ASYNC_PAD) + col + 8 * d2


def mma_format(st: Stage, parts, sm: int, allow_tf32: bool, precision: str = "") -> Optional[str]:
    """The tensor-core format of a matmul stage (None: the float32 kernels): see the module docstring."""
    red, a, b, _ = parts
    if sm < 80 or red.attr[0] != "fma":
        return None
    if precision in NARROW:
        return precision if sm >= MIN_SM[precision] else None
    if _is_half(a) and _is_half(b):
        return "fp16"
    return "tf32" if allow_tf32 else None


def block_tile(batches: int, m: int, n: int, min_blocks: int = MIN_BLOCKS) -> Tuple[int, int]:
    """The block tile of ``batches`` M x N products: the largest of 64 x 64, 64 x 32, 32 x 64 whose grid has
    ``min_blocks`` blocks, else 32 x 32."""
    for tm, tn in ((64, 64), (64, 32), (32, 64)):
        if batches * -(-m // tm) * -(-n // tn) >= min_blocks:
            return tm, tn
    return 32, 32


def plan_matmul(st: Stage, parts, fmt: str, min_blocks: int = MIN_BLOCKS, max_ks: int = 4,
                sm_groups: int = 0, sms: int = 132, vec: bool = False, async_stages: int = 0,
                splits: int = 0, async_costs: Tuple[float, float] = (1.0, 1.0),
                split_filled: bool = True) -> MatmulPlan:
    """The block tile (the largest of 64 x 64, 64 x 32, 32 x 64 giving ``min_blocks`` blocks, else 32 x 32)
    and the K groups (the most of ``max_ks``, 4, 2 that leave each group two chunks, keep the launch within
    ``4 * min_blocks`` groups and fit the static shared memory; else 1).

    ``sm_groups`` > 0 (``PtxTuning.mma_sm_groups``): the K groups and K slices (split-K across blocks) come
    from :func:`plan_slices` instead, for ``sm_groups`` four-warp groups resident per SM on ``sms`` SMs.
    ``vec`` (``PtxTuning.mma_vec``): each operand's loads as wide as :func:`vec_width` allows.
    ``async_stages`` (``PtxTuning.mma_async``): where both operands pass :func:`async_ok`, the cp.async
    kernel with that many shared stages per K group (the K groups then limited by shared memory).
    ``splits`` (``PtxTuning.mma_splits``, with ``sm_groups``): that many K slices where :func:`plan_slices` allows
    it; ``async_costs`` (``PtxTuning.mma_async_costs``): the cp.async kernels' costs there, ``split_filled``
    (``PtxTuning.mma_split_filled``): whether a grid that fills the GPU may be split (:func:`plan_slices`)."""
    red, a, b, swapped = parts
    shape = [int(d) for d in st.buf.shape]
    m, n, k = shape[-2], shape[-1], int(red.attr[2][0])
    kv = red.attr[1][0].attr
    mv, nv = st.vars[-2].attr, st.vars[-1].attr
    a_kfast = _stride(a, kv) == 1 or _stride(a, mv) != 1
    b_kfast = _stride(b, kv) == 1 and _stride(b, nv) != 1
    batch = tuple(shape[:-2])
    nb = 1
    for d in batch:
        nb *= d
    bm, bn = block_tile(nb, m, n, min_blocks)
    chunks = -(-k // TK)
    blocks = nb * -(-m // bm) * -(-n // bn)
    bvars = [v.attr for v in st.vars[:-2]]
    vecs = ((vec_width(a, fmt, a_kfast, kv, mv, bvars, k, m, bm), vec_width(b, fmt, b_kfast, kv, nv, bvars, k, n, bn))
            if vec else (1, 1))
    ns = 1
    if async_stages > 1 and (async_ok(a, fmt, a_kfast, kv, mv, bvars, k, m)
                             and async_ok(b, fmt, b_kfast, kv, nv, bvars, k, n)):
        ns, vecs = async_stages, (ASYNC_VEC, ASYNC_VEC)
    if sm_groups > 0:
        ks, nsplit, ctas = plan_slices(fmt, bm, bn, blocks, chunks, max_ks, sm_groups, sms, ns, only=splits,
                                       async_costs=async_costs, split_filled=split_filled)
        return MatmulPlan(fmt, bm, bn, batch, m, n, k, a_kfast, b_kfast, swapped, ks, nsplit, ctas, *vecs, ns)
    ks = 1
    for cand in (8, 4, 2):
        if (cand <= max_ks and chunks >= 2 * cand and blocks * cand <= 4 * min_blocks
                and smem_bytes(fmt, bm, bn, cand, ns) <= SMEM_LIMIT
                and reduction_bytes(bm, bn, cand) <= smem_bytes(fmt, bm, bn, cand, ns)):
            ks = cand
            break
    return MatmulPlan(fmt, bm, bn, batch, m, n, k, a_kfast, b_kfast, swapped, ks, 1, 1, *vecs, ns)


def plan_slices(fmt: str, bm: int, bn: int, tiles: int, chunks: int, max_ks: int, sm_groups: int,
                sms: int, stages: int = 1, only: int = 0,
                async_costs: Tuple[float, float] = (1.0, 1.0), split_filled: bool = True) -> Tuple[int, int, int]:
    """(K groups per block, K slices, blocks per SM) for ``tiles`` output tiles of ``chunks`` chunks when
    ``sm_groups`` four-warp groups fit an SM at once (ptxas is asked for registers that allow it:
    ``sm_groups / ks`` blocks per SM). A round (every group's chunk loaded, then multiplied) costs about one
    global-load latency however many groups run, so the estimate is waves x (rounds + 1) per block (the
    first chunk's load before the rounds): blocks = ``tiles * slices``, a wave is ``sms * sm_groups / ks``
    blocks, a block runs ``chunks / (slices * ks)`` rounds. The smallest estimate wins (ties: fewer slices, then
    more groups per block); slices divide the chunks evenly, each group keeps two chunks, and a slice count above
    1 costs one round (the sum kernel). ``stages``: shared stages per group (the cp.async kernel), for the
    shared-memory limit. With more than one stage, ``async_costs`` (``PtxTuning.mma_async_costs``, default there
    (1, 8)) are the costs of a round and of the sum kernel instead: waves x (1 + round x rounds) + sum.

    Why a split costs 8 rounds for the cp.async products (session 38, an H100): bench/gpu/split_sweep.py timed
    15 float16 product shapes of BERT-base (S = 32..512) at every K-slice count in CUDA graphs
    (bench/gpu/split_fit.py replays it); the old costs' choices summed to 278 us of products there, the best
    measured per shape to 235, (1, 8)'s to 243. The sweep's own best fit (a round at 0.4) chose unsplit products
    at S = 32 too, and whole BERT-base at S = 32 ran 1.09x slower with it (0.725 against 0.667 ms; at S = 128
    0.93x, 1.031 against 1.104): the sweep's 8 copies of a product kept their 1-5 MB of weights in L2 across
    replays, where a round is cheaper than with BERT's 170 MB streaming from HBM. So a round keeps the full
    latency, and only the sum kernel's cost changes: BERT-base at S = 64 compiles to the old plans' PTX, at S =
    128 to the PTX measured 0.93x, at S = 32 to the old plans but for the FFN's first product (unsplit; not timed
    end to end), and S = 256 / 512 take the sweep's faster plans (bench/gpu/RESULTS.md, session 38).

    ``only`` > 0: that many slices where some K grouping allows it (the estimate then picks only the groups), else
    the estimate's plan.

    ``split_filled`` False (``PtxTuning.mma_split_filled``; True, the default, keeps the estimate's choice): a grid
    whose tiles fill every group slot of the GPU at once (``tiles >= sms * sm_groups``) is not split. The estimate's
    waves are whole and its sum kernel a fixed cost, so it split BERT-base's FFN product at B = 8 (1,024 x 3,072,
    768 tiles of 64 x 64) in two, whose sum kernel then read and wrote 25 MB of partials: 49 + 21 us a layer on an
    H200 (session 39). Not yet timed unsplit on a GPU, hence not the default."""
    round_cost, sum_cost = async_costs if stages > 1 else (1.0, 1.0)
    plans = []           # (estimate, slices, -groups): the smallest wins
    for ks in (8, 4, 2, 1):
        if (ks > max_ks or sm_groups % ks or smem_bytes(fmt, bm, bn, ks, stages) > SMEM_LIMIT
                or reduction_bytes(bm, bn, ks) > smem_bytes(fmt, bm, bn, ks, stages)):
            continue
        for splits in range(1, chunks + 1):
            if chunks % splits or chunks // splits < 2 * ks and not (ks == 1 and splits == 1):
                continue
            if splits > 1 and not only and not split_filled and tiles >= sms * sm_groups:
                continue
            wave = sms * (sm_groups // ks)
            waves, rounds = -(-(tiles * splits) // wave), -(-(chunks // splits) // ks)
            plans.append((waves * (1 + round_cost * rounds) + sum_cost * (splits > 1), splits, -ks))
    if not plans:
        raise ValueError(f"no K plan for {chunks} chunks (a product needs at least one)")
    _, splits, ks = min([p for p in plans if p[1] == only] or plans)     # ``only`` where some grouping allows it
    return -ks, splits, max(1, sm_groups // -ks)


def _plain_read(f: E) -> bool:
    """Whether factor ``f`` only reads a value (loads, a widening cast, integer index arithmetic): then it is
    the node input its buffer names. A factor with float arithmetic (a scale the schedule folded into the load,
    ``Q * c``) computes another value, whose range is not that input's."""
    return all(x.op in ("load", "cast", "var", "const") or x.dtype not in (DType.FLOAT, DType.FLOAT16)
               for x in nodes(f))


def _narrowed_products(graph, sched) -> Dict[str, Tuple[object, Tuple[Optional[int], Optional[int]]]]:
    """Stage name -> (the narrowed MatMul/Gemm node whose product it computes, the node input index each of
    the stage's factors A, B reads, None where not known): the node is found through the product's operand
    buffers (named after the values they hold: the node's inputs, or the inputs of the layout ops, a
    Transpose say, that the schedule folded into the operand's loads).

    Conservative where names are ambiguous (session 23's review found wrong scales there): when the factors do
    not name one node together, a single candidate is taken only if it is the one node whose output reaches
    the stage's own value (several Gemms reading the same ``x``, one with its transB weight folded under a new
    name); otherwise the stage is left out (it computes in float32). An index is None when the factor is not a
    plain read of that input (:func:`_plain_read`), when it is ambiguous, or when both factors would read the
    same input: a fp8 product needs both indices (its scales), fp16 / bf16 only the node."""
    users: Dict[str, List] = {}
    for nd in graph.nodes:
        for i, v in enumerate(nd.inputs):
            if v is not None:
                users.setdefault(v.name, []).append((nd, i))

    def narrowed(name: str, depth: int = 0) -> List:
        out = []
        for nd, i in users.get(name, []):
            if nd.op in NARROWED_OPS and getattr(nd, "precision", "") in NARROW:
                out.append((nd, i))
            elif nd.op in _LAYOUT_OPS and depth < 4:
                for o in nd.outputs:
                    out += narrowed(o.name, depth + 1)
        return out

    def reaches(nd, target: str, depth: int = 12) -> bool:
        frontier, seen = [o.name for o in nd.outputs if o is not None], set()
        for _ in range(depth):
            if target in frontier:
                return True
            nxt = []
            for name in frontier:
                for u, _ in users.get(name, []):
                    if id(u) not in seen:
                        seen.add(id(u))
                        nxt += [o.name for o in u.outputs if o is not None]
            frontier = nxt
        return target in frontier
    if not any(nd.op in NARROWED_OPS and getattr(nd, "precision", "") in NARROW for nd in graph.nodes):
        return {}
    out = {}
    for st in sched.stages:
        parts = matmul_parts(st)
        if parts is None:
            continue
        found = []
        for f in parts[1:3]:
            names = {x.attr.root.name if x.attr.root is not None else x.attr.name
                     for x in nodes(f) if x.op == "load"}
            hits: Dict[int, Tuple[object, set]] = {}
            for nm in names:
                for nd, i in narrowed(nm):
                    hits.setdefault(id(nd), (nd, set()))[1].add(i)
            found.append(hits)
        both = [k for k in found[0] if k in found[1]]
        if len(both) == 1:
            key = both[0]
        else:
            cands = {k: (found[0].get(k) or found[1].get(k))[0] for k in list(found[0]) + list(found[1])}
            if both:
                cands = {k: cands[k] for k in both}
            if len(cands) > 1:
                cands = {k: nd for k, nd in cands.items() if reaches(nd, st.buf.name)}
            if len(cands) != 1:
                continue              # ambiguous: the float32 kernels
            key = next(iter(cands))
        nd = (found[0].get(key) or found[1][key])[0]
        idx = [next(iter(h[key][1])) if key in h and len(h[key][1]) == 1 else None for h in found]
        if idx.count(None) == 1 and (idx[0] if idx[1] is None else idx[1]) in (0, 1) and not found[
                idx.index(None)]:
            # the other factor reads nothing the graph names (a constant the schedule folded: Gemm's transB
            # weight, stored transposed under a new name): a product's factors are the node's inputs 0 and 1
            known = idx[0] if idx[1] is None else idx[1]
            idx = [1 - known if i is None else i for i in idx]
        if idx[0] is not None and idx[0] == idx[1]:
            idx = [None, None]        # both factors from one input (x @ f(x)ᵀ): which is which is unknown
        idx = [i if i is not None and _plain_read(f) else None for i, f in zip(idx, parts[1:3])]
        out[st.name] = (nd, tuple(idx))
    return out


def stage_precisions(graph, sched) -> Dict[str, str]:
    """Stage name -> the ``precision`` ("fp16"/"bf16"/"fp8") of the MatMul/Gemm node whose product it
    computes (:func:`_narrowed_products`). A fp8 product whose factors' scales are not both known
    (:func:`stage_scales`) is left out: it computes in float32."""
    scales = stage_scales(graph, sched)
    return {name: nd.precision for name, (nd, _) in _narrowed_products(graph, sched).items()
            if nd.precision != "fp8" or name in scales}


def narrowed_nodes_run(graph, sched, kernels) -> List[str]:
    """The MatMul/Gemm nodes narrowed by the policy (``precision`` fp16/bf16/fp8) whose product did *not* run
    on a tensor-core kernel of that format (``kernels``: the build's KernelDesc list): a product of fewer than
    16 rows or 8 columns (a vector product: the float32 kernels), a refuted access pattern, a fp8 product
    whose factors' scales could not be named. The manifest records those as float32 (:func:`reconcile`)."""
    ran = {d.stage for d in kernels if d.kind.startswith("matmul_") and d.kind.rsplit("_", 1)[-1] in NARROW}
    done = {nd.name for name, (nd, _) in _narrowed_products(graph, sched).items() if name in ran}
    return [nd.name for nd in graph.nodes if nd.op in NARROWED_OPS and getattr(nd, "precision", "") in NARROW
            and nd.name not in done]


def stage_scales(graph, sched) -> Dict[str, Tuple[int, int]]:
    """Stage name -> (e_a, e_b) for a fp8 product: the exponents of the power-of-two scales the precision
    policy certified for the node inputs its factors A and B read (``Node.precision_scales``): A is rounded
    to E4M3 as ``A * 2^-e_a``, B as ``B * 2^-e_b``, and the float32 sum multiplied by ``2^(e_a + e_b)``."""
    out = {}
    for name, (nd, idx) in _narrowed_products(graph, sched).items():
        if nd.precision != "fp8" or None in idx:
            continue
        sc = tuple(nd.precision_scales)
        es = [sc[i] if i < len(sc) else None for i in idx]
        if None not in es:
            out[name] = (int(es[0]), int(es[1]))
    return out


def scratch_buf(plan: MatmulPlan, offset: int) -> Buf:
    """The split-K partial sums, ``[splits, *batch, m, n]`` floats in the arena at byte ``offset``."""
    return Buf("splitk", DType.FLOAT, (plan.splits,) + tuple(plan.batch) + (plan.m, plan.n), base=ARENA,
               offset=offset)


def combine_stage(st: Stage, red: E, plan: MatmulPlan, scratch: Buf) -> Stage:
    """The stage with its product replaced by the sum of the ``splits`` partials in slice order (the second
    kernel of a split-K product: deterministic, and it runs the stage's epilogue)."""
    idx = list(st.vars)
    total = reduce("sum", [plan.splits], lambda s: load(scratch, [s] + idx), DType.FLOAT)
    return attrs.evolve(st, expr=replace_node(st.expr, red, total))


# --- emission ---------------------------------------------------------------------------------------------

class _V:
    """An emitted i32 value with ``+`` and ``*`` (ints become constants), so the index helpers above run
    on IR values as they do on ints in the tests."""

    def __init__(self, b: ir.IRBuilder, v):
        self.b, self.v = b, v

    def _o(self, x):
        return x.v if isinstance(x, _V) else I32(int(x))

    def __add__(self, x):
        if not isinstance(x, _V) and int(x) == 0:
            return self
        return _V(self.b, self.b.add(self.v, self._o(x)))

    __radd__ = __add__

    def __mul__(self, x):
        if not isinstance(x, _V) and int(x) == 1:
            return self
        return _V(self.b, self.b.mul(self.v, self._o(x)))

    __rmul__ = __mul__


def emit_matmul(km, st: Stage, sym: str, parts, plan: MatmulPlan, scratch: Optional[Buf] = None,
                counters: Optional[int] = None) -> int:
    """Emit the tensor-core kernel ``sym`` of a matmul stage; returns the launch size in threads. With
    split-K (``plan.splits`` > 1) block ``s * tiles + tile`` sums slice ``s`` of the chunks and stores the
    raw sums in ``scratch`` (:func:`scratch_buf`) instead of running the epilogue (:func:`combine_stage` is
    the second kernel). With ``counters`` (the byte offset of one int32 per output tile in ``scratch``'s
    buffer, zeroed before each run) there is no second kernel: the last slice of each tile to finish
    (:meth:`~cuvil.targets.ptx.emitter.PtxEmitter.last_arrival`) reads every slice's partials through L2, adds
    them in slice order from 0 (the sum kernel's order: the same bits), runs the epilogue and resets the
    counter."""
    red, afac, bfac, _ = parts
    fmt = plan.fmt
    frag = FRAGMENTS[fmt]
    SK = row_stride(fmt)
    wide = fmt == "tf32"
    ST = ir.IntType(8 * ELEM_BYTES[fmt])        # shared element type (raw bits)
    # fp8: the operands' power-of-two scales (stage_scales): A * 2^-ea and B * 2^-eb are rounded to E4M3,
    # the float32 sums multiplied by 2^(ea + eb) (exact: |ea + eb| <= 126, formats.FP8_EXPONENT)
    ea, eb = km.precision_scales[st.name] if fmt == "fp8" else (0, 0)
    fn = km.kernel_fn(sym)
    # .maxntid: ptxas keeps the registers within what a block of plan.threads threads may have
    km.module.add_named_metadata("nvvm.annotations", [fn, "maxntidx", I32(plan.threads)])
    if plan.min_ctas > 1:     # ptxas keeps the registers low enough for this many blocks per SM
        km.module.add_named_metadata("nvvm.annotations", [fn, "minctasm", I32(plan.min_ctas)])
    bufs, _n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = PtxEmitter(km, fn, b, bufs, st.buf)
    BM, BN, M, N, K = plan.bm, plan.bn, plan.m, plan.n, plan.k
    kv = red.attr[1][0].attr
    mv, nv = st.vars[-2].attr, st.vars[-1].attr
    bvars = [v.attr for v in st.vars[:-2]]

    KS = plan.ks
    # group g's A tile at g*BM*SK, its B tile after all A tiles; with cp.async (plan.stages > 1) group g's stages
    # from g * stages * (BM + BN) * SK (_async_main_loop)
    tiles_smem = shared_global(km, f"{sym}_t", ST, plan.stages * KS * (BM + BN) * SK)
    sa = sb = tiles_smem
    bar = km.declare("llvm.nvvm.barrier0", ir.VoidType(), [])
    sbase = {}

    def sgep(g, idx, typ=ST):
        if g.name not in sbase:
            sbase[g.name] = em.shared_pointer(g, ST)
        p = b.gep(sbase[g.name], [idx.v if isinstance(idx, _V) else idx], source_etype=ST, inbounds=True)
        return p if typ is ST else b.bitcast(p, ir.PointerType(typ, addrspace=3))

    def divmod_c(x, d: int):
        return tile_divmod(b, x, d)

    if fmt == "fp16":
        def convert(v):
            return b.bitcast(b.fptrunc(v, F16), ST)
    elif fmt == "fp8":      # E4M3 pairs from two floats: the value in the low byte (satfinite: never inf)
        cvt8 = ir.InlineAsm(ir.FunctionType(ir.IntType(16), [F32, F32]),
                            "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f")

        def convert(v, e):
            if e:
                v = b.fmul(v, ir.Constant(F32, 2.0 ** -e))
            return b.trunc(b.call(cvt8, [ir.Constant(F32, 0.0), v]), ST)
    else:
        cvt = ir.InlineAsm(ir.FunctionType(ST, [F32]), "cvt.rna.tf32.f32 $0, $1;" if wide
                           else "cvt.rn.bf16.f32 $0, $1;", "=r,f" if wide else "=h,f")

        def convert(v):
            return b.call(cvt, [v])
    mma_op = ir.InlineAsm(
        ir.FunctionType(ir.LiteralStructType([F32] * 4), [I32] * (4 + 2) + [F32] * 4),
        frag.ptx + " {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")

    tid_all = b.trunc(km.sreg(b, "tid.x"), I32)
    if KS > 1:
        grp, tid = divmod_c(tid_all, THREADS)       # K group, thread within the group
    else:
        grp, tid = I32(0), tid_all
    a_base = _V(b, b.mul(grp, I32(BM * SK)))
    b_base = _V(b, b.add(b.mul(grp, I32(BN * SK)), I32(KS * BM * SK)))
    lane = b.urem(tid, I32(32))
    warp = b.udiv(tid, I32(32))
    wm, wn = divmod_c(warp, 2)
    g_, t_ = _V(b, b.lshr(lane, I32(2))), _V(b, b.and_(lane, I32(3)))
    tiles = warp_tiles(plan)
    accs = [em.alloca(F32) for _ in range(4 * len(tiles))]
    ops = []     # per operand: (vector width, registers, slots (row, k) in the tile, factor, row var, extent)
    for which, fac, var_, ext in (("a", afac, mv, M), ("b", bfac, nv, N)):
        vn, v, rows, kfast = vec_slots(plan, which)
        if v > 1:
            sl = load_slot_indices(b, tid, THREADS, TK // v if kfast else TK, vn, rows if kfast else rows // v,
                                   kfast)
            sl = [(r, b.mul(kk, I32(v))) if kfast else (b.mul(r, I32(v)), kk) for r, kk in sl]
            regs = [em.alloca(ir.VectorType(ST, v)) for _ in range(vn)]
        else:
            n_, rows, kfast = load_slots(plan, which)
            sl = load_slot_indices(b, tid, THREADS, TK, n_, rows, kfast)
            regs = [em.alloca(ST) for _ in range(n_)]
        ops.append((v, kfast, regs, sl, fac, var_, ext))
    (_, _, aregs, a_slots, _, _, _), (_, _, bregs, b_slots, _, _, _) = ops

    def operand(f: E):
        """The factor's value in the format's raw bits (a float16 load kept as is for fp16)."""
        if fmt == "fp16" and _is_half(f):
            return b.bitcast(em.emit(f.args[0]), ST)
        if fmt == "fp8":
            return convert(em.emit(f), ea if f is afac else eb)
        return convert(em.emit(f))

    S, CPS = plan.splits, plan.slice_chunks
    NS = plan.stages
    if S > 1 and counters is not None:     # the last-arrival combine (see the docstring)
        flag = shared_global(km, f"{sym}_last", I32, align=None)
        fence = km.declare("llvm.nvvm.membar.gl", ir.VoidType(), [])
        ld_cg = ir.InlineAsm(ir.FunctionType(F32, [I64]), "ld.global.cg.f32 $0, [$1];", "=f,l,~{memory}",
                             side_effect=True)
    if NS > 1:
        async_rounds = _async_main_loop(km, b, em, plan, (afac, bfac), kv, mv, nv, tiles_smem, sgep, bar,
                                        mma_op, accs, tiles, grp, tid, lane, wm, wn)

    def tile_body(bid64):
        if S > 1:
            sl, tile = divmod_c(b.trunc(bid64, I32), plan.tiles)     # K slice, output tile
            bid64 = b.zext(tile, I64)
            first = b.mul(sl, I32(CPS))                              # the slice's first chunk
        else:
            first = I32(0)
        m0, n0 = bind_tile(b, em, bid64, plan, bvars)
        for a_ in accs:
            b.store(ir.Constant(F32, 0.0), a_)

        def fetch(k0):
            """This thread's elements of the chunk at k0 into registers (clamped rows, zero past K)."""
            scalar = [(regs, sl, fac, base, ext, var_) for (v, _, regs, sl, fac, var_, ext), base
                      in zip(ops, (m0, n0)) if v == 1]
            if scalar:
                fetch_chunk(b, em, k0, scalar, kv, K, TK, operand, ir.Constant(ST, 0))
            for (v, _, regs, sl, fac, var_, ext), base in zip(ops, (m0, n0)):
                if v == 1:
                    continue
                ld = fac.args[0]      # vec_width: one plain float16 load, no vector clamped or past K
                rows_ = plan.bm if var_ == mv else plan.bn
                for reg, (r, kk) in zip(regs, sl):
                    em.memo.append(dict(em.memo[-1]))
                    row = b.add(base, r)
                    if ext % rows_:   # k-contiguous vectors of a ragged tile: rows past the matrix read its last
                        row = clamp(b, row, ext)
                    em.env[var_] = b.zext(row, I64)
                    em.env[kv] = b.zext(b.add(k0, kk), I64)
                    ptr = em.address(ld.attr, [em.emit(i) for i in ld.args])
                    em.memo.pop()
                    x = b.load(ptr, typ=ir.VectorType(F16, v), align=2 * v)
                    if not overlaps(ld.attr, st.buf):
                        x.set_metadata("invariant.load", km.empty_md)
                    b.store(b.bitcast(x, ir.VectorType(ST, v)), reg)

        def rnd(r64):
            c = b.add(first, b.add(b.mul(b.trunc(r64, I32), I32(KS)), grp))   # chunk_of(round, grp, KS)
            end = b.add(first, I32(CPS))                                     # the slice's end
            active = b.icmp_unsigned("<", c, end) if CPS % KS else None

            def stage():
                for (v, kfast, regs, slots, _, _, _), base in zip(ops, (a_base, b_base)):
                    for reg, (r, kk) in zip(regs, slots):
                        at = base + _V(b, b.add(b.mul(r, I32(SK)), kk))
                        if v == 1:
                            b.store(b.load(reg, typ=ST), sgep(sa, at))
                        elif kfast:       # v consecutive k of one row: one shared store (rows 16-byte aligned)
                            vt = ir.VectorType(ST, v)
                            b.store(b.load(reg, typ=vt), sgep(sa, at, vt), align=2 * v)
                        else:             # v consecutive rows at one k
                            x = b.load(reg, typ=ir.VectorType(ST, v))
                            for i in range(v):
                                b.store(b.extract_element(x, I32(i)), sgep(sa, at + i * SK))
            if active is None:
                stage()
            else:
                with b.if_then(active):
                    stage()
            b.call(bar, [])
            nxt = b.add(c, I32(KS))
            with b.if_then(b.icmp_unsigned("<", nxt, end)):   # the next chunk's loads fly meanwhile
                fetch(b.mul(nxt, I32(TK)))
            row_w = _V(b, b.mul(wm, I32(plan.wm)))
            col_w = _V(b, b.mul(wn, I32(plan.wn)))

            def mmas():
                for ks in range(0, TK, frag.k):
                    afr, bfr = {}, {}
                    for ti, (r0, c0) in enumerate(tiles):
                        if r0 not in afr:
                            afr[r0] = [b.load(sgep(sa, a_base + a_word(fmt, SK, row_w + r0, g_, t_, ks, q), I32),
                                              typ=I32, align=4) for q in range(4)]
                        if c0 not in bfr:
                            bfr[c0] = [b.load(sgep(sb, b_base + b_word(fmt, SK, col_w + c0, g_, t_, ks, q), I32),
                                              typ=I32, align=4) for q in range(2)]
                        cs = accs[4 * ti:4 * ti + 4]
                        out = b.call(mma_op, afr[r0] + bfr[c0] + [b.load(c_, typ=F32) for c_ in cs])
                        for q, c_ in enumerate(cs):
                            b.store(b.extract_value(out, q), c_)
            if active is None:
                mmas()
            else:
                with b.if_then(active):       # uniform per warp: a group is four whole warps
                    mmas()
            b.call(bar, [])
        if NS > 1:
            async_rounds(first, m0, n0)
        else:
            fetch(b.mul(b.add(first, grp), I32(TK)))   # plan_matmul keeps KS <= slice chunks / 2: each group has one
            em.loop_range(I64(0), I64(plan.rounds), rnd)
        if KS > 1:
            # groups 1..KS-1 leave their sums in shared memory (over the tiles, no longer read); group 0
            # adds them in group order (deterministic) and runs the epilogue
            fp = b.bitcast(sbase[tiles_smem.name], ir.PointerType(F32, addrspace=3))
            nacc = len(accs)

            def red_slot(g, i):
                return b.gep(fp, [b.add(b.mul(g, I32(nacc * THREADS)), b.add(I32(i * THREADS), tid))],
                             source_etype=F32, inbounds=True)
            with b.if_then(b.icmp_unsigned("!=", grp, I32(0))):
                for i, a_ in enumerate(accs):
                    b.store(b.load(a_, typ=F32), red_slot(b.sub(grp, I32(1)), i))
            b.call(bar, [])
            with b.if_then(b.icmp_unsigned("==", grp, I32(0))):
                for g in range(1, KS):
                    for i, a_ in enumerate(accs):
                        b.store(b.fadd(b.load(a_, typ=F32), b.load(red_slot(I32(g - 1), i), typ=F32)), a_)
            lead = b.icmp_unsigned("==", grp, I32(0))
        else:
            lead = None
        if S > 1:     # the partial sums' rows of this (slice, batch): flat (s * batches + batch) * M
            batch = b.udiv(tile, I32(plan.tiles_m * plan.tiles_n))
            pbase = b.mul(b.add(b.mul(sl, I32(plan.batches)), batch), I32(M))
            pdst = b.gep(em.base(scratch), [I64(scratch.offset)], source_etype=ir.IntType(8), inbounds=True)

        def acc_value(i):
            v = b.load(accs[i], typ=F32)
            return b.fmul(v, ir.Constant(F32, 2.0 ** (ea + eb))) if ea + eb else v

        def outputs(body):
            """``body(accumulator index, m, n)`` for each of this thread's fragment outputs in the product."""
            row_w = _V(b, b.add(m0, b.mul(wm, I32(plan.wm))))
            col_w = _V(b, b.add(n0, b.mul(wn, I32(plan.wn))))
            for ti, (r0, c0) in enumerate(tiles):
                for q in range(4):
                    m, n = c_coords(fmt, row_w + r0, col_w + c0, g_, t_, q)
                    ok = b.and_(b.icmp_unsigned("<", m.v, I32(M)), b.icmp_unsigned("<", n.v, I32(N)))
                    with b.if_then(ok):
                        body(4 * ti + q, m.v, n.v)

        def store(m, n, value):
            """The stage's epilogue at (batch, m, n) with the product's value ``value()``."""
            idx = [em.env[v] for v in bvars] + [b.zext(m, I64), b.zext(n, I64)]
            em.memo.append(dict(em.memo[-1]))
            em.memo[-1][red.uid] = value()
            em.store_element(st, idx)
            em.memo.pop()

        def partial_at(base, m, n):
            """The partial sum of (m, n) in the rows from ``base`` (a slice's and batch's): flat (base + m) * N + n."""
            flat = b.add(b.mul(b.add(base, m), I32(N)), n)
            return lambda: b.gep(pdst, [b.zext(flat, I64)], source_etype=F32, inbounds=True)

        def own(i, m, n):
            if S > 1:
                at = partial_at(pbase, m, n)
                b.store(acc_value(i), at())
            else:
                store(m, n, lambda: acc_value(i))

        def combined(_i, m, n):
            tot = ir.Constant(F32, 0.0)
            for s_ in range(S):
                at = partial_at(b.mul(b.add(I32(s_ * plan.batches), batch), I32(M)), m, n)
                tot = b.fadd(tot, b.call(ld_cg, [b.ptrtoint(at(), I64)]))
            store(m, n, lambda: tot)

        def epilogue():
            outputs(own)
        if lead is None:
            epilogue()
        else:
            with b.if_then(lead):
                epilogue()
        if S > 1 and counters is not None:
            last, cptr = em.last_arrival(scratch, counters, b.zext(tile, I64), S, flag,
                                         b.icmp_unsigned("==", tid_all, I32(0)))

            def combine():
                b.call(fence, [])
                outputs(combined)
            with b.if_then(last):
                if lead is None:
                    combine()
                else:
                    with b.if_then(lead):
                        combine()
                with b.if_then(b.icmp_unsigned("==", tid_all, I32(0))):
                    b.store(I32(0), cptr)     # ready for the next run (the runtime also zeroes them first)
        if KS > 1:
            b.call(bar, [])        # the next tile's stores may not overwrite sums group 0 still reads
    em.loop_range(km.sreg(b, "ctaid.x"), I64(plan.blocks), tile_body, km.sreg(b, "nctaid.x"))
    b.ret_void()
    set_contraction(fn, False)
    km.kernels.append(sym)
    return plan.blocks * plan.threads


def async_asm():
    """The inline PTX of the cp.async kernels (the products' :func:`_async_main_loop`, the flash attention kernel):
    ``cp16(shared address, global address, source bytes)`` (a 16-byte ``cp.async.cg``, zero-filled past the source
    bytes), ``commit()``, ``wait(n)`` (the asm of ``cp.async.wait_group n``) and ``ldsm[trans]`` (``ldmatrix.x4``,
    four 8 x 8 half matrices from the lanes' row addresses, ``.trans`` transposed)."""
    cp16 = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [I64, I64, I32]),
                        "cp.async.cg.shared.global [$0], [$1], 16, $2;", "l,l,r,~{memory}", side_effect=True)
    commit = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "~{memory}",
                          side_effect=True)

    def wait(n):
        return ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {n};", "~{memory}",
                            side_effect=True)
    ldsm = {t: ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([I32] * 4), [I64]),
                            f"ldmatrix.sync.aligned.m8n8.x4{'.trans' if t else ''}.shared.b16 "
                            "{$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,l,~{memory}", side_effect=True)
            for t in (False, True)}
    return cp16, commit, wait, ldsm


def _async_main_loop(km, b: ir.IRBuilder, em, plan: MatmulPlan, facs, kv: str, mv: str, nv: str, tiles_smem,
                     sgep, bar, mma_op, accs, tiles, grp, tid, lane, wm, wn):
    """The main loop of the cp.async kernel (``plan.stages`` = NS > 1; float16 operands that pass
    :func:`async_ok`): returns ``rounds(first, m0, n0)``, which sums the tile's chunks of its K slice into
    ``accs`` and leaves every copy complete and the shared memory free (a barrier) for the K-group reduction.

    Group ``grp`` owns NS stages of (A region, B region) (:func:`async_region`); its chunk of round ``r``
    (:func:`chunk_of`) is copied into stage ``r % NS``, NS - 1 rounds ahead of its products: per round one
    ``cp.async.wait_group NS - 2`` (this thread's copies of the round's chunk are complete), one barrier
    (everyone's are, and every warp has finished the products of the stage the next copies overwrite), the
    copies of round ``r + NS - 1``, a commit, then the ``mma``s with fragments from ``ldmatrix.x4``. Each
    thread copies 16-byte pieces (:func:`async_pieces`) at fixed tile offsets; a piece past the matrix's rows
    or past K reads nothing (source size 0: zero-filled) from the factor's element (0, 0) of the tile's batch."""
    BM, BN, M, N, K, NS, KS = plan.bm, plan.bn, plan.m, plan.n, plan.k, plan.stages, plan.ks
    CPS = plan.slice_chunks
    SK = row_stride("fp16")
    A_H = async_region(BM, plan.a_kfast)
    STG = (BM + BN) * SK                    # halves per stage (smem_bytes; both regions fit in it)
    frag = FRAGMENTS["fp16"]
    sgep(tiles_smem, I32(0))                # (the shared base, used by the K-group reduction too)
    s64 = b.ptrtoint(tiles_smem, I64)
    cp16, commit, wait, ldsm = async_asm()
    lane8 = _V(b, b.and_(lane, I32(7)))
    m2 = _V(b, b.and_(b.lshr(lane, I32(3)), I32(1)))
    d2 = _V(b, b.lshr(lane, I32(4)))
    gbase = _V(b, b.mul(grp, I32(NS * STG)))        # the group's first stage (halves)
    # per operand: (factor's load, row var, extent, tile rows, kfast, region offset, this thread's pieces)
    ops = []
    for fac, var_, ext, rows, kfast, reg_off in ((facs[0], mv, M, BM, plan.a_kfast, 0),
                                                 (facs[1], nv, N, BN, plan.b_kfast, A_H)):
        pieces = async_pieces(rows, kfast)
        mine = []
        for j in range(len(pieces) // THREADS):
            e = b.add(tid, I32(j * THREADS))
            if kfast:
                r, kk = tile_divmod(b, e, TK // ASYNC_VEC)
                kk = b.mul(kk, I32(ASYNC_VEC))
                soff = b.add(b.mul(r, I32(SK)), kk)
            else:
                kk, r = tile_divmod(b, e, rows // ASYNC_VEC)
                r = b.mul(r, I32(ASYNC_VEC))
                soff = b.add(b.mul(kk, I32(rows + ASYNC_PAD)), r)
            mine.append((r, kk, b.add(soff, I32(reg_off))))
        ops.append((fac.args[0], var_, ext, rows, kfast, mine))
    assert all(len(async_pieces(rows, kf)) % THREADS == 0 for _, _, _, rows, kf, _ in ops)

    def issue(c, slot, m0, n0):
        """This thread's copies of chunk ``c`` into stage ``slot`` of its group."""
        k0 = b.mul(c, I32(TK))
        st0 = gbase + _V(b, b.mul(slot, I32(STG)))
        for (ld, var_, ext, rows, kfast, mine), base in zip(ops, (m0, n0)):
            for r, kk, soff in mine:
                row, k = b.add(base, r), b.add(k0, kk)
                conds = ([b.icmp_unsigned("<", row, I32(ext))] if ext % rows else []) + \
                        ([b.icmp_unsigned("<", k, I32(K))] if K % TK else [])
                ok = None
                for x in conds:
                    ok = x if ok is None else b.and_(ok, x)
                if ok is not None:
                    row, k = b.select(ok, row, I32(0)), b.select(ok, k, I32(0))
                em.memo.append(dict(em.memo[-1]))
                em.env[var_] = b.zext(row, I64)
                em.env[kv] = b.zext(k, I64)
                ptr = em.address(ld.attr, [em.emit(i) for i in ld.args])
                em.memo.pop()
                dst = b.add(s64, b.zext(b.mul((st0 + _V(b, soff)).v, I32(2)), I64))
                size = I32(16) if ok is None else b.select(ok, I32(16), I32(0))
                b.call(cp16, [dst, b.ptrtoint(ptr, I64), size])

    row_w = _V(b, b.mul(wm, I32(plan.wm)))
    col_w = _V(b, b.mul(wn, I32(plan.wn)))

    def mmas(slot):
        a0 = gbase + _V(b, b.mul(slot, I32(STG)))
        b0 = a0 + A_H

        def frag_load(half, trans):
            out = b.call(ldsm[trans], [b.add(s64, b.zext(b.mul(half.v, I32(2)), I64))])
            return [b.extract_value(out, q) for q in range(4)]
        for ks in range(0, TK, frag.k):
            afr, bfr = {}, {}
            for r0 in sorted({r for r, _ in tiles}):
                afr[r0] = frag_load(a0 + ldsm_a_half(plan.a_kfast, BM, row_w + r0, lane8, m2, d2, ks),
                                    not plan.a_kfast)
            for c0 in sorted({c for _, c in tiles})[::2]:
                x = frag_load(b0 + ldsm_b_half(plan.b_kfast, BN, col_w + c0, lane8, m2, d2, ks),
                              not plan.b_kfast)
                bfr[c0], bfr[c0 + 8] = x[:2], x[2:]
            for ti, (r0, c0) in enumerate(tiles):
                cs = accs[4 * ti:4 * ti + 4]
                out = b.call(mma_op, afr[r0] + bfr[c0] + [b.load(c_, typ=F32) for c_ in cs])
                for q, c_ in enumerate(cs):
                    b.store(b.extract_value(out, q), c_)

    def rounds(first, m0, n0):
        end = b.add(first, I32(CPS))

        def chunk(r):                    # chunk_of(r, grp, KS) within the slice
            return b.add(first, b.add(b.mul(r, I32(KS)), grp))
        for i in range(NS - 1):          # the prologue: rounds 0 .. NS - 2 in flight
            c = chunk(I32(i))
            with b.if_then(b.icmp_unsigned("<", c, end)):
                issue(c, I32(i), m0, n0)
            b.call(commit, [])

        def rnd(r64):
            r = b.trunc(r64, I32)
            b.call(wait(NS - 2), [])
            b.call(bar, [])
            nr = b.add(r, I32(NS - 1))
            c = chunk(nr)
            with b.if_then(b.icmp_unsigned("<", c, end)):
                issue(c, b.urem(nr, I32(NS)), m0, n0)
            b.call(commit, [])
            with b.if_then(b.icmp_unsigned("<", chunk(r), end)):     # uniform per warp
                mmas(b.urem(r, I32(NS)))
        em.loop_range(I64(0), I64(plan.rounds), rnd)
        b.call(wait(0), [])
        b.call(bar, [])
    return rounds
