"""Recurrent layers (LSTM, GRU, RNN): one op each, ONNX semantics in full.

Inputs: X, W, R, B, sequence_lens, initial_h (LSTM also initial_c, P). Outputs, each optional: Y (every step's
hidden state), Y_h (the last hidden state), LSTM's Y_c (the last cell state). ``layout`` 0 is
``X[seq, batch, input]``, ``Y[seq, dirs, batch, hidden]``, ``Y_h[dirs, batch, hidden]``; layout 1 puts batch
first: ``X[batch, seq, input]``, ``Y[batch, seq, dirs, hidden]``, ``Y_h[batch, dirs, hidden]``.
"""
from __future__ import annotations

from ..registry import InferCtx, op
from ..types import TensorType

# gates per op: LSTM i, o, f, c; GRU z, r, h; RNN one
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
# activations per direction and their defaults
ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}
# activation -> (uses alpha, uses beta, default alpha, default beta), as onnxruntime reads activation_alpha/beta
ACTIVATION_PARAMS = {
    "relu": (False, False, 0.0, 0.0), "tanh": (False, False, 0.0, 0.0), "sigmoid": (False, False, 0.0, 0.0),
    "softsign": (False, False, 0.0, 0.0), "softplus": (False, False, 0.0, 0.0),
    "affine": (True, True, 1.0, 0.0), "leakyrelu": (True, False, 0.01, 0.0),
    "thresholdedrelu": (True, False, 1.0, 0.0), "scaledtanh": (True, True, 1.0, 1.0),
    "hardsigmoid": (True, True, 0.2, 0.5), "elu": (True, False, 1.0, 0.0),
}
DIRECTIONS = {"forward": 1, "reverse": 1, "bidirectional": 2}


def activation_names(op: str, names, dirs: int):
    """The activations of each direction's gates (``ACTIVATIONS[op]`` order), from the attribute's list or
    the defaults. RNN's schema default lists Tanh twice whatever the direction: one direction takes the first
    (as onnxruntime does). A wrong count or an unknown name is a ValueError."""
    per = len(ACTIVATIONS[op])
    names = list(names) if names else list(ACTIVATIONS[op]) * dirs
    if op == "RNN" and dirs == 1 and len(names) == 2:
        names = names[:1]
    if len(names) != per * dirs:
        raise ValueError(f"activations {names} must list {per} per direction ({dirs} direction(s))")
    unknown = [a for a in names if a.lower() not in ACTIVATION_PARAMS]
    if unknown:
        raise ValueError(f"unknown activation(s) {unknown}; ONNX's are {sorted(ACTIVATION_PARAMS)}")
    return names


def _dims(ctx: InferCtx, i: int, what: str, want) -> None:
    """Input ``i``, when present, must have rank len(want) and the static dims of ``want``."""
    if not ctx.has_input(i):
        return
    got = ctx.shape(i)
    if len(got) != len(want) or any(isinstance(a, int) and isinstance(b, int) and a != b for a, b in zip(got, want)):
        ctx.fail(f"{what} has shape [{','.join(map(str, got))}], expected [{','.join(map(str, want))}]")
    for k, (a, b) in enumerate(zip(got, want)):   # symbolic: a condition (the kernels read them as one size)
        if not (isinstance(a, int) and isinstance(b, int)):
            ctx.require("eq", a, b, f"{what} has shape [{','.join(map(str, got))}], expected "
                                    f"[{','.join(map(str, want))}]")


@op("LSTM", "GRU", "RNN")
def recurrent(ctx: InferCtx):
    name = ctx.node.op
    direction = ctx.attr("direction", "forward")
    if direction not in DIRECTIONS:
        ctx.fail(f"direction {direction!r} must be forward, reverse or bidirectional")
    dirs = DIRECTIONS[direction]
    layout = ctx.attr("layout", 0)
    if layout not in (0, 1):
        ctx.fail(f"layout {layout} must be 0 or 1")
    x = ctx.shape(0)
    if len(x) != 3:
        ctx.fail(f"X must have rank 3, got shape {list(x)}")
    seq, batch, inp = (x[1], x[0], x[2]) if layout else x
    w, r = ctx.shape(1), ctx.shape(2)
    g = GATES[name]
    if len(w) != 3 or len(r) != 3:
        ctx.fail(f"W and R must have rank 3, got {list(w)} and {list(r)}")
    hidden = ctx.attr("hidden_size")
    hidden = r[2] if hidden is None else hidden
    _dims(ctx, 1, "W", (dirs, g * hidden, inp))
    _dims(ctx, 2, "R", (dirs, g * hidden, hidden))
    _dims(ctx, 3, "B", (dirs, 2 * g * hidden))
    _dims(ctx, 4, "sequence_lens", (batch,))
    state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    _dims(ctx, 5, "initial_h", state)
    if name == "LSTM":
        _dims(ctx, 6, "initial_c", state)
        _dims(ctx, 7, "P", (dirs, 3 * hidden))
    try:
        activation_names(name, ctx.attr("activations"), dirs)
    except ValueError as e:
        ctx.fail(str(e))
    if name == "LSTM" and ctx.attr("input_forget", 0) not in (0, 1):
        ctx.fail("input_forget must be 0 or 1")
    dt = ctx.dtype(0)
    y = TensorType(dt, (batch, seq, dirs, hidden) if layout else (seq, dirs, batch, hidden))
    outs = [y, TensorType(dt, state), TensorType(dt, state)]
    return outs[:min(ctx.num_outputs, 3 if name == "LSTM" else 2)]
