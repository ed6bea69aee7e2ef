"""The lowering table and what every lowering shares: :class:`TensorFn` (a tensor as shape, dtype and a
function from indices to an expression), :class:`LowerCtx` (a node's inputs, attributes and scratch), the
:func:`lowering` decorator that fills :data:`LOWERINGS`, and the index and scalar helpers of several families."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import attrs
import numpy as np

from ...errors import UnsupportedOpError
from ...ir.dim import SymExpr, evaluate, free_symbols
from ...ir.dtype import DType
from ...ir.graph import Node
from ...ir.registry import attr_defaults
from ..contraction import MR
from ..sequential import Assign, Sequential, sequential
from ..texpr import I64, Buf, E, cast, cmp, const, load, select, var


Index = List[E]
ARENA = 0   # the kernel's bufs slot of the arena (kernels.schedule.ARENA; the lowerings do not import the scheduler)


@attrs.define
class TensorFn:
    shape: Tuple[int, ...]
    dtype: DType
    fn: Callable[[Index], E]
    # "elementwise": output element i reads input elements at i (up to broadcasting) only;
    # "injective": data movement; "complex": reductions and windows (worth materialising before reuse)
    kind: str = "complex"
    # For elementwise ops: which inputs are read at exactly the output index (no broadcasting)
    same_index_inputs: Tuple[int, ...] = ()
    buf: Optional[Buf] = None   # set when the tensor is stored (its loads read this buffer)
    contraction: bool = False   # holds a micro-kernel node (contract/window: at most one per stage)
    # what a lazy view reads, for a lowering that reads the sources itself instead of the view's elements:
    # ("concat", axis, pieces) or ("slice", source, first, steps) (per axis); None for every other tensor
    view: Optional[tuple] = None

    def __call__(self, idx: Index) -> E:
        return self.fn(list(idx))

    def at_or(self, idx: Index, cond: E, default) -> E:
        """``self[idx]`` where ``cond`` holds, else ``default``; indices are clamped so the read itself is
        always in bounds (padding reads no memory outside the tensor)."""
        if cond.op == "const" and cond.attr is True:
            return self(idx)
        return select(cond, self([clamp(i, d) for i, d in zip(idx, self.shape)]), const(default, self.dtype))


def bf16_stored(t: TensorFn) -> TensorFn:
    """A float32 tensor stored as bfloat16 (``t``: the loader of its BFLOAT16 buffer) as its readers see it:
    float32 values (each exactly a bfloat16), its buffer kept so a contraction reads the 16-bit words itself.
    The scheduler stores a narrowed convolution's input this way (``bf16_storage``): half the bytes, and the
    bf16 micro-kernels pack their pair panels from it without rounding."""
    b = t.buf
    return TensorFn(t.shape, DType.FLOAT, lambda idx: cast(load(b, idx), DType.FLOAT), "elementwise", buf=b)


class LowerCtx:
    def __init__(self, node: Node, inputs: List[Optional[TensorFn]], temp: Callable,
                 weight: Optional[Callable] = None, gemm_cols: int = 0, gemm_tiles: tuple = (),
                 unpadded_contractions: bool = False, matmul_panels: bool = True, half_contractions: bool = False,
                 row_kernels: bool = False, channel_tile_cost: Optional[float] = None,
                 used_outputs: Optional[Sequence[bool]] = None, set_size: Optional[Callable] = None,
                 narrow_formats: Sequence[str] = (), matmul_tile: tuple = (), bf16_storage: bool = False,
                 tile_choices: Optional[dict] = None, gpu_attention: bool = False, shared: Optional[dict] = None,
                 gpu_heads_merged: bool = False):
        self.node, self.inputs, self._temp, self._weight = node, inputs, temp, weight
        # copies one reader stored that a later reader may take as they are (key -> TensorFn; None: none may be
        # shared here, in a guard or a run-time loop, where a store may not run before the later reader)
        self.shared = shared
        # (GPU) FusedAttention lowers to the GPU kernel's node, operands read in place (schedule's gpu_attention)
        self.gpu_attention = gpu_attention
        # (GPU) ... its output stored where the exports' head merge puts it (schedule's gpu_heads_merged)
        self.gpu_heads_merged = gpu_heads_merged
        # (rows, cols) of a float32 constant-weight MatMul's register tile; () = (MR, gemm_cols)
        self.matmul_tile = tuple(matmul_tile)
        # {(m, positions, k): register tile} measured by the x86 target's --tune: a float32 convolution
        # contraction of that shape takes it instead of choose_tile's (schedule's tile_choices)
        self.tile_choices = tile_choices or {}
        # the formats (Node.precision spellings) the target's contraction micro-kernels compute in: a node the
        # precision policy narrowed to one of them lowers to a narrowed contraction (x86: ("bf16",) with AVX512_BF16)
        self.narrow_formats = tuple(narrow_formats)
        # a bf16 convolution's own stored copies of its input (zero-padded) are bfloat16 (schedule's bf16_storage)
        self.bf16_storage = bf16_storage
        # stores the node's data-dependent output size into its run-time symbol (None: the size is not one)
        self._set_size = set_size
        # which outputs some node or the graph reads (None: all); an op may skip work for the others
        self.used_outputs = tuple(used_outputs) if used_outputs is not None else (True,) * len(node.outputs)
        # (x86) short reductions (4+ terms) take the GEMM micro-kernels, 2-D average pools the row kernels
        self.row_kernels = row_kernels and gemm_cols > 0
        # a padded convolution's contraction reads the unpadded input (Contraction.pads; the GPU's kernels
        # test bounds) instead of a stored padded copy (x86 micro-kernels pack panels without tests)
        self.unpadded_contractions = unpadded_contractions
        self.half_contractions = half_contractions     # float16 convolutions as contractions too (GPU)
        self.matmul_panels = matmul_panels and gemm_cols > 0   # MatMuls as column-panel contractions (x86)
        # > 0: lower convolutions to packed contractions (and constant-weight MatMuls to column panels this
        # many wide); a convolution's register tile (rows, cols[, lanes]) is chosen among gemm_tiles
        self.gemm_cols = gemm_cols
        self.gemm_tiles = tuple(gemm_tiles) or ((MR, gemm_cols),)
        self.channel_tile_cost = channel_tile_cost     # the weight of channel-lane tiles in the tile choice

    @property
    def narrowed(self) -> str:
        """The format this node's contraction computes in: its ``precision`` where the target's micro-kernels
        take it, else "" (float32)."""
        p = self.node.precision
        return p if p and p in self.narrow_formats else ""

    def narrow_input(self, i: int, store: bool = False) -> Optional["TensorFn"]:
        """Input ``i`` of a narrowed node where no narrowed contraction takes it (a small or depthwise Conv, a
        MatMul of two activations, a product in a format whose kernel takes only constant weights): its values
        rounded to the node's format (:attr:`narrowed`: bfloat16 or float16) and kept as float32, so the node
        computes what its precision says (products of two rounded values are exact in float32; the sums are
        float32). A constant is rounded at compile time; ``store``: the rounded values are stored (for a kernel
        that reads its input's buffer)."""
        t = self.input(i)
        fmt = self.narrowed
        if t is None or t.dtype != DType.FLOAT or not fmt:
            return t
        c = self.const_input(i)
        if c is not None and self._weight is not None:
            from ..contraction import narrow_values
            wb = self.weight(narrow_values(c, fmt), f"in{i}_{fmt}")
            return TensorFn(t.shape, t.dtype, lambda idx: load(wb, idx), "elementwise", buf=wb)
        from ..contraction import NARROW_DTYPES
        dt = NARROW_DTYPES[fmt]
        fn = lambda idx: cast(cast(t(idx), dt), DType.FLOAT)
        return self.temp(t.shape, t.dtype, fn, f"in{i}_{fmt}") if store else TensorFn(t.shape, t.dtype, fn, t.kind)

    def attr(self, name, default=None):
        if name in self.node.attrs:
            return self.node.attrs[name]
        return attr_defaults(self.node.op).get(name, default)

    def input(self, i: int) -> Optional[TensorFn]:
        return self.inputs[i] if i < len(self.inputs) else None

    def out_shape(self, j: int = 0) -> Tuple[int, ...]:
        return tuple(self.node.outputs[j].shape)

    def out_dtype(self, j: int = 0) -> DType:
        return self.node.outputs[j].dtype

    def temp(self, shape, dtype, fn, name="tmp") -> TensorFn:
        """Materialise ``fn`` over ``shape`` into a scratch buffer; returns a loader of it."""
        return self._temp(tuple(shape), dtype, fn, f"{self.node.name}_{name}")

    def shared_temp(self, key, shape, dtype, fn, name="tmp") -> TensorFn:
        """:meth:`temp`, or the one an earlier reader stored under ``key`` (which must name everything ``fn``
        computes: the buffer it reads and how)."""
        if self.shared is None:
            return self.temp(shape, dtype, fn, name)
        if key not in self.shared:
            self.shared[key] = self.temp(shape, dtype, fn, name)
        return self.shared[key]

    def weight(self, array: np.ndarray, name: str) -> Optional[Buf]:
        """A compile-time constant (e.g. weights repacked for a kernel) stored with the weights; None when the
        scheduler does not offer constants."""
        if self._weight is None:
            return None
        return self._weight(np.ascontiguousarray(array), f"{self.node.name}_{name}")

    def const_input(self, i: int) -> Optional[np.ndarray]:
        v = self.node.inputs[i] if i < len(self.node.inputs) else None
        return np.asarray(v.const) if v is not None and v.is_const else None

    def set_size(self, value: E) -> bool:
        """Store ``value`` (an int64 scalar expression, computed before the outputs) as the run-time value of
        this node's data-dependent output size, which the outputs' shapes name; False (nothing stored) when
        the size is not a run-time symbol (a constant, or a dim computed from shapes)."""
        if self._set_size is None:
            return False
        self._set_size(value)
        return True

    def unsupported(self, detail: str):
        raise UnsupportedOpError(self.node.op, self.node.name, detail=detail)


LOWERINGS: Dict[str, Callable[[LowerCtx], List[TensorFn]]] = {}


def lowering(*ops):
    def deco(fn):
        for op in ops:
            LOWERINGS[op] = fn
        return fn
    return deco


def shape_param(ctx: LowerCtx, name: str, i: int):
    """An integer parameter of the node: the lifted attribute ``name``, or the elements of input ``i`` as dims,
    from a constant or from shape computations (Slice's end ``Shape(x)[1]`` is then the symbolic dim ``S``,
    read at run time); None when computed from tensor data."""
    v = ctx.attr(name)
    if v is not None:
        return list(v) if isinstance(v, (list, tuple, np.ndarray)) else [v]
    inp = ctx.node.input(i)
    if inp is not None and inp.is_const and inp.const.dtype.kind in "iu":
        return [int(x) for x in inp.const.reshape(-1)]
    if inp is not None and inp.sym_value is not None:
        return list(inp.sym_value)
    return None


def broadcast_index(idx: Index, in_shape: Sequence[int], out_shape: Sequence[int]) -> Index:
    k = len(out_shape) - len(in_shape)
    return [const(0, I64) if d == 1 and out_shape[k + j] != 1 else idx[k + j] for j, d in enumerate(in_shape)]


def broadcast_fn(t: TensorFn, out_shape) -> Callable[[Index], E]:
    """``t``'s index function read at the indices of an ``out_shape`` output (numpy broadcasting)."""
    if tuple(t.shape) == tuple(out_shape):
        return t.fn
    return lambda idx: t.fn(broadcast_index(idx, t.shape, out_shape))


def elementwise(ctx: LowerCtx, scalar: Callable[..., E], inputs=None, dtype=None) -> List[TensorFn]:
    ins = [t for t in (inputs if inputs is not None else ctx.inputs)]
    shape = ctx.out_shape()
    fns = [broadcast_fn(t, shape) for t in ins]
    same = tuple(k for k, t in enumerate(ins) if tuple(t.shape) == tuple(shape))
    return [TensorFn(shape, dtype or ctx.out_dtype(), lambda idx: scalar(*[f(idx) for f in fns]), "elementwise", same)]


def fconst(v, like: E) -> E:
    return const(v, like.dtype)


def nan_max(a: E, b: E) -> E:
    """np.maximum: NaN if either is NaN; on ties the second argument."""
    if not a.dtype.is_float:
        return select(cmp("gt", a, b), a, b)
    return select(cmp("uno", a, a), a, select(cmp("gt", a, b), a, b))


def nan_min(a: E, b: E) -> E:
    if not a.dtype.is_float:
        return select(cmp("lt", a, b), a, b)
    return select(cmp("uno", a, a), a, select(cmp("lt", a, b), a, b))


def flat_index(idx: Index, shape: Sequence[int]) -> E:
    out = const(0, I64)
    stride = 1
    for i, d in zip(reversed(idx), reversed(shape)):
        out = out + i * stride
        stride *= d
    return out


def unflat_index(flat: E, shape: Sequence[int]) -> Index:
    """Row-major indices of ``flat`` (0 <= flat < prod(shape): the outermost index needs no modulo)."""
    if not shape:
        return []
    out = []
    for d in reversed(shape[1:]):
        out.append(flat % d)
        flat = flat // d
    out.append(flat)
    return list(reversed(out))


def _smaller(a, b) -> bool:
    """Which run of a reshape to extend: compares sizes, symbolic ones at a sample point. A wrong guess only
    costs index arithmetic (runs are accepted only when their sizes are equal as polynomials; otherwise the
    whole index is flattened and unflattened)."""
    if isinstance(a, SymExpr) or isinstance(b, SymExpr):
        sample = {name: 7 for name in free_symbols(a) | free_symbols(b)}
        return evaluate(a, sample) < evaluate(b, sample)
    return a < b


def reshape_index(idx: Index, out_shape: Sequence[int], in_shape: Sequence[int]) -> Index:
    """Input indices of a reshape's output element. Dims are split into runs of equal products (e.g.
    [N, C, H*W] <- [N, C, H, W]: N and C map through unchanged), and only within a run is the index
    flattened and unflattened, so index arithmetic stays cheap and contiguous dims stay unit-stride."""
    if 0 in out_shape or 0 in in_shape:
        return unflat_index(flat_index(idx, out_shape), in_shape)
    res: Index = []
    i = j = 0
    no, ni = len(out_shape), len(in_shape)
    while i < no or j < ni:
        i0, j0, po, pi = i, j, 1, 1
        if i < no:
            po, i = out_shape[i], i + 1
        if j < ni:
            pi, j = in_shape[j], j + 1
        while po != pi:
            if _smaller(po, pi) and i < no:
                po, i = po * out_shape[i], i + 1
            elif j < ni:
                pi, j = pi * in_shape[j], j + 1
            else:  # inconsistent sizes cannot come from shape inference; stay correct regardless
                return unflat_index(flat_index(idx, out_shape), in_shape)
        flat = idx[i0] if i - i0 == 1 else flat_index(idx[i0:i], out_shape[i0:i])
        res.extend([flat] if j - j0 == 1 else unflat_index(flat, in_shape[j0:j]))
    return res


def clamp(i: E, d: int) -> E:
    return E("clamp", (i,), I64, (0, d - 1))


def selected_positions(ctx: LowerCtx, keep: Callable[[E], E], n, name: str) -> Callable[[E], E]:
    """For a predicate ``keep(i)`` over ``[0, n)``: stores the count of kept positions as the node's run-time
    size and returns ``pick(j)``, the position of the j-th kept one (j below the count). One sequential scan,
    linear in ``n`` (:mod:`cuvil.kernels.sequential`): step i writes i at the running count (a position not
    kept is overwritten by the next kept one, as the count has not moved) and adds 1 when i is kept."""
    zero = const(0, I64)
    count = Buf(f"{ctx.node.name}_{name}_count", I64, (1,), ARENA, 0)
    # one spare slot: step i stores at the running count <= i < n, but the store index must be provably in
    # bounds also where n may be 0 (a scan over a run-time size), which the step loop alone does not show
    where = Buf(f"{ctx.node.name}_{name}_at", I64, (n + 1,), ARENA, 0)
    i, row = var("i"), var("row")
    running = load(count, [zero])
    program = Sequential([row], [Assign(count, [zero], zero)], i, n,
                         [Assign(where, [clamp(running, n + 1)], i),
                          Assign(count, [zero], running + select(keep(i), const(1, I64), zero))])
    ctx.temp((1,), I64, lambda idx: sequential(idx, program, I64), f"{name}_scan")
    ctx.set_size(load(count, [zero]))
    # j < count <= n, but the count is a symbol of its own (its bound over the profile, not n): clamped
    return lambda j: clamp(load(where, [clamp(j, n + 1)]), n)


def widened(t: Optional[TensorFn]) -> Optional[TensorFn]:
    """``t`` as float32 (exact) where it holds float16 or bfloat16 values (a narrow model's operand given to a
    float32 kernel); any other ``t`` (or None) as it is."""
    if t is None or t.dtype not in (DType.FLOAT16, DType.BFLOAT16):
        return t
    return TensorFn(t.shape, DType.FLOAT, lambda idx: cast(t(idx), DType.FLOAT), t.kind)


def scalar_of(t: TensorFn) -> E:
    """The single element of a one-element tensor."""
    return t([const(0, I64)] * len(t.shape))


def sub_ctx(ctx, inputs) -> LowerCtx:
    """``ctx`` with other inputs: an op lowered as another one (ConvInteger as Conv) after rewriting its inputs."""
    return LowerCtx(ctx.node, inputs, ctx._temp, ctx._weight, ctx.gemm_cols, ctx.gemm_tiles, ctx.unpadded_contractions,
                    ctx.matmul_panels, ctx.half_contractions, channel_tile_cost=ctx.channel_tile_cost,
                    used_outputs=ctx.used_outputs, narrow_formats=ctx.narrow_formats, matmul_tile=ctx.matmul_tile,
                    bf16_storage=ctx.bf16_storage, tile_choices=ctx.tile_choices)
