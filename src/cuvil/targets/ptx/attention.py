"""Attention as one GPU kernel (``PtxTuning.fused_attention``): the FusedAttention that the proved rules of
``rules/attention.rule`` make of an export's MatMul / Softmax / MatMul (:func:`fuse_attention`, the same rules
as on x86), lowered to :class:`~cuvil.kernels.attention.AttentionRows` (Q, K, V and the mask as index
expressions over the buffers the graph stores them in: the KV cache and presents read in place, the head
split and the transposes folded into the indexing) and computed here.

Only attention with few query rows (at most :data:`MAX_ROWS`: a decode step) is fused; with many (BERT's 128)
the tensor-core products and the row kernels are faster.

The kernel (:func:`emit_attention`): a block of ``T`` threads per query row ``(b, h, i)`` (grid-stride over
rows). The row's query goes to shared memory (float32). The keys are walked in chunks of ``T``:

1. thread ``t`` scores key ``base + t`` (below Sk): ``s = (sum_d q[d] k[key, d]) * scale + mask[key]``, the dot
   product in increasing ``d`` (fma with ``fma`` on), float32; a key past Sk scores ``-inf`` (never loaded);
2. the chunk's maximum by a butterfly over each warp and the warps' results combined in warp order (every
   thread the same value); ``m' = max(m, chunk max)``, the shift ``c = m'`` (0 while every score is ``-inf``),
   ``r = exp(m - c)``, ``p = exp(s - c)`` stored to shared memory; their sum the same way; ``l = l r + sum p``;
3. thread ``t < G Dv`` (``G = T // Dv`` key groups) owns column ``c = t % Dv`` of group ``g = t // Dv``:
   ``acc = acc r + sum_j p[j] V[base + j, c]`` over the chunk's keys ``j = g, g + G, ...`` in increasing order
   (the threads of a warp read consecutive columns of a value row; :data:`PV_UNROLL` loads issued together);

then the groups' accumulators are added in group order and divided by ``l``. Every sum has a fixed order
(no atomics): the result is the same bits run to run. Float32 accumulation whatever the operands' type
(float16 values are widened as loaded); the output rounded to its type once. With ``zero_nan`` (the exports'
``Where(IsNaN(P), 0, P)``) a row whose ``l`` is NaN or 0 gives ``sum_j 0 * V[j, c]`` (0, or NaN in a column
holding a non-finite value), as :func:`cuvil.kernels.lower.attention._guarded` states it.

Against the unfused graph the softmax's sums are reassociated (chunks, rescaling) and the scale multiplies the
dot product once (``prove real`` rules): equal over the reals, within the tolerance the graph is held to.

Memory safety: the kernel evaluates the node's own index expressions at ``d < D``, ``key < Sk``, ``c < Dv``,
the ranges over which the node's ``plain`` value (the expression the bounds prover walks) reduces them: the
certificate's proof of ``plain``'s loads is the proof of the kernel's (ptx/bounds_patterns.py).
"""
from __future__ import annotations

from typing import Optional, Tuple

import attrs
import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.attention import AttentionRows
from ...kernels.schedule import ARENA, Stage
from ...kernels.texpr import Buf, E
from ..llvm.types import F16, F32, I32, I64
from .emitter import set_contraction

MAX_THREADS = 512        # threads per block (a chunk of keys); fewer for short rows
STAGE_BYTES = 40960      # shared memory a chunk's staged keys may take (PtxTuning.attention_stage_keys)
PV_UNROLL = 16           # values a thread loads before their fmas (latency: one round trip per 16 keys, not each)
# query rows a FusedAttention may have to be fused on the GPU (a decode step's few): with many rows the tensor-core
# products and the row kernels are faster (H200, BERT-base B=1 S=128, 128 rows: fp16 1.678 ms fused against 1.113,
# fp32 2.139 against 1.587; bench/gpu/results/session17/gpuattn/call1)
MAX_ROWS = 16


def attention_rules() -> list:
    """The built-in rules whose replacement is a FusedAttention (rules/attention.rule; declared ``on x86``,
    the phase that introduces the op)."""
    from ...rewrite_rules.verdicts import builtin_rules
    return [r for r in builtin_rules() if getattr(r.rhs, "op", None) == "FusedAttention"]


def few_rows(rule, binding, max_rows: int = MAX_ROWS) -> bool:
    """Whether a match's queries have at most ``max_rows`` rows (a static count): the rewrite's ``accept``."""
    q = binding.values.get("q")
    shape = getattr(q, "shape", None)
    return shape is not None and len(shape) == 4 and isinstance(shape[2], int) and shape[2] <= max_rows


def fuse_attention(g, max_rows: int = MAX_ROWS, also=None):
    """(a copy of ``g`` with attention of at most ``max_rows`` query rows fused by the proved rules, the
    rewrite's report). ``also``: a test of a match's binding that accepts other attention too (a float16 build
    for sm_80 or later passes :func:`~cuvil.targets.ptx.attention_mma.flash_shapes`: more rows, computed by the
    tensor-core flash kernel)."""
    from ...rewrite_rules.proved_rewrite import proved_rewrite
    g = g.clone()
    rules = attention_rules()
    report = proved_rewrite(g, rules, phase=rules[0].on if rules else "x86",
                            accept=lambda r, b: few_rows(r, b, max_rows) or also is not None and also(b))
    return g, report


def attention_in_half(g) -> int:
    """After the float16 pass (which keeps Cuvil's FusedAttention in float32 between Casts): each operand of a
    FusedAttention that is a float16 value widened by a Cast is read as that value instead (the kernel widens
    each element as it loads it: the same float32 numbers, without a stored float32 copy of the keys; operands
    that are float32 themselves, such as a KV cache the pass keeps in float32, are read as they are), and where
    every reader of its output is a Cast to float16 it writes float16 itself (one rounding of the same float32
    result, as the Cast made). Edits ``g`` in place; returns the nodes changed."""
    from ...ir.types import TensorType
    F16_, F32_ = DType.FLOAT16, DType.FLOAT

    def widened(v):
        n = v.producer if v is not None else None
        if n is None or n.op != "Cast" or v.dtype != F32_ or n.inputs[0] is None or n.inputs[0].dtype != F16_:
            return None
        return n.inputs[0]
    from ...kernels.lower.attention import gpu_form_shapes
    changed = 0
    for node in list(g.nodes):
        # only nodes the GPU kernel takes (the other lowerings compute in one type: they keep float32 operands)
        if node.op != "FusedAttention" or not gpu_form_shapes(node.outputs[0].shape, node.inputs[1].shape):
            continue
        did = False
        for k in range(len(node.inputs)):      # operands in float32 (a KV cache kept so: to_half) stay as they are
            src = widened(node.inputs[k]) if node.inputs[k] is not None else None
            if src is not None:
                g.set_input(node, k, src)
                did = True
        out = node.outputs[0]
        narrow = [u for u, _ in out.uses]
        if out not in g.outputs and narrow and all(u.op == "Cast" and u.outputs[0].dtype == F16_ for u in narrow):
            out.type = TensorType(F16_, out.type.shape)
            for u in narrow:
                g.replace_all_uses(u.outputs[0], out)
                g.remove_node(u)
            did = True
        changed += did
    if changed:
        g.remove_nodes([n for n in g.nodes if n.op == "Cast" and not n.outputs[0].uses
                        and n.outputs[0] not in g.outputs])
    return changed


def attention_node(st: Stage) -> Optional[E]:
    """The stage's expression when it is the GPU attention node, else None."""
    e = st.expr
    if e.op == "attention" and isinstance(e.attr, AttentionRows) and st.region is None and st.guard is None:
        return e
    return None


def block_threads(spec: AttentionRows, keys: Optional[int] = None) -> int:
    """Threads per block: a warp multiple covering the keys (``keys``, default all the row's; at most
    :data:`MAX_THREADS`) and a value row."""
    t = min(MAX_THREADS, -(-(spec.keys if keys is None else keys) // 32) * 32)
    return max(32, t, -(-spec.dv // 32) * 32)


@attrs.frozen
class AttentionPlan:
    """How a FusedAttention is laid over the GPU: ``splits`` blocks per query row (flash-decoding), block
    ``s`` over the keys ``[s * span, min((s + 1) * span, Sk))``, ``threads`` per block. With one split the
    block writes the row's output; with more each writes its partial softmax (``m``, ``l``, the unnormalised
    ``acc[Dv]`` and, with ``zero_nan``, ``z[Dv]``) to the scratch area after the arena (:func:`scratch_buf`)
    and a second kernel (:func:`emit_attention_merge`) combines a row's splits in split order."""
    rows: int          # query rows b x h x Sq
    splits: int
    span: int          # keys per split (the last may have fewer)
    threads: int
    dv: int
    zero_nan: bool
    staged: bool = False     # a chunk's keys copied to shared memory, coalesced, before they are scored

    @property
    def units(self) -> int:
        return self.rows * self.splits

    @property
    def scratch_floats(self) -> int:
        """The partials: ``[units, 2]`` (m, l), ``[units, Dv]`` acc, and with ``zero_nan`` ``[units, Dv]`` z."""
        return self.units * (2 + self.dv * (2 if self.zero_nan else 1))


def plan_attention(spec: AttentionRows, target_blocks: int, min_keys: int, stage: bool = False) -> AttentionPlan:
    """Split each query row's keys over blocks until the grid has ``target_blocks`` (a decode step has one
    row per head: 12 blocks on an H200's 132 SMs without a split), no split holding fewer than ``min_keys``
    keys (0: never split). The keys are shared evenly (``span`` = ceil(Sk / splits)). ``stage``: a chunk's keys
    go through shared memory where ``threads x (D + 1)`` floats fit :data:`STAGE_BYTES` and D is 32 or 64."""
    rows = spec.batch * spec.heads * spec.rows
    splits = 1
    if min_keys > 0 and rows < target_blocks:
        splits = max(1, min(-(-target_blocks // rows), spec.keys // min_keys))
    span = -(-spec.keys // splits)
    splits = -(-spec.keys // span)          # (every split holds at least one key)
    threads = block_threads(spec, span)
    # (the copy issues all D of a thread's loads before its stores: past 64, or without whole warps along a row,
    # ptxas spills; those head sizes read their rows directly)
    staged = stage and spec.d % 32 == 0 and spec.d <= 64 and 4 * threads * (spec.d + 1) <= STAGE_BYTES
    return AttentionPlan(rows, splits, span, threads, spec.dv, spec.zero_nan, staged)


def scratch_buf(plan: AttentionPlan, offset: int) -> Buf:
    """The split partials, ``plan.scratch_floats`` floats in the arena at byte ``offset``: (m, l) at
    ``2 u``, ``2 u + 1``, acc at ``2 U + u Dv + c``, z at ``(2 + Dv) U + u Dv + c`` for unit ``u = r * splits + s``
    of ``U`` (:func:`partial_index`)."""
    return Buf("attention_partials", DType.FLOAT, (plan.scratch_floats,), base=ARENA, offset=offset)


def partial_index(plan: AttentionPlan, part: str, u, c=0, b: Optional[ir.IRBuilder] = None):
    """The flat index of unit ``u``'s ``part`` (``m``, ``l``, ``acc`` or ``z``; column ``c``) in
    :func:`scratch_buf`: ``u`` and ``c`` ints or texpr index expressions (the bounds patterns), or i64 IR
    values emitted with ``b`` (the kernels)."""
    U, Dv = plan.units, plan.dv
    if b is None:
        add, mul = (lambda x, y: x + y), (lambda x, y: x * y)
    else:
        add, mul = (lambda x, y: b.add(x, I64(y) if isinstance(y, int) else y)), (lambda x, y: b.mul(x, I64(y)))
    if part in ("m", "l"):
        return add(mul(u, 2), 1) if part == "l" else mul(u, 2)
    return add(add(mul(u, Dv), c), 2 * U if part == "acc" else (2 + Dv) * U)


def emit_attention(km, st: Stage, sym: str, plan: Optional[AttentionPlan] = None,
                   scratch: Optional[Buf] = None, counters: Optional[int] = None) -> Tuple[int, int]:
    """Emit the kernel ``sym`` for the attention stage ``st`` laid out by ``plan`` (default: one block per
    row); with ``plan.splits > 1`` it writes the partials to ``scratch``, and then either
    :func:`emit_attention_merge`'s kernel combines them or (``counters``: the byte offset in the arena of one
    int32 per query row, zero before the kernel runs) the last of a row's blocks to finish does (an atomic count
    per row, reset to 0 by that block), reading the partials through L2. Returns (blocks' units: rows x splits,
    threads per block)."""
    from .emitter import PtxEmitter, shared_global
    spec: AttentionRows = st.expr.attr
    if plan is None:
        plan = plan_attention(spec, 1, 0)
    T = plan.threads
    W = T // 32
    D, Dv, Sk = spec.d, spec.dv, spec.keys
    G = max(1, T // Dv)
    rows = spec.batch * spec.heads * spec.rows
    S, span = plan.splits, plan.span
    assert (S > 1) == (scratch is not None)
    fn = km.kernel_fn(sym)
    km.module.add_named_metadata("nvvm.annotations", [fn, "maxntidx", I32(T)])
    bufs, _n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = PtxEmitter(km, fn, b, bufs, st.buf)
    sp = ir.PointerType(F32, addrspace=3)
    with b.goto_block(em.entry):
        b.position_at_start(em.entry)
        qs, ps, red, acc_s, zs = (b.bitcast(shared_global(km, f"{sym}_{n}", F32, size), sp) for n, size in
                                  (("q", D), ("p", T), ("w", W), ("acc", G * Dv), ("z", G * Dv)))
        # a chunk's keys staged whole (rows padded to D + 1 floats: a thread's row walk hits 32 banks)
        ks = b.bitcast(shared_global(km, f"{sym}_k", F32, T * (D + 1)), sp) if plan.staged else None
    bar = km.declare("llvm.nvvm.barrier0", ir.VoidType(), [])
    fence = km.declare("llvm.nvvm.membar.gl", ir.VoidType(), [])
    # partials written by other blocks of this kernel: read through L2 (ld.global.cg), never a stale L1
    ld_cg = ir.InlineAsm(ir.FunctionType(F32, [I64]), "ld.global.cg.f32 $0, [$1];", "=f,l", side_effect=True)
    flag = shared_global(km, f"{sym}_last", I32, align=None) if counters is not None else None
    shfl = km.declare("llvm.nvvm.shfl.sync.bfly.f32", F32, [I32, F32, I32, I32])
    fmaf = em.fma_fn(DType.FLOAT) if km.fma else None
    vb, vh, vi, vd, vkey, vc = (v.attr for v in spec.vars)
    tid = km.sreg(b, "tid.x")
    lane = b.and_(tid, I64(31))
    warp = b.lshr(tid, I64(5))
    F = DType.FLOAT
    neg_inf, zero = ir.Constant(F32, float("-inf")), ir.Constant(F32, 0.0)

    def at(base, i):
        return b.gep(base, [i], source_etype=F32, inbounds=True)

    def value(e: E, **env) -> ir.Value:
        """``e`` (an index expression of the spec) at ``env``, widened to float32; emitted in its own memo
        scope (its variables are rebound between uses)."""
        em.memo.append({})
        for k, x in env.items():
            em.env[k] = x
        x = em.emit(e)
        em.memo.pop()
        return b.fpext(x, F32) if e.dtype == DType.FLOAT16 else x

    def madd(x, y, a):
        return b.call(fmaf, [x, y, a]) if fmaf is not None else b.fadd(b.fmul(x, y), a)

    def block_reduce(v, kind):
        """``kind`` (max / sum) of every thread's ``v``: lanes by butterfly, then the warps in order."""
        for off in (16, 8, 4, 2, 1):
            v = em.combine(kind, v, b.call(shfl, [I32(0xFFFFFFFF), v, I32(off), I32(0x1F)]), F)
        with b.if_then(b.icmp_unsigned("==", lane, I64(0))):
            b.store(v, at(red, warp))
        b.call(bar, [])
        total = b.load(at(red, I64(0)), typ=F32)
        for w in range(1, W):
            total = em.combine(kind, total, b.load(at(red, I64(w)), typ=F32), F)
        b.call(bar, [])      # every thread has read the slots: free for the next reduction
        return total

    m_slot, l_slot, acc, z, s_slot = (em.alloca(F32) for _ in range(5))

    def unit(u):
        if S > 1:       # block u: split u % S of row u // S
            r = b.udiv(u, I64(S))
            start = b.mul(b.urem(u, I64(S)), I64(span))
            end = b.add(start, I64(span))
            end = b.select(b.icmp_signed("<", end, I64(Sk)), end, I64(Sk))
        else:
            r, start, end = u, I64(0), I64(Sk)
        i = b.urem(r, I64(spec.rows))
        r2 = b.udiv(r, I64(spec.rows))
        h = b.urem(r2, I64(spec.heads))
        bb = b.udiv(r2, I64(spec.heads))
        here = {vb: bb, vh: h, vi: i}
        em.loop_range(tid, I64(D), lambda d: b.store(value(spec.q, **here, **{vd: d}), at(qs, d)), I64(T))
        b.call(bar, [])
        b.store(neg_inf, m_slot)
        for slot in (l_slot, acc, z):
            b.store(zero, slot)

        def chunk(base):
            key = b.add(base, tid)
            if ks is not None:
                # the chunk's T x D keys copied to shared memory by the block, consecutive threads reading
                # consecutive d of a row (coalesced; a thread's own row would be T rows apart across a warp):
                # element f = tid + T j is key f // D, column f % D; keys past the split read its last key (in
                # the range the proof covers), never scored
                last = b.sub(end, I64(1))

                def stage(kk, dd):
                    kabs = b.add(base, kk)
                    kabs = b.select(b.icmp_signed("<", kabs, end), kabs, last)
                    return value(spec.k, **here, **{vd: dd, vkey: kabs}), at(ks, b.add(b.mul(kk, I64(D + 1)), dd))
                # warp w copies rows 32 w .. 32 w + 31 (T = 32 W), its lanes along d (plan_attention stages only
                # head sizes that are whole warps, up to 64)
                pairs = [stage(b.add(b.mul(warp, I64(32)), I64(jr)), b.add(lane, I64(32 * jd)))
                         for jr in range(32) for jd in range(D // 32)]
                for v, ptr in pairs:      # every load issued before the first store
                    b.store(v, ptr)
                b.call(bar, [])
            b.store(neg_inf, s_slot)
            with b.if_then(b.icmp_signed("<", key, end)):
                dot = zero
                for d in range(D):
                    kd = (b.load(at(ks, b.add(b.mul(tid, I64(D + 1)), I64(d))), typ=F32) if ks is not None else
                          value(spec.k, **here, **{vd: I64(d), vkey: key}))
                    dot = madd(b.load(at(qs, I64(d)), typ=F32), kd, dot)
                s = b.fmul(dot, value(spec.scale))
                if spec.mask is not None:
                    s = b.fadd(s, value(spec.mask, **here, **{vkey: key}))
                b.store(s, s_slot)
            s = b.load(s_slot, typ=F32)
            m_old = b.load(m_slot, typ=F32)
            m_new = em.combine("max", m_old, block_reduce(s, "max"), F)
            shift = b.select(b.fcmp_ordered("==", m_new, neg_inf), zero, m_new)
            rescale = em.call("exp", [b.fsub(m_old, shift)], F)
            p = em.call("exp", [b.fsub(s, shift)], F)
            b.store(p, at(ps, tid))
            psum = block_reduce(p, "sum")       # its barrier makes every p visible to the block
            b.store(b.fadd(b.fmul(b.load(l_slot, typ=F32), rescale), psum), l_slot)
            with b.if_then(b.icmp_unsigned("<", tid, I64(G * Dv))):
                c = b.urem(tid, I64(Dv))
                g = b.udiv(tid, I64(Dv))
                b.store(b.fmul(b.load(acc, typ=F32), rescale), acc)
                n = b.sub(end, base)
                n = b.select(b.icmp_signed("<", n, I64(T)), n, I64(T))
                # this thread's keys j = g, g + G, ... below n: PV_UNROLL values loaded before their fmas (the
                # loads in flight together), then the rest one by one; the fmas in increasing j either way
                cnt = b.select(b.icmp_signed("<", g, n), b.sdiv(b.add(b.sub(n, g), I64(G - 1)), I64(G)), I64(0))
                whole = b.sdiv(cnt, I64(PV_UNROLL))

                def terms(t, count):
                    j0 = b.add(g, b.mul(t, I64(G)))
                    js = [b.add(j0, I64(u * G)) for u in range(count)]
                    vals = [value(spec.v, **here, **{vkey: b.add(base, j), vc: c}) for j in js]
                    ws = [b.load(at(ps, j), typ=F32) for j in js]
                    a = b.load(acc, typ=F32)
                    zz = b.load(z, typ=F32) if spec.zero_nan else None
                    for w, v in zip(ws, vals):
                        a = madd(w, v, a)
                        if spec.zero_nan:
                            zz = b.fadd(zz, b.fmul(zero, v))
                    b.store(a, acc)
                    if spec.zero_nan:
                        b.store(zz, z)
                em.loop_range(I64(0), whole, lambda t: terms(b.mul(t, I64(PV_UNROLL)), PV_UNROLL))
                em.loop_range(b.mul(whole, I64(PV_UNROLL)), cnt, lambda t: terms(t, 1))
            b.store(m_new, m_slot)
            b.call(bar, [])     # p read by every thread before the next chunk writes it
        em.loop_range(start, end, chunk, I64(T))
        with b.if_then(b.icmp_unsigned("<", tid, I64(G * Dv))):
            b.store(b.load(acc, typ=F32), at(acc_s, tid))
            b.store(b.load(z, typ=F32), at(zs, tid))
        b.call(bar, [])
        with b.if_then(b.icmp_unsigned("<", tid, I64(Dv))):
            y = b.load(at(acc_s, tid), typ=F32)
            zz = b.load(at(zs, tid), typ=F32)
            for g in range(1, G):
                y = b.fadd(y, b.load(at(acc_s, b.add(tid, I64(g * Dv))), typ=F32))
                zz = b.fadd(zz, b.load(at(zs, b.add(tid, I64(g * Dv))), typ=F32))
            total = b.load(l_slot, typ=F32)
            if S > 1:       # the split's partials, unnormalised (the merge kernel scales and divides)
                b.store(y, em.address(scratch, [partial_index(plan, "acc", u, tid, b)]))
                if spec.zero_nan:
                    b.store(zz, em.address(scratch, [partial_index(plan, "z", u, tid, b)]))
                with b.if_then(b.icmp_unsigned("==", tid, I64(0))):
                    b.store(b.load(m_slot, typ=F32), em.address(scratch, [partial_index(plan, "m", u, 0, b)]))
                    b.store(total, em.address(scratch, [partial_index(plan, "l", u, 0, b)]))
            else:
                store_output(em, spec, st, y, total, zz, [bb, h, i, tid])
        if S > 1 and counters is not None:
            # the last of the row's S blocks to finish merges its partials (theirs are in L2 by the fence)
            last, cptr = em.last_arrival(scratch, counters, r, S, flag, b.icmp_unsigned("==", tid, I64(0)))
            with b.if_then(last):
                b.call(fence, [])
                with b.if_then(b.icmp_unsigned("<", tid, I64(Dv))):
                    merge_column(em, plan, spec, st, scratch, r, tid,
                                 lambda idx: b.call(ld_cg, [b.ptrtoint(em.address(scratch, [idx]), I64)]))
                with b.if_then(b.icmp_unsigned("==", tid, I64(0))):
                    b.store(I32(0), cptr)     # ready for the next layer and run (the runtime also zeroes them first)
        b.call(bar, [])         # the shared query and partial sums free for the next row
    em.loop_range(km.sreg(b, "ctaid.x"), I64(plan.units), unit, km.sreg(b, "nctaid.x"))
    b.ret_void()
    set_contraction(fn, False)   # contraction only where written (fma with ``fma`` on)
    km.kernels.append(sym)
    return plan.units, T


def merge_column(em, plan: AttentionPlan, spec: AttentionRows, st: Stage, scratch: Buf, r, c, load) -> None:
    """Store output column ``c`` of query row ``r`` from the row's ``S`` partials (``load(flat index)`` reads
    one from ``scratch``), combined in split order: ``M = max_s m_s``, the shift ``c = M`` (0 when ``M = -inf``),
    ``f_s = exp(m_s - c)``, ``y = (sum_s f_s acc_s) / (sum_s f_s l_s)`` (with ``zero_nan``: ``sum_s z_s`` where
    that sum of ``l`` is NaN or 0), rounded to the output type once."""
    b = em.b
    S, Dv, F = plan.splits, plan.dv, DType.FLOAT
    neg_inf, zero = ir.Constant(F32, float("-inf")), ir.Constant(F32, 0.0)
    fmaf = em.fma_fn(F) if em.km.fma else None
    i = b.urem(r, I64(spec.rows))
    r2 = b.udiv(r, I64(spec.rows))
    h = b.urem(r2, I64(spec.heads))
    bb = b.udiv(r2, I64(spec.heads))
    u0 = b.mul(r, I64(S))
    us = [b.add(u0, I64(s)) for s in range(S)]
    ms = [load(partial_index(plan, "m", u, 0, b)) for u in us]
    top = ms[0]
    for m in ms[1:]:
        top = em.combine("max", top, m, F)
    shift = b.select(b.fcmp_ordered("==", top, neg_inf), zero, top)
    total, y, zz = zero, zero, zero
    for u, m in zip(us, ms):
        f = em.call("exp", [b.fsub(m, shift)], F)
        lu = load(partial_index(plan, "l", u, 0, b))
        au = load(partial_index(plan, "acc", u, c, b))
        total = b.call(fmaf, [lu, f, total]) if fmaf is not None else b.fadd(b.fmul(lu, f), total)
        y = b.call(fmaf, [au, f, y]) if fmaf is not None else b.fadd(b.fmul(au, f), y)
        if spec.zero_nan:
            zz = b.fadd(zz, load(partial_index(plan, "z", u, c, b)))
    store_output(em, spec, st, y, total, zz, [bb, h, i, c])


def store_output(em, spec: AttentionRows, st: Stage, acc, total, zz, idx) -> None:
    """Store ``acc / total`` at output element ``idx`` (b, h, i, c: the buffer's index is
    :meth:`~cuvil.kernels.attention.AttentionRows.out_index`'s), rounded to its type once; with ``zero_nan`` a
    row whose ``total`` is NaN or 0 stores ``zz`` (the sum of ``0 * V``) instead."""
    b = em.b
    y = b.fdiv(acc, total)
    if spec.zero_nan:
        zero = ir.Constant(F32, 0.0)
        nan_row = b.or_(b.fcmp_unordered("uno", total, total), b.fcmp_ordered("==", total, zero))
        y = b.select(nan_row, zz, y)
    if st.buf.dtype == DType.FLOAT16:
        y = b.fptrunc(y, F16)
    b.store(em.to_memory(y, st.buf.dtype), em.address(st.buf, spec.out_index(*idx)))


def emit_attention_merge(km, st: Stage, sym: str, plan: AttentionPlan, scratch: Buf) -> int:
    """Emit ``sym``, the second kernel of a split attention (without ``fused_merge``): a thread per output
    ``(b, h, i, c)`` combines the row's partials (:func:`merge_column`). Returns the threads it needs."""
    from .emitter import PtxEmitter
    spec: AttentionRows = st.expr.attr
    Dv = plan.dv
    fn = km.kernel_fn(sym)
    bufs, _n = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    em = PtxEmitter(km, fn, b, bufs, st.buf)

    def out(x):
        merge_column(em, plan, spec, st, scratch, b.udiv(x, I64(Dv)), b.urem(x, I64(Dv)),
                     lambda idx: b.load(em.address(scratch, [idx]), typ=F32))
    start, step = km.grid_stride(b)
    em.loop_range(start, I64(plan.rows * Dv), out, step)
    b.ret_void()
    set_contraction(fn, False)
    km.kernels.append(sym)
    return plan.rows * Dv
