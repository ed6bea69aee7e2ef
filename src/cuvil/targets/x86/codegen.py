"""LLVM IR for scheduled stages (llvmlite), optimised and emitted as an object file for the host CPU.

Each stage becomes ``void <sym>(ptr bufs, i64 begin, i64 end)``: it computes the output elements whose
leading (parallel) indices, flattened, lie in [begin, end); the runtime splits that range over threads.
Inner loops run over the remaining dimensions, innermost contiguous, so LLVM's vectoriser sees unit
strides. Reductions accumulate with reassociation allowed (the order of a sum is not specified by ONNX).
"""
from __future__ import annotations

import re

from typing import Dict, List, Optional, Sequence, Tuple

import llvmlite.binding as llvm
import llvmlite.ir as ir
import numpy as np

from ...errors import CuvilError
from ...ir.dim import SymExpr, bounds, evaluate, product
from ...ir.dtype import DType
from ...kernels.schedule import Schedule, Stage
from ...kernels.texpr import E, Buf, dim_index, identity_value, nodes, top_level

_INITIALIZED = False


_LOOP_SELF = "cuvil.loop."
_LOOP_ID = re.compile(r'^(!\d+) = !\{ ?!"' + re.escape(_LOOP_SELF) + r'\d+", ', re.M)


def _self_referential_loops(text: str) -> str:
    """``!7 = !{!"cuvil.loop.3", !6}`` -> ``!7 = distinct !{!7, !6}``: llvmlite cannot build a node that
    names itself."""
    return _LOOP_ID.sub(lambda m: f"{m.group(1)} = distinct !{{{m.group(1)}, ", text)


def _init():
    global _INITIALIZED
    if not _INITIALIZED:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        _INITIALIZED = True


I1, I8, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()
PTR = ir.PointerType()
_LL = {DType.FLOAT: F32, DType.DOUBLE: F64, DType.FLOAT16: F16, DType.INT8: I8, DType.UINT8: I8,
       DType.INT16: ir.IntType(16), DType.UINT16: ir.IntType(16), DType.INT32: I32, DType.UINT32: I32,
       DType.INT64: I64, DType.UINT64: I64, DType.BOOL: I1}
_UNSIGNED = {DType.UINT8, DType.UINT16, DType.UINT32, DType.UINT64, DType.BOOL}
_INTRINSICS = {"sqrt", "exp", "log", "sin", "cos", "pow", "floor", "ceil", "roundeven", "fabs"}
_LIBM = {"tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "tanh"}
PARALLEL_MIN = 64   # leading dims are flattened into the parallel range until it has this many points
# A step is cut into at most this many chunks per thread (fewer where a chunk repeats set-up work: see
# KernelModule.split), claimed by whichever thread is free: a worker woken late, or on a core still slow
# after idling, takes fewer.
CHUNKS_PER_THREAD = 4


def ll(dt: DType) -> ir.Type:
    try:
        return _LL[dt]
    except KeyError:
        raise CuvilError(f"dtype {dt.name} is not supported by the x86 backend") from None


def mem_type(dt: DType) -> ir.Type:
    return I8 if dt == DType.BOOL else ll(dt)


# AVX-512 gathers and scatters are microcoded on AMD (Zen 4/5) and slow on most Intel cores: LLVM would
# vectorise a micro-kernel epilogue's per-position copy (output rows narrower than the tile) into
# vscatterqps, which cost a 1x1 64->256 convolution over 56x56 more than its FMAs (2-core Zen 5).
_TUNING = "+prefer-no-gather,+prefer-no-scatter"


def splat(b: ir.IRBuilder, x: ir.Value, n: int) -> ir.Value:
    """``x`` in every lane of an ``n``-lane vector."""
    t = ir.VectorType(x.type, n)
    return b.shuffle_vector(b.insert_element(ir.Constant(t, ir.Undefined), x, I32(0)), ir.Constant(t, ir.Undefined),
                            ir.Constant(ir.VectorType(I32, n), [0] * n))


def _tuned(features: str) -> str:
    return f"{features},{_TUNING}" if features else _TUNING


def host_target(cpu: Optional[str] = None, opt: int = 3):
    _init()
    triple = llvm.get_process_triple()
    target = llvm.Target.from_triple(triple)
    if cpu is None or cpu == "native":
        cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    else:
        features = ""
    tm = target.create_target_machine(cpu=cpu, features=_tuned(features), opt=opt, reloc="pic", codemodel="default")
    return tm, triple, cpu, features


class KernelModule:
    def __init__(self, name: str, tm, triple: str):
        self.module = ir.Module(name=name)
        self.module.triple = triple
        self.module.data_layout = str(tm.target_data)
        self.tm = tm
        self._decls: Dict[str, ir.Function] = {}
        self._loops = 0
        self.vector_bits = 128   # widest vector registers of the target CPU (set by generate_object)
        self.scratch_index: Optional[int] = None   # bufs slot of the thread's scratch (None: no scratch)
        self.scratch_bytes = 0   # per-thread scratch the kernels need
        self.gemm_symbols = set()   # stages emitted as GEMM micro-kernels
        self.gemm_tiles = {}        # symbol -> a convolution micro-kernel's register tile ("12x32", "32x7c")
        self.split = {}             # symbol -> chunks per thread, where not CHUNKS_PER_THREAD
        # stages emitted as row kernels: symbol -> "conv" (depthwise), "max" (pool), "winograd_in"/"_out"
        self.window_kinds = {}
        self.dims_index: Optional[int] = None   # bufs slot of the run-time symbol values (int64[])
        self.symbol_slots: Dict[str, int] = {}  # symbol -> its index in that array
        self.ranges: Dict[str, Tuple[int, int]] = {}   # symbol -> (min, max)
        self.opt: Dict[str, int] = {}           # symbol -> the value sizes are tuned for

    def at_opt(self, d) -> int:
        """A dimension's value at the symbols' opt point (for tuning decisions only)."""
        return evaluate(d, self.opt)

    def at_max(self, d) -> int:
        return bounds(d, self.ranges)[1]

    @property
    def cheap_masks(self) -> bool:
        """Masked vector loads and stores cost about as much as plain ones (AVX-512; AVX2's masked stores
        are microcoded on AMD): short rows and partial tiles then end in one masked vector."""
        return self.vector_bits >= 512

    def loop_id(self, *flags: str) -> ir.Value:
        """A fresh ``llvm.loop`` node with boolean hints ``flags``; made self-referential (``distinct
        !{!self, ...}``, as LLVM requires of loop IDs) when the module is printed, see :meth:`compile`."""
        self._loops += 1
        hints = [self.module.add_metadata([ir.MetaDataString(self.module, f), I1(1)]) for f in flags]
        return self.module.add_metadata([ir.MetaDataString(self.module, f"{_LOOP_SELF}{self._loops}")] + hints)

    def declare(self, name: str, ret: ir.Type, args: Sequence[ir.Type]) -> ir.Function:
        if name not in self._decls:
            self._decls[name] = ir.Function(self.module, ir.FunctionType(ret, list(args)), name=name)
        return self._decls[name]

    def kernel(self, sym: str):
        """A new kernel ``void sym(ptr bufs, i64 begin, i64 end)``: its emitter (positioned in the entry
        block) and the range arguments."""
        fn = ir.Function(self.module, ir.FunctionType(ir.VoidType(), [PTR, I64, I64]), name=sym)
        fn.linkage = "external"
        fn.visibility = "hidden"
        fn.args[0].add_attribute("noalias")
        bufs, begin, end = fn.args
        return _Emitter(self, fn, ir.IRBuilder(fn.append_basic_block("entry")), bufs), begin, end

    def loop_shape(self, st: Stage) -> List:
        """The extents a generic loop nest runs over: the stage's buffer, its region's axis cut to the slice."""
        shape = list(st.buf.shape)
        if st.region is not None:    # the stage writes the slice [lo, hi) of one axis of its buffer
            axis, lo, hi = st.region
            shape[axis] = hi - lo
        return shape

    def parallel_dims(self, st: Stage) -> int:
        """How many leading dims a generic loop nest flattens into its parallel range: until it has
        PARALLEL_MIN points (a row reduction keeps its last dim for the row loop)."""
        shape = self.loop_shape(st)
        limit = len(shape) - 1 if _row_reduction(st, self.at_max) is not None else len(shape)
        k, extent = 0, 1
        while k < limit and self.at_opt(extent) < PARALLEL_MIN:
            extent = extent * shape[k]
            k += 1
        return k

    def add_group(self, sym: str, parts: Sequence[Tuple[str, int]]):
        """Kernel ``sym`` running the kernels ``parts`` ((symbol, extent) each, int extents) as one parallel
        range, their ranges laid end to end: [begin, end) is cut at the part boundaries and each part runs
        on its share."""
        em, begin, end = self.kernel(sym)
        b = em.b
        off = 0
        for psym, extent in parts:
            lo = b.sub(begin, I64(off))
            lo = b.select(b.icmp_signed("<", lo, I64(0)), I64(0), lo)
            hi = b.sub(end, I64(off))
            hi = b.select(b.icmp_signed(">", hi, I64(extent)), I64(extent), hi)
            with b.if_then(b.icmp_signed("<", lo, hi)):
                b.call(self.module.get_global(psym), [em.bufs, lo, hi])
            off += extent
        b.ret_void()

    def add_stage(self, st: Stage, sym: str, lead: Optional[int] = None) -> Tuple[int, int]:
        """Emit ``st`` as function ``sym``; returns (parallel extent, grain). ``lead``: a generic loop nest
        flattens that many leading dims into its parallel range (default :meth:`parallel_dims`)."""
        from .depthwise import emit_depthwise_stage
        from .gemm import emit_gemm_stage
        from .matmul import emit_matmul_stage
        from .pad import emit_pad_stage
        from .winograd import emit_winograd_input, emit_winograd_output
        done = emit_matmul_stage(self, st, sym)
        if done is not None:
            self.gemm_symbols.add(sym)
            return done
        done = emit_gemm_stage(self, st, sym)
        if done is not None:
            self.gemm_symbols.add(sym)
            return done
        done = emit_depthwise_stage(self, st, sym)
        if done is not None:
            self.window_kinds[sym] = done[2]
            return done[:2]
        for kind, emit in (("winograd_in", emit_winograd_input), ("winograd_out", emit_winograd_output),
                           ("pad", emit_pad_stage)):
            done = emit(self, st, sym)
            if done is not None:
                self.window_kinds[sym] = kind
                return done
        em, begin, end = self.kernel(sym)
        shape = self.loop_shape(st)
        red = _row_reduction(st, self.at_max)
        k = self.parallel_dims(st) if lead is None else lead
        extent = product(shape[:k])
        # work of one parallel unit: its output elements times the longest top-level reduction each sums
        # (a global average pool's 1000 outputs of 169 terms each are worth two threads)
        terms = [self.at_opt(product(r.attr[2])) for r in top_level(st.expr, "reduce")[0]]
        inner_work = self.at_opt(product(shape[k:])) * max(terms, default=1)

        def at(ix):
            if st.region is None:
                return ix
            ix = list(ix)
            ix[st.region[0]] = em.b.add(ix[st.region[0]], I64(st.region[1]))
            return ix

        def body(p):
            rest = p
            idx: List[ir.Value] = [None] * len(shape)
            for d in reversed(range(k)):
                if d == 0:
                    idx[d] = rest
                else:
                    idx[d] = em.b.srem(rest, em.index(shape[d]))
                    rest = em.b.sdiv(rest, em.index(shape[d]))
            return idx[:k]

        blocked = red is not None and ROW_BLOCK * self.at_max(shape[-1]) <= ROW_MAX
        if red is None:
            em.loop_range(begin, end, lambda p: em.loops(shape[k:], tail_fold=self.cheap_masks, body=lambda inner: em.store_element(
                st, at(body(p) + inner))))
        elif not blocked:
            em.loop_range(begin, end, lambda p: em.loops(shape[k:-1], lambda mid: em.store_row(
                st, red, [at(body(p) + mid)], shape[-1])))
        elif k < len(shape) - 1:    # rows blocked along the last outer dim
            def rows(p):
                outer = body(p)
                em.loops(shape[k:-2], lambda mid: em.blocked_range(
                    I64(0), em.index(shape[-2]), ROW_BLOCK,
                    lambda j0: em.store_row(st, red, [at(outer + mid + [em.b.add(j0, I64(j))])
                                                      for j in range(ROW_BLOCK)], shape[-1]),
                    lambda j: em.store_row(st, red, [at(outer + mid + [j])], shape[-1])))
            em.loop_range(begin, end, rows)
        else:                       # every parallel unit is one row: block the parallel range
            em.blocked_range(begin, end, ROW_BLOCK,
                             lambda p0: em.store_row(st, red, [at(body(em.b.add(p0, I64(j))))
                                                               for j in range(ROW_BLOCK)], shape[-1]),
                             lambda p: em.store_row(st, red, [at(body(p))], shape[-1]))
        em.b.ret_void()
        return (extent if shape else 1), max(1, int(4096 // max(inner_work, 1)))

    def compile(self, opt: int) -> bytes:
        try:
            mod = llvm.parse_assembly(_self_referential_loops(str(self.module)))
            mod.verify()
        except RuntimeError as e:
            raise CuvilError(f"generated LLVM IR does not verify: {e}") from None
        if opt > 0:
            pto = llvm.create_pipeline_tuning_options(speed_level=min(opt, 3))
            pto.loop_vectorization = opt >= 2
            pto.slp_vectorization = opt >= 2
            # Full unrolling of short constant loops runs before the loop vectoriser and would leave it
            # nothing to vectorise; the vectoriser interleaves instead.
            pto.loop_unrolling = False
            pb = llvm.create_pass_builder(self.tm, pto)
            pb.getModulePassManager().run(mod, pb)
        return self.tm.emit_object(mod)


class _Emitter:
    def __init__(self, km: KernelModule, fn: ir.Function, b: ir.IRBuilder, bufs):
        self.km, self.fn, self.b, self.bufs = km, fn, b, bufs
        self.entry = b.block
        self.bases: Dict[int, ir.Value] = {}
        self.syms: Dict[str, ir.Value] = {}
        self.env: Dict[str, ir.Value] = {}
        self.memo: List[Dict[int, ir.Value]] = [{}]

    # --- structure ----------------------------------------------------------------------------------
    def alloca(self, typ, count: int = 1) -> ir.Value:
        with self.b.goto_block(self.entry):
            self.b.position_at_start(self.entry)
            return self.b.alloca(typ, size=I64(count) if count > 1 else None)

    def loop_range(self, start: ir.Value, stop: ir.Value, body, step: ir.Value = None, tail_fold: bool = False):
        """for (i = start; i < stop; i += step) body(i); step 1 by default. ``tail_fold``: ask the loop
        vectoriser to mask the last partial vector instead of finishing in a scalar loop."""
        b = self.b
        pre = b.block
        head = self.fn.append_basic_block("loop")
        inner = self.fn.append_basic_block("body")
        done = self.fn.append_basic_block("done")
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64)
        i.add_incoming(start, pre)
        b.cbranch(b.icmp_signed("<", i, stop), inner, done)
        b.position_at_end(inner)
        self.memo.append(dict(self.memo[-1]))
        body(i)
        self.memo.pop()
        nxt = b.add(i, I64(1) if step is None else step)
        i.add_incoming(nxt, b.block)
        latch = b.branch(head)
        if tail_fold:
            latch.set_metadata("llvm.loop", self.km.loop_id("llvm.loop.vectorize.predicate.enable"))
        b.position_at_end(done)

    def blocked_range(self, start: ir.Value, stop: ir.Value, rb: int, block, single):
        """``block(i0)`` for i0 = start, start + rb, ... while a whole block fits, then ``single(i)`` for the
        rest."""
        b = self.b
        nblocks = b.sdiv(b.sub(stop, start), I64(rb))
        self.loop_range(I64(0), nblocks, lambda t: block(b.add(start, b.mul(t, I64(rb)))))
        self.loop_range(b.add(start, b.mul(nblocks, I64(rb))), stop, single)

    def loops(self, extents: Sequence, body, idx=(), tail_fold: bool = False):
        """Nested loops over ``extents``; ``tail_fold`` applies to the innermost (see loop_range)."""
        if not extents:
            body(list(idx))
            return
        self.loop_range(I64(0), self.index(extents[0]),
                        lambda i: self.loops(extents[1:], body, tuple(idx) + (i,), tail_fold),
                        tail_fold=tail_fold and len(extents) == 1)

    def index(self, d) -> ir.Value:
        """A dimension (int, or a SymExpr over the run-time symbols) as an i64 value."""
        if isinstance(d, SymExpr):
            return self.emit(dim_index(d))
        return I64(int(d))

    def symbol(self, name: str) -> ir.Value:
        """The run-time value of a shape symbol, loaded once in the entry block."""
        if name not in self.syms:
            if self.km.dims_index is None or name not in self.km.symbol_slots:
                raise CuvilError(f"x86 codegen: symbol {name} has no run-time slot")
            with self.b.goto_block(self.entry):
                self.b.position_at_start(self.entry)
                arr = self.b.load(self.b.gep(self.bufs, [I64(self.km.dims_index)], source_etype=PTR), typ=PTR)
                slot = self.b.gep(arr, [I64(self.km.symbol_slots[name])], source_etype=I64)
                self.syms[name] = self.b.load(slot, typ=I64)
        return self.syms[name]

    # --- memory -----------------------------------------------------------------------------------
    def base(self, buf: Buf) -> ir.Value:
        if buf.base not in self.bases:
            with self.b.goto_block(self.entry):
                self.b.position_at_start(self.entry)
                slot = self.b.gep(self.bufs, [I64(buf.base)], source_etype=PTR)
                self.bases[buf.base] = self.b.load(slot, typ=PTR)
        return self.bases[buf.base]

    def address(self, buf: Buf, idx: Sequence[ir.Value]) -> ir.Value:
        flat = None
        for i, st in zip(idx, buf.strides):
            term = i if st == 1 else self.b.mul(i, self.index(st))
            flat = term if flat is None else self.b.add(flat, term)
        flat = flat if flat is not None else I64(0)
        p = self.b.gep(self.base(buf), [I64(buf.offset)], source_etype=I8, inbounds=True)
        return self.b.gep(p, [flat], source_etype=mem_type(buf.dtype), inbounds=True)

    def store_element(self, st: Stage, idx: List[ir.Value]):
        for v, i in zip(st.vars, idx):
            self.env[v.attr] = i
        val = self.emit(st.expr)
        if st.buf.dtype == DType.BOOL:
            val = self.b.zext(val, I8)
        self.b.store(val, self.address(st.buf, idx))

    def store_row(self, st: Stage, red: E, outers: List[List[ir.Value]], width):
        """Row schedule for a reduction over one or several rows (``outers``: each row's outer indices):
        acc[r][w] accumulates over the reduction loops with w innermost (unit-stride, vectorisable, each
        element summed in order), then the epilogue stores the rows. Rows of a block share every load that
        does not depend on the row (a weight row read once for all of them)."""
        b = self.b
        kind, vs, extents = red.attr
        dt = red.dtype
        t = ll(dt)
        cap = self.km.at_max(width)
        acc = self.alloca(t, cap * len(outers))
        wvar = st.vars[-1].attr
        init = const_value(identity_value(kind, dt), dt)

        def slot(r, w):
            return b.gep(acc, [b.add(w, I64(r * cap))] if r else [w], source_etype=t, inbounds=True)

        def with_row(r, fn):
            """``fn()`` with row r's outer indices bound and its own memo (row-dependent values differ)."""
            for v, i in zip(st.vars, outers[r]):
                self.env[v.attr] = i
            self.memo.append(dict(self.memo[-1]))
            try:
                return fn()
            finally:
                self.memo.pop()

        width = self.index(width)
        self.loop_range(I64(0), width, lambda w: [b.store(init, slot(r, w)) for r in range(len(outers))])

        def accumulate(ridx):
            for v, i in zip(vs, ridx):
                self.env[v.attr] = i

            def inner(w):
                self.env[wvar] = w
                for r in range(len(outers)):
                    x = with_row(r, lambda: self.emit(red.args[0]))
                    a = b.load(slot(r, w), typ=t)
                    b.store(self.combine(kind, a, x, dt), slot(r, w))
            self.loop_range(I64(0), width, inner)
        self.loops(list(extents), accumulate)

        def epilogue(w):
            self.env[wvar] = w
            for r in range(len(outers)):
                def store():
                    self.memo[-1][red.uid] = b.load(slot(r, w), typ=t)
                    val = self.emit(st.expr)
                    if st.buf.dtype == DType.BOOL:
                        val = b.zext(val, I8)
                    b.store(val, self.address(st.buf, outers[r] + [w]))
                with_row(r, store)
        self.loop_range(I64(0), width, epilogue)

    def combine(self, kind: str, a, x, dt: DType):
        b = self.b
        if kind == "sum":
            return b.fadd(a, x) if dt.is_float else b.add(a, x)
        if kind == "prod":
            return b.fmul(a, x) if dt.is_float else b.mul(a, x)
        if kind == "fmax":  # NaN skipped: x wins when greater or when the accumulator is still NaN
            return b.select(b.or_(b.fcmp_ordered(">", x, a), b.fcmp_unordered("uno", a, a)), x, a)
        better = self.compare("gt" if kind == "max" else "lt", x, a, dt)
        if dt.is_float:  # NaN propagates
            better = b.or_(better, b.fcmp_unordered("uno", x, x))
        return b.select(better, x, a)

    # --- expressions ------------------------------------------------------------------------------
    def emit(self, e: E) -> ir.Value:
        memo = self.memo[-1]
        if e.uid in memo:
            return memo[e.uid]
        v = self._emit(e)
        memo[e.uid] = v
        return v

    def _emit(self, e: E) -> ir.Value:
        b, op, dt = self.b, e.op, e.dtype
        if op == "var":
            return self.env[e.attr]
        if op == "sym":
            return self.symbol(e.attr)
        if op == "const":
            return const_value(e.attr, dt)
        if op == "load":
            v = b.load(self.address(e.attr, [self.emit(a) for a in e.args]), typ=mem_type(dt))
            return b.trunc(v, I1) if dt == DType.BOOL else v
        if op == "wino_out" and len(e.args) == 6:    # [vars, direct, sum]: the direct value where sum is not finite
            v = self.emit(e.args[-1])
            d = b.fsub(v, v)                          # NaN exactly for inf and NaN (see x86/winograd.py)
            entry = b.block
            with b.if_then(b.fcmp_unordered("uno", d, d), likely=False):
                self.memo.append(dict(self.memo[-1]))   # values emitted in the branch stay in it
                alt = self.emit(e.args[-2])
                self.memo.pop()
                alt_block = b.block
            out = b.phi(v.type)
            out.add_incoming(v, entry)
            out.add_incoming(alt, alt_block)
            return out
        if op in ("contract", "window", "piecewise", "wino_in", "wino_out", "padwin"):   # nodes other schedules exploit: their plain value
            return self.emit(e.args[-1])
        args = [self.emit(a) for a in e.args] if op not in ("reduce", "argscan") else []
        if op in ("add", "sub", "mul"):
            if dt.is_float:
                return getattr(b, "f" + op)(*args)
            return getattr(b, op)(*args)
        if op == "div":
            return b.fdiv(*args) if dt.is_float else (b.udiv(*args) if dt in _UNSIGNED else b.sdiv(*args))
        if op in ("idiv", "imod"):
            return b.sdiv(*args) if op == "idiv" else b.srem(*args)
        if op in ("fdiv", "fmod_i"):     # floor division / modulo (shape arithmetic)
            q, r = b.sdiv(*args), b.srem(*args)
            fix = b.and_(b.icmp_signed("!=", r, I64(0)),
                         b.xor(b.icmp_signed("<", r, I64(0)), b.icmp_signed("<", args[1], I64(0))))
            if op == "fdiv":
                return b.select(fix, b.sub(q, I64(1)), q)
            return b.select(fix, b.add(r, args[1]), r)
        if op == "fmod":
            return b.frem(*args) if dt.is_float else (b.urem(*args) if dt in _UNSIGNED else b.srem(*args))
        if op == "pymod":
            r = b.srem(*args) if dt not in _UNSIGNED else b.urem(*args)
            if dt in _UNSIGNED:
                return r
            zero = ir.Constant(r.type, 0)
            fix = b.and_(b.icmp_signed("!=", r, zero), b.xor(b.icmp_signed("<", r, zero), b.icmp_signed("<", args[1], zero)))
            return b.select(fix, b.add(r, args[1]), r)
        if op == "neg":
            return b.fneg(args[0]) if dt.is_float else b.sub(ir.Constant(args[0].type, 0), args[0])
        if op == "cmp":
            return self.compare(e.attr, args[0], args[1], e.args[0].dtype)
        if op in ("and", "or", "xor"):
            out = args[0]
            for a in args[1:]:
                out = getattr(b, op + "_")(out, a) if op != "xor" else b.xor(out, a)
            return out
        if op == "not":
            return b.not_(args[0])
        if op in ("shl", "lshr", "ashr"):
            return getattr(b, op)(*args)
        if op == "select":
            return b.select(*args)
        if op == "cast":
            return self.convert(args[0], e.args[0].dtype, dt)
        if op == "call":
            return self.call(e.attr, args, dt)
        if op == "clamp":
            lo, hi = (self.index(v) for v in e.attr)
            x = args[0]
            x = b.select(b.icmp_signed("<", x, lo), lo, x)
            return b.select(b.icmp_signed(">", x, hi), hi, x)
        if op == "reflect":
            d = self.index(e.attr)
            x = args[0]
            x = b.select(b.icmp_signed("<", x, I64(0)), b.sub(I64(0), x), x)
            return b.select(b.icmp_signed(">=", x, d), b.sub(b.mul(b.sub(d, I64(1)), I64(2)), x), x)
        if op == "reduce":
            return self.reduce(e)
        if op == "argscan":
            return self.argscan(e)
        raise CuvilError(f"x86 codegen: no emitter for {op}")

    def compare(self, pred: str, a, c, dt: DType):
        b = self.b
        if dt.is_float:
            p = {"eq": "==", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}.get(pred)
            if pred == "uno":
                return b.fcmp_unordered("uno", a, c)
            if pred == "ne":
                return b.fcmp_unordered("!=", a, c)
            return b.fcmp_ordered(p, a, c)
        p = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}[pred]
        return b.icmp_unsigned(p, a, c) if dt in _UNSIGNED else b.icmp_signed(p, a, c)

    def convert(self, x, src: DType, dst: DType):
        b = self.b
        if src == dst:
            return x
        st, dt_ = ll(src), ll(dst)
        if dst == DType.BOOL:
            return b.fcmp_unordered("!=", x, ir.Constant(st, 0.0)) if src.is_float else b.icmp_unsigned("!=", x, ir.Constant(st, 0))
        if src.is_float and dst.is_float:
            return b.fpext(x, dt_) if _fbits(src) < _fbits(dst) else b.fptrunc(x, dt_)
        if src.is_float:
            return b.fptoui(x, dt_) if dst in _UNSIGNED else b.fptosi(x, dt_)
        if dst.is_float:
            return b.uitofp(x, dt_) if src in _UNSIGNED else b.sitofp(x, dt_)
        sb, db = st.width, dt_.width
        if sb == db:
            return x
        if sb > db:
            return b.trunc(x, dt_)
        return b.zext(x, dt_) if src in _UNSIGNED else b.sext(x, dt_)

    def call(self, name: str, args, dt: DType):
        b = self.b
        if not dt.is_float:
            raise CuvilError(f"x86 codegen: {name} of {dt.name}")
        if dt == DType.FLOAT16:
            wide = [b.fpext(a, F32) for a in args]
            return b.fptrunc(self.call(name, wide, DType.FLOAT), F16)
        t = ll(dt)
        if name in _INTRINSICS:
            f = self.km.declare(f"llvm.{name}.{'f32' if t == F32 else 'f64'}", t, [t] * len(args))
        elif name in _LIBM:
            f = self.km.declare(name + ("f" if t == F32 else ""), t, [t] * len(args))
        else:
            raise CuvilError(f"x86 codegen: unknown function {name}")
        return b.call(f, args)

    def reduce(self, e: E):
        kind, vs, extents = e.attr
        b, dt = self.b, e.dtype
        t = ll(dt)
        acc = self.alloca(t)
        b.store(const_value(identity_value(kind, dt), dt), acc)

        def body(idx):
            for v, i in zip(vs, idx):
                self.env[v.attr] = i
            x = self.emit(e.args[0])
            a = b.load(acc, typ=t)
            if kind == "sum":
                r = b.fadd(a, x) if dt.is_float else b.add(a, x)
                if dt.is_float:
                    r.flags.extend(["reassoc", "contract"])
            elif kind == "prod":
                r = b.fmul(a, x) if dt.is_float else b.mul(a, x)
            else:
                r = self.combine(kind, a, x, dt)
            b.store(r, acc)
        self.loops(list(extents), body)
        return b.load(acc, typ=t)

    def argscan(self, e: E):
        src, base, axis, n, better, last = e.attr
        b = self.b
        dt = src.dtype
        t = ll(dt)
        best_v, best_i = self.alloca(t), self.alloca(I64)
        idx0 = list(base)
        from ...kernels.texpr import const as tconst
        idx0[axis] = tconst(0, DType.INT64)
        b.store(self.emit(src(idx0)), best_v)
        b.store(I64(0), best_i)

        def body(i):
            idx = list(base)
            self.env["__arg"] = i
            from ...kernels.texpr import E as _E
            idx[axis] = _E("var", (), DType.INT64, "__arg")
            x = self.emit(src(idx))
            cur = b.load(best_v, typ=t)
            strict = self.compare(better, x, cur, dt)
            take = b.or_(strict, self.compare("eq", x, cur, dt)) if last else strict
            b.store(b.select(take, x, cur), best_v)
            b.store(b.select(take, i, b.load(best_i, typ=I64)), best_i)
        self.loop_range(I64(1), self.index(n), body)
        return b.load(best_i, typ=I64)


ROW_MAX = 16384   # widest row (elements) the row schedule accumulates on the stack
ROW_BLOCK = 4     # rows accumulated together when they fit in ROW_MAX


def _row_reduction(st: Stage, at_max=lambda d: d) -> Optional[E]:
    """The stage's single top-level reduction, when the row schedule applies: rank >= 2, one reduction
    (not nested in another), and its body reads the last output index (else the row is loop-invariant).
    The row is accumulated on the stack, sized for the last dim's maximum: rows wider than ROW_MAX take the
    loop nest (a 4M-wide row was a 16 MB alloca: past the thread's stack and its guard page, a segfault,
    though every buffer access was proved in bounds)."""
    if len(st.buf.shape) < 2 or (isinstance(st.buf.shape[-1], int) and st.buf.shape[-1] < 2):
        return None
    if st.region is not None and st.region[0] == len(st.buf.shape) - 1:
        return None
    if at_max(st.buf.shape[-1]) > ROW_MAX:
        return None
    found: List[E] = []
    seen = set()

    def walk(e: E, inside: bool):
        if e.uid in seen:
            return
        seen.add(e.uid)
        if e.op == "argscan":
            found.append(None)
            return
        if e.op == "reduce":
            found.append(None if inside else e)
            walk(e.args[0], True)
            return
        for a in e.args:
            walk(a, inside)
    walk(st.expr, False)
    if len(found) != 1 or found[0] is None:
        return None
    red = found[0]
    last = st.vars[-1].attr

    return red if any(x.op == "var" and x.attr == last for x in nodes(red.args[0])) else None


def _fbits(dt: DType) -> int:
    return {DType.FLOAT16: 16, DType.FLOAT: 32, DType.DOUBLE: 64}[dt]


def const_value(v, dt: DType) -> ir.Constant:
    t = ll(dt)
    if dt == DType.BOOL:
        return ir.Constant(I1, int(bool(v)))
    if dt.is_float:
        return ir.Constant(t, float(np.asarray(v, dt.numpy)))
    iv = int(v)
    bits = t.width
    iv &= (1 << bits) - 1
    if iv >= 1 << (bits - 1):
        iv -= 1 << bits
    return ir.Constant(t, iv)


_AVX512_CPUS = ("avx512", "skylake-avx512", "cascadelake", "cooperlake", "cannonlake", "icelake", "tigerlake",
                "rocketlake", "sapphirerapids", "graniterapids", "emeraldrapids", "znver4", "znver5", "x86-64-v4")
_AVX2_CPUS = ("haswell", "broadwell", "skylake", "alderlake", "raptorlake", "meteorlake", "arrowlake", "lunarlake",
              "znver1", "znver2", "znver3", "x86-64-v3", "bdver4")


def vector_bits(cpu: str, features: str) -> int:
    """Width of the target's vector registers: from the feature string, else from the CPU name."""
    feats = set(features.split(",")) if features else set()
    if feats:
        if "+avx512f" in feats:
            return 512
        if "+avx2" in feats and "+fma" in feats:
            return 256
        return 128
    if cpu.startswith(_AVX512_CPUS):
        return 512
    if cpu.startswith(_AVX2_CPUS):
        return 256
    return 128


def generate_object(sched: Schedule, prefix: str, cpu: Optional[str], opt: int) -> Tuple[bytes, List[Tuple[str, int, int]], dict]:
    """The kernels of ``sched`` as an object file, and the (symbol, extent, grain) of each stage."""
    tm, triple, cpu_name, features = host_target(cpu, opt)
    km = KernelModule(prefix, tm, triple)
    km.vector_bits = vector_bits(cpu_name, features)
    km.scratch_index = 2 + len(sched.inputs) + len(sched.outputs)
    km.dims_index = km.scratch_index + 1
    km.symbol_slots = {s.name: k for k, s in enumerate(sched.symbols)}
    km.ranges, km.opt = sched.ranges, sched.opt_point
    steps, step_stages = [], []
    k = 0
    while k < len(sched.stages):
        run = _slice_run(sched.stages, k)
        # a generic piece's unit is then the same block in every piece: the dims up to the region's axis
        # are its parallel range (channel planes of a channel concatenation), the rest its loop nest. With
        # rows as units instead (a piece's own choice below 64 channels), DenseNet-121's pieces ran 43% slower.
        static = all(isinstance(d, int) for i in run for d in km.loop_shape(sched.stages[i]))
        lead = sched.stages[k].region[0] + 1 if len(run) > 1 and static else None
        parts = []
        for i in run:
            sym = f"{prefix}_kernel{i}"
            extent, grain = km.add_stage(sched.stages[i], sym, lead=lead)
            parts.append((i, sym, extent, grain))
        for group in _groups(km, parts):
            if len(group) == 1:
                i, sym, extent, grain = group[0]
            else:
                i, sym = group[0][0], f"{prefix}_group{group[0][0]}"
                km.add_group(sym, [(psym, e) for _, psym, e, _ in group])
                extent, grain = sum(e for _, _, e, _ in group), group[0][3]
            steps.append((sym, extent, grain, km.split.get(sym, CHUNKS_PER_THREAD)))
            step_stages.append([g[0] for g in group])
        k = run[-1] + 1
    obj = km.compile(opt)
    return obj, steps, {"triple": triple, "cpu": cpu_name, "features": features, "scratch_bytes": km.scratch_bytes,
                        "gemm_symbols": km.gemm_symbols, "gemm_tiles": km.gemm_tiles, "window_kinds": km.window_kinds,
                        "step_stages": step_stages}


def _slice_run(stages, k: int) -> List[int]:
    """Stage k and the stages after it that write slices of the same buffer along the same axis (the
    pieces of a split concatenation, :func:`cuvil.kernels.schedule.split_piecewise`)."""
    st = stages[k]
    if st.region is None or st.region[0] == len(st.buf.shape) - 1:   # pieces of rows: their loops differ
        return [k]
    j = k + 1
    while j < len(stages) and stages[j].region is not None and stages[j].buf is st.buf \
            and stages[j].region[0] == st.region[0]:
        j += 1
    return list(range(k, j))


def _groups(km, parts) -> List[list]:
    """Consecutive generic loop-nest pieces with constant extents become one step (DenseNet-121's
    BatchNorm + Relu over each dense layer's concatenation: 594 steps -> 58); each other piece keeps
    its own."""
    out, cur = [], []
    for part in parts:
        _, sym, extent, _ = part
        if sym not in km.gemm_symbols and sym not in km.window_kinds and isinstance(extent, int):
            cur.append(part)
            continue
        out.extend([cur] if cur else [])
        out.append([part])
        cur = []
    out.extend([cur] if cur else [])
    return out
