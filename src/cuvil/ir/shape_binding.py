"""Binding symbolic dims by what a user knows: a symbol's name, or an input's whole shape.

``bind_input_shapes`` is trtexec's ``--shapes``: ``{"x": [1, 3, 640, 640]}`` fixes every symbol among
``x``'s dims to the value at its axis; ``{"x": ([1, 3, 32, 32], [1, 3, 640, 640], [1, 3, 1280, 1280])}``
(min, opt, max) gives each of them that range. Whatever the dims are called in the model (``N``,
``p2o.DynamicDimension.0``, or nothing: ``x.2``), the user names only inputs and axes.

A profile may end with ``{"multiple": M}``: only the multiples of M in the range are served (a detector's
H and W, multiples of 32). By symbol: ``(32, 640, 1280, {"multiple": 32})``, on the command line
``--shape-profile H=32:640:1280/32``; by input, one multiple per axis: ``(min, opt, max, {"multiple": [1, 1,
32, 32]})``, ``--input-shape x=1x3x32x32:1x3x640x640:1x3x1280x1280/1x1x32x32``.
"""
from __future__ import annotations

from typing import Dict, Mapping, Sequence, Tuple

import attrs
import numpy as np

from ..errors import ShapeError
from .dim import SymExpr, Symbol, evaluate, symbol_name
from .graph import Graph


def lookup_symbol(g: Graph, name: str, flag: str) -> Symbol:
    """The symbol ``name`` names: its display name (``x.2``, ``batch_size``), the model's raw spelling
    (``batch size``), or ``INPUT.AXIS`` of an input axis whose dim is a symbol (``state.1`` once Cuvil has
    made it ``input.0``: two dims the ops require equal). ``flag`` is how the user gave it (``--fix x.2``),
    for the error."""
    sym = g.symbols.get(name) or g.symbols.get(symbol_name(name))
    if sym is not None:
        return sym
    for v in g.inputs:
        for k, d in enumerate(v.shape or ()):
            if name == f"{v.name}.{k}" and isinstance(d, SymExpr) and str(d) in g.symbols:
                return g.symbols[str(d)]
    hint = (f"name a symbol as listed (cuvil inspect MODEL lists them), or bind whole inputs: "
            f"{input_shape_hint(g)}")
    left, eq, right = flag.partition(" ")[2].partition("=")
    if eq and right == name:
        # --fix N=abc: the user most likely meant a value, not NAME=OTHER (two symbols made one)
        hint = f"--fix {left}=8 (an integer), or --fix {left}=OTHER with OTHER a symbol as listed"
    raise ShapeError(f"{flag}: the model has no symbol {name!r}", details=[symbols_and_inputs(g)], hint=hint)


def symbols_and_inputs(g: Graph) -> str:
    """``symbols x.0, x.2; inputs x: f32[x.0,3,x.2,x.3]``: what a binding can name."""
    syms = ", ".join(sorted(g.symbols)) or "none"
    return f"its symbols: {syms}; inputs: " + ", ".join(f"{v.name}: {v.type}" for v in g.inputs)


def input_shape_hint(g: Graph, name: str | None = None) -> str:
    """An ``--input-shape`` for input ``name`` (default: the first input with a symbolic dim), each symbol at its
    opt (else min)."""
    for v in g.inputs:
        if v.shape is not None and (not v.type.is_static if name is None else v.name == name):
            dims = [d if isinstance(d, int) else _tuned(g, d) for d in v.shape]
            return f"--input-shape {v.name}=" + "x".join(map(str, dims)) + " (Pipeline: input_shapes=)"
    return "--input-shape INPUT=D0xD1x... (Pipeline: input_shapes=)"


def _tuned(g: Graph, d: SymExpr) -> int:
    try:
        return evaluate(d, {k: s.tuned for k, s in g.symbols.items()})
    except KeyError:
        return 1


def split_options(name: str, prof, flag: str) -> Tuple[tuple, int | Sequence[int]]:
    """A profile's points and its ``multiple`` (1 when not given): ``(32, 640, 1280, {"multiple": 32})`` ->
    ``((32, 640, 1280), 32)``. Any other option is a ShapeError."""
    prof = tuple(prof) if isinstance(prof, (Sequence, np.ndarray)) and not isinstance(prof, (str, bytes)) else prof
    if isinstance(prof, tuple) and prof and isinstance(prof[-1], Mapping):
        opts = dict(prof[-1])
        unknown = sorted(set(opts) - {"multiple"})
        if unknown:
            raise ShapeError(f"{flag} {name}: unknown profile option(s) {unknown}",
                             hint="the one option is {'multiple': M} (only multiples of M are served)")
        return prof[:-1], opts.get("multiple", 1)
    return prof, 1


def profile_symbol(name: str, prof) -> Symbol:
    """The symbol ``name`` with the profile ``prof``: ``(min, max)``, ``(min, opt, max)``, either followed
    by ``{"multiple": M}``. Bad profiles are ShapeErrors that say what to give."""
    points, multiple = split_options(name, prof, "--shape-profile")
    try:
        vals = tuple(int(x) for x in points)
        multiple = int(multiple)
    except (TypeError, ValueError):
        vals = ()
    if len(vals) not in (2, 3):
        raise ShapeError(f"shape profile of {name}: expected (min, opt, max) or (min, max), got {prof!r}",
                         hint=f"give {name}=(min, opt, max), optionally followed by {{'multiple': M}}; on the command "
                              f"line --shape-profile {name}=MIN:OPT:MAX[/M]")
    lo, hi = vals[0], vals[-1]
    opt = vals[1] if len(vals) == 3 else None
    text = ":".join(map(str, vals)) + (f"/{multiple}" if multiple != 1 else "")
    if not (1 <= lo <= hi) or (opt is not None and not lo <= opt <= hi):
        raise ShapeError(f"shape profile {name}={text}: need 1 <= min <= opt <= max",
                         hint=f"give --shape-profile {name}=MIN:OPT:MAX with 1 <= MIN <= OPT <= MAX")
    if multiple < 1:
        raise ShapeError(f"shape profile {name}={text}: the multiple must be >= 1",
                         hint=f"give --shape-profile {name}=MIN:OPT:MAX/M with M >= 1, or leave /M out")
    off = [v for v in vals if v % multiple]
    if off:
        fit = [-(-lo // multiple) * multiple] + ([min(max(round(opt / multiple) * multiple, lo), hi)] if opt else []) \
            + [hi // multiple * multiple]
        raise ShapeError(f"shape profile {name}={text}: {off[0]} is not a multiple of {multiple}",
                         hint=f"give min, opt and max as multiples of {multiple}: --shape-profile {name}="
                              + ":".join(map(str, fit)) + f"/{multiple}")
    return Symbol(name, lo, hi, opt, multiple)


@attrs.frozen
class InputShapeBinding:
    """What input shapes say about the symbols: ``fixed`` values (one shape, or a profile with
    min = opt = max) and ``profiles`` (min, opt, max) ranges, followed by ``{"multiple": M}`` where the
    shapes give one, keyed by symbol name."""

    fixed: Dict[str, int]
    profiles: Dict[str, tuple]


def bind_input_shapes(g: Graph, input_shapes: Mapping[str, object]) -> InputShapeBinding:
    """Bind the symbols of ``g``'s inputs from ``{"x": [1, 3, 640, 640]}`` or ``{"x": (min, opt, max)}``
    (three shapes). A dim the model fixes must be given its value; a symbol shared by several inputs or
    axes must be given one value (range); a derived dim (``2*N``) must agree with its symbols'. Every
    mismatch is a ShapeError naming the input, the axis and what the model declares."""
    by_input = {v.name: v for v in g.inputs}
    seen: Dict[str, Tuple[Tuple[int, int, int], str]] = {}   # symbol -> (min, opt, max), where it came from
    derived = []
    for name, spec in input_shapes.items():
        v = by_input.get(name)
        if v is None:
            raise ShapeError(f"--input-shape {name}: the model has no input {name!r}",
                             details=["its inputs: " + ", ".join(f"{x.name}: {x.type}" for x in g.inputs)],
                             hint=f"name an input: {input_shape_hint(g)}")
        spec, mults = split_options(name, spec, "--input-shape")
        points = _points(name, spec)
        given = _spec_text(points) + ("/" + "x".join(map(str, mults)) if mults != 1 else "")
        if v.shape is None:
            raise ShapeError(f"--input-shape {name}={given}: the model does not declare the rank of {name!r} "
                             f"({v.type})", hint="Cuvil needs a ranked input: declare its shape in the model "
                             "(onnx.tools.update_model_dims.update_inputs_outputs_dims)")
        if mults == 1:
            mults = (1,) * len(v.shape)
        elif _as_dims(mults) is None or len(points) != 3:
            raise ShapeError(f"--input-shape {name}={given}: multiples need three shapes and one multiple per axis",
                             hint=f"give --input-shape {name}=MIN:OPT:MAX/1x1x32x32 ({{'multiple': [1, 1, 32, 32]}} "
                                  f"after three shapes in Python)")
        for p in points + (tuple(mults),):
            if len(p) != len(v.shape):
                raise ShapeError(f"--input-shape {name}={given}: input {name!r} has rank {len(v.shape)} "
                                 f"({v.type}), the shape gives {len(p)} dims",
                                 hint=f"give {len(v.shape)} dims: {input_shape_hint(g, name)}")
        for axis, d in enumerate(v.shape):
            vals = tuple(p[axis] for p in points)
            if len(vals) == 1:
                vals = vals * 3
            where = f"input {name!r} axis {axis}"
            if not vals[0] <= vals[1] <= vals[2]:
                raise ShapeError(f"--input-shape {name}={given}: {where} has min {vals[0]}, opt {vals[1]}, "
                                 f"max {vals[2]}", hint="give the shapes in the order MIN:OPT:MAX, each dim of "
                                 "MIN <= OPT <= MAX")
            multiple = int(mults[axis])
            if multiple < 1 or any(x % multiple for x in vals):
                raise ShapeError(f"--input-shape {name}={given}: {where} has min {vals[0]}, opt {vals[1]}, max "
                                 f"{vals[2]}, multiple {multiple}, not multiples of it",
                                 hint="give a multiple >= 1 and min, opt, max its multiples")
            if multiple != 1:
                if not isinstance(d, SymExpr) or str(d) not in g.symbols:
                    raise ShapeError(f"--input-shape {name}={given}: {where} is {d} in the model ({v.type}), "
                                     f"not a symbol of its own", hint=f"give multiple 1 at {where}: only a dim that "
                                     f"is a symbol of its own takes a multiple")
                vals = vals + ({"multiple": multiple},)
            if isinstance(d, int):
                if vals != (d, d, d):
                    raise ShapeError(f"--input-shape {name}={given}: {where} is fixed to {d} in the model "
                                     f"({v.type})", hint=f"give {d} there: {input_shape_hint(g, name)}")
            elif str(d) in g.symbols:
                prev = seen.get(str(d))
                if prev is not None and prev[0] != vals:
                    raise ShapeError(f"--input-shape {name}={given}: {where} is symbol {d}, which {prev[1]} "
                                     f"also is; they are given {_range_text(vals)} and {_range_text(prev[0])}",
                                     hint=f"give both the same: {_range_text(prev[0])}")
                seen.setdefault(str(d), (vals, where))
            else:
                derived.append((d, vals, where, name, given))
    for d, vals, where, name, given in derived:   # 2*N: checked once its symbols are bound
        unbound = sorted(d.free_symbols - seen.keys())
        if unbound:
            raise ShapeError(f"--input-shape {name}={given}: {where} is {d}, computed from {', '.join(unbound)}",
                             hint=f"bind {', '.join(unbound)} through an input where it is a whole dim, or by name "
                                  f"(--fix {unbound[0]}=VALUE / --shape-profile {unbound[0]}=MIN:OPT:MAX)")
        want = tuple(evaluate(d, {s: seen[s][0][k] for s in d.free_symbols}) for k in range(3))
        vals = vals[:3]
        if want != vals:
            raise ShapeError(f"--input-shape {name}={given}: {where} is {d} = {_range_text(want)} from the other "
                             f"dims, the shape gives {_range_text(vals)}", hint=f"give {_range_text(want)} there")
    fixed = {s: r[0] for s, (r, _) in seen.items() if r[0] == r[2]}
    profiles = {s: r for s, (r, _) in seen.items() if r[0] != r[2]}
    return InputShapeBinding(fixed, profiles)


def _points(name: str, spec) -> Tuple[Tuple[int, ...], ...]:
    """One shape ``[1, 3, 640, 640]`` -> (shape,); three shapes (min, opt, max) -> (min, opt, max)."""
    points = _as_dims(spec)
    if points is not None:
        points = (points,)
    elif isinstance(spec, Sequence) and not isinstance(spec, (str, bytes)) and len(spec) == 3:
        points = tuple(_as_dims(p) for p in spec)
        points = None if None in points else points
    if points is None:
        raise ShapeError(f"input_shapes[{name!r}] = {spec!r}: not one shape nor three",
                         hint=f"give one shape ([1, 3, 640, 640]) or three (min, opt, max); on the command line "
                              f"--input-shape {name}=1x3x640x640 or {name}=1x3x32x32:1x3x640x640:1x3x1280x1280")
    if any(d < 0 for p in points for d in p):
        raise ShapeError(f"input_shapes[{name!r}] = {_spec_text(points)}: a dim is negative",
                         hint="give dims >= 0")
    return points


def _as_dims(x):
    """``x`` as a tuple of ints when it is a sequence of integers (numpy's too), else None."""
    if isinstance(x, (str, bytes)) or not isinstance(x, (Sequence, np.ndarray)):
        return None
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) for d in x):
        return None
    return tuple(int(d) for d in x)


def _spec_text(points) -> str:
    return ":".join("x".join(map(str, p)) for p in points)


def _range_text(vals: tuple) -> str:
    """``640``, ``32:640:1280`` or ``32:640:1280/32`` (a profile with its multiple)."""
    points, multiple = split_options("", vals, "")
    text = str(points[0]) if points[0] == points[2] else ":".join(map(str, points))
    return text + (f"/{multiple}" if multiple != 1 else "")


__all__ = ["InputShapeBinding", "bind_input_shapes", "profile_symbol", "split_options", "lookup_symbol",
           "symbols_and_inputs", "input_shape_hint"]
