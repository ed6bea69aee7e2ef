"""Semantics of the shape and data-movement ops (exact in any domain: they move elements)."""
from __future__ import annotations

import numpy as np

from .table import _in, sem
from .tensors import _axis, _empty, _ints, _scalar_attr, _text, _unsupported

@sem("Reshape")
def _reshape(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    spec = _ints(attrs.get("shape"))
    if spec is None:
        _unsupported("Reshape", "shape must be a constant attribute")
    out = []
    for i, d in enumerate(spec):
        out.append(x.shape[i] if d == 0 and not attrs.get("allowzero", 0) else d)
    if -1 in out:
        k = out.index(-1)
        known = int(np.prod([d for j, d in enumerate(out) if j != k]))
        out[k] = x.size // known if known else 0
    return [x.reshape(out)]


@sem("Flatten")
def _flatten(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    a = attrs.get("axis", 1)
    a = a + x.ndim if a < 0 else a
    return [x.reshape(int(np.prod(x.shape[:a])), int(np.prod(x.shape[a:])))]


@sem("Transpose")
def _transpose(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    perm = attrs.get("perm")
    return [np.transpose(x, None if perm is None else _ints(perm)).copy()]


@sem("Squeeze")
def _squeeze(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    axes = _ints(attrs.get("axes"))
    if axes is None or not axes:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = [_axis(a, x.ndim) for a in axes]
    if any(x.shape[a] != 1 for a in axes):
        _unsupported("Squeeze", f"cannot squeeze axes {axes} of shape {x.shape}")
    return [x.reshape([d for i, d in enumerate(x.shape) if i not in axes])]


@sem("Unsqueeze")
def _unsqueeze(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    axes = _ints(attrs.get("axes"))
    if axes is None:
        _unsupported("Unsqueeze", "axes must be a constant attribute")
    r = x.ndim + len(axes)
    norm = {_axis(a, r) for a in axes}
    rest = iter(x.shape)
    return [x.reshape([1 if i in norm else next(rest) for i in range(r)])]


@sem("Concat")
def _concat(dom, inputs, attrs):
    xs = [_in(dom, inputs, i) for i in range(len(inputs))]
    return [np.concatenate(xs, axis=_axis(attrs["axis"], xs[0].ndim))]


@sem("Split")
def _split(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    a = _axis(attrs.get("axis", 0), x.ndim)
    sizes = _ints(attrs.get("split"))
    if not sizes:
        n = attrs.get("num_outputs") or attrs.get("_num_outputs")
        if not n:
            _unsupported("Split", "needs split sizes, num_outputs or the number of outputs")
        chunk = -(-x.shape[a] // n)
        sizes = [chunk] * (n - 1) + [x.shape[a] - chunk * (n - 1)]
    bounds = np.cumsum([0] + sizes)
    return [np.take(x, range(bounds[i], bounds[i + 1]), axis=a) for i in range(len(sizes))]


def _slice_clamp(d, s, e, step):
    s, e = s + d if s < 0 else s, e + d if e < 0 else e
    if step > 0:
        return min(max(s, 0), d), min(max(e, 0), d)
    return min(max(s, 0), d - 1), min(max(e, -1), d - 1)


@sem("Slice")
def _slice(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    starts, ends = _ints(attrs.get("starts")), _ints(attrs.get("ends"))
    if starts is None or ends is None:
        _unsupported("Slice", "starts and ends must be constant attributes")
    axes = _ints(attrs.get("axes")) or list(range(len(starts)))
    steps = _ints(attrs.get("steps")) or [1] * len(starts)
    for st, en, a, step in zip(starts, ends, axes, steps):
        a = _axis(a, x.ndim)
        s, e = _slice_clamp(x.shape[a], st, en, step)
        x = np.take(x, list(range(s, e, step)), axis=a)
    return [x]


@sem("Pad")
def _pad(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    pads = _ints(attrs.get("pads"))
    if pads is None:
        _unsupported("Pad", "pads must be a constant attribute")
    axes = _ints(attrs.get("axes")) or list(range(x.ndim))
    axes = [_axis(a, x.ndim) for a in axes]
    n = len(axes)
    widths = [[0, 0] for _ in range(x.ndim)]
    for i, a in enumerate(axes):
        widths[a] = [pads[i], pads[i + n]]
    for a, (b, e) in enumerate(widths):  # negative pads crop
        if b < 0 or e < 0:
            x = np.take(x, range(max(-b, 0), x.shape[a] - max(-e, 0)), axis=a)
    widths = [(max(b, 0), max(e, 0)) for b, e in widths]
    mode = _text(attrs.get("mode", "constant"))
    if mode == "constant":
        cv = attrs.get("constant_value")
        cv = dom.const(0.0) if cv is None or (isinstance(cv, np.ndarray) and cv.size == 0) else _scalar_attr(dom, cv)
        out = _empty([d + b + e for d, (b, e) in zip(x.shape, widths)])
        out.fill(cv)
        out[tuple(slice(b, b + d) for d, (b, _e) in zip(x.shape, widths))] = x
        return [out]
    if mode in ("reflect", "edge", "wrap"):
        return [np.pad(x, widths, mode=mode)]
    _unsupported("Pad", f"mode {mode!r}")


@sem("Expand")
def _expand(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    shape = np.broadcast_shapes(x.shape, tuple(_ints(attrs.get("shape"))))
    return [np.broadcast_to(x, shape).copy()]


@sem("Tile")
def _tile(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    return [np.tile(x, _ints(attrs.get("repeats")))]


@sem("DepthToSpace")
def _d2s(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    b = attrs["blocksize"]
    n, c, h, w = x.shape
    if _text(attrs.get("mode", "DCR")) == "DCR":
        t = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        t = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return [t.reshape(n, c // (b * b), h * b, w * b)]


@sem("SpaceToDepth")
def _s2d(dom, inputs, attrs):
    x = _in(dom, inputs, 0)
    b = attrs["blocksize"]
    n, c, h, w = x.shape
    t = x.reshape(n, c, h // b, b, w // b, b).transpose(0, 3, 5, 1, 2, 4)
    return [t.reshape(n, c * b * b, h // b, w // b)]
