"""Lowerings of the ops of no other family: Identity, Dropout (inference) and Det."""
from __future__ import annotations

import itertools

import numpy as np

from ..texpr import BOOL, I64, binop, const, unop
from .core import TensorFn, lowering


@lowering("Identity", "Dropout")
def _identity(ctx):
    x = ctx.input(0)
    if ctx.node.op == "Dropout":
        ins = ctx.node.inputs
        train = ins[2] if len(ins) > 2 else None
        ratio = ins[1] if len(ins) > 1 else None
        if train is not None and (not train.is_const or bool(np.asarray(train.const).reshape(-1)[0])):
            if ratio is None or not ratio.is_const or float(np.asarray(ratio.const).reshape(-1)[0]) != 0.0:
                ctx.unsupported("training mode (random dropout) is not supported")
    outs = [TensorFn(x.shape, x.dtype, x.fn, "elementwise", (0,))]
    if len(ctx.node.outputs) > 1:  # Dropout's mask, inference mode: all kept
        outs.append(TensorFn(x.shape, BOOL, lambda idx: const(True, BOOL), "elementwise"))
    return outs


@lowering("Det")
def _det(ctx):
    """Leibniz expansion: small matrices only (n <= 4)."""
    x = ctx.input(0)
    n = x.shape[-1]
    if n > 4:
        ctx.unsupported(f"{n}x{n} matrices (only up to 4x4)")

    def f(idx):
        total = None
        for perm in itertools.permutations(range(n)):
            inv = sum(1 for i in range(n) for j in range(i + 1, n) if perm[i] > perm[j])
            term = None
            for i, j in enumerate(perm):
                v = x(list(idx) + [const(i, I64), const(j, I64)])
                term = v if term is None else binop("mul", term, v)
            if total is None:
                total = term if inv % 2 == 0 else unop("neg", term)
            else:
                total = binop("add" if inv % 2 == 0 else "sub", total, term)
        return total
    return [TensorFn(ctx.out_shape(), x.dtype, f, "complex")]
