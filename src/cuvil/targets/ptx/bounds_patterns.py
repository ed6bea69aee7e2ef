"""The global-memory access patterns of the PTX kernels, stated for the bounds prover (:mod:`cuvil.kernels.bounds`).

Every GPU kernel shape of :mod:`cuvil.targets.ptx.codegen` but four (below) evaluates the stage's texpr
expression at output and reduction indices inside the stage's loops (element, coarse, split, tiled kernels: the tiled
kernel's shared-memory staging tests ``term < R`` and ``position < P`` before it evaluates a factor), so
the shared machinery proves them from the stage's loads and store as they are. The first exception is a
convolution computed by the implicit-GEMM kernel of :mod:`cuvil.targets.ptx.conv`: it does not read
through the contraction node's loads but forms its own addresses. :class:`GpuPatterns` states them here as
index expressions over that kernel's own loop variables (tile, slice, chunk, row, column, lane), as
``emit_conv`` computes them:

* weight panels, ``float4`` loads: flat element ``((g * Mb + mt) * K + k) * TM + 4 * c4 + i`` of the packed
  panels, ``k = s * kchunk + chunk * TK + row`` inside the slice (``k0 < min(slice end, K)``; the row
  ``k < K`` tested only when TK does not divide K);
* the window: flat element ``n * xs0 + (g * cin + c) * xs1 + sum_d q_d * xs_d`` of the input with
  ``q_d = o_d * s_d - pad_d + tap_d * dil_d`` at the thread's column clamped to the last position; where
  padded, the offset is selected to 0 outside the input (the load itself is unconditional); unpadded,
  the load is skipped only for terms past K;
* tile stores, tested ``m < M`` and ``p < P``: the output at ``(n, g * M + m, unflatten(p))``, or with
  split-K the partial sum at flat ``((s * N + n) * G * M + g * M + m) * P + p`` of the scratch area after
  the arena; the sum kernel (or the fused last slice) reads the S partials back, and the fused variant's
  per-tile counters are indexed by the tile.

A tensor-core product (:mod:`cuvil.targets.ptx.matmul_mma`) forms its own addresses too: its chunk walk,
16-byte float16 vector loads and split-K partial sums ([splits, *batch, M, N] floats after the arena, read
back by the sum kernel) are stated by :meth:`GpuPatterns.matmul_accesses` as the obligations of the product's
stage (the hook's :attr:`~GpuPatterns.ops` adds ``reduce`` nodes), and the float32 SIMT product kernel's chunk
walk by :meth:`GpuPatterns.simt_accesses`, the one-row kernel's weight reads by :meth:`GpuPatterns.gemv_accesses`;
a product refuted there runs on the plain kernels
(:func:`refute_products`) and its stage is listed as guarded.

The fused attention kernel (:mod:`cuvil.targets.ptx.attention`) needs no pattern for its reads: its node
(:class:`~cuvil.kernels.attention.AttentionRows`) carries Q, K, V and the mask as index expressions and its
plain value reduces those very expressions over ``d < D``, ``key < Sk`` and ``c < Dv``, the ranges the kernel
evaluates them at (a thread past its split's last key loads nothing), so the prover walks the plain value's
loads, which are the kernel's, and the store at the stage's own indices; with its keys split over blocks the
hook states the partials' stores and the merge kernel's reads of them (:meth:`GpuPatterns.attention_accesses`).

The kernel computes these offsets in 32-bit arithmetic; :func:`~cuvil.targets.ptx.conv.conv_node` admits
only convolutions whose input and weight offsets are below 2^31 and ``add_conv_stage`` falls back to the
plain kernels where the partial sums would not be, so the int64 index expressions here are exact.
"""
from __future__ import annotations

from typing import List, Optional

import attrs

from ...errors import CuvilError
from ...ir.dtype import DType
from ...kernels.bounds import _FAMILIES, Access, BoundsProver, Certificate, prove_schedule, prove_stage, z3_false
from ...kernels.schedule import ARENA, Schedule, Stage
from ...kernels.texpr import Buf, E, as_index, cmp, idiv, imod, logic, nodes, select, substitute, var
from . import matmul_mma
from .attention import attention_node, partial_index
from .attention import scratch_buf as attention_scratch
from .kernel_shapes import single_sum
from .conv import TK, conv_node, scratch_buf


def _loop(doms, name: str, extent) -> E:
    v = var(name)
    doms[v.attr] = (0, extent)
    return v


def _window_index(spec, n: E, channel: E, out_pos: List[E], taps: List[E], ok: List[E]) -> E:
    """The flat index of a convolution's input element read by image ``n``, input ``channel``, output position
    ``out_pos`` and kernel ``taps`` (one per spatial dimension), selected to 0 where a padded position falls
    outside the input or a test of ``ok`` fails."""
    xs = spec.x.strides
    off = n * xs[0] + channel * xs[1]
    ok = list(ok)
    padded = bool(spec.pads)         # (the lowering records pads per spatial dimension, or none)
    for dd, (od, kd) in enumerate(zip(out_pos, taps)):
        qd = od * int(spec.strides[dd]) - (int(spec.pads[dd]) if padded else 0) + kd * int(spec.dilations[dd])
        if padded:
            ok += [_ge0(qd), _lt(qd, int(spec.x.shape[2 + dd]))]
        off = off + qd * xs[2 + dd]
    both = _and(ok)
    return select(both, off, as_index(0)) if both is not None else off


def _unflatten(x: E, dims) -> List[E]:
    """Row-major digits of ``x`` over ``dims`` (the kernel's 32-bit udiv/urem chain)."""
    if not list(dims):
        return []
    out, rest = [], x
    for d in reversed(list(dims)[1:]):
        out.append(imod(rest, int(d)))
        rest = idiv(rest, int(d))
    out.append(rest)
    return out[::-1]


def _lt(a, b) -> E:
    return cmp("lt", as_index(a), as_index(b))


def _ge0(a) -> E:
    return cmp("ge", as_index(a), as_index(0))


def _and(conds: List[E]) -> Optional[E]:
    return None if not conds else conds[0] if len(conds) == 1 else logic("and", *conds)


class GpuPatterns:
    """The ``families`` hook of :func:`~cuvil.kernels.bounds.prove_schedule` for the PTX backend: the access
    pattern of the implicit-GEMM kernel for a stage's convolution, no accesses for the other family nodes
    (the PTX emitter evaluates their plain expression, whose loads the prover walks). ``km`` is the
    :class:`~cuvil.targets.ptx.codegen.PtxKernelModule` that will emit the stages (its convolution plans and
    scratch layout); ``widen`` adds ``widen`` to every loop extent of the stated patterns (tests: a pattern
    widened by one must be refuted)."""

    ops = _FAMILIES + ("reduce",)      # a tensor-core product is a plain reduction: the hook sees those too

    def __init__(self, km, widen: int = 0):
        self.km = km
        self.widen = widen

    def conv_plan(self, st: Stage, node: E):
        """The plan the kernel module emits ``st`` with, or None where it takes the plain kernels."""
        if conv_node(st) is not node:
            return None
        plan = self.km.conv_plan(st, node)
        if plan.splits > 1 and (self.km.scratch_offset + self.km.counter_bytes) // 4 + plan.scratch_floats >= 2 ** 31:
            return None
        return plan

    def __call__(self, st: Stage, node: E, doms) -> List[Access]:
        if node.op == "reduce":
            mm = self.matmul_plan(st, node)
            if mm is not None:
                return self.matmul_accesses(st, *mm, dict(doms))
            simt = self.simt_plan(st, node)
            if simt is not None:
                return self.simt_accesses(st, *simt, dict(doms))
            gemv = self.gemv_plan(st, node)
            return [] if gemv is None else self.gemv_accesses(st, *gemv, dict(doms))
        if node.op == "attention":
            return self.attention_accesses(st, node, dict(doms))
        if node.op != "contract":
            return []
        plan = self.conv_plan(st, node)
        if plan is None:
            return []
        return self.conv_accesses(st, node, plan, dict(doms))

    def conv_accesses(self, st: Stage, node: E, plan, d) -> List[Access]:
        if hasattr(plan, "fmt"):
            return self.conv_mma_accesses(st, node, plan, d)
        spec, w = node.attr, self.widen
        kind = "family:conv"
        TM, TP, K, M, P, N, G = plan.tm, plan.tp, plan.k, plan.m, plan.p, plan.n, plan.groups
        S = plan.splits
        out: List[Access] = []
        # the block's tile (its flat block index unflattened: a bijection onto these ranges)
        pt, mt = _loop(d, "pt", plan.tiles_p + w), _loop(d, "mt", plan.tiles_m + w)
        s, n, g = _loop(d, "s", S + w), _loop(d, "n", N + w), _loop(d, "g", G + w)
        # the chunk loop: k0 = klo + chunk * TK while k0 < khi = min(klo + kchunk, K)
        klo = s * plan.kchunk
        k0 = klo + _loop(d, "chunk", -(-plan.kchunk // TK) + w) * TK
        khi = select(_lt(klo + plan.kchunk, K), klo + plan.kchunk, as_index(K))
        in_slice = _lt(k0, khi)
        guard_k = K % TK != 0
        # weight panels: rows of the chunk, float4 columns, their 4 lanes
        row, c4, lane = _loop(d, "row", TK + w), _loop(d, "c4", TM // 4 + w), _loop(d, "lane", 4 + w)
        k = k0 + row
        aidx = ((g * plan.tiles_m + mt) * K + k) * TM + c4 * 4 + lane
        out.append(Access(kind, spec.a, [aidx], [in_slice] + ([_lt(k, K)] if guard_k else []), d, node=node,
                          flat=True))
        # the window: this thread's column (clamped to the last position), its chunk rows
        col, xrow_ = _loop(d, "col", TP + w), _loop(d, "xrow", TK + w)
        pos = pt * TP + col
        pos = select(_lt(pos, P), pos, as_index(P - 1))
        o = _unflatten(pos, spec.out_spatial)
        kx = k0 + xrow_
        c, *taps = _unflatten(kx, [spec.cin] + [int(t) for t in spec.kernel])
        xs = spec.x.strides
        off = n * xs[0] + (g * spec.cin + c) * xs[1]
        pads = [int(p) for p in spec.pads]
        if pads:
            ok = [_lt(kx, K)] if guard_k else []
            for dd, (od, kd) in enumerate(zip(o, taps)):
                q = od * int(spec.strides[dd]) - pads[dd] + kd * int(spec.dilations[dd])
                ok += [_ge0(q), _lt(q, int(spec.x.shape[2 + dd]))]
                off = off + q * xs[2 + dd]
            both = _and(ok)
            xidx = select(both, off, as_index(0)) if both is not None else off
            out.append(Access(kind, spec.x, [xidx], [in_slice], d, node=node, flat=True))
        else:
            for dd, (od, kd) in enumerate(zip(o, taps)):
                off = off + (od * int(spec.strides[dd]) + kd * int(spec.dilations[dd])) * xs[2 + dd]
            out.append(Access(kind, spec.x, [off], [in_slice] + ([_lt(kx, K)] if guard_k else []), d, node=node,
                              flat=True))
        # tile stores: the accumulator at (m, p) of the tile, tested m < M and p < P
        m = mt * TM + _loop(d, "tm", TM + w)
        p = pt * TP + _loop(d, "tp", TP + w)
        inside = [_lt(m, M), _lt(p, P)]
        if S == 1:
            out.append(Access(kind, st.buf, [n, g * M + m] + _unflatten(p, spec.out_spatial), inside, d, node=node))
            return out
        scratch = self.km_scratch(plan)
        flat = ((s * N + n) * (G * M) + g * M + m) * P + p
        out.append(Access(kind, scratch, [flat], inside, d, node=node, flat=True))      # partial sums
        if self.km.fused_splitk:       # the last slice reads every slice's partial back, counts per tile
            s2 = _loop(d, "s", S + w)
            out.append(Access(kind, scratch, [((s2 * N + n) * (G * M) + g * M + m) * P + p], inside, d, node=node,
                              flat=True))
            tile = ((n * G + g) * plan.tiles_m + mt) * plan.tiles_p + pt
            out.append(Access(kind, self.counters(), [tile], [], d, node=node))
        else:                        # the sum kernel: partial s of the stage's own output element
            e = dict(d)
            s2 = _loop(e, "s", S + w)
            vs = list(st.vars)
            p_e = vs[2] if len(vs) > 2 else as_index(0)
            for dim, v in zip(spec.out_spatial[1:], vs[3:]):
                p_e = p_e * int(dim) + v
            out.append(Access("family:conv_sum", scratch, [s2, vs[0], vs[1], p_e], [], e, node=node))
        return out

    def conv_mma_accesses(self, st: Stage, node: E, plan, d) -> List[Access]:
        """The whole-batch tensor-core kernel (:mod:`cuvil.targets.ptx.conv_mma`): columns ``q = n * P + p``
        over the batch, clamped to the last; weight terms past K clamped to K - 1 (zeroed when staged), window
        offsets selected to 0 outside the input or past K (the loads are unconditional)."""
        spec, w = node.attr, self.widen
        kind = "family:conv"
        BM, BN, TKc, K, M, P, N, G = plan.bm, plan.bn, plan.tk, plan.k, plan.m, plan.p, plan.n, plan.groups
        S, COLS = plan.splits, plan.cols
        out: List[Access] = []
        qt, mt = _loop(d, "qt", plan.tiles_q + w), _loop(d, "mt", plan.tiles_m + w)
        s, g = _loop(d, "s", S + w), _loop(d, "g", G + w)
        klo = s * plan.kchunk
        chunk = _loop(d, "chunk", -(-plan.kchunk // TKc) + w)
        k0 = klo + chunk * TKc
        khi = select(_lt(klo + plan.kchunk, K), klo + plan.kchunk, as_index(K))
        in_slice = _lt(k0, khi)
        if plan.tap_major:      # k0 = TK * kidx (the slices are whole chunks)
            out += self.conv_mma_tap_major_loads(node, plan, d, mt, qt, g, s * (plan.kchunk // TKc) + chunk,
                                                 in_slice)
        else:
            loads = self.conv_mma_async_copies if plan.vec else self.conv_mma_staged_loads
            out += loads(node, plan, d, mt, qt, g, k0, in_slice)
        # stores: (m, column) of the tile, tested m < M and column < N * P
        m = mt * BM + _loop(d, "tm", BM + w)
        col = qt * BN + _loop(d, "tq", BN + w)
        inside = [_lt(m, M), _lt(col, COLS)]
        cn, cp = idiv(col, P), imod(col, P)
        if S == 1:
            out.append(Access(kind, st.buf, [cn, g * M + m] + _unflatten(cp, spec.out_spatial), inside, d, node=node))
            return out
        scratch = self.km_scratch(plan)
        out.append(Access(kind, scratch, [((s * N + cn) * (G * M) + g * M + m) * P + cp], inside, d, node=node,
                          flat=True))
        if self.km.tuning.conv_mma_fused_splitk:    # the last slice reads every slice's partial back, counts per tile
            s2 = _loop(d, "s2", S + w)
            out.append(Access(kind, scratch, [((s2 * N + cn) * (G * M) + g * M + m) * P + cp], inside, d, node=node,
                              flat=True))
            out.append(Access(kind, self.counters(), [(g * plan.tiles_m + mt) * plan.tiles_q + qt], [], d, node=node))
            return out
        e = dict(d)
        s2 = _loop(e, "s", S + w)
        vs = list(st.vars)
        p_e = vs[2] if len(vs) > 2 else as_index(0)
        for dim, v in zip(spec.out_spatial[1:], vs[3:]):
            p_e = p_e * int(dim) + v
        out.append(Access("family:conv_sum", scratch, [s2, vs[0], vs[1], p_e], [], e, node=node))
        return out

    def conv_mma_staged_loads(self, node, plan, d, mt, qt, g, k0, in_slice) -> List[Access]:
        """The register-staged loads of :mod:`cuvil.targets.ptx.conv_mma`."""
        spec, w, kind = node.attr, self.widen, "family:conv"
        BM, BN, TKc, K, P, COLS, TM = plan.bm, plan.bn, plan.tk, plan.k, plan.p, plan.cols, plan.tm
        guard_k = K % TKc != 0
        out: List[Access] = []
        # weights: channel mc of the block's BM (4 per vector load), term k of the chunk (clamped)
        mc = mt * BM + _loop(d, "mrow", BM + w)
        k = k0 + _loop(d, "row", TKc + w)
        if guard_k:
            k = select(_lt(k, K), k, as_index(K - 1))
        aidx = ((g * (plan.m_pad // TM) + idiv(mc, TM)) * K + k) * TM + imod(mc, TM)
        out.append(Access(kind, spec.a, [aidx], [in_slice], d, node=node, flat=True))
        # the window: this thread's column over the batch (clamped), its run of the chunk's terms
        q = qt * BN + _loop(d, "col", BN + w)
        q = select(_lt(q, COLS), q, as_index(COLS - 1))
        nn, pp = idiv(q, P), imod(q, P)
        o = _unflatten(pp, spec.out_spatial)
        kx = k0 + _loop(d, "xrow", TKc + w)
        c, *taps = _unflatten(kx, [spec.cin] + [int(t) for t in spec.kernel])
        xidx = _window_index(spec, nn, g * spec.cin + c, o, taps, [_lt(kx, K)] if guard_k else [])
        out.append(Access(kind, spec.x, [xidx], [in_slice], d, node=node, flat=True))
        return out

    def conv_mma_tap_major_loads(self, node, plan, d, mt, qt, g, kidx, in_slice) -> List[Access]:
        """The register-staged loads in (tap, channel) order (``plan.tap_major``: C a multiple of TK, so chunk
        ``k0 = TK * kidx`` is tap k0 // C = kidx // (C / TK) and channels k0 % C = TK * (kidx % (C / TK)) ..,
        the kernel's divmod of k0 by C written in kidx): weight row channel * taps + tap; the window at channel
        c0 + h * BT + j of the tap's input position, selected to 0 outside the input."""
        spec, w, kind = node.attr, self.widen, "family:conv"
        BM, BN, TKc, K, P, COLS, TM = plan.bm, plan.bn, plan.tk, plan.k, plan.p, plan.cols, plan.tm
        C, BT = spec.cin, plan.b_terms
        ntaps, CC = K // C, C // TKc
        tap, c0 = idiv(kidx, CC), imod(kidx, CC) * TKc
        out: List[Access] = []
        mc = mt * BM + _loop(d, "mrow", BM + w)
        c = c0 + _loop(d, "row", TKc + w)
        aidx = ((g * (plan.m_pad // TM) + idiv(mc, TM)) * K + c * ntaps + tap) * TM + imod(mc, TM)
        out.append(Access(kind, spec.a, [aidx], [in_slice], d, node=node, flat=True))
        q = qt * BN + _loop(d, "col", BN + w)
        q = select(_lt(q, COLS), q, as_index(COLS - 1))
        nn, pp = idiv(q, P), imod(q, P)
        o = _unflatten(pp, spec.out_spatial)
        cx = c0 + _loop(d, "xh", TKc // BT + w) * BT + _loop(d, "xj", BT + w)
        taps = _unflatten(tap, [int(t) for t in spec.kernel])
        xidx = _window_index(spec, nn, g * C + cx, o, taps, [])
        out.append(Access(kind, spec.x, [xidx], [in_slice], d, node=node, flat=True))
        return out

    def conv_mma_async_copies(self, node, plan, d, mt, qt, g, k0, in_slice) -> List[Access]:
        """The cp.async kernel's copies (:func:`cuvil.targets.ptx.conv_mma.async_vec`): 16 bytes of a weight
        panel row (8 channels of the block, term k; past K the address is the panel's start and nothing is
        read), ``vec`` halves of an input row (positions q .. q + vec - 1 of one image, channel k; outside the
        batch or past K the buffer's start)."""
        spec, w, kind = node.attr, self.widen, "family:conv"
        BM, BN, TKc, K, P, COLS, TM, V = plan.bm, plan.bn, plan.tk, plan.k, plan.p, plan.cols, plan.tm, plan.vec
        out: List[Access] = []
        k = k0 + _loop(d, "row", TKc + w)
        mc = mt * BM + _loop(d, "seg", BM // 8 + w) * 8
        e = _loop(d, "e", 8 + w)
        aidx = ((g * (plan.m_pad // TM) + idiv(mc, TM)) * K + k) * TM + imod(mc, TM)
        out.append(Access(kind, spec.a, [select(_lt(k, K), aidx, as_index(0)) + e], [in_slice], d, node=node,
                          flat=True))
        q = qt * BN + _loop(d, "qseg", BN // V + w) * V
        ev = _loop(d, "ev", V + w)
        xs = spec.x.strides
        xidx = idiv(q, P) * xs[0] + (g * spec.cin + k) * xs[1] + imod(q, P)
        ok = _and([_lt(q, COLS), _lt(k, K)])
        out.append(Access(kind, spec.x, [select(ok, xidx, as_index(0)) + ev], [in_slice], d, node=node,
                          flat=True))
        return out

    def matmul_plan(self, st: Stage, node: E):
        """(parts, plan) where the kernel module emits ``st`` as a tensor-core product whose reduction is
        ``node`` (:meth:`~cuvil.targets.ptx.codegen.PtxKernelModule.matmul_plan`), else None."""
        km = self.km
        if not km.tuning.mma or st.expr.op == "sequential" or (km.tuning.conv_enabled and conv_node(st) is not None):
            return None
        mm = km.matmul_plan(st)
        return mm if mm is not None and mm[0][0] is node else None

    def simt_plan(self, st: Stage, node: E):
        """(parts, plan) where the kernel module emits ``st`` with the float32 SIMT product kernel, else None
        (as ``PtxKernelModule.add_stage_plain`` chooses: not a tensor-core product, ``tuning.simt_matmul``)."""
        km = self.km
        if not km.tuning.simt_matmul or st.expr.op == "sequential" or \
                (km.tuning.conv_enabled and conv_node(st) is not None) or \
                (km.tuning.mma and km.matmul_plan(st) is not None):
            return None
        simt = km.simt_plan(st)
        return simt if simt is not None and simt[0][0] is node else None

    def gemv_plan(self, st: Stage, node: E):
        """(parts, plan) where the kernel module emits ``st`` with the one-row product kernel
        (:mod:`cuvil.targets.ptx.gemv`, ``tuning.gemv``), else None."""
        km = self.km
        if not km.tuning.gemv or st.expr.op == "sequential" or \
                (km.tuning.conv_enabled and conv_node(st) is not None) or \
                (km.tuning.mma and km.matmul_plan(st) is not None) or \
                (km.tuning.simt_matmul and km.simt_plan(st) is not None):
            return None
        gemv = km.gemv_plan(st)
        return gemv if gemv is not None and gemv[0][0] is node else None

    def gemv_accesses(self, st: Stage, parts, plan, d) -> List[Access]:
        """The one-row product kernel (:func:`~cuvil.targets.ptx.gemv.emit_gemv`): per row ``k < K`` of the
        weight factor, the thread's columns of tile ``tile``: with 16-byte loads the weight load at column
        ``n0 = tile * TN + VEC * ct`` (or ``N - VEC`` where ``n0`` is past ``N``) and its last index + 0 ..
        VEC - 1, the factor's other loads at ``n0``; else the factor at columns ``tile * TN + ct + j * CT``
        clamped to ``N - 1``. (``x`` is read at ``k < K`` through the stage's own loads; the epilogue stores at
        column ``< N`` through the stage's store.)"""
        red, _afac, wfac, _ = parts
        w, kind = self.widen, "family:gemv"
        kv, nv = red.attr[1][0].attr, st.vars[-1].attr
        N, K, CT, TN, VEC = plan.n, plan.k, plan.ct, plan.tn, plan.vec
        k = _loop(d, "k", K + w)
        tile = _loop(d, "tile", plan.tiles + w)
        ct = _loop(d, "ct", CT + w)
        loads = [x for x in nodes(wfac) if x.op == "load"]
        out: List[Access] = []
        if plan.vector:
            n0 = tile * TN + ct * VEC
            env = {kv: k, nv: select(_lt(n0, N), n0, as_index(N - VEC))}
            for i, ld in enumerate(loads):
                idx = [substitute(a, env) for a in ld.args]
                if i == 0:       # the vector: VEC elements along the contiguous last index
                    idx[-1] = idx[-1] + _loop(d, "e", VEC + w)
                out.append(Access(kind, ld.attr, idx, [], d))
            return out
        c = tile * TN + ct + _loop(d, "j", VEC + w) * CT
        env = {kv: k, nv: select(_lt(c, N - 1), c, as_index(N - 1))}
        return [Access(kind, ld.attr, [substitute(a, env) for a in ld.args], [], d) for ld in loads]

    def matmul_accesses(self, st: Stage, parts, plan, d) -> List[Access]:
        """The tensor-core product kernel (:func:`~cuvil.targets.ptx.matmul_mma.emit_matmul`) over its own
        loops: slice ``s``, round ``rnd`` and K group ``grp`` take chunk ``c = s * CPS + rnd * ks + grp`` while
        ``c < s * CPS + CPS``; tile ``(batch, mt, nt)``; per operand the tile's rows and the chunk's terms.

        * scalar operand loads: the factor's loads at the row clamped into the matrix and, when TK does not
          divide K, the term clamped into ``[0, K)`` (``tile_walk.fetch_chunk``);
        * vector loads (``plan.a_vec`` / ``b_vec`` = V): V halves from the factor's load at (row, term), its
          last index + 0 .. V - 1 (``vec_width`` admits only vectors none of whose elements is clamped): rows
          ``mt * BM + r`` clamped to the last and terms ``k0 + V * kv`` when k is contiguous, else rows
          ``mt * BM + V * rv`` (M a multiple of BM) and terms ``k0 + kk``;
        * cp.async copies (``plan.stages`` > 1, :func:`~cuvil.targets.ptx.matmul_mma.async_pieces`): 8 halves
          from the factor's load at (row, term) = (``mt * BM + r``, ``k0 + 8 * kv``) when k is contiguous, else
          (``mt * BM + 8 * rv``, ``k0 + kk``); a piece with its row past the matrix or its term past K reads
          nothing (source size 0) and its address is the one at (0, 0): both selected to 0 there;
        * split-K: the partial sums at flat ``((s * batches + batch) * M + m) * N + n`` of the scratch for
          ``m = mt * BM + i``, ``n = nt * BN + j`` where ``m < M`` and ``n < N``, and the sum kernel's reads
          ``splitk[s, *batch, m, n]`` at the stage's own indices.
        (Without split-K the epilogue stores through the stage's own store at ``m < M``, ``n < N``.)"""
        red, afac, bfac, _ = parts
        w, kind = self.widen, "family:matmul"
        vs = list(st.vars)
        kv, mv, nv = red.attr[1][0].attr, vs[-2].attr, vs[-1].attr
        M, N, K, TKm = plan.m, plan.n, plan.k, matmul_mma.TK
        S, CPS, KS = plan.splits, plan.slice_chunks, plan.ks
        out: List[Access] = []
        s = _loop(d, "s", S + w)
        c = s * CPS + _loop(d, "rnd", plan.rounds + w) * KS + _loop(d, "grp", KS + w)
        in_slice = _lt(c, s * CPS + CPS)
        k0 = c * TKm
        for which, fac, rv, ext, tile_rows, tiles, v in (("a", afac, mv, M, plan.bm, plan.tiles_m, plan.a_vec),
                                                         ("b", bfac, nv, N, plan.bn, plan.tiles_n, plan.b_vec)):
            base = _loop(d, "t" + which, tiles + w) * tile_rows
            kfast = plan.a_kfast if which == "a" else plan.b_kfast
            if plan.stages > 1:
                out.append(self.async_piece(fac.args[0], kfast, rv, ext, base, tile_rows, kv, K, k0, in_slice, d))
                continue
            if v == 1:
                out += self.fetched_loads(fac, rv, ext, base, tile_rows, kv, K, k0, TKm, [in_slice], d)
                continue
            ld = fac.args[0]        # vec_width: the factor is one float16 load
            if kfast:       # rows of a ragged tile clamped to the last (never stored)
                row = base + _loop(d, "r" + which, tile_rows + w)
                if ext % tile_rows:
                    row = select(_lt(row, ext), row, as_index(ext - 1))
                k = k0 + _loop(d, "kv" + which, TKm // v + w) * v
            else:
                row = base + _loop(d, "rv" + which, tile_rows // v + w) * v
                k = k0 + _loop(d, "kk" + which, TKm + w)
            # the V elements follow the last index (stride 1; a pitched view's rows lie further apart, so the
            # vector is stated as indices, not as a flat offset)
            idx = [substitute(i, {rv: row, kv: k}) for i in ld.args]
            idx[-1] = idx[-1] + _loop(d, "e" + which, v + w)
            conds = [in_slice] + ([] if int(ld.attr.strides[-1]) == 1 else [z3_false()])
            out.append(Access(kind, ld.attr, idx, conds, d))
        if S == 1:
            return out
        batches = plan.batches
        m = _loop(d, "tm", plan.tiles_m + w) * plan.bm + _loop(d, "im", plan.bm + w)
        n = _loop(d, "tn", plan.tiles_n + w) * plan.bn + _loop(d, "jn", plan.bn + w)
        bb = _loop(d, "batch", batches + w)
        scratch = matmul_mma.scratch_buf(plan, self.km.scratch_offset + self.km.counter_bytes)
        out.append(Access(kind, scratch, [((s * batches + bb) * M + m) * N + n], [_lt(m, M), _lt(n, N)], d,
                          flat=True))
        if self.km.tuning.mma_fused_splitk:     # the last slice reads every slice's partial back, counts per tile
            s2 = _loop(d, "s2", S + w)
            out.append(Access(kind, scratch, [((s2 * batches + bb) * M + m) * N + n], [_lt(m, M), _lt(n, N)], d,
                              flat=True))
            tm, tn = _loop(d, "tm", plan.tiles_m + w), _loop(d, "tn", plan.tiles_n + w)
            tile = (bb * plan.tiles_m + tm) * plan.tiles_n + tn
            out.append(Access(kind, self.counters(), [tile], [], d))
            return out
        e = dict(d)
        s2 = _loop(e, "s", S + w)
        out.append(Access("family:matmul_sum", scratch, [s2] + vs, [], e))
        return out

    def counters(self) -> Buf:
        """The split-K counters (one int32 per output tile of the largest fused split kernel), first in the
        scratch area after the arena (``PtxKernelModule.plan_scratch``)."""
        return Buf("splitk counters", DType.INT32, (self.km.counter_bytes // 4,), base=ARENA,
                   offset=self.km.scratch_offset)

    def async_piece(self, ld: E, kfast: bool, rv: str, ext: int, base: E, tile_rows: int, kv: str, K: int, k0: E,
                    in_slice: E, d) -> Access:
        """One cp.async piece of a product operand (see :meth:`matmul_accesses`)."""
        w, V = self.widen, matmul_mma.ASYNC_VEC
        if kfast:
            row = base + _loop(d, "r" + rv, tile_rows + w)
            k = k0 + _loop(d, "kv" + rv, matmul_mma.TK // V + w) * V
        else:
            row = base + _loop(d, "rv" + rv, tile_rows // V + w) * V
            k = k0 + _loop(d, "kk" + rv, matmul_mma.TK + w)
        ok = _and(([_lt(row, ext)] if ext % tile_rows else []) + ([_lt(k, K)] if K % matmul_mma.TK else []))
        if ok is not None:
            row, k = select(ok, row, as_index(0)), select(ok, k, as_index(0))
        idx = [substitute(i, {rv: row, kv: k}) for i in ld.args]
        idx[-1] = idx[-1] + _loop(d, "e" + rv, V + w)
        conds = [in_slice] + ([] if int(ld.attr.strides[-1]) == 1 else [z3_false()])
        return Access("family:matmul", ld.attr, idx, conds, d)

    def fetched_loads(self, fac: E, rv: str, ext: int, base: E, tile_rows: int, kv: str, K: int, k0: E, tk: int,
                      conds: List[E], d, kind: str = "family:matmul") -> List[Access]:
        """A product operand's elements as ``tile_walk.fetch_chunk`` reads them: the factor's loads at tile row
        ``base + r`` clamped to ``ext - 1`` and term ``k0 + kk`` (clamped to ``K - 1`` when ``tk`` does not
        divide ``K``)."""
        row = base + _loop(d, "r" + rv, tile_rows + self.widen)
        k = k0 + _loop(d, "kk" + rv, tk + self.widen)
        env = {rv: select(_lt(row, ext), row, as_index(ext - 1)),
               kv: select(_lt(k, K), k, as_index(K - 1)) if K % tk else k}
        return [Access(kind, ld.attr, [substitute(i, env) for i in ld.args], list(conds), d)
                for ld in [x for x in nodes(fac) if x.op == "load"]]

    def simt_accesses(self, st: Stage, parts, plan, d) -> List[Access]:
        """The float32 SIMT product kernel (:func:`~cuvil.targets.ptx.matmul_simt.emit_simt`): group ``grp``
        fetches chunk ``grp`` first, then in round ``rnd`` chunk ``min(rnd * ks + grp + ks, chunks - 1)``
        (unconditionally); per operand the tile's rows and the chunk's terms (:meth:`fetched_loads`)."""
        red, afac, bfac, _ = parts
        w = self.widen
        vs = list(st.vars)
        kv, mv, nv = red.attr[1][0].attr, vs[-2].attr, vs[-1].attr
        KS, C = plan.ks, plan.chunks
        out: List[Access] = []
        for first in (True, False):
            e = dict(d)
            grp = _loop(e, "grp", KS + w)
            if first:
                c = grp
            else:
                nxt = _loop(e, "rnd", plan.rounds + w) * KS + grp + KS
                c = select(_lt(nxt, C - 1), nxt, as_index(C - 1))
            for fac, rv, ext, rows, tiles in ((afac, mv, plan.m, plan.bm, plan.tiles_m),
                                              (bfac, nv, plan.n, plan.bn, plan.tiles_n)):
                base = _loop(e, "t" + rv, tiles + w) * rows
                out += self.fetched_loads(fac, rv, ext, base, rows, kv, plan.k, c * plan.tk, plan.tk, [], e,
                                          kind="family:matmul_simt")
        return out

    def attention_accesses(self, st: Stage, node: E, d) -> List[Access]:
        """A FusedAttention split over blocks (:func:`~cuvil.targets.ptx.attention.plan_attention`): each
        unit ``u < rows x splits`` stores its partials, ``m`` and ``l`` (thread 0) and ``acc`` / ``z`` at column
        ``c < Dv``, at :func:`~cuvil.targets.ptx.attention.partial_index` of the scratch after the arena, and the
        merge kernel reads the same elements back (the same indices, so one obligation each). Without a split
        the kernel's reads are its plain value's (walked by the prover) and it stores at the stage's indices."""
        if attention_node(st) is not node:
            return []
        plan = self.km.attention_plan(st)
        if plan.splits == 1:
            return []
        w = self.widen
        scratch = attention_scratch(plan, self.km.scratch_offset + self.km.counter_bytes)
        u = _loop(d, "unit", plan.units + w)
        c = _loop(d, "col", plan.dv + w)
        parts = ("m", "l", "acc") + (("z",) if plan.zero_nan else ())
        out = [Access("family:attention", scratch, [as_index(partial_index(plan, p, u, c if p in ("acc", "z") else 0))],
                      [], d, node=node, flat=True) for p in parts]
        if self.km.tuning.attention_fused_merge:     # the last block's count: one int32 per query row
            # declared with one int per query row (the reserved area is rounded up to 256 bytes: a widened
            # pattern must fail against the rows, not against the rounding)
            counters = Buf("attention counters", DType.INT32, (min(plan.rows, self.km.counter_bytes // 4),),
                           base=ARENA, offset=self.km.scratch_offset)
            out.append(Access("family:attention", counters, [_loop(d, "row", plan.rows + w)], [], d, node=node))
        return out

    def km_scratch(self, plan) -> Buf:
        return scratch_buf(plan, self.km.scratch_offset + self.km.counter_bytes)


def arena_limit(km, sched: Schedule, stages) -> int:
    """The arena the bundle allocates for these stages: the schedule's, then the split-K counters and the
    largest convolution's or tensor-core product's partial sums (as ``PtxKernelModule.add_conv_stage`` and
    ``add_matmul_stage`` reserve them)."""
    pats = GpuPatterns(km)
    need = 0
    for st in stages:
        node = conv_node(st) if km.tuning.conv_enabled else None
        plan = pats.conv_plan(st, node) if node is not None else None
        if plan is not None and plan.splits > 1:
            need = max(need, km.counter_bytes + 4 * plan.scratch_floats)
        # a split-K tensor-core product (PtxTuning.mma_sm_groups): its partial sums, [splits, *batch, M, N]
        # floats (their stores and the sum kernel's reads: GpuPatterns.matmul_accesses)
        mm = km.matmul_plan(st) if node is None and km.tuning.mma and st.expr.op != "sequential" else None
        if mm is not None and mm[1].splits > 1:
            need = max(need, km.counter_bytes + 4 * mm[1].scratch_floats)
        # a FusedAttention split over blocks: its partials (GpuPatterns.attention_accesses)
        att = km.attention_plan(st) if attention_node(st) is not None else None
        if att is not None and att.splits > 1:
            need = max(need, km.counter_bytes + 4 * att.scratch_floats)
    return km.scratch_offset + need if need else sched.arena_bytes


def prove_gpu_stages(sched: Schedule, stages: List[Stage], km, prover: Optional[BoundsProver] = None,
                     variant: str = "gpu") -> Certificate:
    """Prove the stages the kernel module ``km`` is about to emit (after kernel rules and float16
    widening), guarding in place those with unproved accesses; ``km``'s split-K scratch is planned for the
    guarded stages. The split-K scratch sits after the arena, so the arena the proof checks buffers against
    is the one the bundle allocates (:func:`arena_limit`); guards that take a convolution back to the plain
    kernels may shrink it, and the stages are then proved again against the smaller one."""
    prover = prover or BoundsProver()
    for st in stages:    # the PTX kernels run over the whole buffer; a region would be proved over its slice
        if st.region is not None:
            raise CuvilError(f"internal: stage {st.name} writes a region, which the PTX kernels do not honour "
                             f"(gpu_schedule does not split concatenations); report it")
    first: Optional[Certificate] = None
    while True:
        km.plan_scratch(stages)
        limit = arena_limit(km, sched, stages)
        if refute_products(sched, stages, km, prover):
            km.plan_scratch(stages)
            limit = arena_limit(km, sched, stages)
        cert = prove_schedule(attrs.evolve(sched, stages=stages, arena_bytes=limit), variant, prover,
                              families=GpuPatterns(km))
        if first is not None:        # a stage guarded by an earlier pass stays listed as guarded
            for k0, k in zip(first.kernels, cert.kernels):
                if k0.status != "proved" and k.status == "proved":
                    k.status, k.failures = "guarded", k0.failures
            cert.seconds += first.seconds
            cert.queries += first.queries
            cert.cache_hits += first.cache_hits
        for k in cert.kernels:       # a product refuted on the tensor cores runs on the plain kernels: guarded
            if k.stage in km.plain_products and k.status == "proved":
                k.status, k.failures = "guarded", list(km.plain_products[k.stage])
        first = cert
        km.plan_scratch(stages)
        if arena_limit(km, sched, stages) == limit:
            return cert


def refute_products(sched: Schedule, stages: List[Stage], km, prover: BoundsProver) -> bool:
    """Send every product whose tensor-core kernel's stated accesses (:meth:`GpuPatterns.matmul_accesses`)
    are not proved against the arena the bundle allocates to the plain kernels (``km.plain_products``, with
    the reasons), as a refuted convolution is; repeated until none is refuted (the scratch shrinks as
    products leave). Returns whether any was."""
    any_refuted = False
    while True:
        km.plan_scratch(stages)
        proof = attrs.evolve(sched, stages=stages, arena_bytes=arena_limit(km, sched, stages))
        pats, refuted = GpuPatterns(km), False
        for st in stages:
            red = single_sum(st) if st.name not in km.plain_products else None
            if red is None or (pats.matmul_plan(st, red) is None and pats.simt_plan(st, red) is None
                               and pats.gemv_plan(st, red) is None):
                continue
            _, failed = prove_stage(prover, proof, st, pats)
            why = [w for a, w in failed if a.kind.startswith(("family:matmul", "family:gemv"))]
            if why:
                km.plain_products[st.name] = why
                refuted = any_refuted = True
        if not refuted:
            return any_refuted
