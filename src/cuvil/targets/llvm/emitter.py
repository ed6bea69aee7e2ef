"""The emitter skeleton both backends share: a tensor expression (:class:`~cuvil.kernels.texpr.E`) becomes
LLVM IR inside one kernel function: loops, indices and addresses, arithmetic, comparisons, conversions and
reductions. A target fills in its hooks: :meth:`LLVMEmitter.call` (math functions: intrinsics, libm,
libdevice) and, where its memory differs, :meth:`LLVMEmitter.base` (a buffer's base pointer)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Dict, List, Sequence

import llvmlite.ir as ir

from ...errors import CuvilError
from ...ir.dim import SymExpr
from ...ir.dtype import DType
from ...kernels.schedule import Stage
from ...kernels.texpr import E, Buf, const, dim_index, identity_value
from .module import LLVMKernelModule
from .narrow import (MINIFLOAT_FORMATS, bfloat16_from_memory, bfloat16_round, bfloat16_to_memory, decode_e8m0,
                     decode_minifloat, encode_e8m0, encode_minifloat, load_narrow_int, store_narrow_int,
                     wrap_narrow_int)
from .types import I1, I8, I64, PTR, UNSIGNED, const_value, float_bits, ll, mem_type


class LLVMEmitter(ABC):
    """Emits into function ``fn`` of kernel module ``km`` through builder ``b``; ``bufs`` is the kernel's
    buffer table. Values are memoised per expression node (``memo``: one scope per loop body or branch);
    ``env`` binds index variables to values."""

    target = "LLVM"    # the backend's name in error messages

    def __init__(self, km: LLVMKernelModule, fn: ir.Function, b: ir.IRBuilder, bufs):
        self.km, self.fn, self.b, self.bufs = km, fn, b, bufs
        self.entry = b.block
        self.bases: Dict[int, ir.Value] = {}
        self.syms: Dict[str, ir.Value] = {}
        self.env: Dict[str, ir.Value] = {}
        self.memo: List[Dict[int, ir.Value]] = [{}]
        self.mutable: List[Buf] = []    # buffers a sequential node writes (never read as invariant)

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
                raise CuvilError(f"{self.target} codegen: symbol {name} has no run-time slot")
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

    def loaded(self, instr, buf: Buf) -> None:
        """Hook: ``instr`` loads an element of ``buf`` (a target may attach alias metadata)."""

    def store_element(self, st: Stage, idx: List[ir.Value]):
        """Store the stage's value at output index ``idx`` (its variables bound to it)."""
        for v, i in zip(st.vars, idx):
            self.env[v.attr] = i
        self.b.store(self.to_memory(self.emit(st.expr), st.buf.dtype), self.address(st.buf, idx))

    def to_memory(self, val: ir.Value, dt: DType) -> ir.Value:
        """A computed value of ``dt`` in its memory form (bool: a byte; the narrow types: narrow.py)."""
        if dt == DType.BOOL:
            return self.b.zext(val, I8)
        if dt == DType.BFLOAT16:
            return bfloat16_to_memory(self.b, val)
        if dt.narrow_bits:
            return store_narrow_int(self.b, val, dt)
        return val

    def from_memory(self, val: ir.Value, dt: DType) -> ir.Value:
        """A loaded value of ``dt`` in the form it is computed in (the inverse of :meth:`to_memory`)."""
        if dt == DType.BOOL:
            return self.b.trunc(val, I1)
        if dt == DType.BFLOAT16:
            return bfloat16_from_memory(self.b, val)
        if dt.narrow_bits:
            return load_narrow_int(self.b, val, dt)
        return val

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
    def int_divide(self, instr, a, d, signed: bool = True):
        """``instr(a, d)`` (an LLVM integer division or remainder) that cannot trap: LLVM's sdiv/srem on a zero
        divisor, or INT_MIN / -1, is undefined and faults (SIGFPE) on x86, and a model's integer Div/Mod runs on
        the caller's data. A zero divisor gives 0, as numpy does; INT_MIN / -1 wraps to INT_MIN (remainder 0).
        A constant divisor other than 0 and -1 needs no guard."""
        b = self.b
        if isinstance(d, ir.Constant) and d.constant not in (0, -1, None):
            return instr(a, d)
        zero, one = ir.Constant(d.type, 0), ir.Constant(d.type, 1)
        is_zero = b.icmp_signed("==", d, zero)
        unsafe = is_zero
        if signed:
            int_min = ir.Constant(a.type, -(1 << (a.type.width - 1)))
            overflow = b.and_(b.icmp_signed("==", a, int_min), b.icmp_signed("==", d, ir.Constant(d.type, -1)))
            unsafe = b.or_(is_zero, overflow)
        result = instr(a, b.select(unsafe, one, d))
        return b.select(is_zero, ir.Constant(result.type, 0), result)

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
            ld = b.load(self.address(e.attr, [self.emit(a) for a in e.args]), typ=mem_type(dt))
            self.loaded(ld, e.attr)
            return self.from_memory(ld, dt)
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
        if op in ("contract", "window", "piecewise", "wino_in", "wino_out", "padwin", "attention",
                  "attention_keys", "qgemm", "qplanes", "pplanes", "nhwc_rows"):   # nodes other schedules exploit: their plain value
            return self.emit(e.args[-1])
        args = [self.emit(a) for a in e.args] if op not in ("reduce", "argscan", "sequential") else []
        if op in ("add", "sub", "mul"):
            if dt.is_float:
                return getattr(b, "f" + op)(*args)
            return getattr(b, op)(*args)
        if op == "div":
            if dt.is_float:
                return b.fdiv(*args)
            return self.int_divide(b.udiv if dt in UNSIGNED else b.sdiv, *args, signed=dt not in UNSIGNED)
        if op in ("idiv", "imod"):
            return self.int_divide(b.sdiv if op == "idiv" else b.srem, *args)
        if op in ("fdiv", "fmod_i"):     # floor division / modulo (shape arithmetic)
            q, r = self.int_divide(b.sdiv, *args), self.int_divide(b.srem, *args)
            fix = b.and_(b.icmp_signed("!=", r, I64(0)),
                         b.xor(b.icmp_signed("<", r, I64(0)), b.icmp_signed("<", args[1], I64(0))))
            if op == "fdiv":
                return b.select(fix, b.sub(q, I64(1)), q)
            return b.select(fix, b.add(r, args[1]), r)
        if op == "fmod":
            if dt.is_float:
                return b.frem(*args)
            return self.int_divide(b.urem if dt in UNSIGNED else b.srem, *args, signed=dt not in UNSIGNED)
        if op == "pymod":
            r = self.int_divide(b.srem if dt not in UNSIGNED else b.urem, *args, signed=dt not in UNSIGNED)
            if dt in UNSIGNED:
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
            saturate, round_mode = e.attr or (True, "up")
            return self.convert(args[0], e.args[0].dtype, dt, saturate, round_mode)
        if op == "bitcast":   # through the memory form: the bits as stored (bfloat16's 16, bool's byte)
            return self.from_memory(b.bitcast(self.to_memory(args[0], e.args[0].dtype), mem_type(dt)), dt)
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
        if op == "sequential":
            return self.sequential(e)
        raise CuvilError(f"{self.target} codegen: no emitter for {op}")

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
        return b.icmp_unsigned(p, a, c) if dt in UNSIGNED else b.icmp_signed(p, a, c)

    def convert(self, x, src: DType, dst: DType, saturate: bool = True, round_mode: str = "up"):
        """``x`` of ``src`` as ``dst`` (float to integer: truncated; ``saturate``: float8 overflow gives the
        largest finite value, not inf/NaN; ``round_mode``: float8e8m0's rounding)."""
        b = self.b
        if src == dst:
            return x
        if src == DType.FLOAT8E8M0:
            return self.convert(decode_e8m0(b, x), DType.FLOAT, dst)
        if dst == DType.FLOAT8E8M0:
            return encode_e8m0(b, self.convert(x, src, DType.FLOAT), saturate, round_mode)
        # The narrow types convert through float32 (bfloat16: through float32 rounded to bfloat16).
        if src in MINIFLOAT_FORMATS:
            return self.convert(decode_minifloat(b, x, MINIFLOAT_FORMATS[src]), DType.FLOAT, dst)
        if dst in MINIFLOAT_FORMATS:
            wide = self.convert(x, src, DType.FLOAT)
            return encode_minifloat(b, wide, MINIFLOAT_FORMATS[dst], saturate,
                                    lambda v: self.call("roundeven", [v], DType.FLOAT))
        if src == DType.BFLOAT16:
            return self.convert(bfloat16_round(b, x), DType.FLOAT, dst)
        if dst == DType.BFLOAT16:
            return bfloat16_round(b, self.convert(x, src, DType.FLOAT))
        if dst.narrow_bits:
            if src.is_float:   # as ml_dtypes' astype (onnx's reference): truncated, 0 outside the range
                lo, hi = dst.int_range
                ok = b.and_(b.fcmp_ordered(">", x, ir.Constant(x.type, lo - 1.0)), b.fcmp_ordered("<", x, ir.Constant(x.type, hi + 1.0)))
                return b.select(ok, b.fptosi(x, I8), I8(0))
            return wrap_narrow_int(b, x if src.narrow_bits else self.convert(x, src, DType.INT8), dst)  # wraps
        st, dt_ = ll(src), ll(dst)
        if dst == DType.BOOL:
            return b.fcmp_unordered("!=", x, ir.Constant(st, 0.0)) if src.is_float else b.icmp_unsigned("!=", x, ir.Constant(st, 0))
        if src.is_float and dst.is_float:
            return b.fpext(x, dt_) if float_bits(src) < float_bits(dst) else b.fptrunc(x, dt_)
        if src.is_float:
            return b.fptoui(x, dt_) if dst in UNSIGNED else b.fptosi(x, dt_)
        if dst.is_float:
            return b.uitofp(x, dt_) if src in UNSIGNED else b.sitofp(x, dt_)
        sb, db = st.width, dt_.width
        if sb == db:
            return x
        if sb > db:
            return b.trunc(x, dt_)
        return b.zext(x, dt_) if src in UNSIGNED else b.sext(x, dt_)

    @abstractmethod
    def call(self, name: str, args, dt: DType):
        """The math function ``name`` (sqrt, exp, tanh, ...) of ``args``, all of ``dt``: the target's hook."""

    def reduce(self, e: E):
        kind, vs, extents = e.attr
        b, dt = self.b, e.dtype
        # float16 sums and products accumulate in float32 and round once (as numpy's and onnxruntime's do):
        # a float16 accumulator loses an ulp every few terms
        wide = dt == DType.FLOAT16 and kind in ("sum", "prod")
        acc_dt = DType.FLOAT if wide else dt
        t = ll(acc_dt)
        acc = self.alloca(t)
        b.store(const_value(identity_value(kind, acc_dt), acc_dt), acc)

        def body(idx):
            for v, i in zip(vs, idx):
                self.env[v.attr] = i
            x = self.wide_term(e.args[0]) if wide else self.emit(e.args[0])
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
        out = b.load(acc, typ=t)
        return b.fptrunc(out, ll(dt)) if wide else out

    def wide_term(self, body: E) -> ir.Value:
        """A float16 reduction's term in float32: a product of two float16 values is exact in float32, so it
        is formed there (as numpy's and onnxruntime's float16 MatMul do) instead of rounded to float16 first."""
        b = self.b
        if body.op == "mul" and all(a.dtype == DType.FLOAT16 for a in body.args):
            return b.fmul(*(b.fpext(self.emit(a), ll(DType.FLOAT)) for a in body.args))
        return b.fpext(self.emit(body), ll(DType.FLOAT))

    def argscan(self, e: E):
        src, base, axis, n, better, last = e.attr
        b = self.b
        dt = src.dtype
        t = ll(dt)
        best_v, best_i = self.alloca(t), self.alloca(I64)
        idx0 = list(base)
        idx0[axis] = const(0, DType.INT64)
        b.store(self.emit(src(idx0)), best_v)
        b.store(I64(0), best_i)

        def body(i):
            idx = list(base)
            self.env["__arg"] = i
            idx[axis] = E("var", (), DType.INT64, "__arg")
            x = self.emit(src(idx))
            cur = b.load(best_v, typ=t)
            strict = self.compare(better, x, cur, dt)
            take = b.or_(strict, self.compare("eq", x, cur, dt)) if last else strict
            b.store(b.select(take, x, cur), best_v)
            b.store(b.select(take, i, b.load(best_i, typ=I64)), best_i)
        self.loop_range(I64(1), self.index(n), body)
        return b.load(best_i, typ=I64)

    def sequential(self, e: E):
        """Run a :func:`~cuvil.kernels.sequential.sequential` node's program for the row at its arguments:
        the init assignments, then the body's for each step. Every assignment is a loop nest of its own,
        with its own memo scope: a value loaded from a buffer an earlier assignment stored is loaded again."""
        prog = e.attr
        for v, a in zip(prog.row_vars, e.args):
            self.env[v.attr] = self.emit(a)
        self.mutable.extend(prog.written())
        for a in prog.init:
            self.assign(a)

        def step(s):
            self.env[prog.step.attr] = s
            for a in prog.body:
                self.assign(a)
        self.loop_range(I64(0), self.index(prog.steps), step)
        return const_value(0, e.dtype)

    def assign(self, a):
        """``a.buf[a.index] = a.value`` over ``a``'s loop nest."""
        self.memo.append(dict(self.memo[-1]))

        def body(idx):
            for v, i in zip(a.loop_vars, idx):
                self.env[v.attr] = i
            val = self.emit(a.value)
            if a.buf.dtype == DType.BOOL:
                val = self.b.zext(val, I8)
            self.b.store(val, self.address(a.buf, [self.emit(i) for i in a.index]))
        self.loops(list(a.extents), body)
        self.memo.pop()
