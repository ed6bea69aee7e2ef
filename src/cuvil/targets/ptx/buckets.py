"""Shape buckets of a GPU profile bundle (issue 22): which values of each profiled symbol get their own
ahead-of-time specialisation, and which bucket serves a call.

A bundle compiled with a shape profile (``--shape-profile N=1:8:64``, ``--input-shape x=MIN:OPT:MAX``) holds
one set of kernels per *bucket point*: one value per profiled symbol, the cartesian product of each symbol's
bucket list. By default a symbol's buckets are the powers of two inside its range plus its min and max
(``N`` in [1, 64]: 1 2 4 8 16 32 64; in [3, 100]: 3 4 8 16 32 64 100), rounded up to its ``multiple``;
``--graph-buckets 1,2,4,8`` (or ``N=1,2,4,8``) gives them. The largest bucket is always the max, so every
value of the profile has a bucket at or above it.

A call whose symbol value is a bucket runs that bucket exactly. A value between buckets runs the next bucket
up, padded, where the symbol is batch-like (:mod:`cuvil.kernels.batch_rows` proves that on the graph: the
padding rows are computed and dropped); elsewhere only the bucket values themselves run, and another value
is refused with the compile that serves it (nothing compiles at run time).

Pure Python: no driver, no graph; tested directly (tests/test_gpu_profiles.py).
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ...errors import CuvilError, ShapeError

Profile = Tuple[int, int, int, int]      # (min, opt, max, multiple)
BucketSpec = Union[None, Sequence[int], Mapping[str, Sequence[int]]]


def default_buckets(lo: int, hi: int, multiple: int = 1) -> List[int]:
    """The powers of two in ``[lo, hi]`` plus ``lo`` and ``hi``, each rounded up to a multiple of
    ``multiple`` (kept inside the range), sorted, without repeats."""
    if lo > hi:
        raise CuvilError(f"empty range [{lo}, {hi}]")
    m = max(1, int(multiple))
    vals = {lo, hi}
    p = 1
    while p < hi:
        if p > lo:
            vals.add(min(hi, -(-p // m) * m))
        p *= 2
    return sorted(vals)


def parse_bucket_flag(text: str) -> BucketSpec:
    """``--graph-buckets``: ``1,2,4,8`` (the one profiled symbol) or ``N=1,2,4;S=16,128`` (by symbol)."""
    text = (text or "").strip()
    hint = "--graph-buckets 1,2,4,8,16,32,64 (the profiled symbol) or --graph-buckets N=1,2,4,8;S=128,512"
    if not text:
        raise CuvilError("--graph-buckets is empty", hint=hint)

    def ints(part: str, flag: str) -> List[int]:
        try:
            vals = [int(v) for v in part.split(",") if v.strip()]
        except ValueError:
            raise CuvilError(f"--graph-buckets {flag}: expected comma-separated integers", hint=hint) from None
        if not vals or any(v < 0 for v in vals):
            raise CuvilError(f"--graph-buckets {flag}: expected non-negative integers", hint=hint)
        return vals
    if "=" not in text:
        return tuple(ints(text, text))
    out: Dict[str, Tuple[int, ...]] = {}
    for part in text.split(";"):
        name, eq, vals = part.partition("=")
        if not eq or not name.strip():
            raise CuvilError(f"--graph-buckets {text}: {part!r} is not SYMBOL=V1,V2,...", hint=hint)
        out[name.strip()] = tuple(ints(vals, part))
    return out


def resolve_buckets(profiles: Mapping[str, Profile], given: BucketSpec = None) -> Dict[str, List[int]]:
    """Each profiled symbol's bucket values: ``given`` (a list for the one symbol, or by symbol name; a
    symbol not named gets the default) checked against its profile, else :func:`default_buckets`."""
    names = list(profiles)
    by_name: Dict[str, Sequence[int]] = {}
    if given is not None and not isinstance(given, Mapping):
        if len(names) != 1:
            raise CuvilError(f"--graph-buckets {','.join(map(str, given))}: the bundle has "
                             f"{len(names)} profiled symbols ({', '.join(names) or 'none'}); name the symbol",
                             hint="--graph-buckets " + ";".join(f"{n}=V1,V2" for n in names[:2] or ["N"]))
        by_name = {names[0]: list(given)}
    elif given is not None:
        unknown = [n for n in given if n not in profiles]
        if unknown:
            raise CuvilError(f"--graph-buckets names {', '.join(unknown)}, which the profile does not have "
                             f"(profiled: {', '.join(names) or 'none'})",
                             hint="name a profiled symbol, or give a --shape-profile / --input-shape range for it")
        by_name = dict(given)
    out = {}
    for name, (lo, _opt, hi, mult) in profiles.items():
        if name not in by_name:
            out[name] = default_buckets(lo, hi, mult)
            continue
        vals = sorted(set(int(v) for v in by_name[name]))
        bad = [v for v in vals if not lo <= v <= hi or v % max(mult, 1)]
        if bad:
            raise CuvilError(f"--graph-buckets {name}: {bad[0]} is not in the profile {name} in [{lo}, {hi}]"
                             + (f", multiples of {mult}" if mult > 1 else ""),
                             hint=f"give values inside the profile, ending at its max {hi}")
        if vals[-1] != hi:
            vals.append(hi)        # every value of the profile has a bucket at or above it
        out[name] = vals
    return out


def bucket_points(buckets: Mapping[str, Sequence[int]]) -> List[Dict[str, int]]:
    """Every bucket point (one value per symbol), in a fixed order: the cartesian product of the lists."""
    names = list(buckets)
    return [dict(zip(names, combo)) for combo in itertools.product(*(buckets[n] for n in names))]


def choose(buckets: Sequence[int], value: int, paddable: bool) -> Optional[int]:
    """The bucket that serves ``value``: ``value`` itself when it is one, else the smallest bucket above it
    when the symbol may be padded, else None."""
    for b in buckets:
        if b == value:
            return b
        if b > value:
            return b if paddable else None
    return None


def choose_point(buckets: Mapping[str, Sequence[int]], paddable: Mapping[str, bool],
                 bindings: Mapping[str, int], artifact: str = "the bundle") -> Dict[str, int]:
    """The bucket point of a call with symbol values ``bindings``; :class:`ShapeError` naming the buckets and
    the compile that serves the value where none does (a non-paddable symbol between buckets)."""
    point = {}
    for name, vals in buckets.items():
        v = int(bindings[name])
        b = choose(vals, v, bool(paddable.get(name)))
        if b is None:
            why = ("above the largest bucket" if v > vals[-1] else
                   f"between buckets, and {name} cannot be padded (its rows are not independent in this graph)")
            raise ShapeError(f"{artifact}: {name} = {v} has no bucket ({why}); the buckets of {name} are "
                             f"{', '.join(map(str, vals))}",
                             hint=f"pass {name} = one of the buckets, or compile with --graph-buckets "
                                  f"{name}={','.join(map(str, sorted(set(vals) | {v})))}")
        point[name] = b
    return point


def point_key(point: Mapping[str, int]) -> Tuple[Tuple[str, int], ...]:
    """A hashable key of a bucket point (the graph cache's)."""
    return tuple(sorted((str(k), int(v)) for k, v in point.items()))


def point_text(point: Mapping[str, int]) -> str:
    """``N=8`` / ``H=256,W=512``: a bucket point as stats and messages print it."""
    return ",".join(f"{k}={v}" for k, v in point.items()) or "static"


__all__ = ["default_buckets", "parse_bucket_flag", "resolve_buckets", "bucket_points", "choose", "choose_point",
           "point_key", "point_text"]
