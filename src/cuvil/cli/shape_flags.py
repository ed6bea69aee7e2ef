"""The shape flags every command that takes a model shares: ``--input-shape`` (by input), ``--fix`` and
``--shape-profile`` (by symbol name), parsed into what ``Pipeline.resolve_shapes`` takes."""
from __future__ import annotations

from ..errors import CuvilError
from ..ir.dim import is_symbol_name
from ..pipeline import Pipeline


def parse_input_shapes(items, flag: str = "--input-shape") -> dict:
    """``x=1x3x640x640`` -> {"x": (1, 3, 640, 640)}; ``x=1x3x32x32:1x3x640x640:1x3x1280x1280`` -> {"x": (min,
    opt, max)}, as trtexec's ``--shapes``; a ``/1x1x32x32`` suffix gives each axis's multiple (``{"multiple":
    (1, 1, 32, 32)}`` after the three shapes)."""
    out = {}
    for item in items or ():
        name, _, spec = item.rpartition("=")
        spec, slash, mult = spec.partition("/")
        shapes = [part.lower().split("x") for part in spec.split(":")]
        mults = mult.lower().split("x") if slash else []
        if (not name or len(shapes) not in (1, 3) or not all(d.isdigit() for sh in shapes + [mults] for d in sh)
                or (slash and (len(shapes) != 3 or not mults))):
            x = name or "x"
            raise CuvilError(f"{flag} takes INPUT=D0xD1x... (one shape) or INPUT=MIN:OPT:MAX (three shapes, "
                             f"e.g. x=1x3x32x32:1x3x640x640:1x3x1280x1280), optionally followed by /MULTIPLES "
                             f"(one per axis, e.g. /1x1x32x32), got {item!r}",
                             hint=f"{flag} {x}=1x3x640x640 (one shape), or {flag} {x}=1x3x32x32:1x3x640x640:1x3x1280x1280 "
                                  f"(min:opt:max), with the input's rank; `cuvil inspect MODEL` lists the inputs")
        if name in out:
            raise CuvilError(f"{flag} {name}: the input is given twice", hint=f"give {flag} {name}=... once")
        dims = [tuple(int(d) for d in sh) for sh in shapes]
        out[name] = dims[0] if len(dims) == 1 else tuple(dims)
        if slash:
            out[name] += ({"multiple": tuple(int(d) for d in mults)},)
    return out


def parse_profiles(items) -> dict:
    """``N=1:8:64`` (min:opt:max) -> {"N": (1, 8, 64)}; ``N=1:64`` -> {"N": (1, 64)} (min, max);
    ``H=32:640:1280/32`` -> {"H": (32, 640, 1280, {"multiple": 32})} (only multiples of 32)."""
    out = {}
    for item in items or ():
        name, _, spec = item.partition("=")
        spec, slash, mult = spec.partition("/")
        parts = spec.split(":")
        if (not name or len(parts) not in (2, 3) or not all(x.isdigit() for x in parts)
                or (slash and not mult.isdigit())):
            raise CuvilError(f"--shape-profile takes NAME=MIN:OPT:MAX, or NAME=MIN:OPT:MAX/MULTIPLE, got {item!r}",
                             hint=f"--shape-profile {name or 'N'}=1:8:64 (min:opt:max), or {name or 'H'}=32:640:1280/32 "
                                  f"(multiples of 32); `cuvil inspect MODEL` lists the symbols")
        vals = tuple(int(x) for x in parts)
        if not 1 <= vals[0] <= vals[-1] or not vals[0] <= vals[len(vals) // 2] <= vals[-1]:
            lo, hi = max(1, min(vals)), max(1, max(vals))
            raise CuvilError(f"--shape-profile {item!r}: need 1 <= MIN <= OPT <= MAX",
                             hint=f"--shape-profile {name}={lo}:{lo}:{hi} (min:opt:max, in this order)")
        out[name] = vals + (({"multiple": int(mult)},) if slash else ())
    return out


def parse_fixed(items) -> dict:
    """``N=8`` -> {"N": 8}; ``s.0=x.0`` -> {"s.0": "x.0"} (the two symbols become one)."""
    out = {}
    for item in items or ():
        name, _, val = item.rpartition("=")
        if name and is_symbol_name(val):
            out[name] = val   # another symbol: the two become one
            continue
        if not name or not val.lstrip("-").isdigit():
            raise CuvilError(f"--fix takes NAME=INT, or NAME=OTHER to make two symbols one, got {item!r}",
                             hint=f"--fix {name or item.partition('=')[0] or 'N'}=8; `cuvil inspect MODEL` lists the "
                                  f"symbols")
        out[name] = int(val)
    return out


def check_shape_flags(args) -> None:
    """Parses the shape flags the command has, so that a malformed value is refused before the model is read."""
    parse_fixed(getattr(args, "fix", None))
    parse_profiles(getattr(args, "shape_profile", None))
    parse_input_shapes(getattr(args, "input_shape", None))


def shape_flags(p: Pipeline, args):
    """``(fixed, shape_profiles)`` from ``--fix``, ``--shape-profile`` and ``--input-shape`` (where the
    command has them), by symbol name."""
    return p.resolve_shapes(parse_fixed(getattr(args, "fix", None)),
                            parse_profiles(getattr(args, "shape_profile", None)),
                            parse_input_shapes(getattr(args, "input_shape", None)))


def bind_shapes(p: Pipeline, args, check: bool = True):
    """``p`` with the shape flags applied (ranges set, fixed symbols specialised), and the fixed values."""
    fixed, profiles = shape_flags(p, args)
    p = p.specialize(fixed) if fixed else p
    return (p.with_profiles(profiles, check=check) if profiles else p), fixed
