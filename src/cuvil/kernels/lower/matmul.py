"""Lowerings of the matrix products (MatMul, Gemm, MatMulInteger, Einsum)."""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from ...ir.dim import SymExpr, product
from ...ir.dtype import DType
from ..contraction import (AMX_K, AMX_TILES, MR, NARROW_DTYPES, MatContraction, narrow_values, pack_columns,
                           pack_columns_bf16, pack_columns_fp16)
from ..texpr import I64, E, binop, cast, const, load, reduce
from .core import LOWERINGS, TensorFn, broadcast_fn, broadcast_index, fconst, lowering, sub_ctx, widened
from .quant import minus_zp


#: the narrowed format whose kernels take a product of a model of this element type (its tensors all of it)
_MODEL_FORMATS = {dt: fmt for fmt, dt in NARROW_DTYPES.items()}


def _matmul_as_gemm(ctx, a, wv: Optional[np.ndarray], out, epilogue=None) -> Optional[TensorFn]:
    """``A @ W`` with ``W[K, M]`` constant as a packed contraction (:class:`MatContraction`), when the target
    asks for micro-kernels and everything is float32. ``epilogue(idx, acc)`` adds what the op adds to the
    product (Gemm's alpha, beta * C). A is stored first when it is an expression.

    A float16 or bfloat16 model's product (A, W and the output of that type) takes the narrowed kernels of its
    format where the target has them (x86 ``narrow_formats``: "fp16", the float16 weight panels of
    :mod:`cuvil.targets.x86.gemm_fp16`; "bf16", :mod:`cuvil.targets.x86.gemm_bf16` and AMX): W as it is, A
    widened (exactly) by a stage of its own, float32 sums and epilogue, the output rounded once."""
    model_fmt = _MODEL_FORMATS.get(a.dtype, "")
    half_model = bool(model_fmt and ctx.out_dtype() == a.dtype and wv is not None and wv.dtype == a.dtype.numpy
                      and model_fmt in ctx.narrow_formats)
    if (not ctx.matmul_panels or wv is None or wv.ndim != 2 or len(a.shape) < 2
            or not (half_model or (a.dtype == DType.FLOAT and ctx.out_dtype() == DType.FLOAT))
            or ctx._weight is None or isinstance(a.shape[-1], SymExpr)):
        return None
    K, M = wv.shape
    if K < 8 or M < 8 or tuple(out[:-1]) != tuple(a.shape[:-1]) or out[-1] != M:
        return None
    # float32: the target's register tile (rows x cols); bf16 panels keep MR x gemm_cols (gemm_bf16.py)
    narrow = model_fmt if half_model else ctx.narrowed
    mr, cols = ctx.matmul_tile if ctx.matmul_tile and narrow != "bf16" else (MR, ctx.gemm_cols)
    out_dtype = a.dtype if half_model else DType.FLOAT
    if half_model:          # the model's A widened, exactly, where the kernels read float32 rows
        wide = widened(a)
        a = ctx.temp(a.shape, DType.FLOAT, wide.fn, "in_f32")
        wv = wv.astype(np.float32)
    elif a.buf is None and narrow != "fp16":
        a = ctx.temp(a.shape, a.dtype, a.fn, "in")
    if narrow == "fp16":    # weights in float16 panels, A rounded to float16 by a stage of its own, float32 sums
        if not half_model:
            a16 = a
            a = ctx.temp(a.shape, DType.FLOAT, lambda idx: cast(cast(a16(idx), DType.FLOAT16), DType.FLOAT), "in_fp16")
        wp = ctx.weight(pack_columns_fp16(wv, cols), "panels_fp16")
        term = lambda rows, m, k: binop("mul", a(rows + [k]), cast(load(wp, [m // cols, k, m % cols]), DType.FLOAT))
    elif narrow == "bf16":    # weights in bfloat16 pairs along K, A rounded to bfloat16, float32 sums
        amx = AMX_TILES in ctx.narrow_formats     # K padded to whole AMX tile steps
        wp = ctx.weight(pack_columns_bf16(wv.astype(np.float32), cols, AMX_K if amx else 2),
                        "panels_amx" if amx else "panels_bf16")
        term = lambda rows, m, k: binop("mul", cast(cast(a(rows + [k]), DType.BFLOAT16), DType.FLOAT),
                                        cast(load(wp, [m // cols, k // 2, m % cols, k % 2]), DType.FLOAT))
    else:
        wp = ctx.weight(pack_columns(wv.astype(np.float32), cols), "panels")
        term = lambda rows, m, k: binop("mul", a(rows + [k]), load(wp, [m // cols, k, m % cols]))
    spec = MatContraction(wp, a.buf, product(a.shape[:-1]), M, K, cols, narrow,
                          narrow == "bf16" and AMX_TILES in ctx.narrow_formats, mr)

    def f(idx):
        rows, m = list(idx[:-1]), idx[-1]
        acc = E("contract", list(idx) + [reduce("sum", [K], lambda k: term(rows, m, k))], DType.FLOAT, spec)
        acc = epilogue(idx, acc) if epilogue is not None else acc
        return cast(acc, out_dtype) if half_model else acc
    return TensorFn(out, ctx.out_dtype(), f, "complex", contraction=True)


@lowering("MatMul")
def _matmul(ctx):
    a, b = ctx.input(0), ctx.input(1)
    out = ctx.out_shape()
    gemm = _matmul_as_gemm(ctx, a, ctx.const_input(1), out)
    if gemm is not None:
        return [gemm]
    if ctx.narrowed:   # no narrowed contraction (a product of two activations, small M): rounded inputs
        a, b = ctx.narrow_input(0), ctx.narrow_input(1)
    if ctx.matmul_panels and b.buf is None and len(b.shape) >= 2:
        # the row schedule reads B's rows with the output column innermost: store B (e.g. a transposed
        # key matrix) so those reads are contiguous instead of strided through the expression
        b = ctx.temp(b.shape, b.dtype, b.fn, "rhs")
    a_shape, b_shape = list(a.shape), list(b.shape)
    K = a_shape[-1]

    def f(idx):
        if len(a_shape) == 1:
            ai = lambda k: [k]
        else:
            batch = broadcast_index(idx[:-2] if len(b_shape) > 1 else idx[:-1], a_shape[:-2], out[:len(out) - (2 if len(b_shape) > 1 else 1)])
            row = idx[-2] if len(b_shape) > 1 else idx[-1]
            ai = lambda k: batch + [row, k]
        if len(b_shape) == 1:
            bi = lambda k: [k]
        else:
            col = idx[-1]
            bbatch = broadcast_index(idx[:-2] if len(a_shape) > 1 else idx[:-1], b_shape[:-2],
                                     out[:len(out) - (2 if len(a_shape) > 1 else 1)])
            bi = lambda k: bbatch + [k, col]
        return reduce("sum", [K], lambda k: binop("mul", a(ai(k)), b(bi(k))))
    return [TensorFn(out, ctx.out_dtype(), f, "complex")]


@lowering("Gemm")
def _gemm(ctx):
    a, b, c = ctx.input(0), ctx.input(1), ctx.input(2)
    ta, tb = ctx.attr("transA", 0), ctx.attr("transB", 0)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    out = ctx.out_shape()
    K = a.shape[0] if ta else a.shape[1]
    cf = broadcast_fn(c, out) if c is not None else None
    wv = ctx.const_input(1)

    def epilogue(idx, acc):
        if alpha != 1.0:
            acc = binop("mul", acc, fconst(alpha, acc))
        if cf is not None and beta != 0.0:
            cv = cf(idx)
            cv = cv if cv.dtype == acc.dtype else cast(cv, acc.dtype)
            acc = binop("add", acc, cv if beta == 1.0 else binop("mul", cv, fconst(beta, cv)))
        return acc
    if not ta and wv is not None:
        gemm = _matmul_as_gemm(ctx, a, wv.T if tb else wv, out, epilogue)
        if gemm is not None:
            return [gemm]
    if ctx.narrowed:   # no narrowed contraction for this form: its inputs rounded, computed in float32
        a, b = ctx.narrow_input(0), ctx.narrow_input(1)
        wv = None if wv is None else narrow_values(ctx.const_input(1), ctx.narrowed)
    if tb and wv is not None and ctx._weight is not None:
        # constant B^T: stored transposed at compile time so the row schedule reads it with unit stride
        bt = ctx.weight(np.ascontiguousarray(wv.T), "transposed")
        b, tb = TensorFn(bt.shape, bt.dtype, lambda idx: load(bt, idx), "elementwise", buf=bt), 0

    def f(idx):
        i, j = idx
        return epilogue(idx, reduce("sum", [K], lambda k: binop("mul", a([k, i] if ta else [i, k]),
                                                                 b([j, k] if tb else [k, j]))))
    return [TensorFn(out, ctx.out_dtype(), f, "complex")]


@lowering("MatMulInteger")
def _matmul_integer(ctx):
    a, b = ctx.input(0), ctx.input(1)
    a2 = minus_zp(a, ctx.input(2), len(a.shape) - 2)
    b2 = minus_zp(b, ctx.input(3), len(b.shape) - 1)
    return LOWERINGS["MatMul"](sub_ctx(ctx, [a2, b2]))


def _einsum_labels(term: str, rank: int, what: str, ctx) -> List:
    """Labels of ``term``'s dims: letters, and ("...", k) for the k-th ellipsis dim counted from its end."""
    term = term.strip()
    if "..." in term:
        left, right = term.split("...")
        n_ell = rank - len(left) - len(right)
        if n_ell < 0:
            ctx.unsupported(f"{what} {term!r} does not fit rank {rank}")
        return list(left) + [("...", n_ell - k) for k in range(n_ell)] + list(right)
    if len(term) != rank:
        ctx.unsupported(f"{what} {term!r} does not fit rank {rank}")
    return list(term)


@lowering("Einsum")
def _einsum(ctx):
    eq = ctx.attr("equation").replace(" ", "")
    ins = [t for t in ctx.inputs if t is not None]
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ins):
        ctx.unsupported(f"equation {eq!r} has {len(terms)} operands, the node {len(ins)}")
    labels = [_einsum_labels(t, len(x.shape), "operand", ctx) for t, x in zip(terms, ins)]
    n_ell = max([sum(1 for lb in ls if isinstance(lb, tuple)) for ls in labels] + [0])
    ell = [("...", n_ell - k) for k in range(n_ell)]
    if "->" in eq:
        out_labels = [lb for lb in (list(rhs.split("...")[0]) + (ell if "..." in rhs else []) +
                                    (list(rhs.split("...")[1]) if "..." in rhs else []))]
    else:
        letters = [lb for ls in labels for lb in ls if not isinstance(lb, tuple)]
        out_labels = ell + sorted(lb for lb in set(letters) if letters.count(lb) == 1)
    size = {}
    for ls, x in zip(labels, ins):
        for lb, d in zip(ls, x.shape):
            if d != 1 or lb not in size:
                size[lb] = max(size.get(lb, 1), d) if isinstance(lb, tuple) else d
    red = [lb for lb in dict.fromkeys(lb for ls in labels for lb in ls) if lb not in out_labels]
    dt = ctx.out_dtype()

    def f(idx):
        env = dict(zip(out_labels, idx))

        def product(*ks):
            e = dict(env)
            e.update(zip(red, ks))
            acc = None
            for ls, x in zip(labels, ins):
                sub = [const(0, I64) if d == 1 and size.get(lb, 1) != 1 else e[lb] for lb, d in zip(ls, x.shape)]
                v = x(sub)
                acc = v if acc is None else binop("mul", acc, v)
            return acc
        if not red:
            return product()
        return reduce("sum", [size[lb] for lb in red], product)
    return [TensorFn(ctx.out_shape(), dt, f, "complex")]
