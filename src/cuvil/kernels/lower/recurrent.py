"""Lowerings of LSTM, GRU and RNN: the input projection as one matrix product, then one sequential kernel.

1. ``XW[seq, batch, dirs * gates * hidden]`` = X · W^T (+ the biases that sit outside the gates' nonlinear
   parts) for every step at once: a MatMul-shaped contraction (x86: the packed GEMM micro-kernel when W is a
   constant; the GPU: its matrix-product kernels).
2. A :func:`~cuvil.kernels.sequential.sequential` stage, one row per (direction, batch row): per step the
   recurrent product H_{t-1} · R^T into the gate buffer, then the gates' elementwise update of the cell and
   hidden states (in place, element by element), then the step's Y. The state buffers are Y_h and Y_c.

``sequence_lens``: a row's steps at or past its length leave its states unchanged (so Y_h / Y_c hold the last
valid step) and write zeros into Y; the reverse direction walks each row's valid steps backwards from its own
last one (as onnxruntime does). Lengths are clamped into [0, seq].
"""
from __future__ import annotations

from typing import Callable, List, Optional

from ...ir.dtype import DType
from ...ir.ops.recurrent import ACTIVATION_PARAMS, ACTIVATIONS, DIRECTIONS, GATES, activation_names
from ..sequential import Assign, Sequential, sequential
from ..texpr import I64, Buf, E, binop, call, cast, cmp, const, load, reduce, select, unop, var
from .activation import relu
from .core import TensorFn, fconst, lowering
from .matmul import _matmul_as_gemm

ARENA = 0   # the kernel's bufs slot of the arena (kernels.schedule.ARENA; the lowerings do not import the scheduler)


def _activation(name: str, alpha: float, beta: float) -> Callable[[E], E]:
    """ONNX's recurrent activation ``name`` (case-insensitive) as a scalar expression builder."""
    n = name.lower()
    if n == "relu":
        return relu
    if n == "tanh":
        return lambda x: call("tanh", x)
    if n == "sigmoid":
        return lambda x: binop("div", fconst(1, x), binop("add", fconst(1, x), call("exp", unop("neg", x))))
    if n == "affine":
        return lambda x: binop("add", binop("mul", fconst(alpha, x), x), fconst(beta, x))
    if n == "leakyrelu":
        return lambda x: select(cmp("lt", x, fconst(0, x)), binop("mul", x, fconst(alpha, x)), x)
    if n == "thresholdedrelu":
        return lambda x: select(cmp("gt", x, fconst(alpha, x)), x, fconst(0, x))
    if n == "scaledtanh":
        return lambda x: binop("mul", fconst(alpha, x), call("tanh", binop("mul", fconst(beta, x), x)))
    if n == "hardsigmoid":
        def hard(x):
            y = binop("add", binop("mul", fconst(alpha, x), x), fconst(beta, x))
            y = select(cmp("lt", y, fconst(1, x)), y, fconst(1, x))
            return select(cmp("gt", y, fconst(0, x)), y, fconst(0, x))
        return hard
    if n == "elu":
        return lambda x: select(cmp("lt", x, fconst(0, x)),
                                binop("mul", fconst(alpha, x), binop("sub", call("exp", x), fconst(1, x))), x)
    if n == "softsign":
        return lambda x: binop("div", x, binop("add", fconst(1, x), call("fabs", x)))
    if n == "softplus":
        return lambda x: call("log", binop("add", call("exp", x), fconst(1, x)))
    raise ValueError(name)


def _activations(ctx, op: str, dirs: int) -> List[List[tuple]]:
    """Per direction, the op's activations (f, g[, h]) as (name, alpha, beta), alpha/beta consumed in list
    order by the activations that take them (onnxruntime's reading of activation_alpha / activation_beta)."""
    names = activation_names(op, ctx.attr("activations"), dirs)
    alphas = list(ctx.attr("activation_alpha") or [])
    betas = list(ctx.attr("activation_beta") or [])
    fns = []
    for n in names:
        uses_a, uses_b, a, b = ACTIVATION_PARAMS[n.lower()]
        if uses_a and alphas:
            a = alphas.pop(0)
        if uses_b and betas:
            b = betas.pop(0)
        fns.append((n.lower(), a, b))
    k = len(ACTIVATIONS[op])
    return [fns[d * k:(d + 1) * k] for d in range(dirs)]


@lowering("LSTM", "GRU", "RNN")
def _recurrent(ctx):
    op = ctx.node.op
    x, w, r = ctx.input(0), ctx.input(1), ctx.input(2)
    bias, lens, h0 = ctx.input(3), ctx.input(4), ctx.input(5)
    c0, peep = (ctx.input(6), ctx.input(7)) if op == "LSTM" else (None, None)
    dt = x.dtype
    if not dt.is_float:
        ctx.unsupported(f"X of {dt.name}: recurrent layers compute in a float type")
    layout = ctx.attr("layout", 0)
    direction = ctx.attr("direction", "forward")
    dirs = DIRECTIONS[direction]
    G, H = GATES[op], r.shape[2]
    GH = G * H
    T, N, I = (x.shape[1], x.shape[0], x.shape[2]) if layout else tuple(x.shape)
    lbr = op == "GRU" and ctx.attr("linear_before_reset", 0)
    clip = ctx.attr("clip")
    acts = _activations(ctx, op, dirs)

    def xin(t, n, k):
        return x([n, t, k] if layout else [t, n, k])

    def state_in(s: TensorFn, d, n, h):
        return s([n, d, h] if layout else [d, n, h])

    # --- 1. the input projection of every step, biases that are not inside a gate's product added ---------
    def gate_bias(dj, j):
        """Wb (+ Rb) of flat gate index j of direction dj; GRU's Rbh stays inside the reset product when
        linear_before_reset."""
        if bias is None:
            return None
        wb, rb = bias([dj, j]), bias([dj, j + GH])
        if lbr:
            return select(cmp("lt", j, const(2 * H, I64)), binop("add", wb, rb), wb)
        return binop("add", wb, rb)

    def with_bias(idx, acc):
        j = idx[-1]
        b = gate_bias(j // GH, j % GH)
        if b is not None and b.dtype != acc.dtype:    # a float16 model's bias beside the product's float32 sums
            b = cast(b, acc.dtype)
        return acc if b is None else binop("add", acc, b)

    proj_shape = (N, T, dirs * GH) if layout else (T, N, dirs * GH)
    wv = ctx.const_input(1)
    gemm = None
    if wv is not None:
        gemm = _matmul_as_gemm(ctx, x, wv.transpose(2, 0, 1).reshape(wv.shape[2], dirs * GH), proj_shape, with_bias)
    if gemm is not None:
        proj = ctx.temp(proj_shape, dt, gemm.fn, "xw")
    else:
        def proj_fn(idx):
            a, b_, j = idx
            t, n = (b_, a) if layout else (a, b_)
            dj, gj = j // GH, j % GH
            return with_bias(idx, reduce("sum", [I], lambda k: binop("mul", xin(t, n, k), w([dj, gj, k]))))
        proj = ctx.temp(proj_shape, dt, proj_fn, "xw")

    # --- 2. the recurrence: one row per (direction, batch row); rows run in parallel (x86: threads; the GPU:
    # a thread block each) -------------------------------------------------------------------------------
    def scratch(name, shape):
        return Buf(f"{ctx.node.name}_{name}", dt, tuple(shape), ARENA, 0)

    hs = scratch("h", (dirs, N, H))
    cs = scratch("c", (dirs, N, H)) if op == "LSTM" else None
    gs = scratch("gates", (dirs, N, GH))
    want_y = len(ctx.node.outputs) > 0 and ctx.used_outputs[0]
    ys = scratch("y", (T, dirs, N, H)) if want_y else None

    d, n, s = var("dir"), var("batch"), var("step")
    def hidden(k):
        return load(hs, [d, n, k])

    def cell(k):
        return load(cs, [d, n, k])

    def gate(j):
        return load(gs, [d, n, j])

    if lens is not None:
        raw = cast(lens([n]), I64)
        length = E("clamp", (raw,), I64, (0, T))
    else:
        length = const(T, I64)
    valid = cmp("lt", s, length)
    if direction == "forward":
        rev = None
    elif direction == "reverse":
        rev = const(True, DType.BOOL)
    else:
        rev = cmp("eq", d, const(1, I64))
    if rev is None:
        t = s
    else:
        back = E("clamp", (binop("sub", binop("sub", length, const(1, I64)), s),), I64, (0, T - 1))
        t = select(rev, back, s)
    t_write = t if rev is None else select(valid, t, s)    # a padded step writes its zeros at its own place

    def xw(j):
        jj = d * GH + j
        return proj([n, t, jj] if layout else [t, n, jj])

    # R^T[d, k, j]: a step's products read the weights with j, the output gate, at unit stride (x86's row
    # schedule vectorises over j; the GPU's neighbouring threads, each a j, read neighbouring addresses)
    rv = ctx.const_input(2)
    rt_buf = ctx.weight(rv.transpose(0, 2, 1), "rt") if rv is not None else None
    if rt_buf is not None:
        r_at = lambda dj, j, k: load(rt_buf, [dj, k, j])
    else:
        rt = ctx.temp((dirs, H, GH), dt, lambda idx: r([idx[0], idx[2], idx[1]]), "rt")
        r_at = lambda dj, j, k: rt([dj, k, j])

    def rec(row0, k_of=hidden):
        """sum_k k_of(k) * R[d, row0 + j, k] as a function of j."""
        return lambda j: reduce("sum", [H], lambda k: binop("mul", k_of(k), r_at(d, row0 + j, k)))

    def clipped(e):
        if clip is None:
            return e
        e = select(cmp("lt", e, fconst(clip, e)), e, fconst(clip, e))
        return select(cmp("gt", e, fconst(-clip, e)), e, fconst(-clip, e))

    def per_dir(k):
        """Activation k of this row's direction (one expression when both directions use the same: a select
        computes both of its arms)."""
        if dirs == 1 or acts[0][k] == acts[1][k]:
            return _activation(*acts[0][k])
        fwd, bwd = _activation(*acts[0][k]), _activation(*acts[1][k])
        return lambda e: select(cmp("eq", d, const(0, I64)), fwd(e), bwd(e))

    def keep(new, old):
        return select(valid, new, old)

    def put(buf: Buf, index, value, v: E, extent) -> Assign:
        """``buf[index] = value`` for v in [0, extent)."""
        return Assign(buf, index, value, [v], [extent])

    j, h = var("j"), var("h")

    def initial(given: Optional[TensorFn]) -> E:
        """A state's initial value; a row of length 0 runs no step and reports zero states (onnxruntime)."""
        if given is None:
            return const(0, dt)
        v = state_in(given, d, n, h)
        return v if lens is None else select(cmp("eq", length, const(0, I64)), const(0, dt), v)
    init = [put(hs, [d, n, h], initial(h0), h, H)]
    body = []
    f_act, g_act = per_dir(0), per_dir(1) if op != "RNN" else None

    if op == "LSTM":
        init.append(put(cs, [d, n, h], initial(c0), h, H))
        h_act = per_dir(2)
        body.append(put(gs, [d, n, j], binop("add", xw(j), rec(0)(j)), j, GH))

        def peephole(k, cval):
            """Adds P[k] (.) cval to a gate's pre-activation (P's gates: i, o, f)."""
            if peep is None:
                return lambda e: e
            return lambda e: binop("add", e, binop("mul", peep([d, k * H + h]), cval))
        c_old = cell(h)
        i_gate = f_act(clipped(peephole(0, c_old)(gate(h))))
        if ctx.attr("input_forget", 0):
            f_gate = binop("sub", fconst(1, i_gate), i_gate)
        else:
            f_gate = f_act(clipped(peephole(2, c_old)(gate(2 * H + h))))
        c_new = binop("add", binop("mul", f_gate, c_old), binop("mul", i_gate, g_act(clipped(gate(3 * H + h)))))
        body.append(put(cs, [d, n, h], keep(c_new, c_old), h, H))
        c_t = cell(h)
        o_gate = f_act(clipped(peephole(1, c_t)(gate(H + h))))
        body.append(put(hs, [d, n, h], keep(binop("mul", o_gate, h_act(c_t)), hidden(h)), h, H))
    elif op == "GRU":
        body.append(put(gs, [d, n, j], f_act(clipped(binop("add", xw(j), rec(0)(j)))), j, 2 * H))
        z = gate(h)
        if lbr:
            rbh = (lambda k: bias([d, GH + 2 * H + k])) if bias is not None else None
            inner = rec(2 * H)(j)
            body.append(put(gs, [d, n, 2 * H + j], inner if rbh is None else binop("add", inner, rbh(j)), j, H))
            cand = binop("add", xw(2 * H + h), binop("mul", gate(H + h), gate(2 * H + h)))
        else:
            reset = rec(2 * H, lambda k: binop("mul", gate(H + k), hidden(k)))
            body.append(put(gs, [d, n, 2 * H + j], binop("add", xw(2 * H + j), reset(j)), j, H))
            cand = gate(2 * H + h)
        h_new = binop("add", binop("mul", binop("sub", fconst(1, z), z), g_act(clipped(cand))),
                      binop("mul", z, hidden(h)))
        body.append(put(hs, [d, n, h], keep(h_new, hidden(h)), h, H))
    else:
        body.append(put(gs, [d, n, j], binop("add", xw(j), rec(0)(j)), j, H))
        body.append(put(hs, [d, n, h], keep(f_act(clipped(gate(h))), hidden(h)), h, H))
    if ys is not None:
        body.append(put(ys, [t_write, d, n, h], select(valid, hidden(h), const(0, dt)), h, H))

    program = Sequential([d, n], init, s, T, body)
    ctx.temp((dirs, N), dt, lambda idx: sequential(idx, program, dt), "steps")

    # --- 3. the outputs read the buffers the program wrote -------------------------------------------
    def reader(buf: Buf, order: Callable[[list], list], shape) -> TensorFn:
        same = tuple(shape) == tuple(buf.shape)
        return TensorFn(tuple(shape), dt, lambda idx: load(buf, order(list(idx))), "injective",
                        buf=buf if same else None)

    outs: List[Optional[TensorFn]] = []
    if ys is not None:
        outs.append(reader(ys, (lambda i: [i[1], i[2], i[0], i[3]]) if layout else (lambda i: i), ctx.out_shape(0)))
    elif ctx.node.outputs:
        outs.append(TensorFn(ctx.out_shape(0), dt, lambda idx: const(0, dt), "elementwise"))
    state_order = (lambda i: [i[1], i[0], i[2]]) if layout else (lambda i: i)
    if len(ctx.node.outputs) > 1:
        outs.append(reader(hs, state_order, ctx.out_shape(1)))
    if len(ctx.node.outputs) > 2:
        outs.append(reader(cs, state_order, ctx.out_shape(2)))
    return outs
