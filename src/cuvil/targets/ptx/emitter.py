"""The PTX expression emitter: the shared LLVM emitter with global-memory addressing (address space 1),
read-only loads (``!invariant.load``: ``ld.global.nc``), ``llvm.fma`` for the kernel rules' fused
multiply-adds, and GPU math (NVPTX intrinsics, libdevice)."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import llvmlite.ir as ir

from ...errors import CuvilError, UnsupportedOpError
from ...ir.dtype import DType
from ...kernels.texpr import E, Buf
from ..llvm.emitter import LLVMEmitter
from ..llvm.types import F16, F32, I1, I64, PTR, const_value, ll, mem_type

if TYPE_CHECKING:
    from ...kernels.schedule import Stage

GLOBAL = 1                # NVPTX address space of global memory
GPTR = ir.PointerType(addrspace=GLOBAL)
SHARED = 3                # NVPTX address space of a block's shared memory

# calls lowered to PTX instructions by the NVPTX backend
_NATIVE = {"sqrt": "sqrt", "fabs": "fabs", "floor": "floor", "ceil": "ceil", "roundeven": "roundeven",
           "trunc": "trunc", "fma": "fma", "copysign": "copysign", "fmin": "minnum", "fmax": "maxnum",
           "minnum": "minnum", "maxnum": "maxnum", "minimum": "minimum", "maximum": "maximum"}
# calls to libdevice (__nv_<name>f for float, __nv_<name> for double)
_LIBDEVICE = {"exp", "exp2", "exp10", "expm1", "log", "log2", "log10", "log1p", "sin", "cos", "tan", "asin",
              "acos", "atan", "atan2", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "pow",
              "fmod", "cbrt", "rsqrt", "hypot", "remainder", "lgamma", "tgamma"}
_FP_ARITH = {"fadd", "fsub", "fmul"}


def overlaps(a: Buf, b: Buf) -> bool:
    """Whether two buffers share bytes of the same storage."""
    ra, rb = a.storage, b.storage
    if ra.base != rb.base:
        return False
    return ra.offset < rb.offset + max(rb.nbytes, 1) and rb.offset < ra.offset + max(ra.nbytes, 1)


def shared_global(km, name: str, elem: ir.Type, count: Optional[int] = None,
                  align: Optional[int] = 16) -> ir.GlobalVariable:
    """Declare the block's shared-memory array ``name`` of ``count`` ``elem`` (``count`` None: one ``elem``, not
    an array) in ``km``'s module: internal, uninitialized (undef), aligned to ``align`` bytes (None: the type's
    own alignment). Every PTX kernel declares its shared memory here."""
    g = ir.GlobalVariable(km.module, elem if count is None else ir.ArrayType(elem, count), name, addrspace=SHARED)
    g.linkage = "internal"
    g.initializer = ir.Constant(g.value_type, ir.Undefined)
    if align is not None:
        g.align = align
    return g


class PtxEmitter(LLVMEmitter):
    """The LLVM emitter with global-memory addressing, read-only loads and GPU math; ``out`` is the buffer
    the kernel writes (every other buffer is read-only while it runs)."""

    target = "PTX"

    def __init__(self, km, fn: ir.Function, b: ir.IRBuilder, bufs, out: Buf):
        super().__init__(km, fn, b, bufs)
        self.out = out
        # (thread index, threads) of the block that shares a sequential node's assignments; None: the thread
        # runs them alone
        self.lanes = None

    def last_arrival(self, base_buf: Buf, counters: int, slot: ir.Value, arrivals: int, flag, first_thread):
        """The split-K pattern of "the last block to finish combines": after the block's partial stores, fence
        them to L2, count this block at int32 ``slot`` of the counters at byte ``counters`` of ``base_buf``'s
        buffer (thread ``first_thread``, an atomic add), and share whether it was the ``arrivals``-th through the
        shared word ``flag``. Returns (i1: this block is the last, the counter's pointer). The last block must
        fence again before it reads the others' partials (through L2: ``ld.global.cg``) and reset the counter."""
        b, km = self.b, self.km
        bar = km.declare("llvm.nvvm.barrier0", ir.VoidType(), [])
        fence = km.declare("llvm.nvvm.membar.gl", ir.VoidType(), [])
        b.call(fence, [])
        b.call(bar, [])
        cptr = b.gep(b.gep(self.base(base_buf), [I64(counters)], source_etype=ir.IntType(8), inbounds=True),
                     [slot], source_etype=ir.IntType(32), inbounds=True)
        with b.if_then(first_thread):
            old = b.atomic_rmw("add", cptr, ir.Constant(ir.IntType(32), 1), "monotonic")
            b.store(b.zext(b.icmp_unsigned("==", old, ir.Constant(ir.IntType(32), arrivals - 1)), ir.IntType(32)),
                    flag)
        b.call(bar, [])
        last = b.load(flag, typ=ir.IntType(32))
        b.call(bar, [])          # every thread has read the flag before thread 0 may write the next one
        return b.icmp_unsigned("!=", last, ir.Constant(ir.IntType(32), 0)), cptr

    def store_elements(self, st: "Stage", idxs: List[List[ir.Value]]) -> None:
        """The stage's value at each output index of ``idxs``: every value computed (its loads issued) before
        the first store, each in its own memo scope (its variables are bound anew)."""
        vals = []
        for idx in idxs:
            self.memo.append({})
            for v, i in zip(st.vars, idx):
                self.env[v.attr] = i
            vals.append(self.to_memory(self.emit(st.expr), st.buf.dtype))
            self.memo.pop()
        for idx, val in zip(idxs, vals):
            self.b.store(val, self.address(st.buf, idx))

    def shared_array(self, name: str, elem: ir.Type, count: int, align: int = 16) -> ir.Value:
        """Declare the shared array ``name`` (:func:`shared_global`) and return a pointer to its first ``elem``,
        formed at the start of the entry block (:meth:`shared_pointer`)."""
        return self.shared_pointer(shared_global(self.km, name, elem, count, align), elem)

    def shared_pointer(self, g: ir.GlobalVariable, elem: ir.Type) -> ir.Value:
        """A pointer to ``elem`` at the start of the shared array ``g``, formed at the start of the entry block
        (so it dominates every use, wherever the kernel asks for it first)."""
        with self.b.goto_block(self.entry):
            self.b.position_at_start(self.entry)
            return self.b.bitcast(g, ir.PointerType(elem, addrspace=SHARED))

    def base(self, buf: Buf) -> ir.Value:
        if buf.base not in self.bases:
            with self.b.goto_block(self.entry):
                self.b.position_at_start(self.entry)
                slot = self.b.gep(self.bufs, [I64(buf.base)], source_etype=PTR, inbounds=True)
                p = self.b.load(slot, typ=PTR)
                p.set_metadata("invariant.load", self.km.empty_md)
                self.bases[buf.base] = self.b.addrspacecast(p, GPTR)
        return self.bases[buf.base]

    def _emit(self, e: E) -> ir.Value:
        op, dt = e.op, e.dtype
        if op == "load":
            buf = e.attr
            v = self.b.load(self.address(buf, [self.emit(a) for a in e.args]), typ=mem_type(dt))
            if not overlaps(buf, self.out) and not any(overlaps(buf, w) for w in self.mutable):
                v.set_metadata("invariant.load", self.km.empty_md)
            return self.from_memory(v, dt)
        if op == "fmod" and dt.is_float:
            return self.call("fmod", [self.emit(a) for a in e.args], dt)
        if op == "fma":
            return self.b.call(self.fma_fn(dt), [self.emit(a) for a in e.args])
        if op == "gload":
            raise UnsupportedOpError("gload", detail="guarded loads have no PTX lowering")
        try:
            return super()._emit(e)
        except UnsupportedOpError:
            raise
        except CuvilError as err:
            if "no emitter" in str(err):
                raise UnsupportedOpError(op, detail="no PTX lowering") from None
            raise

    def assign(self, a):
        """With :attr:`lanes`: the assignment's loop nest flattened and shared by the block's threads
        (thread t takes elements t, t + threads, ...), then a block barrier, so the next assignment reads
        what every thread stored."""
        if self.lanes is None:
            return super().assign(a)
        b = self.b
        tid, threads = self.lanes
        exts = [self.index(x) for x in a.extents]
        total = I64(1)
        for x in exts:
            total = b.mul(total, x)
        self.memo.append(dict(self.memo[-1]))

        def element(f):
            idx = [None] * len(exts)
            for k in reversed(range(len(exts))):
                if k == 0:
                    idx[k] = f
                else:
                    idx[k] = b.urem(f, exts[k])
                    f = b.udiv(f, exts[k])
            for v, i in zip(a.loop_vars, idx):
                self.env[v.attr] = i
            val = self.emit(a.value)
            if a.buf.dtype == DType.BOOL:
                val = b.zext(val, ll(DType.INT8))
            b.store(val, self.address(a.buf, [self.emit(i) for i in a.index]))
        self.loop_range(tid, total, element, threads)
        self.memo.pop()
        b.call(self.km.declare("llvm.nvvm.barrier0", ir.VoidType(), []), [])

    def fma_fn(self, dt: DType) -> ir.Function:
        if dt not in (DType.FLOAT16, DType.FLOAT, DType.DOUBLE):
            raise UnsupportedOpError("fma", detail=f"fma of {dt.name} has no PTX lowering")
        t = ll(dt)
        return self.km.declare(f"llvm.fma.{ {DType.FLOAT16: 'f16', DType.FLOAT: 'f32', DType.DOUBLE: 'f64'}[dt]}", t, [t] * 3)

    def reduce(self, e: E):
        """``reduce[fma](a, b)``: acc = fma(a, b, acc) over the reduction's variables, from +0.0 (the sum's
        start), in order. Other reductions: the shared emitter's loop."""
        kind, vs, extents = e.attr
        if kind != "fma":
            return super().reduce(e)
        b, dt = self.b, e.dtype
        t = ll(dt)
        f = self.fma_fn(dt)
        acc = self.alloca(t)
        b.store(const_value(0.0, dt), acc)

        def body(idx):
            for v, i in zip(vs, idx):
                self.env[v.attr] = i
            x, y = self.emit(e.args[0]), self.emit(e.args[1])
            b.store(b.call(f, [x, y, b.load(acc, typ=t)]), acc)
        self.loops(list(extents), body)
        return b.load(acc, typ=t)

    def call(self, name: str, args, dt: DType):
        b = self.b
        if not dt.is_float:
            raise UnsupportedOpError(name, detail=f"{name} of {dt.name} has no PTX lowering")
        if dt == DType.FLOAT16:
            wide = [b.fpext(a, F32) for a in args]
            return b.fptrunc(self.call(name, wide, DType.FLOAT), F16)
        if dt not in (DType.FLOAT, DType.DOUBLE):
            raise UnsupportedOpError(name, detail=f"{name} of {dt.name} has no PTX lowering")
        t = ll(dt)
        if name in _NATIVE:
            f = self.km.declare(f"llvm.{_NATIVE[name]}.{'f32' if t == F32 else 'f64'}", t, [t] * len(args))
        elif name in _LIBDEVICE:
            f = self.km.declare(f"__nv_{name}{'f' if t == F32 else ''}", t, [t] * len(args))
            self.km.needs_libdevice = True
        else:
            raise UnsupportedOpError(name, detail="no PTX (NVPTX intrinsic or libdevice) lowering")
        return b.call(f, args)


def set_contraction(fn: ir.Function, on: bool):
    """Mark every float add/sub/mul ``contract`` (fma allowed) or strip ``contract`` everywhere."""
    for blk in fn.blocks:
        for ins in blk.instructions:
            flags = getattr(ins, "flags", None)
            if flags is None or not isinstance(flags, list):
                continue
            if on and ins.opname in _FP_ARITH:
                if "contract" not in flags and "fast" not in flags:
                    flags.append("contract")
            elif not on:
                if "fast" in flags:   # fast implies contract: spell out the rest
                    flags.remove("fast")
                    flags.extend(x for x in ("nnan", "ninf", "nsz", "arcp", "afn", "reassoc") if x not in flags)
                while "contract" in flags:
                    flags.remove("contract")

