"""Scheduling: graph -> kernels ("stages") with fused expressions, and a static memory plan.

Each stage computes one buffer from one tensor expression. A value is *inlined* into its consumers
(never stored) when that costs no repeated work: its only consumer reads it element for element
(epilogue fusion: Conv -> Add(residual) -> Relu becomes one stage), or it is cheap index arithmetic
(Transpose, Pad, Slice, broadcast) or a cheap elementwise op read only by elementwise ops. Everything
else is stored: in the caller's output buffer for graph outputs, else in the arena at an offset chosen
from liveness (buffers whose lifetimes do not overlap share bytes). Reshape-like ops are views.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import attrs
import numpy as np

from ..errors import ShapeError, UnsupportedOpError
from ..ir.dim import SymExpr, Symbol, bounds, evaluate, product
from ..ir.dtype import DType
from ..ir.graph import Graph, Value
from ..ir.ops.control import hoist_out_of_loops
from ..ir.registry import ops_with
from .loops import LoopRegion, extend_lifetimes, lower_loop_back, lower_loop_state
from .lower import LOWERINGS, LowerCtx, TensorFn
from .lower.core import bf16_stored
from .bf16_storage import bf16_storage_reason
from .contraction_nhwc import (BF16_CHANNELS_LAST, ChannelsLastContraction, channels_last_piece, channels_last_pitch,
                               channels_last_reader, is_channels_last)
from .concat_in_place import write_concats_in_place
from .pad_in_place import write_pads_in_place, write_rows_in_place
from .run_time_sizes import run_time_symbols
from .texpr import E, Buf, const, load, nodes, replace_node, top_level, var

ALIGN = 64
ARENA, WEIGHTS = 0, 1
# Ops that read each input element at the output's index (up to broadcasting): fusion consumers.
ELEMENTWISE_OPS = ops_with("elementwise")
#: Elementwise in their data input (scale and zero point per tensor, per axis or blocked): a cheap value read only
#: by these and ELEMENTWISE_OPS is inlined into them, so a quantized model's DequantizeLinear -> Mul -> Add ->
#: QuantizeLinear after an int8 convolution is one pass over bytes, not a float tensor stored between two
QUANT_READERS = frozenset({"QuantizeLinear", "DequantizeLinear"})


@attrs.define(eq=False)
class Stage:
    name: str
    buf: Buf
    vars: List[E]
    expr: E
    reads: List[Buf] = attrs.field(factory=list)
    flops: int = 0       # multiply-adds count 2 (reductions of products); elementwise work is not counted
    op: str = ""         # the op whose lowering produced the stage (its epilogue may hold fused consumers)
    region: Optional[Tuple[int, int, int]] = None   # (axis, lo, hi): the stage writes only that slice
    # (cond, polarity): the stage may be skipped when the bool scalar in buffer ``cond`` differs from
    # ``polarity`` (a branch of a run-time If, an iteration after a Loop's run-time exit); cond is written by
    # an earlier stage (or is an input) and is among ``reads``, so it lives until this stage
    guard: Optional[Tuple[Buf, bool]] = None


@attrs.define
class Schedule:
    stages: List[Stage]
    inputs: List[Buf]
    outputs: List[Buf]
    weights: List[Tuple[Buf, np.ndarray]]
    arena_bytes: int
    weights_bytes: int
    fused: Dict[str, int]     # op -> how many were inlined into a consumer
    symbols: List[Symbol] = attrs.field(factory=list)   # run-time shape symbols, in binding-slot order
    loops: List[LoopRegion] = attrs.field(factory=list)  # run-time loops (backward branches), inner first
    # the last this many symbols are data-dependent sizes, written by a kernel during the run (range [0, bound])
    num_run_time_symbols: int = 0
    # run-time symbol -> a dim it never exceeds (NonZero's count: its input's element count), for the prover
    size_limits: Dict[str, object] = attrs.field(factory=dict)
    # the graph's last inputs that the runtime supplies, not the caller (a LoRA slot's adapter tensors): buffer
    # table slots 4 + inputs + outputs + k, after the scratch and the symbol table
    hidden: List[Buf] = attrs.field(factory=list)
    # values stored as bfloat16 (``bf16_storage``): name -> why (the readers that round them anyway)
    bf16_stored: Dict[str, str] = attrs.field(factory=dict)
    # values a bf16 convolution stores into its reader's padded buffer (``pad_in_place``)
    pads_in_place: List[str] = attrs.field(factory=list)
    # values whose producer writes its slice of a stored concatenation (``concat_in_place``)
    concats_in_place: List[str] = attrs.field(factory=list)
    # values stored channels-last (``[N, H, W, C]``) between channels-last convolutions (kernels.contraction_nhwc)
    channels_last: List[str] = attrs.field(factory=list)
    # outputs written over the residual their stage reads last (output -> residual; _residual_in_place)
    over_residuals: Dict[str, str] = attrs.field(factory=dict)

    @property
    def ranges(self) -> Dict[str, Tuple[int, int]]:
        return {s.name: (s.min, s.max) for s in self.symbols}

    @property
    def opt_point(self) -> Dict[str, int]:
        """Each symbol at its ``opt`` value (else its ``min``): where sizes are reported."""
        return {s.name: s.tuned for s in self.symbols}

    def weights_blob(self) -> bytes:
        """Every constant at the offset the weights plan gave it (booleans as one byte each)."""
        blob = bytearray(self.weights_bytes)
        for b, arr in self.weights:
            data = np.require(np.asarray(arr, dtype=b.dtype.numpy), requirements="C")
            raw = data.astype(np.uint8) if data.dtype == np.bool_ else data
            blob[b.offset:b.offset + data.nbytes] = raw.reshape(-1).view(np.uint8).tobytes()
        return bytes(blob)

    def describe(self) -> str:
        return "\n".join(f"{s.name}: {s.buf.name}{list(s.buf.shape)}" for s in self.stages)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def schedule(g: Graph, gemm_cols: int = 0, split_concat: bool = False, gemm_tiles: tuple = (),
             unpadded_contractions: bool = False, matmul_panels: bool = True,
             half_contractions: bool = False, row_kernels: bool = False,
             channel_tile_cost: Optional[float] = None, run_time_sizes: bool = False,
             hidden_inputs: int = 0, narrow_formats: tuple = (), matmul_tile: tuple = (),
             bf16_storage: str = "", tile_choices: Optional[dict] = None,
             scaled_operands: bool = False, pad_in_place: bool = False, rows_in_place: bool = False,
             gpu_attention: bool = False, concat_in_place: bool = False, inline_views: bool = False,
             gpu_heads_merged: bool = False) -> Schedule:
    """Stages and memory plan of ``g``. ``gemm_cols > 0`` lowers convolutions to packed contractions (the
    x86 micro-kernels), each with a register tile (rows, cols[, lanes]) among ``gemm_tiles`` (default
    ``((MR, gemm_cols),)``), and constant-weight MatMuls to column panels ``gemm_cols`` wide; 0 keeps plain
    reductions.
    ``split_concat``: a stage storing a concatenation becomes one stage per piece, each writing its slice
    (for backends whose kernels honour :attr:`Stage.region`). ``unpadded_contractions`` (the GPU's): a
    padded convolution's contraction reads its input unpadded (``Contraction.pads``), its kernel tests the
    bounds, and no padded copy is stored. ``matmul_panels`` (x86): constant-weight MatMuls become column-panel
    contractions and a MatMul's expression operand B is stored (the row schedule's reads); the GPU keeps
    plain reductions (its split-lane kernels read the weights as given). ``half_contractions`` (the GPU's):
    float16 convolutions become contractions too (its kernels accumulate them in float32). ``row_kernels``
    (x86): convolutions with reductions of 4-7 terms become contractions too, and 2-D average pools depthwise
    windows (:class:`cuvil.kernels.contraction.DepthwiseWindow`) for the row kernels. ``channel_tile_cost``:
    the weight of a channel-lane tile's work in the tile choice (:func:`cuvil.kernels.contraction.tile_cost`),
    needed when ``gemm_tiles`` offers such tiles (x86: ``X86Tuning.channel_tile_cost``). ``run_time_sizes``
    (x86): a size that depends on tensor values (NonZero's count, TopK's k read from data, Compress's kept
    count, Unique's, NonMaxSuppression's) becomes a run-time symbol its producer's kernel writes
    (:mod:`cuvil.kernels.run_time_sizes`; the schedule's last ``num_run_time_symbols`` symbols); without it
    such a size is refused naming its node. ``hidden_inputs``: the last this many graph inputs are supplied by
    the runtime (:attr:`Schedule.hidden`), not by the caller. ``narrow_formats`` (x86: ``("bf16",)`` on a CPU
    with AVX512_BF16): the Node.precision formats the target's contraction micro-kernels compute in; a node
    narrowed to one of them lowers to a narrowed contraction (``Contraction.precision``). ``matmul_tile``
    (x86): the (rows, cols) register tile of float32 constant-weight MatMuls (their weights are packed in
    panels ``cols`` wide); default ``(MR, gemm_cols)``. ``bf16_storage`` (x86, with "bf16" among
    ``narrow_formats``): a float32 value stored in the arena whose every reader is a convolution narrowed to
    bf16, taking it as its input, is stored as bfloat16 (half the bytes; :mod:`cuvil.kernels.bf16_storage`), and
    so is the zero-padded copy such a convolution packs from: the readers round it to bfloat16 anyway, so the
    stored values are the ones they compute with and nothing is narrowed that was not (the readers' own
    certificates cover it; listed in :attr:`Schedule.bf16_stored`): ``"convs"``. ``"plan"``: also the values
    read by ``Add`` nodes besides such convolutions that the precision policy marked (``Value.storage`` "bf16":
    an explicit ``--precision bf16``, their ranges certified finite in bf16; a new rounding of the skip path,
    :func:`cuvil.precision.policy.residual_storage`). ``"residual"``: every such value, marked or not
    (:func:`cuvil.kernels.bf16_storage.bf16_storage_reason`); "" none. ``tile_choices`` (x86 ``--tune``):
    {(m, positions, k): tile}, the register tile of a float32 convolution contraction of that shape (m output
    channels per group, k reduction terms), taken instead of :func:`cuvil.kernels.contraction.choose_tile`'s. ``scaled_operands`` (the GPU's): a value
    that only MatMuls read and that is another value times (or divided by) a constant scalar is inlined into
    their loads instead of stored (attention's ``Q * s`` and ``Kt * s``: the product's kernel multiplies each
    element it loads, the same rounding, and a kernel and a pass over the operand less). ``pad_in_place`` (x86):
    a bf16 convolution whose output only a padded copy reads writes into the copy's interior, and the copy
    stage writes only the border (:mod:`cuvil.kernels.pad_in_place`); ``rows_in_place`` (x86) the same for a
    channels-last convolution's output and its stride-1 reader's rows copy. ``gpu_attention`` (the GPU's,
    ``PtxTuning.fused_attention``): a FusedAttention with static shapes lowers to the GPU kernel's node
    (:class:`cuvil.kernels.attention.AttentionRows`: its operands read in place through index expressions);
    ``gpu_heads_merged`` (with it, ``PtxTuning.attention_heads_merged``): that node's output stored where the
    exports' head merge next puts it (``AttentionRows.out_heads_inner``), the merge then a view.
    ``concat_in_place`` (x86, with ``split_concat``): a stored value that only a concatenation piece copies, into
    a contiguous slice, is written there by its producer and the copy goes (:mod:`cuvil.kernels.concat_in_place`).
    ``inline_views`` (the GPU's): a reshape of a value that is not stored (a head split of a Split's output, the
    merge of a transposed attention output), and an elementwise value whose one reader only moves data (the Cast
    of a new KV row into its cache's Concat), are inlined into their readers as index arithmetic, where otherwise
    each would be stored by a kernel of its own (on the GPU a launch costs more than the index arithmetic; x86 keeps
    the copy, whose readers then vectorise over contiguous rows)."""
    data_syms, writers, limits = run_time_symbols(g, run_time_sizes)
    syms = _run_time_symbols(g, data_syms)
    ranges = {s.name: (s.min, s.max) for s in syms}
    opt = {s.name: s.tuned for s in syms}
    builder = _StageBuilder(g, (gemm_cols, gemm_tiles, unpadded_contractions, matmul_panels, half_contractions,
                                row_kernels, channel_tile_cost), hidden_inputs)
    builder.narrow_formats = tuple(narrow_formats)
    builder.matmul_tile = tuple(matmul_tile)
    builder.tile_choices = dict(tile_choices or {})
    builder.bf16_storage = bf16_storage if "bf16" in builder.narrow_formats else ""
    builder.scaled_operands = scaled_operands
    builder.gpu_attention = gpu_attention
    builder.gpu_heads_merged = gpu_heads_merged
    builder.inline_views = inline_views
    builder.size_writers = writers
    builder.symbol_slots = {s.name: k for k, s in enumerate(syms)}
    g.toposort()
    hoist_out_of_loops(g.nodes)
    for node in g.nodes:
        builder.lower(node)
    builder.copy_unproduced_outputs()
    stages, weights = builder.stages, builder.weights

    builder.resolve_guards()
    if split_concat:
        stages = [part for st in stages for part in split_piecewise(st)]
    for s in stages:
        s.reads = _reads(s.expr) + ([s.guard[0]] if s.guard is not None else [])
        s.flops = _flops(s, opt)
    in_concat = write_concats_in_place(stages, ARENA, ALIGN) if concat_in_place and split_concat else []
    in_place = write_pads_in_place(stages, ARENA) if pad_in_place else []
    in_place += write_rows_in_place(stages, ARENA) if rows_in_place else []
    # constants that no kernel reads (weights a kernel reads repacked) stay out of the artifact
    read = {id(root_of(b)) for s in stages for b in s.reads}
    weights = {k: (b, a) for k, (b, a) in weights.items() if id(root_of(b)) in read}
    over: Dict[str, str] = {}
    arena = _plan_arena(stages, ranges, builder.loops, over)
    wbytes = _plan_weights(weights)
    return Schedule(stages, builder.in_bufs, builder.out_bufs, [(b, a) for b, a in weights.values() if a is not None],
                    arena, wbytes, builder.fused, syms, builder.loops, len(data_syms), limits, builder.hidden_bufs,
                    builder.bf16_stored, in_place, in_concat, builder.channels_last, over)


def _run_time_symbols(g: Graph, data_syms: Dict[str, Symbol]) -> List[Symbol]:
    """The symbols that size ``g``'s tensors, in binding-slot order (those input dims give, then the
    data-dependent ones ``data_syms``, which kernels write); refuses a graph a backend cannot bind (an
    unknown rank, an unknown symbol, an input dim that is an expression, a symbol no input dim gives)."""
    for v in g.values():
        if v.shape is None:
            raise ShapeError(f"value {v.name!r} has unknown rank: the x86 and GPU backends need every rank")
    known = set(g.symbols) | set(data_syms)
    used = set()
    for v in g.values():
        here = set().union(*[d.free_symbols for d in v.shape if isinstance(d, SymExpr)])
        if here - known:
            raise ShapeError(f"value {v.name!r} has shape {v.type} over unknown symbol(s) {sorted(here - known)}")
        used |= here - set(data_syms)
    bound = set()
    for v in g.inputs:
        for d in v.shape:
            if isinstance(d, SymExpr):
                if not (len(d.free_symbols) == 1 and str(d) in g.symbols):
                    raise ShapeError(f"input {v.name!r} has dim {d}: an input dim must be an integer or a symbol")
                bound.add(str(d))
    if used - bound:
        raise ShapeError(f"symbol(s) {sorted(used - bound)} size tensors but no input dim gives them a value: "
                         f"fix them (fixed={{...}})")
    return [g.symbols[k] for k in sorted(used)] + list(data_syms.values())


class _StageBuilder:
    """One scheduling run, node by node: each value's expression (``fns``) and, once stored, its buffer
    (``bufs``); the stages, constants and fusion counts so far; which values are expensive to recompute or
    hold a contraction."""

    def __init__(self, g: Graph, lower_options: tuple, hidden_inputs: int = 0):
        self.g = g
        self.lower_options = lower_options   # LowerCtx's arguments after the node, inputs, temp and weight
        self.narrow_formats: tuple = ()      # LowerCtx.narrow_formats
        self.matmul_tile: tuple = ()         # LowerCtx.matmul_tile
        self.bf16_storage = ""               # schedule's bf16_storage
        self.scaled_operands = False         # schedule's scaled_operands
        self.gpu_attention = False           # schedule's gpu_attention (LowerCtx.gpu_attention)
        self.gpu_heads_merged = False        # schedule's gpu_heads_merged (LowerCtx.gpu_heads_merged)
        self.inline_views = False            # schedule's inline_views
        self.bf16_stored: Dict[str, str] = {}
        self.shared_temps: dict = {}          # LowerCtx.shared
        self.channels_last: List[str] = []    # Schedule.channels_last
        self.fns: Dict[int, TensorFn] = {}
        self.bufs: Dict[int, Buf] = {}
        self.expensive: Dict[int, bool] = {}
        self.contracting: Dict[int, bool] = {}   # inlined values whose expression holds a contraction
        # inlined values -> the values whose contraction their expression holds (one node each, shared)
        self.contraction_of: Dict[int, frozenset] = {}
        self.stages: List[Stage] = []
        self.weights: Dict[int, Tuple[Buf, np.ndarray]] = {}
        self.fused: Dict[str, int] = {}
        self.current_op = ""
        self.current_guard = None   # the guard of the node being lowered (its stages take it)
        self.guards: Dict[int, tuple] = {}   # id(stage) -> (cond value, polarity), resolved to buffers at the end
        # Values that guard nodes: stored (never inlined), so the run time can read them before the guarded steps.
        self.guard_conds = {id(n.guard[0]) for n in g.nodes if n.guard is not None}
        self.open_loops: Dict[str, tuple] = {}   # loop id -> its LoopState's head and slots, until its LoopBack
        self.loops: List[LoopRegion] = []
        self.size_writers: Dict[int, str] = {}     # id(node) -> the run-time symbol its lowering writes
        self.symbol_slots: Dict[str, int] = {}
        self.in_bufs, self.out_bufs, self.hidden_bufs = [], [], []
        ni, no = len(g.inputs) - hidden_inputs, len(g.outputs)
        for i, v in enumerate(g.inputs):
            b = Buf(v.name, v.dtype, tuple(v.shape), 2 + i if i < ni else 4 + no + i, 0)
            (self.in_bufs if i < ni else self.hidden_bufs).append(b)
            self.bufs[id(v)] = b
            self.fns[id(v)] = _loader(b)
        self.out_index: Dict[int, List[int]] = {}
        for j, v in enumerate(g.outputs):
            self.out_index.setdefault(id(v), []).append(j)
            self.out_bufs.append(Buf(g.output_names[j], v.dtype, tuple(v.shape), 2 + ni + j, 0))

    def const_fn(self, v: Value) -> TensorFn:
        if id(v) in self.fns:
            return self.fns[id(v)]
        arr = np.asarray(v.const)
        if arr.size == 1 and v.dtype != DType.STRING:
            e = const(arr.reshape(-1)[0].item(), v.dtype)
            t = TensorFn(tuple(arr.shape), v.dtype, lambda idx, e=e: e, "elementwise")
        else:
            b = Buf(v.name, v.dtype, tuple(arr.shape), WEIGHTS, 0)
            self.weights[id(v)] = (b, arr)
            self.bufs[id(v)] = b
            t = _loader(b)
        self.fns[id(v)] = t
        return t

    def packed_weight(self, arr: np.ndarray, name: str) -> Buf:
        b = Buf(name, DType.from_numpy(arr.dtype), tuple(arr.shape), WEIGHTS, 0)
        self.weights[id(b)] = (b, arr)
        return b

    def materialize(self, name: str, shape, dtype, fn, base=ARENA, guard=None) -> TensorFn:
        b = Buf(name, dtype, tuple(shape), base, 0)
        vs = [var(f"i{k}") for k in range(len(shape))]
        self.add_stage(Stage(name, b, vs, fn(list(vs)), op=self.current_op), self.current_guard if guard is None else guard)
        return _loader(b)

    def add_stage(self, st: Stage, guard) -> None:
        self.stages.append(st)
        if guard:
            self.guards[id(st)] = guard

    def resolve_guards(self) -> None:
        """Each guarded stage's condition as a buffer written before it (a graph input, or a stage earlier in
        the order); a guard whose condition is not stored by then, or is a constant, is dropped (the stage
        always runs, which is always correct)."""
        written = {id(b) for b in self.in_bufs + self.hidden_bufs}
        for st in self.stages:
            g = self.guards.get(id(st))
            if g is not None:
                cond, polarity = g
                b = self.bufs.get(id(cond))
                if b is not None and id(root_of(b)) in written and b.dtype == DType.BOOL and b.base != WEIGHTS:
                    st.guard = (b, polarity)
            written.add(id(root_of(st.buf)))

    def store_into(self, name: str, buf: Buf, fn) -> None:
        """A stage writing ``fn`` into an existing buffer (a run-time loop's back edge into a state slot)."""
        vs = [var(f"i{k}") for k in range(len(buf.shape))]
        self.add_stage(Stage(name, buf, vs, fn(list(vs)), op=self.current_op), self.current_guard)

    def place_stored(self, node, o: Value, buf: Buf) -> None:
        """Output ``o`` of ``node`` is the contents of ``buf`` (read in place, or copied where it must be)."""
        self.expensive[id(o)] = False
        self.contracting[id(o)] = False
        self._place(node, o, _loader(buf))

    def write_symbol(self, name: str, value: E) -> None:
        """A scalar stage storing ``value`` (int64) into run-time symbol ``name``'s slot of the symbol table
        (buffer table index ``3 + inputs + outputs``): later kernels read the symbol from there."""
        base = 3 + len(self.in_bufs) + len(self.g.outputs)
        b = Buf(f"{name}_size", DType.INT64, (), base, 8 * self.symbol_slots[name])
        self.add_stage(Stage(f"{name}_size", b, [], value, op=self.current_op), self.current_guard)

    def temp(self, shape, dtype, fn, name) -> TensorFn:
        return self.materialize(name, shape, dtype, fn)

    def lower(self, node) -> None:
        """Lower ``node`` and place each of its outputs (stored, a view, or inlined into its consumers)."""
        self.current_op = node.op
        self.current_guard = node.guard
        if node.op in _LOOP_LOWERINGS:
            _LOOP_LOWERINGS[node.op](self, node)
            return
        ins = self._inputs(node)
        low = LOWERINGS.get(node.op)
        if low is None:
            raise UnsupportedOpError(node.op, node.name, detail="no x86 lowering")
        used = [bool(o.uses) or id(o) in self.out_index for o in node.outputs]
        writes = self.size_writers.get(id(node))
        outs = low(LowerCtx(node, ins, self._input_store(node, ins), self.packed_weight, *self.lower_options, used_outputs=used,
                            narrow_formats=self.narrow_formats, matmul_tile=self.matmul_tile,
                            tile_choices=self.tile_choices, bf16_storage=bool(self.bf16_storage),
                            gpu_attention=self.gpu_attention, gpu_heads_merged=self.gpu_heads_merged,
                            shared=self.shared_temps if node.guard is None and not self.open_loops else None, set_size=(lambda value, name=writes: self.write_symbol(name, value)) if writes else None))
        inlined = [v for v in node.inputs if v is not None and id(v) not in self.bufs]
        # an expression that inlines a reduction is expensive however cheap its own op is
        inlined_cost = any(self.expensive.get(id(v), False) for v in inlined)
        carries = any(self.contracting.get(id(v)) for v in inlined)
        sources = frozenset().union(*(self.contraction_of.get(id(v), frozenset()) for v in inlined))
        for o, t in zip(node.outputs, outs):
            self.expensive[id(o)] = t.kind == "complex" or inlined_cost
            self.contracting[id(o)] = t.contraction or carries
            self.contraction_of[id(o)] = sources | {id(o)} if t.contraction else sources
            self._place(node, o, t)

    def _input_store(self, node, ins):
        """The ``temp`` of ``node``'s lowering. A reader that needs an inlined input as a buffer (a convolution's
        or a pool's ``in``) stores it whole; that store then becomes the value's own buffer, which later readers
        read instead of each storing it again (Inception's concatenations, read by three convolutions and a
        pool: one copy, not four; then written in place by :mod:`cuvil.kernels.concat_in_place`). Only the
        input's own expression over its own shape and dtype counts, outside guards and run-time loops (a store
        there may not run before a later reader)."""
        inlined = {id(t.fn): v for v, t in zip(node.inputs, ins)
                   if v is not None and t is not None and not v.is_const and id(v) not in self.bufs}
        if not inlined or node.guard is not None or self.open_loops:
            return self.temp

        def temp(shape, dtype, fn, name):
            t = self.temp(shape, dtype, fn, name)
            v = inlined.get(id(fn))
            if v is None or tuple(shape) != tuple(v.shape) or id(v) in self.bufs:
                return t
            if dtype == v.dtype:
                self.bufs[id(v)] = self.stages[-1].buf
                self.fns[id(v)] = t
            elif dtype == DType.BFLOAT16 and v.dtype == DType.FLOAT and self._bf16_pieces(v):
                # (a concatenation of bfloat16 values stored as bfloat16, a max pool's input: no rounding)
                self.bufs[id(v)] = self.stages[-1].buf
                self.fns[id(v)] = bf16_stored(t)
            return t
        return temp

    def _bf16_pieces(self, v: Value) -> bool:
        """``v`` is a Concat of values all stored as bfloat16 (its elements exactly bfloat16 values)."""
        p = v.producer
        return p is not None and p.op == "Concat" and all(
            x is not None and self.bufs.get(id(x)) is not None and self.bufs[id(x)].dtype == DType.BFLOAT16
            for x in p.inputs)

    def _inputs(self, node) -> List[Optional[TensorFn]]:
        # A stage computes at most one contraction with a micro-kernel: when a node would inline several
        # (the residual Add of two convolutions), all but the last are stored first.
        pending = [v for v in node.inputs
                   if v is not None and self.contracting.get(id(v)) and id(v) not in self.bufs]
        # ... unless they all carry the one same contraction (a GELU's two branches over one product: its
        # node is shared, see _shared)
        one = {self.contraction_of.get(id(v), frozenset()) for v in pending}
        if len(one) == 1 and len(next(iter(one))) == 1:
            pending = pending[-1:]
        for v in pending[:-1]:
            # stored for every reader of v: it runs under v's own guard, not the node's
            own = v.producer.guard if v.producer is not None else None
            self.fns[id(v)] = self.store_value(v, self.fns[id(v)].fn, guard=own or ())
            self.bufs[id(v)] = self.stages[-1].buf
        ins = []
        for v in node.inputs:
            if v is None:
                ins.append(None)
            elif v.is_const:
                ins.append(self.const_fn(v))
            else:
                ins.append(self.fns[id(v)])
        return ins

    def _place(self, node, o: Value, t: TensorFn) -> None:
        """A graph output is stored in its output buffer; an alias of a stored value is a view of its
        buffer; a value cheap to recompute is inlined; anything else is stored in the arena."""
        if id(o) in self.out_index:
            j = self.out_index[id(o)][0]
            ob = self.out_bufs[j]
            self.add_stage(Stage(f"{node.name}", ob, *(_vars_expr(t, ob.shape)), op=node.op), node.guard)
            self.bufs[id(o)] = ob
            self.fns[id(o)] = _loader(ob)
            return
        if t.kind == "alias":
            src = node.inputs[0]
            if id(src) in self.bufs:
                sb = self.bufs[id(src)]
                view = Buf(o.name, o.dtype, tuple(o.shape), sb.base, sb.offset, root=sb.storage)
                if sb.base == WEIGHTS:
                    self.weights[id(o)] = (view, None)
                self.bufs[id(o)] = view
                self.fns[id(o)] = _loader(view)
                return
        sb = (_read_in_order(t, o) if node.guard is None and not self.open_loops and id(o) not in self.guard_conds
              else None)
        if sb is not None:
            # a data move that reads a stored buffer at its own index (two transposes undoing each other: the
            # attention kernel's rows stored [B, S, H, D] for the exports' head merge) is that buffer: a view
            self.bufs[id(o)] = view = Buf(o.name, o.dtype, tuple(o.shape), sb.base, sb.offset, root=sb.storage)
            self.fns[id(o)] = _loader(view)
            return
        # a guarded value read outside its guard is stored under it: inlined there, it would run unguarded
        leaves_guard = node.guard is not None and any(u.guard != node.guard for u in self.g.consumers(o))
        if (t.buf is not None and self.stages and t.buf is self.stages[-1].buf and _reads_whole(t)
                and t.buf.base == ARENA and t.buf.dtype == o.dtype and tuple(t.buf.shape) == tuple(o.shape)
                and node.guard is None and not self.open_loops and id(o) not in self.guard_conds):
            # the lowering's last temp read whole is the value: its buffer, not a copy of it (outside guards and
            # run-time loops, as _input_store's stores: there a store may not run before a later reader)
            self.bufs[id(o)] = t.buf
            self.fns[id(o)] = t
            return
        if id(o) not in self.guard_conds and not leaves_guard and (
                _inline(self.g, o, t, self.expensive[id(o)])
                or self.inline_views and not self.expensive[id(o)] and _view_inline(self.g, o, t)
                or self.scaled_operands and not self.expensive[id(o)] and _scaled_operand(self.g, node, o, t)):
            self.fns[id(o)] = _shared(t) if self.expensive[id(o)] and len(o.uses) > 1 else t
            self.fused[node.op] = self.fused.get(node.op, 0) + 1
            return
        self.fns[id(o)] = self.store_value(o, t.fn)
        self.bufs[id(o)] = self.stages[-1].buf

    def store_value(self, v: Value, fn, guard=None) -> TensorFn:
        """Value ``v`` (computed by ``fn``) stored in the arena: as bfloat16 where ``bf16_storage`` and every
        reader rounds it to bfloat16 anyway (:mod:`cuvil.kernels.bf16_storage`), else in its own dtype."""
        plan = self.bf16_storage == "plan" and v.storage == "bf16"
        why = bf16_storage_reason(self.g, v, residual=self.bf16_storage == "residual" or plan) \
            if self.bf16_storage else None
        if why is not None and plan and "residual" in why:
            why += " (the precision plan's: --precision bf16, its range certified finite in bf16)"
        if why is None:
            out = self.materialize(v.name, v.shape, v.dtype, fn, guard=guard)
        else:
            self.bf16_stored[v.name] = why
            out = bf16_stored(self.materialize(v.name, v.shape, DType.BFLOAT16, fn, guard=guard))
        self._choose_layout(v, self.stages[-1])
        return out

    def _choose_layout(self, v: Value, st: Stage) -> None:
        """Store ``v`` channels-last (its buffer pitched ``[N, H, W, C]``, :mod:`cuvil.kernels.contraction_nhwc`)
        where its stage is a channels-last convolution (whose tiles hold rows of channels: contiguous stores) and
        every reader takes it so: a channels-last convolution reading it as its input (in place, no copy) or as
        a piece of a concatenation of channels it reads where each piece lies (a Concat or a strided Slice,
        :func:`cuvil.kernels.contraction_nhwc.channels_last_piece`), or a residual Add / Sum (fused into a channels-last convolution's epilogue, where it loads vectors of
        channels), or an average pool over the whole map (a classifier's last one: its loop nest reads the
        value through its strides, and the convolution before it keeps its vector epilogue). Any other kernel
        that meets such a buffer addresses it through its strides (the generic loop nest): the choice changes
        speed, never values."""
        if BF16_CHANNELS_LAST not in self.narrow_formats or len(v.shape) != 4 or \
                not all(isinstance(d, int) for d in v.shape[1:]) or st.buf.root is not None or st.buf.pitch is not None:
            return
        if not any(e.op == "contract" and isinstance(e.attr, ChannelsLastContraction) for e in top_level(st.expr, "contract")[0]):
            return
        users = self.g.consumers(v)
        if not users:
            return
        if all(u.op in ("Add", "Sum") or channels_last_reader(u, v) or channels_last_piece(u, v) or _global_pool(u)
               for u in users):
            st.buf.pitch = channels_last_pitch(v.shape)
            self.channels_last.append(v.name)

    def copy_unproduced_outputs(self) -> None:
        """Outputs that no node produces (inputs, constants, duplicates) are copied."""
        for j, v in enumerate(self.g.outputs):
            ob = self.out_bufs[j]
            if any(s.buf is ob for s in self.stages):
                continue
            t = self.const_fn(v) if v.is_const else self.fns[id(v)]
            self.stages.append(Stage(f"copy_{ob.name}", ob, *(_vars_expr(t, ob.shape))))


_LOOP_LOWERINGS = {"LoopState": lower_loop_state, "LoopBack": lower_loop_back}


def root_of(b: Buf) -> Buf:
    return b.storage


def _loader(b: Buf) -> TensorFn:
    return TensorFn(b.shape, b.dtype, lambda idx: load(b, idx), "elementwise", buf=b)


def _read_in_order(t: TensorFn, o) -> Optional[Buf]:
    """The arena buffer that data move ``t`` (the value ``o``) reads whole at its own index, of ``o``'s shape and
    type, row-major and unshifted; else None."""
    if t.kind not in ("injective", "alias"):
        return None
    vs = [var(f"w{k}") for k in range(len(t.shape))]
    e = t.fn(list(vs))
    if e.op != "load" or not isinstance(e.attr, Buf) or len(e.args) != len(vs):
        return None
    sb = e.attr
    if (sb.base != ARENA or sb.dtype != o.dtype or tuple(sb.shape) != tuple(o.shape) or sb.pitch is not None
            or sb.shift or not all(a.op == "var" and a.attr == v.attr for a, v in zip(e.args, vs))):
        return None
    return sb


def _reads_whole(t: TensorFn) -> bool:
    """Whether ``t`` reads its buffer at its own index (a loader, not a permuted or converted view of it)."""
    vs = [var(f"w{k}") for k in range(len(t.shape))]
    e = t.fn(list(vs))
    return (e.op == "load" and e.attr is t.buf and len(e.args) == len(vs)
            and all(a.op == "var" and a.attr == v.attr for a, v in zip(e.args, vs)))


def _vars_expr(t: TensorFn, shape):
    vs = [var(f"i{k}") for k in range(len(shape))]
    return vs, t.fn(list(vs))


def _inline(g: Graph, o: Value, t: TensorFn, expensive: bool) -> bool:
    users = g.consumers(o)
    if not users:
        return True  # dead: nothing will read it
    if all(u.op == "LoopBack" for u in users):
        return True  # a run-time loop's next value: stored by the back edge (kernels/loops.py), once
    readers_same = all(u.op in ELEMENTWISE_OPS and tuple(u.outputs[0].shape) == tuple(o.shape) for u in users)
    if len(o.uses) == 1 and readers_same:
        return True
    if expensive:
        return readers_same and _joins(g, o, users)
    if t.kind == "injective":
        return True
    return t.kind == "elementwise" and all(u.op in ELEMENTWISE_OPS or (u.op in QUANT_READERS and u.inputs[0] is o and
                                                                      tuple(u.outputs[0].shape) == tuple(o.shape))
                                           for u in users)


# data movement that reads each element of its input at most once (schedule's inline_views)
MOVES = ("Concat", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Slice")
# ... only for values up to this many elements (a decode step's head splits: 768 a token): a small view's own
# kernel costs its launch (a few us in a CUDA graph) against its readers' index arithmetic; a large one stays
# stored so that products read contiguous rows (16-byte vector loads, cp.async: BERT's merged heads at S = 128)
VIEW_INLINE_MAX = 16384
# readers whose kernels read an operand many times over (a widening Cast stays stored for them)
CONTRACTING_READERS = ("MatMul", "Gemm", "Conv", "ConvTranspose", "FusedAttention")


def _view_inline(g: Graph, o: Value, t: TensorFn) -> bool:
    """(schedule's ``inline_views``) ``o`` is a reshape of a value that is not stored, an elementwise value (a
    Cast of a new KV row) whose one reader moves data, or a widening Cast whose one reader is not a product (the
    float16 pass's widening of a residual for a float32 LayerNorm): inlined into its reader as index arithmetic
    or a conversion."""
    if o.shape is None:
        return False
    n = 1
    for d in o.shape:
        n = n * d if isinstance(d, int) else VIEW_INLINE_MAX + 1
    if n > VIEW_INLINE_MAX:
        return False
    if t.kind == "alias":
        return True
    users = g.consumers(o)
    if t.kind != "elementwise" or len(o.uses) != 1 or len(users) != 1:
        return False
    widening = (o.producer is not None and o.producer.op == "Cast" and o.producer.inputs[0] is not None
                and o.producer.inputs[0].dtype.is_float and o.dtype.is_float
                and o.dtype.itemsize > o.producer.inputs[0].dtype.itemsize)
    if users[0].op in MOVES:
        # not where the move is itself read by a product without being stored (a graph output is): the
        # elementwise work would be redone on every read, and the product's operand no plain load
        moved = users[0].outputs[0]
        return id(moved) in {id(v) for v in g.outputs} or not any(
            u.op in CONTRACTING_READERS for u in g.consumers(moved))
    return widening and users[0].op not in CONTRACTING_READERS


def _scaled_operand(g: Graph, node, o: Value, t: TensorFn) -> bool:
    """``o = x * c`` or ``x / c`` (``c`` a constant scalar) read only by MatMuls (schedule's ``scaled_operands``)."""
    if t.kind != "elementwise" or node.op not in ("Mul", "Div") or len(node.inputs) != 2:
        return False
    consts = [v for v in node.inputs if v is not None and v.is_const and all(d == 1 for d in v.shape)]
    if len(consts) != 1 or (node.op == "Div" and node.inputs[1] is not consts[0]):
        return False
    users = g.consumers(o)
    return bool(users) and all(u.op == "MatMul" for u in users)


JOIN_DEPTH = 8    # elementwise ops followed from each use of an expensive value looking for where they join


def _joins(g: Graph, o: Value, users) -> bool:
    """Whether every use of the expensive value ``o`` (all elementwise, of its shape) flows through
    single-use elementwise ops of that shape into one node, within JOIN_DEPTH ops: a GELU's
    ``(f * 0.5) * (Erf(f / sqrt 2) + 1)``, a SiLU's ``f * Sigmoid(f)``. Every value on the way is then
    inlined into that node's stage, and so is ``o``, once (its expression shared, :func:`_shared`): the
    product's epilogue computes the activation instead of a separate pass over a stored ``o``."""
    outputs = {id(v) for v in g.outputs}
    shape = tuple(o.shape)

    def chain(n) -> List[int]:
        out = [id(n)]
        for _ in range(JOIN_DEPTH):
            v = n.outputs[0] if len(n.outputs) == 1 else None
            if v is None or id(v) in outputs or len(v.uses) != 1:
                break
            n = v.uses[0][0]
            if n.op not in ELEMENTWISE_OPS or len(n.outputs) != 1 or tuple(n.outputs[0].shape) != shape:
                break
            out.append(id(n))
        return out
    chains = [chain(u) for u in users]
    return any(all(j in c for c in chains[1:]) for j in chains[0])


def _shared(t: TensorFn) -> TensorFn:
    """``t`` whose expression at one index is built once: the consumers that inline a value read more than
    once (:func:`_joins`) share its node (one contraction in the stage; emitted once, memoised by uid)."""
    memo: Dict[tuple, E] = {}

    def fn(idx):
        key = tuple(i if not isinstance(i, E) else (i.op, i.attr, i.dtype) if i.op in ("var", "const") else i.uid
                    for i in idx)
        if key not in memo:
            memo[key] = t.fn(list(idx))
        return memo[key]
    return attrs.evolve(t, fn=fn)


def _reads(e: E) -> List[Buf]:
    out, seen, stack = [], set(), [e]
    while stack:
        x = stack.pop()
        if x.uid in seen:
            continue
        seen.add(x.uid)
        if x.op == "load":
            out.append(x.attr)
        elif x.op == "argscan":
            stack.extend(_argscan_reads(x))
        elif x.op == "sequential":     # every buffer its program writes, and what its expressions load
            out.extend(x.attr.written())
            stack.extend(x.attr.exprs())
        stack.extend(x.args)
    return out


def split_piecewise(st: Stage) -> List[Stage]:
    """A stage whose expression is piecewise along one of its own axes (a stored Concat, possibly under
    fused elementwise consumers) as one stage per piece writing its slice: each piece reads only its input,
    with no selects or clamps. Pieces that are themselves concatenations along the same axis (DenseNet's
    chains) are split again."""
    found, reductions = top_level(st.expr, "piecewise")
    if len(found) != 1 or reductions:   # a row reduction's loop does not take a region
        return [st]
    node = found[0]
    _, bounds, make_pieces = node.attr
    # the stage axis whose variable (plus a constant shift) indexes the concatenation
    hits = [(k, _var_offset(node.args[0], v.attr)) for k, v in enumerate(st.vars)]
    hits = [(k, c) for k, c in hits if c is not None]
    if len(hits) != 1:
        return [st]
    axis, shift = hits[0]
    if st.region is not None and st.region[0] != axis:
        return [st]
    lo0, hi0 = st.region[1:] if st.region is not None else (0, st.buf.shape[axis])
    if any(isinstance(x, SymExpr) for x in (lo0, hi0, *bounds)):
        return [st]     # pieces of symbolic extent: one stage selecting per element
    out = []
    for k, (piece, b0, b1) in enumerate(zip(make_pieces(), bounds[:-1], bounds[1:])):
        lo, hi = max(lo0, b0 - shift), min(hi0, b1 - shift)
        if lo < hi:
            part = Stage(f"{st.name}_{k}", st.buf, st.vars, replace_node(st.expr, node, piece), op=st.op,
                         region=(axis, lo, hi), guard=st.guard)
            out.extend(split_piecewise(part))
    return out


def _var_offset(e: E, name: str):
    """c when ``e`` is the variable ``name`` plus a constant c, else None."""
    if e.op == "var":
        return 0 if e.attr == name else None
    if e.op == "add" and len(e.args) == 2:
        for v, c in (e.args, e.args[::-1]):
            if v.op == "var" and v.attr == name and c.op == "const":
                return int(c.attr)
    return None


def _flops(st: Stage, env: Dict[str, int]) -> int:
    """2 x (output elements) x (reduction extent) for the stage's top-level sums and contractions (symbolic
    shapes: at ``env``, the symbols' opt point)."""
    total, seen, stack = 0, set(), [st.expr]
    elems = evaluate(product(st.buf.shape), env)
    while stack:
        x = stack.pop()
        if x.uid in seen:
            continue
        seen.add(x.uid)
        if x.op in ("contract", "window", "wino_in", "wino_out", "qgemm"):
            total += evaluate(x.attr.flops, env)
            continue
        if x.op == "reduce":
            if x.attr[0] == "sum":
                total += 2 * elems * evaluate(product(x.attr[2]), env)
            continue
        if x.op == "sequential":     # each row's program: its steps' sums of products
            total += elems * x.attr.flops(env)
            continue
        stack.extend(x.args)
    return total


def _argscan_reads(x: E):
    src, base, axis, n, _, _ = x.attr
    idx = list(base)
    idx[axis] = const(0, DType.INT64)
    return [src(idx)]


def _plan_arena(stages: List[Stage], ranges: Dict[str, Tuple[int, int]], loops: List[LoopRegion] = (),
                over_residuals: Optional[Dict[str, str]] = None) -> int:
    """Offsets for arena buffers from liveness: first-fit into space freed by dead buffers. A buffer of
    symbolic shape gets its size at the symbols' maxima (sizes only grow with the symbols), so one plan
    serves every shape of the profile. A run-time loop keeps what it reads from before it alive through
    its back edge (:func:`cuvil.kernels.loops.extend_lifetimes`). An output written over the residual its stage
    reads last (:func:`_residual_in_place`) takes that residual's bytes; ``over_residuals`` receives their names
    (output -> residual)."""
    first: Dict[int, int] = {}
    last: Dict[int, int] = {}
    roots: Dict[int, Buf] = {}
    for k, s in enumerate(stages):
        for b in [s.buf] + s.reads:
            r = root_of(b)
            if r.base != ARENA:
                continue
            roots[id(r)] = r
            first.setdefault(id(r), k)
            last[id(r)] = k
    extend_lifetimes(loops, stages, first, last)
    over = _residual_in_place(stages, roots, first, last)
    active: List[Tuple[int, int, int]] = []  # (offset, size, last use)
    top = 0
    offsets: Dict[int, int] = {}
    for rid in sorted(first, key=lambda r: (first[r], r)):
        k = first[rid]
        active = [a for a in active if a[2] >= k]
        size = _align(max(bounds(roots[rid].nbytes, ranges)[1], 1))
        if rid in over:          # the bytes of the residual this stage reads last, element by element
            off = offsets[over[rid]]
            if over_residuals is not None:
                over_residuals[roots[rid].name] = roots[over[rid]].name
            active = [a for a in active if a[0] != off] + [(off, size, last[rid])]
            offsets[rid] = off
            continue
        off, cursor = None, 0
        for a in sorted(active):
            if a[0] - cursor >= size:
                off = cursor
                break
            cursor = max(cursor, a[0] + a[1])
        if off is None:
            off = cursor
        active.append((off, size, last[rid]))
        offsets[rid] = off
        top = max(top, off + size)
    for rid, r in roots.items():      # a root no stage writes whole (Winograd M's longer rows) has its own too
        r.offset = offsets[rid]
    for s in stages:
        for b in [s.buf] + s.reads:
            r = root_of(b)
            if r.base == ARENA:
                b.offset = offsets[id(r)] + b.shift
    return top


def _global_pool(node) -> bool:
    """An average pool whose output is one position per channel (GlobalAveragePool, or AveragePool over the
    whole map)."""
    out = node.outputs[0].shape if node.outputs and node.outputs[0] is not None else None
    return node.op == "GlobalAveragePool" or (node.op == "AveragePool" and out is not None and len(out) == 4
                                                and tuple(out[2:]) == (1, 1))


def _residual_in_place(stages: List[Stage], roots: Dict[int, Buf], first: Dict[int, int],
                       last: Dict[int, int]) -> Dict[int, int]:
    """Outputs written over a residual (output root id -> residual root id): a channels-last convolution's stage
    (:class:`cuvil.kernels.contraction_nhwc.ChannelsLastContraction`, whose epilogue reads each operand element at
    the output position just before it stores that position) whose output is a channels-last arena buffer first
    used there, reading a channels-last arena buffer of the same shape and dtype last there and only at the
    output's own index. The output then takes the residual's bytes: its epilogue reads and writes the same lines
    (a skip Add's residual and output were two streams, the output's lines fetched before they were written)."""
    out: Dict[int, int] = {}
    for k, s in enumerate(stages):
        o = s.buf
        if o.root is not None or o.base != ARENA or not is_channels_last(o) or first.get(id(o)) != k or \
                s.region is not None or not any(isinstance(e.attr, ChannelsLastContraction)
                                                for e in top_level(s.expr, "contract")[0]):
            continue
        names = [v.attr for v in s.vars]
        loads = [e for e in nodes(s.expr) if e.op == "load"]
        for r in {id(root_of(e.attr)): root_of(e.attr) for e in loads}.values():
            if r.base != ARENA or last.get(id(r)) != k or not is_channels_last(r) or r.dtype != o.dtype or \
                    tuple(r.shape) != tuple(o.shape) or id(r) in out.values():
                continue
            if all(e.attr is r and [a.attr if a.op == "var" else None for a in e.args] == names
                   for e in loads if root_of(e.attr) is r):
                out[id(o)] = id(r)
                break
    return out


def _plan_weights(weights) -> int:
    off = 0
    placed: Dict[int, int] = {}
    for b, arr in weights.values():
        if arr is None:
            continue
        b.offset = off
        placed[id(b)] = off
        off = _align(off + max(arr.nbytes, 1))
    for b, arr in weights.values():
        if arr is None:
            b.offset = root_of(b).offset
    return off
