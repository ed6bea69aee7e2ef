"""Lowering of FusedAttention. On x86 (and with static head sizes) as flash-style tiles
(:class:`cuvil.kernels.attention.AttentionTile`, the kernel of :mod:`cuvil.targets.x86.attention`): a block of
``QUERY_BLOCK`` query rows against a panel of ``KEY_BLOCK`` keys per step, so that each key and value vector
loaded is used by every row of the block; the operands stored once per call in the layouts that kernel reads
(see that module). Elsewhere (symbolic head sizes, another backend) as one sequential program per query row,
below.

The sequential form: one kernel, a row per (batch, head, query), walking the keys in
blocks with an online softmax (flash attention's recurrence); the [B, H, Sq, Sk] scores are never stored.

Per row, with ``m`` the running max of the scores seen, ``l`` the running sum of their exponentials and
``acc[Dv]`` the running sum of exp(score - m) * V, a step over the block of keys ``t*KB .. t*KB+KB-1``:

0. (once, before the rows) Kt and V copied with their key axes padded with zeros to whole blocks: O(S D)
   copies against the O(S^2 D) products, so that the loops below read contiguous keys with no clamped index;
1. ``s[j] = (Q[i] · Kt[:, key]) * scale + mask[i, key]`` (``-inf`` past the last key): a row of KB
   accumulators over contiguous keys, summed over d (x86's row schedule for sequential assignments);
2. ``m' = max(m, max_j s[j])``; the shift ``c = m'`` (0 while every score so far is ``-inf``, so a row masked
   so far adds exp(-inf) = 0 instead of NaN);
3. ``r = exp(m - c)``, ``p[j] = exp(s[j] - c)`` (in place of ``s``), ``l = l * r + sum_j p[j]``;
4. ``acc[d] = acc[d] * r + sum_j p[j] * V[key, d]``, unrolled over the block's keys in groups so that the
   innermost loop runs over ``d`` at unit stride (vectorised; a padded key adds 0 * 0);
5. ``m = m'``.

The output is ``acc / l``: a row whose every key is masked with ``-inf`` ends with ``l = 0`` and gives NaN,
as the unfused Softmax does; under ``zero_nan`` such a row (or one with a NaN score) is ``sum_j 0 * V[j]``, as
the guarded composite computes it (:func:`_guarded`). Rows run in parallel (x86: the thread pool splits
the stage's rows). Equal to the composite over the reals; in float32 the sums are reassociated (blocks,
rescaling), within the tolerances the unfused graph is held to (tests/test_attention.py).

Exp is the emitter's (``call("exp")``): the shared vector polynomial of :mod:`cuvil.targets.llvm.vecmath`.
"""
from __future__ import annotations

from ...ir.dtype import DType
from ..sequential import Assign, Sequential, sequential
from ..texpr import I64, Buf, E, binop, call, cast, cmp, const, dim_index, load, logic, reduce, select, substitute, var
from ..attention import AttentionRows, AttentionTile
from .core import ARENA, TensorFn, broadcast_fn, lowering, scalar_of, widened

KEY_BLOCK = 32      # keys per step: the scores of one block stay in L1 next to the accumulator
PV_GROUP = 4        # keys whose P·V terms one vectorised pass over d adds (one load/store of acc per group)
# Tiles: QUERY_BLOCK rows x KEY_BLOCK keys. With AVX-512 the scores of a tile are 6 x 2 vector accumulators and
# the output rows (head size 64) 6 x 4: each key vector loaded feeds 6 FMAs, each value vector 6.
QUERY_BLOCK = 6
TILE_VECTOR = 16    # the padding unit of the values' head size (AVX-512's lanes; a multiple of narrower ones)
NARROW_VECTOR = 8   # ... for a head size up to 8 (AVX2's lanes): such values are read in place, not copied padded
TILE_MAX_DV = 512   # a tile's output rows stay on the stack: wider heads take the sequential form
# Up to this many query rows (static: a decode step's one token) read stored keys in place, a row at a time,
# instead of copying the whole key cache into panels every call (the copy was O(Sk D) per step for O(Sk D)
# products: as costly as the attention itself). The head size must be whole vectors of any width.
IN_PLACE_ROWS = 2
# the key panels' kernel loads whole panels straight from the keys' stored rows (off: through its stack tile)
KEY_PANELS_FROM_ROWS = True


def _clamp(i: E, n) -> E:
    return E("clamp", (i,), I64, (0, n - 1))


@lowering("FusedAttention")
def _fused_attention(ctx):
    q, kt, v, scale_t, mask = (ctx.input(i) for i in range(5))
    dt = q.dtype
    if ctx.gpu_attention and _gpu_form(ctx, q, kt, v):
        return _rows(ctx, q, kt, v, scale_t, mask)
    if dt in (DType.FLOAT16, DType.BFLOAT16) and not ctx.gpu_attention:
        # x86, a float16 / bfloat16 model's attention: its operands widened (exactly) into the float32 kernel's
        # own copies, the output rounded once to the model's type (the GPU's kernel takes float16 as it is)
        (res,) = _fused_attention_float32(ctx, *(widened(t) for t in (q, kt, v, scale_t, mask)))
        return [TensorFn(res.shape, dt, lambda idx: cast(res(idx), dt), "injective")]
    if dt != DType.FLOAT:
        ctx.unsupported(f"FusedAttention of {dt.name}: the kernel computes in float32 (and widens float16 / bfloat16)")
    return _fused_attention_float32(ctx, q, kt, v, scale_t, mask)


def _fused_attention_float32(ctx, q, kt, v, scale_t, mask):
    """FusedAttention of float32 operands on x86: the tiled kernel where the head sizes are static, else the
    sequential loop form."""
    dt = q.dtype
    out_shape = ctx.out_shape()
    B, H, Sq, Dv = out_shape
    D, Sk = kt.shape[2], kt.shape[3]
    if ctx.row_kernels and all(isinstance(x, int) for x in (H, D, Dv)) and Dv <= TILE_MAX_DV:
        return _tiled(ctx, q, kt, v, scale_t, mask)
    qf = broadcast_fn(q, (B, H, Sq, D))
    steps = (Sk + KEY_BLOCK - 1) // KEY_BLOCK
    padded = steps * KEY_BLOCK
    n_keys = _to_index(Sk)

    def keys_padded(read, key_axis):
        """``read`` (a broadcast index function) with the key axis padded with zeros to whole blocks."""
        def f(idx):
            k = idx[key_axis]
            inner = list(idx)
            inner[key_axis] = _clamp(k, Sk)
            return select(cmp("lt", k, n_keys), read(inner), const(0.0, dt))
        return f
    # Kt and V stored once, their key axes padded to whole blocks (O(S D) copies against O(S^2 D) products):
    # a block's scores are then a row of accumulators over contiguous keys, summed over d (x86's row
    # schedule), with no clamped index (reading the exports' K [B, S, H, D] through their transposes would
    # gather across rows); a padded key's V row is 0, its probability exp(-inf) = 0.
    kf = ctx.temp((B, H, D, padded), dt, keys_padded(broadcast_fn(kt, (B, H, D, Sk)), 3), "keys")
    vf = ctx.temp((B, H, padded, Dv), dt, keys_padded(broadcast_fn(v, (B, H, Sk, Dv)), 2), "values")
    mf = broadcast_fn(mask, (B, H, Sq, Sk)) if mask is not None else None
    scale = scalar_of(scale_t)

    def scratch(name, shape):
        return Buf(f"{ctx.node.name}_{name}", dt, tuple(shape), ARENA, 0)
    m_buf, shift_buf, r_buf, l_buf = (scratch(n, (B, H, Sq)) for n in ("max", "shift", "rescale", "sum"))
    mnew_buf = scratch("newmax", (B, H, Sq))
    s_buf = scratch("scores", (B, H, Sq, KEY_BLOCK))
    acc_buf = scratch("acc", (B, H, Sq, Dv))

    b, h, i, step, j, d = var("b"), var("h"), var("i"), var("step"), var("j"), var("d")
    row = [b, h, i]
    zero, neg_inf = const(0.0, dt), const(float("-inf"), dt)
    key0 = step * KEY_BLOCK

    def key(jj: E) -> E:
        return key0 + jj

    def valid(jj: E) -> E:
        return cmp("lt", key(jj), _to_index(Sk))

    def score(jj: E) -> E:
        dot = reduce("sum", [D], lambda c: binop("mul", qf([b, h, i, c]), kf([b, h, c, key(jj)])))
        s = binop("mul", dot, scale)
        if mf is not None:
            s = binop("add", s, mf([b, h, i, _clamp(key(jj), Sk)]))
        return select(valid(jj), s, neg_inf)

    def at(buf, *extra):
        return load(buf, row + list(extra))

    def put(buf, value, loop_vars=(), extents=(), extra=()) -> Assign:
        return Assign(buf, row + list(extra), value, list(loop_vars), list(extents))

    init = [put(m_buf, neg_inf), put(l_buf, zero), put(acc_buf, zero, [d], [Dv], [d])]
    block_max = reduce("max", [KEY_BLOCK], lambda jj: load(s_buf, row + [jj]))
    new_max = select(cmp("gt", block_max, at(m_buf)), block_max, at(m_buf))
    body = [
        put(s_buf, score(j), [j], [KEY_BLOCK], [j]),
        put(mnew_buf, new_max),
        put(shift_buf, select(cmp("eq", at(mnew_buf), neg_inf), zero, at(mnew_buf))),
        put(r_buf, call("exp", binop("sub", at(m_buf), at(shift_buf)))),
        put(s_buf, call("exp", binop("sub", at(s_buf, j), at(shift_buf))), [j], [KEY_BLOCK], [j]),
        put(l_buf, binop("add", binop("mul", at(l_buf), at(r_buf)),
                         reduce("sum", [KEY_BLOCK], lambda jj: at(s_buf, jj)))),
    ]
    for g in range(0, KEY_BLOCK, PV_GROUP):
        total = binop("mul", at(acc_buf, d), at(r_buf)) if g == 0 else at(acc_buf, d)
        for jj in range(g, g + PV_GROUP):
            jc = const(jj, I64)
            total = binop("add", total, binop("mul", at(s_buf, jc), vf([b, h, key(jc), d])))
        body.append(put(acc_buf, total, [d], [Dv], [d]))
    body.append(put(m_buf, at(mnew_buf)))

    program = Sequential(row, init, step, steps, body)
    ctx.temp((B, H, Sq), dt, lambda idx: sequential(idx, program, dt), "rows")

    def out(idx):
        total = load(l_buf, list(idx[:3]))
        y = binop("div", load(acc_buf, list(idx)), total)
        if ctx.attr("zero_nan", 0):
            bb, hh, _, c = idx
            y = _guarded(y, total, lambda key: vf([bb, hh, key, c]), [padded])
        return y
    return [TensorFn(tuple(out_shape), dt, out, "injective")]


def _stored_rows(read):
    """For the values', keys' or queries' index function ``read`` (at [b, h, key, column]): when it is a plain
    load of a stored buffer whose last dim is the column (contiguous rows), or such a load of float16 widened to
    float32, that buffer and the logical axis each of its dims is indexed by (None: a broadcast dim, index 0);
    else None."""
    vs = [var("b"), var("h"), var("key"), var("c")]
    e = read(vs)
    if e.op == "cast" and e.dtype == DType.FLOAT and e.args[0].op == "load" and e.args[0].dtype == DType.FLOAT16:
        e = e.args[0]    # a float16 model's keys / values, widened as the kernel loads them (x86 attention.py)
    if e.op != "load":
        return None
    names = {v.attr: k for k, v in enumerate(vs)}
    axes = []
    for a in e.args:
        if a.op == "var" and a.attr in names:
            axes.append(names[a.attr])
        elif a.op == "const" and a.attr == 0:
            axes.append(None)
        else:
            return None
    used = [x for x in axes if x is not None]
    if axes[-1] != 3 or 2 not in used or len(used) != len(set(used)):
        return None
    return e.attr, tuple(axes)


def _guarded(y: E, total: E, value, keys) -> E:
    """Where(IsNaN(P), 0, P) · V from the unguarded row ``y = acc / l``: a row's probabilities are NaN all
    together, exactly when ``l`` is NaN (a NaN or infinite score) or 0 (every key -inf); such a row is then
    ``sum_j 0 * V[j]`` (0, or NaN in a column holding a non-finite value), any other row ``y`` itself (a NaN
    value times its probability stays NaN, as in the composite)."""
    zero = const(0.0, y.dtype)
    nan_row = logic("or", cmp("uno", total, total), cmp("eq", total, zero))
    return select(nan_row, reduce("sum", keys, lambda *j: binop("mul", zero, value(*j))), y)


def _to_index(n) -> E:
    """A dim (int or symbolic) as an int64 expression."""
    return const(n, I64) if isinstance(n, int) else dim_index(n)


def _tiled(ctx, q, kt, v, scale_t, mask):
    """The operands stored in the tile kernel's layouts (cuvil.kernels.attention) and the output as one stage
    whose expression is the ``attention`` node (its plain value: the max-shifted softmax by reductions)."""
    dt = q.dtype
    B, H, Sq, Dv = ctx.out_shape()
    D, Sk = kt.shape[2], kt.shape[3]
    KB = KEY_BLOCK
    nkb = (Sk + KB - 1) // KB
    padded = nkb * KB
    unit = NARROW_VECTOR if Dv <= NARROW_VECTOR else TILE_VECTOR
    dvp = -(-Dv // unit) * unit
    n_keys = _to_index(Sk)
    zero, neg_inf = const(0.0, dt), const(float("-inf"), dt)
    qf = broadcast_fn(q, (B, H, Sq, D))
    ktf = broadcast_fn(kt, (B, H, D, Sk))
    vf = broadcast_fn(v, (B, H, Sk, Dv))

    def kt_panels(idx):
        b, h, t, d, j = idx
        key = t * KB + j
        return select(cmp("lt", key, n_keys), ktf([b, h, d, _clamp(key, Sk)]), zero)

    def v_rows(idx):
        b, h, key, c = idx
        inside = cmp("lt", key, n_keys)
        if dvp != Dv:
            inside = logic("and", inside, cmp("lt", c, const(Dv, I64)))
        return select(inside, vf([b, h, _clamp(key, Sk), _clamp(c, Dv)]), zero)

    m4 = (1,) * (4 - len(mask.shape)) + tuple(mask.shape) if mask is not None else (1, 1, 1, 1)
    mshape = (m4[0], m4[1], m4[2], padded)
    mf = broadcast_fn(mask, m4[:3] + (Sk,)) if mask is not None else None

    def mask_rows(idx):
        key = idx[3]
        inside = mf(list(idx[:3]) + [_clamp(key, Sk)]) if mf is not None else zero
        return select(cmp("lt", key, n_keys), inside, neg_inf)

    q_stored = _stored_rows(qf)
    if q_stored is not None and q_stored[0].dtype == dt:
        qb, q_axes = q_stored       # the queries read in place (rows of d: the projection's output, a view)
    else:
        qb, q_axes = ctx.temp((B, H, Sq, D), dt, qf, "queries").buf, None
    k_stored = None
    if isinstance(Sq, int) and Sq <= IN_PLACE_ROWS and D % TILE_VECTOR == 0:
        # the keys' rows as stored (ktf at [b, h, d, key] a load of a buffer whose last dim is d)
        k_stored = _stored_rows(lambda idx: ktf([idx[0], idx[1], idx[3], idx[2]]))
    if k_stored is not None:
        kb, k_axes = k_stored
    else:
        # the keys' rows as stored (rows of d contiguous: the K projection through the head split), for the panel
        # kernel's whole panels to load as vectors (x86/attention.py emit_key_panels_stage); None: element by element
        rows = _stored_rows(lambda idx: ktf([idx[0], idx[1], idx[3], idx[2]])) if KEY_PANELS_FROM_ROWS else None
        rows = (*rows, Sk) if rows is not None and rows[0].dtype == dt else None
        kb = ctx.temp((B, H, nkb, D, KB), dt,
                      lambda idx: E("attention_keys", list(idx) + [kt_panels(idx)], dt, rows), "key_panels").buf
        k_axes = None
    stored = _stored_rows(vf) if dvp == Dv else None
    if stored is not None:
        vb, v_axes = stored
    else:
        vb, v_axes = ctx.temp((B, H, padded, dvp), dt, v_rows, "values").buf, None
    mb = ctx.temp(mshape, dt, mask_rows, "mask").buf
    spec = AttentionTile(q=qb, kt=kb, v=vb, mask=mb, scale=scalar_of(scale_t), heads=H, d=D, dv=Dv, dvp=dvp,
                         kb=KB, qb=QUERY_BLOCK, zero_nan=bool(ctx.attr("zero_nan", 0)), keys=Sk, v_axes=v_axes,
                         k_axes=k_axes, blocks=nkb, q_axes=q_axes, q_dims=(B, Sq))

    def element(idx):
        b, h, i, c = idx
        mrow = [b if m4[0] != 1 else const(0, I64), h if m4[1] != 1 else const(0, I64),
                i if m4[2] != 1 else const(0, I64)]

        def key_at(t, j, d):
            if k_axes is None:
                return load(kb, [b, h, t, d, j])
            return select(cmp("lt", t * KB + j, n_keys), ktf([b, h, d, _clamp(t * KB + j, Sk)]), zero)

        def score(t, j):
            dot = reduce("sum", [D], lambda d: binop("mul", load(qb, [b, h, i, d]) if q_axes is None
                                                     else qf([b, h, i, d]), key_at(t, j, d)))
            return binop("add", binop("mul", dot, spec.scale), load(mb, mrow + [t * KB + j]))
        top = reduce("max", [nkb, KB], score)
        shift = select(cmp("eq", top, neg_inf), zero, top)

        def weight(t, j):
            return call("exp", binop("sub", score(t, j), shift))
        def value(t, j):
            if v_axes is None:
                return load(vb, [b, h, t * KB + j, c])
            return select(cmp("lt", t * KB + j, n_keys), vf([b, h, _clamp(t * KB + j, Sk), c]), zero)
        num = reduce("sum", [nkb, KB], lambda t, j: binop("mul", weight(t, j), value(t, j)))
        total = reduce("sum", [nkb, KB], weight)
        y = binop("div", num, total)
        if spec.zero_nan:
            y = _guarded(y, total, value, [nkb, KB])
        return E("attention", [b, h, i, c, y], dt, spec)
    if not _heads_merged_next(ctx):
        return [ctx.temp((B, H, Sq, Dv), dt, element, "out")]
    # the exports merge the heads next (Transpose [0, 2, 1, 3], then a Reshape to [B, Sq, H * Dv]): the kernel
    # stores its rows there, [B, Sq, H, Dv], and the transpose reads them at their own index (a view, no copy:
    # schedule._place); this tensor is that buffer seen as [B, H, Sq, Dv]
    spec.out_heads_inner = True
    out = ctx.temp((B, Sq, H, Dv), dt, lambda idx: element([idx[0], idx[2], idx[1], idx[3]]), "out")
    return [TensorFn((B, H, Sq, Dv), dt, lambda idx: out([idx[0], idx[2], idx[1], idx[3]]), "injective")]


def _heads_merged_next(ctx) -> bool:
    """The op's output is read by one Transpose that swaps the head and row axes, and by no other node (as a
    graph output too, it is copied into its output buffer from the transposed view: correct, one copy)."""
    uses = ctx.node.outputs[0].uses
    if len(uses) != 1:
        return False
    user = uses[0][0]
    return user.op == "Transpose" and list(user.attrs.get("perm", ())) == [0, 2, 1, 3]


GPU_MAX_HEAD = 256      # the GPU kernel's head sizes (D, Dv) at most: a block's threads cover a value row


def gpu_form_shapes(out_shape, kt_shape) -> bool:
    """Whether the GPU kernel's shapes allow a FusedAttention of output ``[B, H, Sq, Dv]`` and keys ``Kt [B, H,
    D, Sk]``: every dim static and at least 1, head sizes up to :data:`GPU_MAX_HEAD` (the float16 pass's
    ``attention_in_half`` asks it too)."""
    if out_shape is None or kt_shape is None or len(out_shape) != 4 or len(kt_shape) != 4:
        return False
    B, H, Sq, Dv = out_shape
    D, Sk = kt_shape[2], kt_shape[3]
    dims = (B, H, Sq, Dv, D, Sk)
    return all(isinstance(x, int) and x >= 1 for x in dims) and D <= GPU_MAX_HEAD and Dv <= GPU_MAX_HEAD


def _gpu_form(ctx, q, kt, v) -> bool:
    """Whether the GPU kernel (:class:`AttentionRows`) takes this node: :func:`gpu_form_shapes`, float32 or
    float16 operands."""
    return (gpu_form_shapes(tuple(ctx.out_shape()), tuple(kt.shape))
            and all(t.dtype in (DType.FLOAT, DType.FLOAT16) for t in (q, kt, v)))


def _rows(ctx, q, kt, v, scale_t, mask):
    """The GPU form: the operands' index expressions over fixed variables (no copies), and ``plain`` built
    from those same expressions, reduced over every key (float32 arithmetic, the output rounded to its
    type): max-shifted softmax times V, as the sequential form computes it."""
    dt = ctx.out_dtype()
    F = DType.FLOAT
    B, H, Sq, Dv = ctx.out_shape()
    D, Sk = kt.shape[2], kt.shape[3]
    vb, vh, vi, vd, vkey, vc = (var(n) for n in ("ab", "ah", "ai", "ad", "akey", "ac"))
    qe = broadcast_fn(q, (B, H, Sq, D))([vb, vh, vi, vd])
    ke = broadcast_fn(kt, (B, H, D, Sk))([vb, vh, vd, vkey])
    ve = broadcast_fn(v, (B, H, Sk, Dv))([vb, vh, vkey, vc])
    me = broadcast_fn(mask, (B, H, Sq, Sk))([vb, vh, vi, vkey]) if mask is not None else None
    spec = AttentionRows(q=qe, k=ke, v=ve, mask=me, scale=scalar_of(scale_t), vars=(vb, vh, vi, vd, vkey, vc),
                         batch=B, heads=H, rows=Sq, keys=Sk, d=D, dv=Dv, zero_nan=bool(ctx.attr("zero_nan", 0)))
    zero, neg_inf = const(0.0, F), const(float("-inf"), F)

    def element(idx):
        b, h, i, c = idx
        at = {vb.attr: b, vh.attr: h, vi.attr: i, vc.attr: c}

        def score(key):
            dot = reduce("sum", [D], lambda d: binop("mul", cast(substitute(qe, {**at, vd.attr: d}), F),
                                                   cast(substitute(ke, {**at, vd.attr: d, vkey.attr: key}), F)))
            s = binop("mul", dot, cast(spec.scale, F))
            if me is not None:
                s = binop("add", s, cast(substitute(me, {**at, vkey.attr: key}), F))
            return s
        top = reduce("max", [Sk], score)
        shift = select(cmp("eq", top, neg_inf), zero, top)

        def weight(key):
            return call("exp", binop("sub", score(key), shift))

        def value(key):
            return cast(substitute(ve, {**at, vkey.attr: key}), F)
        num = reduce("sum", [Sk], lambda key: binop("mul", weight(key), value(key)))
        total = reduce("sum", [Sk], weight)
        y = binop("div", num, total)
        if spec.zero_nan:
            y = _guarded(y, total, value, [Sk])
        return E("attention", [b, h, i, c, cast(y, dt)], dt, spec)
    if not (ctx.gpu_heads_merged and _heads_merged_next(ctx)):
        return [ctx.temp((B, H, Sq, Dv), dt, element, "out")]
    # the heads merged next, as on x86 (_tiled): the kernels store rows at [B, Sq, H, Dv]
    # (AttentionRows.out_index), the Transpose reads them at their own index and the Reshape is a view, so the
    # products after it read the kernel's output where it lies instead of a copy (an element kernel per layer:
    # BERT-base S = 128 spent 7.8 us a layer in it on an H200, session 39)
    spec.out_heads_inner = True
    out = ctx.temp((B, Sq, H, Dv), dt, lambda idx: element([idx[0], idx[2], idx[1], idx[3]]), "out")
    return [TensorFn((B, H, Sq, Dv), dt, lambda idx: out([idx[0], idx[2], idx[1], idx[3]]), "injective")]
