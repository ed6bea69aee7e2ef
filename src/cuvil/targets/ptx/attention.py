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

import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.attention import AttentionRows
from ...kernels.schedule import Stage
from ...kernels.texpr import E
from ..llvm.types import F16, F32, I32, I64
from .emitter import set_contraction

MAX_THREADS = 512        # threads per block (a chunk of keys); fewer for short rows
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


def fuse_attention(g, max_rows: int = MAX_ROWS):
    """(a copy of ``g`` with attention of at most ``max_rows`` query rows fused by the proved rules, the
    rewrite's report)."""
    from ...rewrite_rules.proved_rewrite import proved_rewrite
    g = g.clone()
    rules = attention_rules()
    report = proved_rewrite(g, rules, phase=rules[0].on if rules else "x86",
                            accept=lambda r, b: few_rows(r, b, max_rows))
    return g, report


def attention_in_half(g) -> int:
    """After the float16 pass (which keeps Cuvil's FusedAttention in float32 between Casts): a FusedAttention
    whose operands are float16 values widened by a Cast reads those values instead (the kernel widens each
    element as it loads it: the same float32 numbers, without a stored float32 copy of the keys), and where every
    reader of its output is a Cast to float16 it writes float16 itself (one rounding of the same float32 result,
    as the Cast made). Edits ``g`` in place; returns the nodes changed."""
    from ...ir.types import TensorType
    F16_, F32_ = DType.FLOAT16, DType.FLOAT

    def widened(v):
        n = v.producer if v is not None else None
        if n is None or n.op != "Cast" or v.dtype != F32_ or n.inputs[0] is None or n.inputs[0].dtype != F16_:
            return None
        return n.inputs[0]
    changed = 0
    for node in list(g.nodes):
        if node.op != "FusedAttention":
            continue
        out = node.outputs[0]
        narrow = [u for u, _ in out.uses]
        if out in g.outputs or not narrow or any(u.op != "Cast" or u.outputs[0].dtype != F16_ for u in narrow):
            continue
        srcs = [widened(node.inputs[k]) for k in range(3)]
        if any(x is None for x in srcs):
            continue
        for k in range(len(node.inputs)):
            src = widened(node.inputs[k]) if node.inputs[k] is not None else None
            if src is not None:
                g.set_input(node, k, src)
        out.type = TensorType(F16_, out.type.shape)
        for u in narrow:
            g.replace_all_uses(u.outputs[0], out)
            g.remove_node(u)
        changed += 1
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


def block_threads(spec: AttentionRows) -> int:
    """Threads per block: a warp multiple covering the keys (at most :data:`MAX_THREADS`) and a value row."""
    t = min(MAX_THREADS, -(-spec.keys // 32) * 32)
    return max(32, t, -(-spec.dv // 32) * 32)


def emit_attention(km, st: Stage, sym: str) -> Tuple[int, int]:
    """Emit the kernel ``sym`` for the attention stage ``st``; returns (rows, threads per block)."""
    from .emitter import PtxEmitter, shared_global
    spec: AttentionRows = st.expr.attr
    T = block_threads(spec)
    W = T // 32
    D, Dv, Sk = spec.d, spec.dv, spec.keys
    G = max(1, T // Dv)
    rows = spec.batch * spec.heads * spec.rows
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
    bar = km.declare("llvm.nvvm.barrier0", ir.VoidType(), [])
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

    def row(r):
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
            b.store(neg_inf, s_slot)
            with b.if_then(b.icmp_signed("<", key, I64(Sk))):
                dot = zero
                for d in range(D):
                    dot = madd(b.load(at(qs, I64(d)), typ=F32), value(spec.k, **here, **{vd: I64(d), vkey: key}), dot)
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
                n = b.sub(I64(Sk), base)
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
        em.loop_range(I64(0), I64(Sk), chunk, I64(T))
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
            y = b.fdiv(y, total)
            if spec.zero_nan:
                nan_row = b.or_(b.fcmp_unordered("uno", total, total), b.fcmp_ordered("==", total, zero))
                y = b.select(nan_row, zz, y)
            if st.buf.dtype == DType.FLOAT16:
                y = b.fptrunc(y, F16)
            b.store(em.to_memory(y, st.buf.dtype), em.address(st.buf, [bb, h, i, tid]))
        b.call(bar, [])         # the shared query and partial sums free for the next row
    em.loop_range(km.sreg(b, "ctaid.x"), I64(rows), row, km.sreg(b, "nctaid.x"))
    b.ret_void()
    set_contraction(fn, False)   # contraction only where written (fma with ``fma`` on)
    km.kernels.append(sym)
    return rows, T
