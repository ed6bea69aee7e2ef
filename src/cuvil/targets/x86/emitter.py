"""The x86 expression emitter: the shared LLVM emitter with host math (float32 exp, erf, tanh and log as
vectorisable polynomials, :mod:`cuvil.targets.llvm.vecmath`; LLVM intrinsics and libm otherwise) and the row
schedule (a reduction accumulated for a whole output row at once, :meth:`X86Emitter.store_row`)."""
from __future__ import annotations

from typing import List, Optional

import llvmlite.ir as ir

from ...errors import CuvilError
from ...ir.dtype import DType
from ...kernels.schedule import ARENA, WEIGHTS, Stage
from ...kernels.texpr import E, Buf, identity_value, nodes, top_level
from ..llvm.emitter import LLVMEmitter
from ..llvm.types import F16, F32, I8, I64, const_value, ll
from ..llvm.vecmath import VECTOR_FUNCTIONS, VectorMath

_INTRINSICS = {"sqrt", "exp", "log", "sin", "cos", "pow", "floor", "ceil", "roundeven", "fabs"}
_LIBM = {"tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "erf", "tanh"}


class X86Emitter(LLVMEmitter):
    """The LLVM emitter for host kernels."""

    target = "x86"

    # Alias scopes. Arena buffers live at offsets of one base pointer, so LLVM cannot tell a stage's store
    # from its loads of other arena buffers: a loop-invariant load (a LayerNorm row's mean and variance) then
    # stays inside the loop and the loop vectoriser gives up. The memory plan never overlaps buffers that are
    # alive at once (cuvil.kernels.schedule._plan_arena), and a stage's reads are alive while it stores, so
    # a store to an arena buffer does not alias the loads of any other root buffer the stage reads (arena
    # or weights): each such load carries its buffer's scope, the store those scopes as ``!noalias``. The one
    # exception: an output the plan wrote over the residual its stage reads last (schedule._residual_in_place,
    # the same offset): that residual's scope is left off the store's list.
    # BERT-base's LayerNorms writing the arena (1 x 128 x 768): 0.20 -> 0.01 ms each (2-core Zen 5).
    def scope(self, buf: Buf):
        """The alias scope of ``buf``'s root (arena and weight buffers only), made once per module."""
        root = buf.storage
        if root.base not in (ARENA, WEIGHTS):
            return None
        km = self.km
        if not hasattr(km, "alias_scopes"):
            km.alias_scopes = {}
            km.alias_domain = km.module.add_metadata([ir.MetaDataString(km.module, "cuvil.arena")])
        if id(root) not in km.alias_scopes:
            name = f"cuvil.buf{len(km.alias_scopes)}.{root.name}"
            km.alias_scopes[id(root)] = (root, km.module.add_metadata([ir.MetaDataString(km.module, name),
                                                                       km.alias_domain]))
        return km.alias_scopes[id(root)][1]

    def loaded(self, instr, buf: Buf) -> None:
        sc = self.scope(buf)
        if sc is not None:
            instr.set_metadata("alias.scope", self.km.module.add_metadata([sc]))

    def store_element(self, st: Stage, idx: List[ir.Value]):
        for v, i in zip(st.vars, idx):
            self.env[v.attr] = i
        value = self.to_memory(self.emit(st.expr), st.buf.dtype)
        instr = self.b.store(value, self.address(st.buf, idx))
        if st.buf.base == ARENA and not self.mutable:
            out = st.buf.storage
            others = {id(r.storage): r for r in st.reads if r.storage is not out
                      and not (r.storage.base == ARENA and r.storage.offset == out.offset)}
            scopes = [sc for sc in (self.scope(r) for r in others.values()) if sc is not None]
            if scopes:
                instr.set_metadata("noalias", self.km.module.add_metadata(scopes))

    def store_row(self, st: Stage, red: E, outers: List[List[ir.Value]], width):
        """Row schedule for a reduction over one or several rows (``outers``: each row's outer indices):
        acc[r][w] accumulates over the reduction loops with w innermost (unit-stride, vectorisable, each
        element summed in order), then the epilogue stores the rows. Rows of a block share every load that
        does not depend on the row (a weight row read once for all of them)."""
        b = self.b
        kind, vs, extents = red.attr
        dt = red.dtype
        wide = dt == DType.FLOAT16 and kind in ("sum", "prod")   # float32 accumulators, as LLVMEmitter.reduce
        acc_dt = DType.FLOAT if wide else dt
        t = ll(acc_dt)
        cap = self.km.at_max(width)
        acc = self.alloca(t, cap * len(outers))
        wvar = st.vars[-1].attr
        init = const_value(identity_value(kind, acc_dt), acc_dt)

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
                    x = with_row(r, lambda: self.wide_term(red.args[0]) if wide else self.emit(red.args[0]))
                    a = b.load(slot(r, w), typ=t)
                    b.store(self.combine(kind, a, x, dt), slot(r, w))
            self.loop_range(I64(0), width, inner)
        self.loops(list(extents), accumulate)

        def epilogue(w):
            self.env[wvar] = w
            for r in range(len(outers)):
                def store():
                    total = b.load(slot(r, w), typ=t)
                    self.memo[-1][red.uid] = b.fptrunc(total, ll(dt)) if wide else total
                    b.store(self.to_memory(self.emit(st.expr), st.buf.dtype), self.address(st.buf, outers[r] + [w]))
                with_row(r, store)
        self.loop_range(I64(0), width, epilogue)


    def assign(self, a):
        """A sequential program's assignment. Loads that do not move with its loops (a row's scalars, read at
        the row's and step's indices only) from buffers other than the one it stores are read once before
        its loop nest: inside it, LLVM must assume the store may alias them (one arena), reloads them every
        iteration and does not vectorise (attention's ``acc[d] += p[j] * V[j, d]``). Only where every extent
        is a positive constant, so the hoisted loads run only where the loop would have run them."""
        self.memo.append(dict(self.memo[-1]))
        try:
            for x in _invariant_loads(a):
                self.emit(x)
            self._assign(a)
        finally:
            self.memo.pop()

    def _assign(self, a):
        """One whose value is a reduction reading the innermost loop variable (a step's recurrent product,
        ``sum_k h[k] * R^T[k, j]``) takes the row schedule: the row of accumulators over that variable
        (unit-stride, vectorised) summed over the reduction loops, then the value computed and stored for each
        element of the row."""
        red = _row_assign_reduction(a, self.km.at_max)
        if red is None:
            return super().assign(a)
        b = self.b
        kind, vs, extents = red.attr
        dt = red.dtype
        t = ll(dt)
        width = a.extents[-1]
        acc = self.alloca(t, self.km.at_max(width))
        init = const_value(identity_value(kind, dt), dt)
        wvar = a.loop_vars[-1].attr
        n = self.index(width)
        self.memo.append(dict(self.memo[-1]))

        def row(outer):
            for v, i in zip(a.loop_vars, outer):
                self.env[v.attr] = i
            self.loop_range(I64(0), n, lambda w: b.store(init, b.gep(acc, [w], source_etype=t, inbounds=True)))

            def terms(ridx):
                for v, i in zip(vs, ridx):
                    self.env[v.attr] = i

                def inner(w):
                    self.env[wvar] = w
                    x = self.emit(red.args[0])
                    slot = b.gep(acc, [w], source_etype=t, inbounds=True)
                    b.store(self.combine(kind, b.load(slot, typ=t), x, dt), slot)
                self.loop_range(I64(0), n, inner)
            self.loops(list(extents), terms)

            def store(w):
                self.env[wvar] = w
                self.memo[-1][red.uid] = b.load(b.gep(acc, [w], source_etype=t, inbounds=True), typ=t)
                val = self.emit(a.value)
                if a.buf.dtype == DType.BOOL:
                    val = b.zext(val, I8)
                b.store(val, self.address(a.buf, [self.emit(i) for i in a.index]))
            self.loop_range(I64(0), n, store)
        self.loops(list(a.extents[:-1]), row)
        self.memo.pop()

    def call(self, name: str, args, dt: DType):
        """Float32 exp, erf, tanh and log inline as polynomials (:mod:`~cuvil.targets.llvm.vecmath`) unless the
        module asks for libm (``km.math == "libm"``); LLVM intrinsics where LLVM lowers them inline, libm
        otherwise; float16 computes in float32."""
        b = self.b
        if not dt.is_float:
            raise CuvilError(f"{self.target} codegen: {name} of {dt.name}")
        if dt == DType.FLOAT16:
            wide = [b.fpext(a, F32) for a in args]
            return b.fptrunc(self.call(name, wide, DType.FLOAT), F16)
        t = ll(dt)
        if t == F32 and name in VECTOR_FUNCTIONS and self.km.math == "vector":
            return getattr(VectorMath(b, self.km.declare, scalef=self.km.scalef), name)(*args)
        if name in _INTRINSICS:
            f = self.km.declare(f"llvm.{name}.{'f32' if t == F32 else 'f64'}", t, [t] * len(args))
        elif name in _LIBM:
            f = self.km.declare(name + ("f" if t == F32 else ""), t, [t] * len(args))
        else:
            raise CuvilError(f"{self.target} codegen: unknown function {name}")
        return b.call(f, args)


ROW_MAX = 16384   # widest row (elements) the row schedule accumulates on the stack
ROW_BLOCK = 4     # rows accumulated together when they fit in ROW_MAX


def _invariant_loads(a) -> List[E]:
    """The loads in ``a``'s value whose indices use none of the variables its loops and reductions bind,
    from buffers other than ``a.buf``; none unless every extent is a positive constant and the value has no
    scan (whose variables are bound another way)."""
    if not a.loop_vars or not all(isinstance(n, int) and n > 0 for n in a.extents):
        return []
    every = list(nodes(a.value))
    if any(x.op == "argscan" for x in every):
        return []
    bound = {v.attr for v in a.loop_vars}
    for x in every:
        if x.op == "reduce":
            bound |= {v.attr for v in x.attr[1]}

    stored = a.buf.storage

    def invariant(x: E) -> bool:
        return x.op == "load" and x.attr.storage is not stored and not any(
            y.op == "var" and y.attr in bound for i in x.args for y in nodes(i))
    return [x for x in every if invariant(x)]


def _row_assign_reduction(a, at_max) -> Optional[E]:
    """The single top-level reduction of a sequential assignment's value when it reads the assignment's
    innermost loop variable and that row fits ROW_MAX accumulators; else None."""
    if not a.loop_vars or at_max(a.extents[-1]) > ROW_MAX:
        return None
    found, scans = top_level(a.value, "reduce")
    if len(found) != 1 or scans or any(x.op in ("reduce", "argscan") for x in nodes(found[0].args[0])):
        return None
    last = a.loop_vars[-1].attr
    red = found[0]
    return red if any(x.op == "var" and x.attr == last for x in nodes(red.args[0])) else None


def row_reduction(st: Stage, at_max=lambda d: d) -> Optional[E]:
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

