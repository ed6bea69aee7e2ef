"""The x86 attention kernel: flash-style tiles of :class:`cuvil.kernels.attention.AttentionTile`.

One unit of the parallel range is a block of ``qb`` query rows of one (batch, head). For each panel of ``kb``
keys (``nv = kb / lanes`` vectors) the kernel

1. computes the ``qb x kb`` scores as a register-blocked micro-kernel: for each ``d`` it loads the panel's
   ``nv`` key vectors once (contiguous: the keys are stored transposed and cut into panels) and multiplies
   them by each row's ``q[d]`` broadcast, ``qb * nv`` FMAs into accumulators that stay in registers;
2. per row, scales the scores and adds the mask row (``-inf`` past the last key), takes the block max with
   ``vmaxps`` (a NaN score need not reach the max: its own probability makes the row's sum NaN) and updates
   the row's running max ``m`` and the shift ``c`` (0 while every score so far is ``-inf``, so a row masked
   so far adds exp(-inf) = 0, not NaN); ``r = exp(m_old - c)``, the tile's rows' in one vector exp;
3. replaces the scores by ``exp(s - c)`` in their vector registers (the shared polynomial of
   :mod:`cuvil.targets.llvm.vecmath` on whole vectors), stores them to a stack tile and adds them to the row's
   running sum ``l`` (a vector of partial sums, scaled by ``r``);
4. scales the output accumulators by ``r`` and adds ``P · V``: for each key, its value row's vectors
   (``dvp / lanes``) loaded once and multiplied by each row's probability broadcast from the tile (values read
   in place stop at the last key; the padded copy's zero rows past it add 0).

A decode step (``k_axes`` set: a few static query rows, the keys stored with contiguous rows of ``d``, e.g. the
KV cache) reads the keys in place instead of from panels: step 1 becomes, per key, its row's ``d / lanes``
vectors times the query's (held in registers), and ``lanes`` keys' vectors of partial sums are reduced together
by a tree of shuffles and adds into one vector of their scores (a key past the last is clamped to the last row
and its score replaced by 0 before the mask's ``-inf``); each row takes the one-row tile. The whole cache is
then read once per step, not copied into panels and read again.

The rows end as ``acc / l``: NaN for a row whose every key is ``-inf`` (0 / 0) or that has a NaN or infinite score
(l is NaN), as the unfused Softmax gives; under ``zero_nan`` (the guard ``Where(IsNaN(P), 0, P)``: such a row's
probabilities all become 0) such a row is ``sum_j 0 * V[j]`` as the guarded composite computes it (0, or NaN in
a column with a non-finite value), and any other row keeps its NaN elements (a NaN value times its
probability). A block of ``qb`` rows takes the full tile; a last partial block of ``r`` rows (``Sq`` not a multiple
of ``qb``; a decode step's single query) an ``r``-row tile, so no row is computed twice (one-row tiles each, as
before, run their products as latency-bound FMA chains: S = 32's last 2 rows were most of a tile's time). In the
full tile panel 0 is peeled: its running max is -inf and its sums 0, so it skips the rescale (a scalar exp per row
and the accumulators' multiply by 0); at ``Sk <= kb`` it is the only panel (the smaller tiles keep one copy of the
panel's code: the peel in every tile added a third to a BERT library's compile time). The recurrence
is the sequential form's (:mod:`cuvil.kernels.lower.attention`); the order of every sum is fixed per row (a row
gives the same bits in either tile), so results do not depend on the thread count.
"""
from __future__ import annotations

from typing import Optional, Tuple

import llvmlite.ir as ir

from ...ir.dtype import DType
from ...kernels.attention import AttentionTile, stored_index
from ...kernels.schedule import Stage
from ..llvm.types import F32, I1, I32, I64, splat
from ..llvm.vecmath import VectorMath


def find_attention(st: Stage) -> Optional[AttentionTile]:
    """The tile spec when the stage's whole expression is the ``attention`` node at the stage's own indices."""
    e = st.expr
    if e.op != "attention" or not isinstance(e.attr, AttentionTile) or st.region is not None:
        return None
    idx = e.args[:-1]       # (b, h, i, c): the node's order; the buffer's is spec.out_index's
    if len(idx) != len(st.vars) or any(a.op != "var" for a in idx):
        return None
    if [a.attr for a in e.attr.out_index(*idx)] != [v.attr for v in st.vars]:
        return None
    return e.attr


def emit_attention_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """Emit an attention stage; returns (parallel extent, grain) or None if ``st`` is not one (its plain value
    then takes the loop nest)."""
    spec = find_attention(st)
    if spec is None:
        return None
    vw = min(max(4, km.vector_bits // 32), spec.dvp)   # values of 8 floats a row (dvp 8): 8 lanes
    if spec.kb % vw or spec.dvp % vw:
        return None
    vec = ir.VectorType(F32, vw)
    QB, KB, D, NV, NW = spec.qb, spec.kb, spec.d, spec.kb // vw, spec.dvp // vw
    em, begin, end = km.kernel(sym)
    b = em.b
    fma = km.declare(f"llvm.fma.v{vw}f32", vec, [vec, vec, vec])
    # exp of the scores' vectors as they are (the scalar loop over a spilled tile that LLVM widened ran half
    # the kernel's time: 8-lane vectors, a store-to-load round trip per vector)
    vmath = VectorMath(b, km.declare, vw, scalef=km.scalef)
    zero_v = ir.Constant(vec, [0.0] * vw)
    neg_inf = ir.Constant(F32, float("-inf"))

    def fptr(base, off):
        return b.gep(base, [off], source_etype=F32, inbounds=True)

    vptr = ir.PointerType(vec)

    def vload(p):
        return b.load(b.bitcast(p, vptr), typ=vec, align=4)

    # keys / values read in place from a float16 model's stored rows: widened as they are loaded (exact)
    half = ir.HalfType()
    kel = half if spec.k_axes is not None and spec.kt.dtype == DType.FLOAT16 else F32
    vel = half if spec.v_axes is not None and spec.v.dtype == DType.FLOAT16 else F32

    def eload(base, off, el):
        """vw elements of ``el`` (float32, or float16 widened) at ``base + off`` as a float32 vector."""
        p = b.gep(base, [off], source_etype=el, inbounds=True)
        if el is F32:
            return vload(p)
        return b.fpext(b.load(p, typ=ir.VectorType(half, vw), align=2), vec)

    def vstore(x, p):
        b.store(x, b.bitcast(p, vptr), align=4)

    def slot(arr, k):
        return b.gep(arr, [I64(k)], source_etype=vec, inbounds=True)

    def vmax(x, y):
        """``x > y ? x : y`` (one ``vmaxps``): a NaN score may or may not reach the running max, and needs not:
        its probability exp(NaN - c) is NaN whatever ``c`` is, so the row's sum ``l`` is NaN, and so are its
        outputs (``acc / l``; under ``zero_nan`` the guarded row), as the unfused Softmax gives; a NaN max
        makes every probability and ``l`` NaN the same way. Rows without NaN: the max, the same bits."""
        return b.select(b.fcmp_ordered(">", x, y), x, y)

    def horizontal(x, combine):
        n = vw
        while n > 1:
            n //= 2
            undef = ir.Constant(x.type, ir.Undefined)
            lo = b.shuffle_vector(x, undef, ir.Constant(ir.VectorType(I32, n), list(range(n))))
            hi = b.shuffle_vector(x, undef, ir.Constant(ir.VectorType(I32, n), list(range(n, 2 * n))))
            x = combine(lo, hi)
        return b.extract_element(x, I32(0))

    lanes_i = ir.Constant(ir.VectorType(I64, vw), list(range(vw)))

    def lane_sums(parts):
        """The vector whose lane ``j`` is the sum of the lanes of ``parts[j]`` (vw vectors): halves of pairs
        added level by level (2 shuffles and an add per pair and level), then one shuffle into key order."""
        level = [(x, [j] * vw) for j, x in enumerate(parts)]     # (vector, the key each lane's partial is of)
        g = vw
        while g > 1:
            h2 = g // 2
            nxt = []
            for (x, lx), (y, ly) in zip(level[0::2], level[1::2]):
                lo_i, hi_i, lab = [], [], []
                for src, off, labels in ((x, 0, lx), (y, vw, ly)):
                    for grp in range(vw // g):
                        lo_i += [off + grp * g + c for c in range(h2)]
                        hi_i += [off + grp * g + h2 + c for c in range(h2)]
                        lab += labels[grp * g:grp * g + h2]
                mk = lambda ix: ir.Constant(ir.VectorType(I32, vw), ix)  # noqa: E731
                nxt.append((b.fadd(b.shuffle_vector(x, y, mk(lo_i)), b.shuffle_vector(x, y, mk(hi_i))), lab))
            level, g = nxt, h2
        (x, lab), = level
        order = [lab.index(j) for j in range(vw)]
        return b.shuffle_vector(x, ir.Constant(x.type, ir.Undefined), ir.Constant(ir.VectorType(I32, vw), order))

    H = spec.heads
    Sq = em.index(spec.rows)
    nqb = b.sdiv(b.add(Sq, I64(QB - 1)), I64(QB))
    nkb = em.index(spec.key_blocks)
    n_keys = em.index(spec.keys)
    scale = splat(b, em.emit(spec.scale), vw)
    mshape = spec.mask.shape
    s_acc = em.alloca(vec, QB * NV)       # the tile's scores (registers after SROA)
    o_acc = em.alloca(vec, QB * NW)       # the rows' output accumulators
    l_vec = em.alloca(vec, QB)            # the rows' running sums, per lane
    m_row = em.alloca(F32, QB)            # the rows' running maxima
    ptile = em.alloca(F32, QB * KB)       # the tile's probabilities (broadcast by P · V)

    def tile(n, h, i0, QB):
        """Rows i0 .. i0 + QB - 1 of (n, h) (rows past Sq computed on the last row's copy, not stored)."""
        last = b.sub(Sq, I64(1))
        rows = []
        for qi in range(QB):
            i = b.add(i0, I64(qi))
            rows.append(b.select(b.icmp_signed("<", i, Sq), i, last))
        # the queries' copy, or their stored buffer read in place (each row's d elements contiguous)
        qrow = [em.address(spec.q, [n, h, r, I64(0)] if spec.q_axes is None else
                           stored_index(spec.q_axes, (n, h, r, I64(0)), I64(0))) for r in rows]
        mrow = [em.address(spec.mask, [n if mshape[0] != 1 else I64(0), h if mshape[1] != 1 else I64(0),
                                        r if mshape[2] != 1 else I64(0), I64(0)]) for r in rows]
        kbase = em.address(spec.kt, [n, h, I64(0), I64(0), I64(0)]) if spec.k_axes is None else None
        # a row reading the keys in place: its query as D / vw vectors, held across the key panels
        qvecs = [vload(fptr(qrow[0], I64(c * vw))) for c in range(D // vw)] if spec.k_axes is not None else None

        def krow(key):
            """The address of key row ``key`` of the stored keys (read in place)."""
            at = (n, h, key, I64(0))
            return em.address(spec.kt, stored_index(spec.k_axes, at, I64(0)))

        def vrow(key):
            """The address of value row ``key`` (the padded copy's, or the stored buffer's in place)."""
            if spec.v_axes is None:
                return em.address(spec.v, [n, h, key, I64(0)])
            at = (n, h, key, I64(0))
            return em.address(spec.v, stored_index(spec.v_axes, at, I64(0)))
        for qi in range(QB):
            b.store(neg_inf, b.gep(m_row, [I64(qi)], source_etype=F32))
            vstore(zero_v, slot(l_vec, qi))
            for w in range(NW):
                vstore(zero_v, slot(o_acc, qi * NW + w))

        def in_place_scores(key0):
            """1'. (one row, keys in place) the panel's scores: per key the dot product of its row with the query
            as a vector of partial sums, vw keys' vectors reduced together into one vector of their vw scores;
            a key past the last (its row clamped to the last one) scores 0 here, -inf once its mask is added."""
            for v in range(NV):
                k0 = b.add(key0, I64(v * vw))
                parts = []
                for jj in range(vw):
                    kp = krow(b.select(b.icmp_signed("<", b.add(k0, I64(jj)), n_keys), b.add(k0, I64(jj)),
                                       b.sub(n_keys, I64(1))))
                    acc = None
                    for c in range(D // vw):
                        x = eload(kp, I64(c * vw), kel)
                        acc = b.fmul(qvecs[c], x) if acc is None else b.call(fma, [qvecs[c], x, acc])
                    parts.append(acc)
                s = lane_sums(parts)
                inside = b.icmp_signed("<", b.add(lanes_i, splat(b, k0, vw)), splat(b, n_keys, vw))
                # scaled and masked below: a key past the last gets -inf there (its mask), its garbage
                # score is replaced by 0 first so that no NaN of a clamped row reaches the max
                vstore(b.select(inside, s, zero_v), slot(s_acc, v))

        def panel(t, first=False):
            """Panel ``t``; ``first``: panel 0, where the running max is -inf and the sums and accumulators are 0,
            so its rescale (exp(-inf - c) = 0, times 0) is left out: l = the panel's sum, the same bits."""
            key0 = b.mul(t, I64(KB))
            if spec.k_axes is not None:
                in_place_scores(key0)
            else:
                kpanel = fptr(kbase, b.mul(t, I64(D * KB)))
                for k in range(QB * NV):
                    vstore(zero_v, slot(s_acc, k))

                def qk(d):      # 1. scores: nv key vectors x qb broadcast query elements
                    kp = fptr(kpanel, b.mul(d, I64(KB)))
                    keys = [vload(fptr(kp, I64(v * vw))) for v in range(NV)]
                    for qi in range(QB):
                        qs = splat(b, b.load(fptr(qrow[qi], d), typ=F32), vw)
                        for v in range(NV):
                            a = slot(s_acc, qi * NV + v)
                            vstore(b.call(fma, [qs, keys[v], vload(a)]), a)
                em.loop_range(I64(0), I64(D), qk)
            shifts, rescale, scores, moved = [], [], [], []
            for qi in range(QB):     # 2. scale, mask, running max
                mp = fptr(mrow[qi], key0)
                s = [b.fadd(b.fmul(vload(slot(s_acc, qi * NV + v)), scale), vload(fptr(mp, I64(v * vw))))
                     for v in range(NV)]
                top = s[0]
                for x in s[1:]:
                    top = vmax(top, x)
                top = horizontal(top, vmax)
                mp_old = b.gep(m_row, [I64(qi)], source_etype=F32)
                m_old = neg_inf if first else b.load(mp_old, typ=F32)
                m_new = top if first else vmax(m_old, top)     # max(-inf, top) is top
                c = b.select(b.fcmp_ordered("==", m_new, neg_inf), ir.Constant(F32, 0.0), m_new)
                if not first:
                    moved.append(b.fsub(m_old, c))
                shifts.append(c)
                b.store(m_new, mp_old)
                scores.append(s)
            if not first:   # the rows' rescales exp(m_old - c), one vector exp for all rows (each lane the
                # scalar form's bits): QB scalar exps were a fifth of a panel's instructions
                ms = ir.Constant(vec, ir.Undefined)
                for qi, x in enumerate(moved):
                    ms = b.insert_element(ms, x, I32(qi % vw))
                    if qi % vw == vw - 1 or qi == QB - 1:
                        ex = vmath.exp(ms)
                        rescale += [b.extract_element(ex, I32(k)) for k in range(qi % vw + 1)]
                        ms = ir.Constant(vec, ir.Undefined)
            for qi in range(QB):     # 3. probabilities (in the scores' registers) and running sums
                row = fptr(ptile, I64(qi * KB))
                c = splat(b, shifts[qi], vw)
                probs = [vmath.exp(b.fsub(x, c)) for x in scores[qi]]
                for v, x in enumerate(probs):
                    vstore(x, fptr(row, I64(v * vw)))
                total = probs[0]
                for x in probs[1:]:
                    total = b.fadd(total, x)
                lp = slot(l_vec, qi)
                if first:       # 0 * r + total is total (r is 0, or NaN where total is NaN too)
                    vstore(total, lp)
                    continue
                vstore(b.fadd(b.fmul(vload(lp), splat(b, rescale[qi], vw)), total), lp)
                r = splat(b, rescale[qi], vw)
                for w in range(NW):
                    a = slot(o_acc, qi * NW + w)
                    vstore(b.fmul(vload(a), r), a)

            def pv(j):      # 4. P · V: nw value vectors x qb broadcast probabilities
                vp = vrow(b.add(key0, j))
                vals = [eload(vp, I64(w * vw), vel) for w in range(NW)]
                for qi in range(QB):
                    pj = splat(b, b.load(fptr(ptile, b.add(j, I64(qi * KB))), typ=F32), vw)
                    for w in range(NW):
                        a = slot(o_acc, qi * NW + w)
                        vstore(b.call(fma, [pj, vals[w], vload(a)]), a)
            # the padded copy has zero rows past the last key; values read in place stop at it (a padded
            # key's probability is 0: the terms skipped are 0)
            em.loop_range(I64(0), I64(KB) if spec.v_axes is None else b.select(
                b.icmp_signed("<", b.sub(n_keys, key0), I64(KB)), b.sub(n_keys, key0), I64(KB)), pv)
        if QB == spec.qb:   # the full tile: panel 0 peeled (no rescale: at S <= KB the only one), then the rest
            em.loop_range(I64(0), b.select(b.icmp_signed(">", nkb, I64(0)), I64(1), I64(0)),
                          lambda t: panel(t, first=True))
            em.loop_range(I64(1), nkb, panel)
        else:               # a last block's few rows: one copy of the panel's code (compile time)
            em.loop_range(I64(0), nkb, panel)

        lanes = ir.Constant(ir.VectorType(I64, vw), list(range(vw)))
        mstore = km.declare(f"llvm.masked.store.v{vw}f32.p0", ir.VoidType(), [vec, ir.PointerType(), I32,
                                                                              ir.VectorType(I1, vw)])
        keys = b.mul(nkb, I64(KB)) if spec.v_axes is None else n_keys

        def store_row(out, ys):
            for w, y in enumerate(ys):
                at = fptr(out, I64(w * vw))
                if (w + 1) * vw <= spec.dv:
                    vstore(y, at)
                elif w * vw < spec.dv:
                    keep = b.icmp_signed("<", b.add(lanes, splat(b, I64(w * vw), vw)), splat(b, I64(spec.dv), vw))
                    b.call(mstore, [y, at, I32(4), keep])

        def zero_times_values(out):
            """sum_j 0 * V[j]: the guarded composite's P · V for a row whose probabilities were all NaN (each
            then 0): 0, or NaN in a column holding an infinite or NaN value."""
            z = em.alloca(vec, NW)
            for w in range(NW):
                vstore(zero_v, slot(z, w))

            def add(j):
                vp = vrow(j)
                for w in range(NW):
                    vstore(b.fadd(vload(slot(z, w)), b.fmul(zero_v, eload(vp, I64(w * vw), vel))), slot(z, w))
            em.loop_range(I64(0), keys, add)
            store_row(out, [vload(slot(z, w)) for w in range(NW)])

        for qi in range(QB):         # the rows: acc / l, stored below Sq
            i = b.add(i0, I64(qi))
            with b.if_then(b.icmp_signed("<", i, Sq)):
                l_sum = horizontal(vload(slot(l_vec, qi)), b.fadd)
                lv = splat(b, l_sum, vw)
                out = em.address(st.buf, spec.out_index(n, h, i, I64(0)))

                def quotient(out=out, qi=qi, lv=lv):
                    store_row(out, [b.fdiv(vload(slot(o_acc, qi * NW + w)), lv) for w in range(NW)])
                if not spec.zero_nan:
                    quotient()
                    continue
                # the row's probabilities are NaN exactly when l is (a NaN or infinite score) or 0 (every key -inf)
                nan_row = b.or_(b.fcmp_unordered("uno", l_sum, l_sum),
                                b.fcmp_ordered("==", l_sum, ir.Constant(F32, 0.0)))
                with b.if_else(nan_row, likely=False) as (then, otherwise):
                    with then:
                        zero_times_values(out)
                    with otherwise:
                        quotient()

    def unit(p):
        qblk = b.srem(p, nqb)
        bh = b.sdiv(p, nqb)
        h = b.srem(bh, I64(H))
        n = b.sdiv(bh, I64(H))
        i0 = b.mul(qblk, I64(QB))
        # a whole block takes the full tile; the last rows (Sq not a multiple of QB, a decode step's one
        # query) one at a time, so no row is computed twice
        if spec.k_axes is not None:     # keys read in place: every row alone
            em.loop_range(i0, b.select(b.icmp_signed("<", b.add(i0, I64(QB)), Sq), b.add(i0, I64(QB)), Sq),
                          lambda i: tile(n, h, i, 1))
            return
        left = b.sub(Sq, i0)

        def rows_tile(r):
            """A block of ``r`` rows (QB: a whole one; fewer: the last) takes an ``r``-row tile."""
            if r == 1:
                tile(n, h, i0, 1)
                return
            with b.if_else(b.icmp_signed(">=", left, I64(r))) as (then, otherwise):
                with then:
                    tile(n, h, i0, r)
                with otherwise:
                    rows_tile(r - 1)
        rows_tile(QB)

    em.loop_range(begin, end, unit)
    b.ret_void()
    extent = spec.batch * H * ((spec.rows + QB - 1) // QB)
    return extent, 1


def transpose(b: ir.IRBuilder, rows: list) -> list:
    """The columns of the square matrix whose rows are the ``n`` vectors ``rows`` (``n`` lanes each, a power of
    two): log2(n) butterfly stages of two-input shuffles, stage ``s`` swapping bit ``s`` of the row index with
    bit ``s`` of the lane index."""
    n = len(rows)
    rows = list(rows)
    s = 1
    while s < n:
        lo = ir.Constant(ir.VectorType(I32, n), [c if not c & s else c - s + n for c in range(n)])
        hi = ir.Constant(ir.VectorType(I32, n), [c + s if not c & s else c + n for c in range(n)])
        for i in range(n):
            if not i & s:
                x, y = rows[i], rows[i + s]
                rows[i], rows[i + s] = b.shuffle_vector(x, y, lo), b.shuffle_vector(x, y, hi)
        s *= 2
    return rows


def emit_key_panels_stage(km, st: Stage, sym: str) -> Optional[Tuple[object, int]]:
    """The keys' panels ``kt[B, H, KBLOCKS, D, KB]`` (an ``attention_keys`` stage): a unit is one panel of one
    (batch, head). Its elements are computed key by key, ``d`` innermost (where the keys come from, ``d`` is
    the contiguous axis: the exports' K rows), into a stack tile ``[KB, D]``, which is then stored transposed,
    ``lanes x lanes`` blocks at a time through registers. (The generic loop nest ran ``KB`` innermost, a gather
    of one float per key: 93% of a decode step's fused attention at 1,025 keys.) Where the keys' rows are a
    stored buffer (the node's attr: the buffer, its axes, the key count) a panel of keys all below the count
    loads its ``lanes x lanes`` blocks straight from those rows: through the tile, the loop vectoriser's
    256-bit stores were read back by 512-bit loads, a store-forwarding stall per row (47% of the kernel's
    samples on one load, BERT-base S = 384)."""
    e = st.expr
    if e.op != "attention_keys" or st.region is not None:
        return None
    idx = e.args[:-1]
    if len(idx) != len(st.vars) or any(a.op != "var" or a.attr != v.attr for a, v in zip(idx, st.vars)):
        return None
    B, H, nkb, D, KB = st.buf.shape
    vw = max(4, km.vector_bits // 32)
    if not all(isinstance(x, int) for x in (H, D, KB)) or D % vw or KB % vw:
        return None
    vec = ir.VectorType(F32, vw)
    vptr = ir.PointerType(vec)
    em, begin, end = km.kernel(sym)
    b = em.b
    tile = em.alloca(F32, KB * D)
    blocks_n = em.index(nkb)
    plain = e.args[-1]
    stored = e.attr     # (the keys' stored rows, their axes, the key count), or None

    def fptr(base, off):
        return b.gep(base, [off], source_etype=F32, inbounds=True)

    def unit(p):
        t = b.srem(p, blocks_n)
        bh = b.sdiv(p, blocks_n)
        h = b.srem(bh, I64(H))
        n = b.sdiv(bh, I64(H))

        out = em.address(st.buf, [n, h, t, I64(0), I64(0)])

        def blocks(row_vector):
            """The panel stored transposed, from ``row_vector(r, d0)``: key r's vector of d0 .. d0 + lanes - 1."""
            for jb in range(KB // vw):
                for db in range(D // vw):
                    rows = [row_vector(jb * vw + r, db * vw) for r in range(vw)]
                    for r, col in enumerate(transpose(b, rows)):
                        b.store(col, b.bitcast(fptr(out, I64((db * vw + r) * KB + jb * vw)), vptr), align=4)

        def through_tile():
            def key(j):
                def element(d):
                    for v, i in zip(st.vars, (n, h, t, d, j)):
                        em.env[v.attr] = i
                    b.store(em.emit(plain), fptr(tile, b.add(b.mul(j, I64(D)), d)))
                em.loop_range(I64(0), I64(D), element)
            em.loop_range(I64(0), I64(KB), key)
            blocks(lambda r, d0: b.load(b.bitcast(fptr(tile, I64(r * D + d0)), vptr), typ=vec, align=4))
        if stored is None:
            through_tile()
            return
        kbuf, axes, keys = stored
        key0 = b.mul(t, I64(KB))

        def from_rows(r, d0):
            at = (n, h, b.add(key0, I64(r)), I64(d0))
            p = em.address(kbuf, stored_index(axes, at, I64(0)))
            return b.load(b.bitcast(p, vptr), typ=vec, align=4)
        with b.if_else(b.icmp_signed("<=", b.add(key0, I64(KB)), em.index(keys))) as (whole, last):
            with whole:
                blocks(from_rows)
            with last:
                through_tile()
    em.loop_range(begin, end, unit)
    b.ret_void()
    return B * H * nkb, 1
